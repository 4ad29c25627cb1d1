"""The GRPO surrogate (DeepSeekMath eq. 3) and its variants, selected by `loss_type` (TRL's names).

A loss type is an objective (the per-token term ℓ_t) and an aggregation (what Σ ℓ_t m_t is divided by,
groupwise.core.aggregation). With ρ_t = π_θ(o_t) / π_θold(o_t) per token, or exp(mean_t log ρ_t) per sequence (GSPO):

    clip   ℓ_t = −min(min(ρ_t, δ) Â_t, clip(ρ_t, 1−ε_low, 1+ε_high) Â_t)     DeepSeekMath eq. 3 (δ: INTELLECT-2)
    cispo  ℓ_t = −sg[min(ρ_t, ε_high)] Â_t log π_θ(o_t)                          (MiniMax-M1; ε_high is ε_max here)
    sapo   ℓ_t = −(4/τ) σ(τ (ρ_t − 1)) Â_t,  τ = τ_pos if Â_t > 0 else τ_neg     (soft gate; d/dρ = 1 at ρ = 1)
    vespo  ℓ_t = −sg[φ(w)] Â_t log π_θ(o_t),  φ(w) = e^λ w^k e^(−λw)                (VESPO; φ(1) = 1)
           w = exp(Σ_t log ρ_t · m_t + Σ_t log w_t^IS), the whole sequence's ratio (log-ratios clamped to [−20, 20],
           log w to [log 1e-8, 20]), (k, λ) = (k_pos, λ_pos) if Â ≥ 0 else (k_neg, λ_neg): a smooth weight that
           vanishes far from the sampling policy on either side, in place of clipping

then, when the sampler's numerics differ from the trainer's, ℓ_t times the importance weight w_t^IS
(groupwise.core.importance; vespo folds it into w instead), then, with `off_policy_mask_threshold` δ, the off-policy
sequence mask (DeepSeek-V3.2's eq. 9, TRL's OPSM): a sequence whose mean forward KL to the sampler,
mean_t (log π_sampler(o_t) − log π_θ(o_t)), exceeds δ has its policy term dropped where Â_t < 0 — negative
advantages are trusted only near the policy that sampled them — and, for every loss type, the KL penalty β · k3_t
(DeepSeekMath eq. 4),
k3_t = exp(ref_t − logp_t) − (ref_t − logp_t) − 1, multiplied by ρ_t when `use_bias_correction_kl` (TRL's default:
the samples come from π_θold, so ρ_t k3_t is the importance-weighted KL; its value at ρ = 1 is unchanged but its
gradient gains k3_t ∇log π_θ).

Â may be one value per completion (N,) (outcome supervision) or one per token (N, T) (process supervision).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from groupwise.core.aggregation import AGGREGATIONS, aggregate
from groupwise.core.kl import k3

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _clip(ratio, logps, adv, *, epsilon_low, epsilon_high, delta, **_):
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)  # two-sided clipping (δ)
    return -torch.min(capped * adv, clipped * adv)


def _cispo(ratio, logps, adv, *, epsilon_high, **_):
    return -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps


def _sapo(ratio, logps, adv, *, sapo_temperature_pos, sapo_temperature_neg, **_):
    tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg).to(ratio.dtype)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


_LOG_1E8 = math.log(1e-8)


def gamma_weights(adv, token_log_ratio, mask, is_weights, *, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                  vespo_lambda_neg):
    """VESPO's φ(w) per sequence, (N, 1) (or (N, T) with token advantages: (k, λ) by each token's sign), detached.
    `is_weights`: the sampler correction's per-token weights, (N, T), or None. Computed in log space, as TRL 1.16."""
    with torch.no_grad():
        log_w = (token_log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
        if is_weights is not None:  # every column, as TRL: padding carries weight 1, log 0
            log_w = log_w + torch.log(is_weights).clamp(_LOG_1E8, 20.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(_LOG_1E8, 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, vespo_k_pos, vespo_k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, vespo_lambda_pos, vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo(ratio, logps, adv, *, token_log_ratio, mask, is_weights, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
           vespo_lambda_neg, **_):
    phi = gamma_weights(adv, token_log_ratio, mask, is_weights, vespo_k_pos=vespo_k_pos,
                        vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)
    return -phi * adv * logps


def off_policy_mask(
    advantages: torch.Tensor,  # (N, 1) or (N, T)
    logps: torch.Tensor,  # (N, T) log π_θ
    sampling_logps: torch.Tensor,  # (N, T) log-probs of the policy that sampled (NaN: not scored, no evidence)
    mask: torch.Tensor,  # (N, T)
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's OPSM): 1 keeps, 0 drops. A sequence is dropped where its
    advantage is negative and its mean forward KL, mean_t (log π_sampler − log π_θ) over real tokens, exceeds
    `threshold`. (N, 1), or (N, T) with token advantages (process supervision: each token by its own sign)."""
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's masked mean of a metric and what it divides by (its count: update.py weighs each process's mean by it,
    so the logged value is TRL's global_masked_mean, token-weighted over processes)."""
    if x.size(-1) == 1:  # sequence-level quantities are (N, 1): one value per sequence
        return x.float().mean(), torch.tensor(float(x.size(0)), device=x.device)
    count = mask.float().sum()
    return (x.float() * mask).sum() / count.clamp(min=1.0), count


def _sequence_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # (N,): each sequence's masked mean
    if x.size(-1) == 1:
        return x.float().squeeze(-1)
    return (x.float() * mask).sum(-1) / mask.sum(-1)  # NaN for a sequence without tokens (left out of min / max)


def _clip_metrics(ratio, adv, mask, *, epsilon_low, epsilon_high, **_):
    """TRL's clip_ratio/*: the share of tokens whose ratio the clip holds (below 1−ε_low with Â < 0, above 1+ε_high
    with Â > 0); low_min / high_max: the extreme over sequences of each sequence's share (update.py takes the
    extreme over processes)."""
    low, high = (ratio < 1 - epsilon_low) & (adv < 0), (ratio > 1 + epsilon_high) & (adv > 0)
    return {"clip_ratio/low_mean": _masked_mean(low, mask), "clip_ratio/high_mean": _masked_mean(high, mask),
            "clip_ratio/region_mean": _masked_mean(low | high, mask),
            "clip_ratio/low_min": (_sequence_means(low, mask).nan_to_num(float("inf")).min(), None),
            "clip_ratio/high_max": (_sequence_means(high, mask).nan_to_num(float("-inf")).max(), None)}


def _cispo_metrics(ratio, adv, mask, *, epsilon_high, **_):
    """TRL's cispo_clip_ratio: the share of tokens whose weight is capped at ε_max (on positive advantages)."""
    return {"cispo_clip_ratio": _masked_mean((ratio > epsilon_high) & (adv > 0), mask)}


def _vespo_metrics(ratio, adv, mask, *, inputs, **_):
    """TRL's vespo/phi_seq_mean: the mean of φ over sequences (over tokens with token advantages)."""
    return {"vespo/phi_seq_mean": _masked_mean(gamma_weights(adv, **inputs), mask)}


@dataclass(frozen=True)
class Objective:
    per_token: Callable[..., torch.Tensor]  # (ratio, logps, adv, **options) → (N, T) per-token loss
    options: tuple[str, ...]  # GRPOConfig fields it reads (setting another objective's field is a ConfigError)
    # (ratio, adv, mask, epsilon_low=, epsilon_high=, inputs=) → {name: (value, count)}: a mean and what it divides
    # by, or an extreme over sequences and None
    metrics: Callable[..., dict] | None = None
    # the per-token log-ratio, the mask and the sampler-correction weights (per_token's keywords, not options): the
    # objective builds its own sequence weight from them, and the correction enters it instead of multiplying ℓ_t
    sequence_weight: bool = False


OBJECTIVES: dict[str, Objective] = {
    "clip": Objective(_clip, ("epsilon", "epsilon_high", "delta"), _clip_metrics),
    "cispo": Objective(_cispo, ("epsilon_high",), _cispo_metrics),
    "sapo": Objective(_sapo, ("sapo_temperature_pos", "sapo_temperature_neg")),  # a soft gate clips nothing (TRL)
    "vespo": Objective(_vespo, ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                       _vespo_metrics, sequence_weight=True),
}


@dataclass(frozen=True)
class LossType:
    objective: str  # key of OBJECTIVES
    aggregation: str  # key of AGGREGATIONS
    summary: str
    paper_level: str | None = None  # the importance_sampling_level of its paper (another one: TRL's warning)
    # sums per-token terms: with a sequence-level ratio each sequence weighs by its length, not GSPO's per-sequence
    # objective (TRL warns)
    length_weighted: bool = False


# TRL 1.16's loss_type values, each as objective + aggregation
LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType("clip", "grpo", "clipped ratio; mean over each sequence's tokens, then over sequences"),
    "bnpo": LossType("clip", "bnpo", "clipped ratio; mean over the micro-batch's tokens", length_weighted=True),
    "dr_grpo": LossType("clip", "dr_grpo", "clipped ratio; sum / (N · max_completion_length) (Dr. GRPO)",
                        length_weighted=True),
    "dapo": LossType("clip", "dapo", "clipped ratio; sum / tokens of the whole optimizer step (DAPO)",
                     length_weighted=True),
    "cispo": LossType("cispo", "dapo", "clipped, detached ratio × Â × log π (MiniMax-M1); dapo normaliser",
                      length_weighted=True),
    "sapo": LossType("sapo", "grpo", "soft sigmoid gate instead of clipping (SAPO); grpo normaliser"),
    "luspo": LossType("clip", "luspo", "clipped ratio; sum over each sequence's tokens, mean over sequences (LUSPO)",
                      paper_level="sequence"),
    "vespo": LossType("vespo", "dapo", "gamma weight of the sequence ratio × Â × log π (VESPO); dapo normaliser"),
}
assert all(t.objective in OBJECTIVES and t.aggregation in AGGREGATIONS for t in LOSS_TYPES.values())


def policy_loss(
    logps: torch.Tensor,  # (N, T)  log π_θ of the sampled tokens
    old_logps: torch.Tensor,  # (N, T)  log π_θold (the sampling policy), no grad
    advantages: torch.Tensor,  # (N,) or (N, T)
    mask: torch.Tensor,  # (N, T)  1 on completion tokens (EOS included), 0 on padding
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,  # (N, T), needed when beta != 0
    use_bias_correction_kl: bool = False,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,  # (N, T) extra 0/1 mask on the policy term (top-entropy tokens)
    is_weights: torch.Tensor | None = None,  # (N, T) or (N, 1) sampler correction (groupwise.core.importance)
    off_policy_mask_threshold: float | None = None,  # δ of the off-policy sequence mask (None: off)
    sampling_logps: torch.Tensor | None = None,  # (N, T) the sampler's log-probs for that mask (default: old_logps)
    metric_counts: dict[str, torch.Tensor] | None = None,  # filled, when given, with what each mean metric divides by
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (scalar loss, metrics) — metrics (detached, TRL's names): `kl` when β ≠ 0 (the mean of the per-token KL
    term β multiplies: k3, or ρ·k3 with `use_bias_correction_kl`, as TRL), and the objective's
    (clip: `clip_ratio/low_mean`, `high_mean`, `region_mean`, `low_min`, `high_max`; cispo: `cispo_clip_ratio`;
    vespo: `vespo/phi_seq_mean`).
    `metric_counts`: each mean metric's count (real tokens, or sequences for a per-sequence quantity), for a mean
    over processes weighted as TRL's; the extremes (`low_min`, `high_max`) have none."""
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r} is not one of {IMPORTANCE_SAMPLING_LEVELS}"
        )
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {sorted(LOSS_TYPES)}")
    if logps.shape != old_logps.shape or logps.shape != mask.shape:
        raise ValueError(f"logps {tuple(logps.shape)}, old_logps {tuple(old_logps.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same (N, T) shape")
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps")
    kind = LOSS_TYPES[loss_type]
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # (N, 1), broadcast over tokens
    elif adv.shape != logps.shape:
        raise ValueError(f"advantages must be (N,) or (N, T) = {tuple(logps.shape)}, got {tuple(adv.shape)}")

    log_ratio = logps - old_logps  # (N, T)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (N, 1)
    ratio = torch.exp(log_ratio)
    objective = OBJECTIVES[kind.objective]
    inputs = {}
    if objective.sequence_weight:
        if is_weights is not None and is_weights.shape != logps.shape:
            raise ValueError(f"loss_type={loss_type!r} needs one importance weight per token, (N, T) = "
                             f"{tuple(logps.shape)}, got {tuple(is_weights.shape)}: use a token_* "
                             "vllm_importance_sampling_mode")
        inputs = {"token_log_ratio": logps.detach() - old_logps, "mask": mask, "is_weights": is_weights,
                  "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
                  "vespo_lambda_neg": vespo_lambda_neg}
    per_token = objective.per_token(
        ratio, logps, adv, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg, **inputs)
    if off_policy_mask_threshold is not None:
        reference = old_logps if sampling_logps is None else sampling_logps
        per_token = per_token * off_policy_mask(adv, logps, reference, mask, off_policy_mask_threshold)
    if loss_mask is not None:
        per_token = per_token * loss_mask.to(per_token.dtype)
    if is_weights is not None and not objective.sequence_weight:  # the policy term only, as TRL (not the KL)
        per_token = per_token * is_weights.to(per_token.dtype)
    measured: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    if beta != 0.0:
        kl = k3(logps, ref_logps)  # (N, T)
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
        measured["kl"] = _masked_mean(kl.detach(), mask)  # the term β multiplies, as TRL logs it (ρ·k3 if corrected)
    loss = aggregate(per_token, mask, kind.aggregation, max_completion_length=max_completion_length,
                     num_items_in_batch=num_items_in_batch)

    if objective.metrics is not None:
        with torch.no_grad():
            measured.update(objective.metrics(ratio, adv, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                                              inputs=inputs))
    if metric_counts is not None:
        metric_counts.update({name: count for name, (_, count) in measured.items() if count is not None})
    return loss, {name: value for name, (value, _) in measured.items()}

"""The clipped GRPO surrogate (DeepSeekMath eq. 3) with the field's common extensions.

    ρ_t   = π_θ(o_t) / π_θold(o_t)                      per token, or exp(mean_t log ρ_t) per sequence (GSPO)
    ℓ_t   = −min(min(ρ_t, δ) Â_t, clip(ρ_t, 1−ε_low, 1+ε_high) Â_t) + β · k3_t
    k3_t  = exp(ref_t − logp_t) − (ref_t − logp_t) − 1

Â may be one value per completion (N,) (outcome supervision) or one per token (N, T) (process supervision).
"""

from __future__ import annotations

import torch

from groupwise.core.aggregation import aggregate
from groupwise.core.kl import k3

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.size(-1) == 1:  # sequence-level quantities are (N, 1)
        return x.float().mean()
    return (x.float() * mask).sum() / mask.sum().clamp(min=1.0)


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
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,  # (N, T), needed when beta != 0
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,  # (N, T) extra 0/1 mask on the policy term (top-entropy tokens)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (scalar loss, metrics) — metrics: `kl`, `clip/low`, `clip/high`, `clip/region` (detached)."""
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r} is not one of {IMPORTANCE_SAMPLING_LEVELS}"
        )
    if logps.shape != old_logps.shape or logps.shape != mask.shape:
        raise ValueError(f"logps {tuple(logps.shape)}, old_logps {tuple(old_logps.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same (N, T) shape")
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps")
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
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)  # two-sided clipping (δ)
    per_token = -torch.min(capped * adv, clipped * adv)  # (N, T)
    if loss_mask is not None:
        per_token = per_token * loss_mask.to(per_token.dtype)
    metrics: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        kl = k3(logps, ref_logps)  # (N, T)
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, loss_type, max_completion_length=max_completion_length,
                     num_items_in_batch=num_items_in_batch)

    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        metrics["clip/low"] = _masked_mean(low, mask)
        metrics["clip/high"] = _masked_mean(high, mask)
        metrics["clip/region"] = _masked_mean(low | high, mask)
    return loss, metrics

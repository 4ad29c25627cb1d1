"""Group-relative advantages (DeepSeekMath §4.1.2 outcome, §4.1.3 process).

Outcome supervision:  r̃_i = (r_i − mean(r)) / std(r)  over the G rewards of one prompt; Â_{i,t} = r̃_i.
Process supervision:  r̃_i^{index(j)} = (r_i^{index(j)} − mean(R)) / std(R), R = every step reward of the
                      group; Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)}.

`std="population"` is the 1/G definition the seeds use; `std="unbiased"` is Bessel's 1/(G−1) (TRL's choice).
NaN marks a reward that could not be scored: it is left out of mean and std and gets advantage 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SCALES = ("group", "batch", "none")
STDS = ("population", "unbiased")


def _masked_std(centered: torch.Tensor, count: torch.Tensor, std: str, dim=None) -> torch.Tensor:
    """Std of values already centred (0 where invalid); `count` valid entries. Empty or single → 0."""
    sq = (centered**2).sum(dim=dim, keepdim=dim is not None)
    denom = count if std == "population" else count - 1
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq)).sqrt()


def _check(scale: str, std: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not one of {SCALES}")
    if std not in STDS:
        raise ValueError(f"std={std!r} is not one of {STDS}")


def outcome_advantages(
    rewards: torch.Tensor,  # (B, G), NaN = could not be scored
    *,
    scale: str = "group",
    std: str = "population",
    eps: float = 1e-4,
) -> torch.Tensor:  # (B, G)
    """Outcome-supervision advantages (DeepSeekMath §4.1.2, eq. for r̃_i).

    scale="group": (r − group mean) / (group std + eps)
    scale="batch": (r − group mean) / (std of every reward in the batch + eps)
    scale="none":  r − group mean   (Dr. GRPO, Liu et al. 2025)
    An all-equal group gets 0 (never NaN); eps keeps float noise from being blown up into ±1 advantages.
    """
    _check(scale, std)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, G), got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    valid = ~torch.isnan(rewards)  # (B, G)
    count = valid.sum(-1, keepdim=True).float()  # (B, 1)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = filled.sum(-1, keepdim=True) / count.clamp(min=1)  # (B, 1)
    centered = torch.where(valid, rewards - mean, torch.zeros_like(rewards))  # (B, G)
    if scale == "group":
        centered = centered / (_masked_std(centered, count, std, dim=-1) + eps)
    elif scale == "batch":
        n = valid.sum().float()
        batch_mean = filled.sum() / n.clamp(min=1)
        batch_centered = torch.where(valid, rewards - batch_mean, torch.zeros_like(rewards))
        centered = centered / (_masked_std(batch_centered, n, std) + eps)
    return centered


def process_advantages(
    step_rewards: Sequence[Sequence[Sequence[float | None]]],  # [B][G][K_i]
    step_ends: Sequence[Sequence[Sequence[int]]],  # [B][G][K_i], token index within the completion, ascending
    num_tokens: int,  # T
    *,
    std: str = "population",
    eps: float = 1e-4,
) -> torch.Tensor:  # (B, G, T)
    """Process-supervision advantages (DeepSeekMath §4.1.3).

    Every step reward of group b (all completions, all steps) forms R_b; r̃ = (r − mean(R_b)) / (std(R_b) + eps);
    A[b, g, t] = Σ_{j : end_j ≥ t} r̃_{b,g,j}. Tokens after a completion's last step get 0; a completion with
    no steps gets 0 everywhere. None/NaN step rewards are left out of mean and std and contribute 0.
    """
    _check("group", std)
    B = len(step_rewards)
    if len(step_ends) != B:
        raise ValueError(f"step_rewards has {B} prompts but step_ends has {len(step_ends)}")
    G = len(step_rewards[0]) if B else 0
    flat_r, flat_b, flat_g, flat_end = [], [], [], []
    for b in range(B):
        if len(step_rewards[b]) != G or len(step_ends[b]) != G:
            raise ValueError(f"prompt {b}: expected {G} completions in step_rewards and step_ends")
        for g in range(G):
            rs, es = step_rewards[b][g], step_ends[b][g]
            if len(rs) != len(es):
                raise ValueError(f"prompt {b}, completion {g}: {len(rs)} step rewards but {len(es)} step ends")
            prev = -1
            for r, e in zip(rs, es):
                e = int(e)
                if not 0 <= e < num_tokens:
                    raise ValueError(f"prompt {b}, completion {g}: step end {e} outside [0, {num_tokens})")
                if e < prev:
                    raise ValueError(f"prompt {b}, completion {g}: step ends must be ascending, got {list(es)}")
                prev = e
                flat_r.append(float("nan") if r is None else float(r))
                flat_b.append(b)
                flat_g.append(g)
                flat_end.append(e)
    out = torch.zeros(B, G, num_tokens)
    if not flat_r:
        return out
    r = torch.tensor(flat_r)  # (S,)
    b_idx, g_idx, end = torch.tensor(flat_b), torch.tensor(flat_g), torch.tensor(flat_end)
    valid = ~torch.isnan(r)
    filled = torch.where(valid, r, torch.zeros_like(r))
    count = torch.zeros(B).index_add_(0, b_idx, valid.float())  # (B,)
    mean = torch.zeros(B).index_add_(0, b_idx, filled) / count.clamp(min=1)  # (B,)
    centered = torch.where(valid, r - mean[b_idx], torch.zeros_like(r))  # (S,)
    sq = torch.zeros(B).index_add_(0, b_idx, centered**2)
    denom = count if std == "population" else count - 1
    sd = torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq)).sqrt()  # (B,)
    normalized = centered / (sd[b_idx] + eps)  # (S,)
    # Put each r̃ at its step's last token, then a reverse cumulative sum over t gives Σ_{end ≥ t}.
    out.index_put_((b_idx, g_idx, end), normalized, accumulate=True)
    return out.flip(-1).cumsum(-1).flip(-1)

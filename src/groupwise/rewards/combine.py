"""Several reward functions → one advantage per completion.

sum_then_normalize  r = Σ_f w_f r_f (NaN terms skipped; NaN if every term is NaN); Â = outcome_advantages(r)
normalize_then_sum  r = Σ_f w_f z_f with z_f = per-group z-score of function f (GDPO-style);
                    Â = outcome_advantages(r) — the sum is centred (and scaled) again so groups stay comparable
"""

from __future__ import annotations

import torch

from groupwise.core.advantages import outcome_advantages


def _weighted_nansum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (B, G, F), (F,) → (B, G)
    valid = ~torch.isnan(values)
    total = torch.where(valid, values * weights, torch.zeros_like(values)).sum(-1)
    return torch.where(valid.any(-1), total, torch.full_like(total, float("nan")))


def combine_rewards(
    per_func: torch.Tensor,  # (B, G, F)
    weights: torch.Tensor,  # (F,)
    *,
    aggregation: str,
    scale: str,
    std: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # rewards (B, G), advantages (B, G)
    if aggregation == "sum_then_normalize":
        rewards = _weighted_nansum(per_func, weights)
    elif aggregation == "normalize_then_sum":
        z = torch.stack([outcome_advantages(per_func[..., f], scale="group", std=std, eps=eps)
                         for f in range(per_func.size(-1))], dim=-1)  # (B, G, F), NaN → 0
        z = torch.where(torch.isnan(per_func), torch.full_like(z, float("nan")), z)
        rewards = _weighted_nansum(z, weights)
    else:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is not one of "
                         "['sum_then_normalize', 'normalize_then_sum']")
    return rewards, outcome_advantages(rewards, scale=scale, std=std, eps=eps)

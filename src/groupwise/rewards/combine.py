"""Several reward functions → one reward per completion (GRPOConfig.multi_objective_aggregation).

sum_then_normalize  r = Σ_f w_f r_f                  (NaN terms skipped; NaN if every term is NaN); the estimator
                    then normalises r as scale_rewards says
normalize_then_sum  r = Σ_f w_f z_f, z_f = per-group z-score of function f (GDPO-style), so functions on
                    different scales weigh as their weights say; grpo then normalises r over the batch
                    (scale "batch", whatever scale_rewards says), as TRL does for this aggregation
Turning the combined reward into advantages is the estimator's job (groupwise.core.advantages), not this module's;
an aggregation only says which advantage options it reads itself and which scale it fixes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from groupwise.core.advantages import outcome_advantages


def weighted_nansum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (…, F), (F,) → (…)
    """Σ_f w_f v_f over the non-NaN terms; NaN where every term is NaN."""
    valid = ~torch.isnan(values)
    total = torch.where(valid, values * weights, torch.zeros_like(values)).sum(-1)
    return torch.where(valid.any(-1), total, torch.full_like(total, float("nan")))


def reward_weights(given: list[float] | None, n: int) -> torch.Tensor:  # (n,)
    """The n functions' weights: `given` (reward_weights covers reward_funcs, process_reward_weights
    process_reward_funcs) and 1 for the rest (an environment's get_reward / get_step_rewards, appended last), as TRL."""
    weights = list(given or [])
    return torch.tensor(weights + [1.0] * (n - len(weights)), dtype=torch.float)


def _sum_then_normalize(per_func, weights, *, std, eps):
    return weighted_nansum(per_func, weights)


def _normalize_then_sum(per_func, weights, *, std, eps):
    z = torch.stack([outcome_advantages(per_func[..., f], scale="group", std=std, eps=eps)
                     for f in range(per_func.size(-1))], dim=-1)  # (B, G, F), NaN → 0
    z = torch.where(torch.isnan(per_func), torch.full_like(z, float("nan")), z)
    return weighted_nansum(z, weights)


@dataclass(frozen=True)
class Aggregation:
    """A way to combine reward functions: `combine(per_func (B, G, F), weights (F,), *, std, eps) → (B, G)`, the
    advantage options (as in groupwise.core.advantages) it reads itself besides the estimator's, and the scale the
    grpo estimator must use on the combined reward (None: scale_rewards decides)."""

    combine: Callable[..., torch.Tensor]
    options: tuple[str, ...]
    scale: str | None


MULTI_OBJECTIVE: dict[str, Aggregation] = {
    "sum_then_normalize": Aggregation(_sum_then_normalize, (), None),
    # TRL normalises the sum of the z-scores over the batch, whatever scale_rewards says
    "normalize_then_sum": Aggregation(_normalize_then_sum, ("std", "eps"), "batch"),
}


def combine_rewards(
    per_func: torch.Tensor,  # (B, G, F)
    weights: torch.Tensor,  # (F,)
    *,
    aggregation: str,
    std: str = "population",
    eps: float = 1e-4,
) -> torch.Tensor:  # (B, G) rewards, NaN where nothing scored the completion
    try:
        combine = MULTI_OBJECTIVE[aggregation].combine
    except KeyError:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is not one of {sorted(MULTI_OBJECTIVE)}") from None
    return combine(per_func, weights, std=std, eps=eps)

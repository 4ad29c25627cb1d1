"""How the advantages reach the loss: the supervision variants (GRPOConfig.supervision) and what each needs.

outcome  Â_{i,t} = r̃_i                                         (N,)    DeepSeekMath §4.1.2
process  Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)}             (N, T)  DeepSeekMath §4.1.3
both     Â_{i,t} = w_o · r̃_i + w_p · Σ_{index(j) ≥ t} r̃_i^{index(j)}   (N, T)
         (w_o = outcome_advantage_weight, w_p = process_advantage_weight; each term normalised on its own)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Supervision:
    """A supervision variant: how outcome (N,) and process (N, T) advantages combine, and which reward sources it
    reads. `outcome`/`process`: the variant's advantages use outcome rewards / step rewards (so those sources
    are required, and the learning signal of a group is read from them). `allows_step_rewards`: step-reward
    sources may be given at all."""

    combine: Callable[[torch.Tensor | None, torch.Tensor | None, float, float], torch.Tensor]
    outcome: bool
    process: bool

    def check_sources(self, name: str, num_outcome: int, num_process: int) -> None:
        """Raise ValueError naming what is missing or unused (the trainer calls this before any model loads)."""
        if self.outcome and not num_outcome:
            raise ValueError(f"supervision={name!r} needs at least one outcome reward: pass reward_funcs, or an "
                             "environment_factory whose environment defines get_reward")
        if self.process and not num_process:
            raise ValueError(f"supervision={name!r} needs process_reward_funcs (one reward per step), or an "
                             "environment_factory whose environment defines get_step_rewards (step_split='turn')")
        if not self.process and num_process:
            raise ValueError(f"process_reward_funcs were given but supervision={name!r} does not use them: set "
                             "supervision='process' or 'both' (GRPOConfig) to use them")

    def check_fields(self, name: str, *, outcome_weight: float, process_weight: float,
                     score_truncated_step: bool) -> None:
        """Raise ValueError naming a field the variant does not read, set away from its default: the weights w_o,
        w_p of Â = w_o·Â_outcome + w_p·Â_process are read only where both kinds combine; score_truncated_step only
        where there are steps."""
        if not (self.outcome and self.process) and (outcome_weight != 1.0 or process_weight != 1.0):
            field = "outcome_advantage_weight" if outcome_weight != 1.0 else "process_advantage_weight"
            raise ValueError(f"{field} weighs the outcome and process advantages of supervision='both'; "
                             f"supervision={name!r} does not read it: drop it, or set supervision='both'")
        if not self.process and score_truncated_step:
            raise ValueError(f"score_truncated_step applies to the steps of process supervision; supervision={name!r} "
                             "has none: drop it, or set supervision='process' or 'both'")


SUPERVISIONS: dict[str, Supervision] = {
    "outcome": Supervision(lambda o, p, w_o, w_p: o, outcome=True, process=False),  # (N,)
    "process": Supervision(lambda o, p, w_o, w_p: p, outcome=False, process=True),  # (N, T)
    "both": Supervision(lambda o, p, w_o, w_p: w_o * o.unsqueeze(-1) + w_p * p, outcome=True, process=True),
}


def token_advantages(
    supervision: str,
    outcome: torch.Tensor | None,  # (N,)
    process: torch.Tensor | None,  # (N, T)
    *,
    outcome_weight: float = 1.0,
    process_weight: float = 1.0,
) -> torch.Tensor:  # (N,) or (N, T)
    return SUPERVISIONS[supervision].combine(outcome, process, outcome_weight, process_weight)

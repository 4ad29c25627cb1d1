"""How the advantages reach the loss — the one place the supervision variant is chosen.

outcome  Â_{i,t} = r̃_i                                         (N,)    DeepSeekMath §4.1.2
process  Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)}             (N, T)  DeepSeekMath §4.1.3
both     Â_{i,t} = w_o · r̃_i + w_p · Σ_{index(j) ≥ t} r̃_i^{index(j)}   (N, T)
         (w_o = outcome_advantage_weight, w_p = process_advantage_weight; each term normalised on its own)
"""

from __future__ import annotations

import torch


def _outcome(outcome, process, w_o, w_p):
    return outcome  # (N,)


def _process(outcome, process, w_o, w_p):
    return process  # (N, T)


def _both(outcome, process, w_o, w_p):
    return w_o * outcome.unsqueeze(-1) + w_p * process  # (N, T)


SUPERVISION = {"outcome": _outcome, "process": _process, "both": _both}


def token_advantages(
    supervision: str,
    outcome: torch.Tensor | None,  # (N,)
    process: torch.Tensor | None,  # (N, T)
    *,
    outcome_weight: float = 1.0,
    process_weight: float = 1.0,
) -> torch.Tensor:  # (N,) or (N, T)
    return SUPERVISION[supervision](outcome, process, outcome_weight, process_weight)

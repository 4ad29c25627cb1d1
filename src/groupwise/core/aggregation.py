"""Reduce a (N, T) per-token loss to a scalar. The aggregations (each loss_type names one,
groupwise.core.losses.LOSS_TYPES), each with its normaliser:

grpo     Σ_i (Σ_t ℓ_it m_it / Σ_t m_it) / N           per-sequence mean, then mean (DeepSeekMath eq. 3)
bnpo     Σ_it ℓ_it m_it / Σ_it m_it                    mean over the tokens of this micro-batch
dr_grpo  Σ_it ℓ_it m_it / (N · max_completion_length)  constant normaliser, no length bias (Dr. GRPO)
dapo     Σ_it ℓ_it m_it / num_items_in_batch           token count of the whole optimizer step, all processes (DAPO)
luspo    Σ_i (Σ_t ℓ_it m_it) / N                       per-sequence sum, then mean: longer sequences weigh more (LUSPO)

`Aggregation.spans_step` tells the update step how to scale each micro-batch's loss under gradient accumulation
(k micro-batches) and data parallelism (W processes, DDP averages gradients): a normaliser local to the
micro-batch is scaled by 1/k; one that already divides by the whole step's token count is scaled by W.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _grpo(loss, mask, **_):
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (N,)
    return per_seq.mean()


def _bnpo(loss, mask, **_):
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def _dr_grpo(loss, mask, *, max_completion_length=None, **_):
    if max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    return (loss * mask).sum() / (loss.size(0) * max_completion_length)


def _luspo(loss, mask, **_):
    return (loss * mask).sum(-1).mean()


def _dapo(loss, mask, *, num_items_in_batch=None, **_):
    normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return (loss * mask).sum() / normalizer.clamp(min=1.0)


@dataclass(frozen=True)
class Aggregation:
    reduce: Callable[..., torch.Tensor]
    summary: str  # what the sum is divided by
    spans_step: bool  # True: divides by num_items_in_batch, the token count of the whole optimizer step


AGGREGATIONS: dict[str, Aggregation] = {
    "grpo": Aggregation(_grpo, "tokens of each sequence, then sequences of the micro-batch", spans_step=False),
    "bnpo": Aggregation(_bnpo, "tokens of the micro-batch", spans_step=False),
    "dr_grpo": Aggregation(_dr_grpo, "N · max_completion_length", spans_step=False),
    "dapo": Aggregation(_dapo, "tokens of the whole optimizer step, all processes", spans_step=True),
    "luspo": Aggregation(_luspo, "sequences of the micro-batch (tokens summed)", spans_step=False),
}


def aggregation(name: str) -> Aggregation:
    try:
        return AGGREGATIONS[name]
    except KeyError:
        raise ValueError(f"aggregation {name!r} is not one of {sorted(AGGREGATIONS)}") from None


def aggregate(
    per_token_loss: torch.Tensor,  # (N, T)
    mask: torch.Tensor,  # (N, T)
    name: str,
    *,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    return aggregation(name).reduce(
        per_token_loss,
        mask.to(per_token_loss.dtype),
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )

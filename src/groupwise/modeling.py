"""Model-facing helpers: per-token log-probs of completions, model loading, dropout."""

from __future__ import annotations

import inspect

import torch

from groupwise.core.logprobs import entropy_from_logits, selective_log_softmax


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:  # (N, L) → (N, L)
    """Positions count real tokens only, as in generate(): left padding must not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _accepts(model, name: str) -> bool:
    fwd = getattr(model, "forward", model)
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def completion_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (N, P + T)
    attention_mask: torch.Tensor,  # (N, P + T)
    num_completion_tokens: int,  # T
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_rows: int = 4,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (N, T) log-probs, (N, T) entropies or None
    """log π(o_t | q, o_<t) of each completion token, at the sampling temperature (logits / T, as in sampling).
    Logits are kept for the T+1 last positions only; log-softmax runs in row chunks."""
    T = num_completion_tokens
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    inner = getattr(model, "module", model)
    if _accepts(inner, "position_ids"):
        kwargs["position_ids"] = position_ids_from_mask(attention_mask)
    if _accepts(inner, "logits_to_keep"):
        kwargs["logits_to_keep"] = T + 1
    logits = model(**kwargs).logits  # (N, ≤ L, V)
    logits = logits[:, -(T + 1):-1, :]  # position p predicts token p + 1 → (N, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -T:]
    logps = selective_log_softmax(logits, targets, chunk_rows=chunk_rows)
    entropies = None
    if compute_entropy:
        with torch.no_grad():
            entropies = entropy_from_logits(logits.detach(), chunk_rows=chunk_rows)
    return logps, entropies


@torch.no_grad()
def batched_logps(model, input_ids, attention_mask, T: int, *, temperature: float, batch_size: int) -> torch.Tensor:
    """No-grad log-probs in batches (old policy and reference model)."""
    out = [completion_logps(model, input_ids[i:i + batch_size], attention_mask[i:i + batch_size], T,
                            temperature=temperature)[0] for i in range(0, input_ids.size(0), batch_size)]
    return torch.cat(out, dim=0)


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

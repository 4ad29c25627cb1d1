"""Per-token log-probabilities and entropies from logits, in row chunks so peak memory stays bounded.

selective_log_softmax(logits, ids)[n, t] = logits[n, t, ids[n, t]] − logsumexp_v logits[n, t, v]
entropy_from_logits(logits)[n, t]        = −Σ_v p_v log p_v,  p = softmax(logits[n, t])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint


def selective_log_softmax(
    logits: torch.Tensor,  # (N, T, V)
    index: torch.Tensor,  # (N, T)
    chunk_rows: int = 4,
) -> torch.Tensor:  # (N, T)
    """log softmax(logits)[index] without materialising a second (N, T, V) tensor of log-probs."""
    out = []
    for start in range(0, logits.size(0), chunk_rows):
        chunk = logits[start : start + chunk_rows].float()  # (n, T, V): one chunk upcast at a time
        picked = torch.gather(chunk, -1, index[start : start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out, dim=0)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:  # (N, T, V) → (N, T)
    out = []
    for start in range(0, logits.size(0), chunk_rows):
        logp = torch.log_softmax(logits[start : start + chunk_rows].float(), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out, dim=0)


def top_entropy_mask(
    entropies: torch.Tensor,  # (N, T)
    mask: torch.Tensor,  # (N, T)
    quantile: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # (N, T) float 0/1
    """Keep the tokens whose entropy is at or above the `1 − quantile` quantile of the real tokens' entropies
    ("Beyond the 80/20 rule", Wang et al. 2025: train only on the top-ρ highest-entropy tokens). quantile=1 keeps all.
    `gather` concatenates the real tokens' entropies of every process (1-D, any length per process), so that the
    threshold is that of the micro-batch over all processes, as with one process holding them all.
    """
    if quantile >= 1.0:
        return mask.float()
    real = entropies[mask.bool()].float()
    if gather is not None:
        real = gather(real)
    if real.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.float)
    threshold = torch.quantile(real, 1.0 - quantile)
    return ((entropies >= threshold) & mask.bool()).float()


def _chunk(hidden, weight, bias, targets, temperature: float, softcap: float | None, scale: float,
           want_entropy: bool, entropy_grad: bool = False, head_fp32: bool = False):
    """One chunk: (n, V) logits → log-prob of the targets (n,), and the entropy (n,) from the same logits or an
    empty tensor. The entropy is detached (a metric and a mask) unless `entropy_grad` (an entropy bonus in the loss)."""
    if head_fp32:  # the head's matmul in float32, outside autocast (cast_lm_head_to_fp32)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            logits = torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    else:
        logits = torch.nn.functional.linear(hidden, weight, bias).float()  # (n, V): one chunk only
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logsumexp = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logsumexp
    if not want_entropy:
        return logps, logits.new_empty(0)
    if entropy_grad:
        logp_all = logits - logsumexp.unsqueeze(-1)
        return logps, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        logp_all = logits.detach() - logsumexp.detach().unsqueeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def logps_from_hidden(
    hidden: torch.Tensor,  # (N, T, H) final hidden states at the positions that predict the targets
    weight: torch.Tensor,  # (V, H) output head
    targets: torch.Tensor,  # (N, T)
    *,
    bias: torch.Tensor | None = None,  # (V,)
    temperature: float = 1.0,
    softcap: float | None = None,  # logits = tanh(logits / c) · c (Gemma 2)
    scale: float = 1.0,  # logits · scale (Cohere)
    chunk_tokens: int = 1024,
    compute_entropy: bool = False,
    entropy_grad: bool = False,  # the entropies carry gradients (an entropy bonus in the loss)
    head_fp32: bool = False,  # the head's matmul in float32 outside autocast
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (N, T), (N, T) or None
    """log softmax(head(h) / temperature)[target] for every position, `chunk_tokens` positions at a time. With
    gradients, each chunk runs under activation checkpointing: its (chunk, V) logits are freed after the forward and
    recomputed in the backward, so the (N, T, V) logits never exist, in either pass."""
    N, T, H = hidden.shape
    flat_h, flat_t = hidden.reshape(N * T, H), targets.reshape(N * T)
    args = (temperature, softcap, scale, compute_entropy, entropy_grad, head_fp32)
    logps, entropies = [], []
    for lo in range(0, N * T, chunk_tokens):
        h, t = flat_h[lo:lo + chunk_tokens], flat_t[lo:lo + chunk_tokens]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk, h, weight, bias, t, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(h, weight, bias, t, *args)
        logps.append(lp)
        entropies.append(ent)
    # copies, not views of the concatenation: FSDP2 hooks the outputs of a sharded module for its backward
    return torch.cat(logps).view(N, T).clone(), torch.cat(entropies).view(N, T).clone() if compute_entropy else None

"""Per-token log-probabilities and entropies from logits, in row chunks so peak memory stays bounded.

selective_log_softmax(logits, ids)[n, t] = logits[n, t, ids[n, t]] − logsumexp_v logits[n, t, v]
entropy_from_logits(logits)[n, t]        = −Σ_v p_v log p_v,  p = softmax(logits[n, t])
"""

from __future__ import annotations

import torch


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
) -> torch.Tensor:  # (N, T) float 0/1
    """Keep the tokens whose entropy is at or above the `1 − quantile` quantile of the real tokens' entropies
    ("Beyond the 80/20 rule", Wang et al. 2025: train only on the top-ρ highest-entropy tokens). quantile=1 keeps all.
    """
    if quantile >= 1.0:
        return mask.float()
    real = entropies[mask.bool()].float()
    if real.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.float)
    threshold = torch.quantile(real, 1.0 - quantile)
    return ((entropies >= threshold) & mask.bool()).float()

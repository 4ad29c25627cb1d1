"""Importance-sampling correction for a sampler whose numerics differ from the trainer's (TRL 1.16's
`vllm_importance_sampling_*`, for any generation backend).

The completions were sampled from π_sampler (vLLM, a bfloat16 copy, a quantized model), but the loss is written for
π_θold, the trainer's own numerics. With d_t = log π_θold(o_t) − log π_sampler(o_t) on completion tokens (a token
the sampler could not score, NaN, gets d_t = 0):

    token_*     w_t = exp(d_t)                      one weight per token            (N, T)
    sequence_*  w   = exp(Σ_t d_t)                  one weight per completion       (N, 1)
    *_truncate  w ← clamp(w, clip_min, clip_max)    truncated importance sampling (TIS)
    *_mask      w ← 0 where w ∉ [clip_min, clip_max] masked importance sampling (MIS)

and each token's policy term ℓ_t is multiplied by w (the KL term is not). When sampler and trainer agree, d = 0 and
w = 1: the correction changes nothing.
"""

from __future__ import annotations

import math

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampling_weights(
    old_logps: torch.Tensor,  # (N, T) log π_θold, the trainer's numerics
    sampling_logps: torch.Tensor,  # (N, T) log π_sampler of the same tokens; NaN = not scored
    mask: torch.Tensor,  # (N, T) 1 on completion tokens
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The importance weights ((N, T) for token_* modes, (N, 1) for sequence_*) and their statistics:
    importance_sampling_ratio/min|mean|max (over completion tokens, or completions), masked_fraction (*_mask
    modes: the share of weights set to 0) and sampling_logp_difference/mean|max (|d_t| over scored tokens)."""
    if mode not in IS_MODES:
        raise ValueError(f"importance sampling mode {mode!r} is not one of {IS_MODES}")
    # TRL 1.16's GRPOConfig refuses both (a truncation with no bound, a window that masks every weight)
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError("At least one of `vllm_importance_sampling_clip_min` or `vllm_importance_sampling_clip_max` "
                         "must be set when `vllm_importance_sampling_mode` is a `*_truncate` mode.")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be less than "
                         f"vllm_importance_sampling_clip_max ({clip_max}).")
    mask = mask.to(old_logps.dtype)
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)  # (N, T)
    sequence = mode.startswith("sequence")
    weights = torch.exp(diff.sum(-1, keepdim=True) if sequence else diff)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    masked = torch.zeros_like(weights, dtype=torch.bool)
    if mode.endswith("truncate"):
        weights = torch.clamp(weights, min=clip_min, max=clip_max)
    else:
        masked = (weights < lo) | (weights > hi)
        weights = weights.masked_fill(masked, 0.0)
    with torch.no_grad():
        real = mask.bool()
        flat = weights.flatten() if sequence else weights[real]
        flat_masked = masked.flatten() if sequence else masked[real]
        delta = (old_logps - sampling_logps).abs()[real & ~torch.isnan(sampling_logps)]
        zero = weights.new_zeros(())
        metrics = {
            "importance_sampling_ratio/min": flat.min() if flat.numel() else zero,
            "importance_sampling_ratio/mean": flat.mean() if flat.numel() else zero,
            "importance_sampling_ratio/max": flat.max() if flat.numel() else zero,
            "importance_sampling_ratio/masked_fraction": flat_masked.float().mean() if flat.numel() else zero,
            "sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
            "sampling_logp_difference/max": delta.max() if delta.numel() else zero,
        }
    return weights.detach(), metrics

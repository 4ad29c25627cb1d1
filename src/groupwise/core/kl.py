"""Per-token KL estimators of KL[π_θ ‖ π_ref] from samples of π_θ (Schulman, "Approximating KL Divergence").

With log r = log π_ref − log π_θ:  k1 = −log r,  k2 = ½ (log r)²,  k3 = r − log r − 1 (unbiased, always ≥ 0;
the estimator DeepSeekMath eq. 4 uses, and the one the loss adds). k1 and k2 are kept for
diagnostics and tests.
"""

from __future__ import annotations

import torch


def k1(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:  # (N, T) → (N, T)
    return logps - ref_logps


def k2(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logps - logps) ** 2


def k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    log_r = ref_logps - logps
    return torch.exp(log_r) - log_r - 1


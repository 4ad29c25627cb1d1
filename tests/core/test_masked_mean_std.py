"""masked_mean_std, the one mean / std of the package (DeepSeekMath §4.1.2/§4.1.3's mean(·), std(·)), against a
plain loop over every reduction the estimators use."""

import math

import pytest
import torch

from groupwise.core.advantages import masked_mean_std


@pytest.mark.parametrize("std", ["population", "unbiased"])
@pytest.mark.parametrize("dims", [(1,), (1, 2), (0, 1, 2)])
def test_masked_mean_std_matches_loop(std, dims):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 2, generator=g, dtype=torch.float64)
    valid = torch.rand(3, 4, 2, generator=g) < 0.7
    valid[1] = False  # an empty set
    mean, sd, count = masked_mean_std(x, valid, dims, std=std)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in x.shape]).tolist():
        key = tuple(slice(None) if d in dims else idx[d] for d in range(3))
        vals = x[key][valid[key]].tolist()
        m = sum(vals) / len(vals) if vals else 0.0
        d = len(vals) if std == "population" else len(vals) - 1
        s = math.sqrt(sum((v - m) ** 2 for v in vals) / d) if d > 0 and vals else 0.0
        at = tuple(0 if d in dims else idx[d] for d in range(3))
        assert mean[at].item() == pytest.approx(m, abs=1e-12) and sd[at].item() == pytest.approx(s, abs=1e-12)
        assert count[at].item() == len(vals)

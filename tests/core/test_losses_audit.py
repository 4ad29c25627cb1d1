"""Audit of groupwise.core.losses / aggregation / logprobs: expected numbers worked by hand (in the comments), and a
plain-loop reference for the top-entropy mask. Complements test_losses.py (which compares with a transcription of
TRL 1.16's _compute_loss) with values that do not come from any implementation."""

import math

import pytest
import torch

from groupwise.core.logprobs import top_entropy_mask
from groupwise.core.losses import LOSS_TYPES, policy_loss

E2 = math.exp(2.0)  # 7.389056


def test_gspo_sequence_ratio_is_the_mean_log_ratio_of_real_tokens_by_hand():
    """importance_sampling_level="sequence" (GSPO, TRL): ρ = exp(mean_t log ρ_t) over the completion's tokens only.
    Log-ratios [1, 3] and a padding token with log-ratio 50 (masked out): ρ = exp((1 + 3)/2) = e² = 7.389056.
    (The outcome seed's "sum" would give e⁴ = 54.598; counting the padding, exp(54/3) = 6.6e7.)
    A = −1, ε = 0.2: ℓ_t = −min(7.389056·(−1), 1.2·(−1)) = 7.389056 on both tokens; dapo over 2 tokens: 7.389056.
    Gradient: L = ρ, ∂ρ/∂log π_t = ρ/2 on each real token = 3.694528, 0 on padding.
    Clip metrics are per sequence (one value per sequence): ρ > 0.8, so nothing low-clipped."""
    lp = torch.tensor([[1.0, 3.0, 50.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, m = policy_loss(lp, torch.zeros(1, 3, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64), mask,
                          importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(E2, abs=1e-9)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[E2 / 2, E2 / 2, 0.0]], dtype=torch.float64))
    assert m["clip_ratio/low_mean"].item() == 0.0 and m["clip_ratio/region_mean"].item() == 0.0

    # A = +1: −min(7.389056, 1.2) = −1.2 per token, loss −1.2, no gradient (the clip holds), high-clipped sequence 1/1
    lp = torch.tensor([[1.0, 3.0, 50.0]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(1, 3, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), mask,
                          importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(1, 3, dtype=torch.float64))
    assert m["clip_ratio/high_mean"].item() == 1.0 and m["clip_ratio/high_max"].item() == 1.0

    # A = −1 with δ = 2: −min(min(7.389056, 2)·(−1), 1.2·(−1)) = 2 per token, loss 2, no gradient (δ caps ρ)
    lp = torch.tensor([[1.0, 3.0, 50.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(1, 3, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64), mask,
                          importance_sampling_level="sequence", delta=2.0)
    assert loss.item() == pytest.approx(2.0, abs=1e-12)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(1, 3, dtype=torch.float64))


# On-policy (ρ = 1, so ∂ℓ_t/∂log π_t = −Â for every objective: clip, cispo with ε_max ≥ 1, sapo, whose gate has
# slope 1 at ρ = 1, and vespo, whose weight φ(1) = e^λ · 1^k · e^−λ = 1), the gradient of every loss type is
# −Â_i · m_it / (its normaliser for row i). Two rows, T = 3:
# row 0 has 3 tokens and Â = 1, row 1 has 1 token and Â = −2; 4 tokens in all; max_completion_length L = 4.
#   grpo, sapo   N·|o_i|:   row 0 −1/(2·3) = −1/6,  row 1  2/(2·1) = 1
#   bnpo         tokens 4:  row 0 −1/4,             row 1  2/4 = 0.5
#   dr_grpo      N·L = 8:   row 0 −1/8,             row 1  2/8 = 0.25
#   dapo, cispo, vespo  num_items_in_batch = 10 (the optimizer step's tokens, not this micro-batch's 4):
#                           row 0 −1/10,            row 1  2/10 = 0.2
#   luspo        N = 2:     row 0 −1/2,             row 1  2/2 = 1
ON_POLICY_GRADIENT = {
    "grpo": (-1 / 6, 1.0), "sapo": (-1 / 6, 1.0), "bnpo": (-0.25, 0.5), "dr_grpo": (-0.125, 0.25),
    "dapo": (-0.1, 0.2), "cispo": (-0.1, 0.2), "vespo": (-0.1, 0.2), "luspo": (-0.5, 1.0),
}


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_normaliser_by_its_on_policy_gradient_by_hand(loss_type):
    assert set(ON_POLICY_GRADIENT) == set(LOSS_TYPES)
    lp0 = torch.tensor([[-0.5, -1.0, -1.5], [-2.0, -9.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    lp = lp0.clone().requires_grad_()
    loss, _ = policy_loss(lp, lp0, adv, mask, loss_type=loss_type, max_completion_length=4, num_items_in_batch=10,
                          epsilon_high=5.0 if loss_type == "cispo" else None)
    loss.backward()
    a, b = ON_POLICY_GRADIENT[loss_type]
    expected = torch.tensor([[a, a, a], [b, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected, atol=1e-12, rtol=0)


def test_kl_term_by_hand_is_inside_each_sequences_mean_as_in_deepseekmath_eq_3():
    """DeepSeekMath eq. 3: (1/G) Σ_i (1/|o_i|) Σ_t {min(...) − β D_KL}, the k3 KL per token inside the per-sequence
    mean (loss_type="grpo"). Â = 0 (no policy term). Row 0, 2 tokens, log π − log π_ref = [1, 0]: k3 = [e^{−1} + 1 − 1,
    0] = [0.367879, 0]; row 1, 1 token, log π − log π_ref = −1: k3 = e¹ − 1 − 1 = 0.718282.
    β = 0.5: row means 0.367879/2 = 0.183940 and 0.718282 → loss 0.5·(0.183940 + 0.718282)/2 = 0.225555.
    The logged kl is the token mean: (0.367879 + 0 + 0.718282)/3 = 0.362054."""
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -7.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -2.0], [-2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, m = policy_loss(lp, lp, torch.zeros(2, dtype=torch.float64), mask, loss_type="grpo", beta=0.5,
                          ref_logps=ref)
    k_a, k_b = math.exp(-1), math.e - 2
    assert loss.item() == pytest.approx(0.5 * (k_a / 2 + k_b) / 2, abs=1e-12)
    assert loss.item() == pytest.approx(0.225555, abs=1e-6)
    assert m["kl"].item() == pytest.approx((k_a + k_b) / 3, abs=1e-6)  # metrics are float32


def _quantile_loop(values, q):
    """Linear interpolation between the order statistics (numpy's / torch's default 'linear')."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _top_entropy_loop(entropies, mask, quantile, other_processes=()):
    real = [entropies[i][t] for i in range(len(mask)) for t in range(len(mask[0])) if mask[i][t]]
    real += list(other_processes)
    if not real:
        return [[0.0] * len(mask[0]) for _ in mask]
    threshold = _quantile_loop(real, 1.0 - quantile)
    return [[float(bool(mask[i][t]) and entropies[i][t] >= threshold) for t in range(len(mask[0]))]
            for i in range(len(mask))]


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.8, 1.0])
def test_top_entropy_mask_matches_loop(quantile):
    """TRL's get_high_entropy_mask: keep the real tokens whose entropy is ≥ the (1 − quantile) quantile of the
    real tokens of every process; padding never kept."""
    g = torch.Generator().manual_seed(4)
    ent = torch.rand(5, 6, generator=g) * 3  # float32, as the model's entropies (the threshold is float32, as TRL)
    mask = (torch.rand(5, 6, generator=g) < 0.7).long()
    mask[3] = 0
    other = torch.rand(7, generator=g) * 3
    got = top_entropy_mask(ent, mask, quantile, gather=lambda real: torch.cat([real, other.to(real.dtype)]))
    expected = _top_entropy_loop(ent.tolist(), mask.tolist(), quantile, other.tolist())
    assert got.tolist() == expected
    alone = top_entropy_mask(ent, mask, quantile)
    assert alone.tolist() == _top_entropy_loop(ent.tolist(), mask.tolist(), quantile)
    assert top_entropy_mask(ent, torch.zeros_like(mask), quantile).sum() == 0

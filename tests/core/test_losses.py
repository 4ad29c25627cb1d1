import math

import pytest
import torch

from groupwise.core.aggregation import aggregate
from groupwise.core.kl import k1, k2, k3
from groupwise.core.losses import policy_loss


def test_clip_worked_example():
    # DeepSeekMath eq. 3 by hand: ratios [1.22, 1.11, 1.11, 1.22] (here set exactly via log-ratios), A = 0.6, ε = 0.2.
    # clip → [1.2, 1.11, 1.11, 1.2]; per-token objective min(ρA, clip(ρ)A) = [0.72, 0.666, 0.666, 0.72]
    # dapo over 4 tokens: loss = −(0.72 + 0.666 + 0.666 + 0.72)/4 = −2.772/4 = −0.693
    ratios = torch.tensor([[1.22, 1.11, 1.11, 1.22]])
    logps = torch.log(ratios)
    loss, m = policy_loss(logps, torch.zeros(1, 4), torch.tensor([0.6]), torch.ones(1, 4))
    assert loss.item() == pytest.approx(-0.693, abs=1e-6)
    # ρ = 1.22 > 1.2 with A > 0: 2 of 4 tokens high-clipped
    assert m["clip/high"].item() == pytest.approx(0.5) and m["clip/low"].item() == 0.0


def test_sequence_ratio_worked_example():
    # sequence-level ratio by hand: sum log-ratio 2.0 → ratio e² = 7.389, clipped to 1.2, A = 1.24:
    # min(7.389·1.24, 1.2·1.24) = 1.488. With a sequence of one token and log-ratio 2.0 the loss is −1.488.
    loss, m = policy_loss(torch.tensor([[2.0]]), torch.zeros(1, 1), torch.tensor([1.24]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.488, abs=1e-6)
    assert m["clip/region"].item() == 1.0


def test_negative_advantage_low_clip_and_delta():
    # A = −1, ρ = 0.5 with ε_low 0.2: min(0.5·−1, 0.8·−1) = −0.8 → loss 0.8 (clip engaged, low)
    # ρ = 3 with δ = 2: min(min(3,2)·−1, 1.2·−1) = −2 → loss 2 (δ caps the unbounded side)
    lp = torch.log(torch.tensor([[0.5, 3.0]]))
    loss, m = policy_loss(lp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), loss_type="bnpo", delta=2.0)
    assert loss.item() == pytest.approx((0.8 + 2.0) / 2, abs=1e-6)
    assert m["clip/low"].item() == pytest.approx(0.5)
    no_delta, _ = policy_loss(lp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), loss_type="bnpo")
    assert no_delta.item() == pytest.approx((0.8 + 3.0) / 2, abs=1e-6)


def test_epsilon_high_asymmetric():
    # ρ = 1.25, A = 1: ε_high = 0.28 leaves it unclipped (objective 1.25), ε_high = 0.2 clips to 1.2
    lp = torch.log(torch.tensor([[1.25]]))
    a, _ = policy_loss(lp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), epsilon_high=0.28)
    b, _ = policy_loss(lp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    assert a.item() == pytest.approx(-1.25) and b.item() == pytest.approx(-1.2)


def test_kl_estimators_by_hand():
    # logp = −1, ref = −2: log r = −1; k1 = 1; k2 = 0.5; k3 = e^−1 + 1 − 1 = 0.367879
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert k1(lp, ref).item() == pytest.approx(1.0)
    assert k2(lp, ref).item() == pytest.approx(0.5)
    assert k3(lp, ref).item() == pytest.approx(math.exp(-1), abs=1e-6)


def test_beta_adds_k3():
    # on-policy (ratio 1), A = 0: policy term 0; k3 with log r = −1 per token = 0.367879; β = 0.1 → 0.0367879
    lp = torch.full((1, 2), -1.0)
    loss, m = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), beta=0.1, ref_logps=torch.full((1, 2), -2.0))
    assert loss.item() == pytest.approx(0.1 * math.exp(-1), abs=1e-6)
    assert m["kl"].item() == pytest.approx(math.exp(-1), abs=1e-6)
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), beta=0.1)


def test_aggregations_by_hand():
    # per-token loss [[1, 2, 3], [4, 0, 0]] with mask [[1, 1, 1], [1, 0, 0]]:
    # grpo   = mean(6/3, 4/1) = 3;  bnpo = 10/4 = 2.5;  dr_grpo (L=5) = 10/(2·5) = 1;  dapo (items 8) = 10/8
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(loss, mask, "grpo").item() == pytest.approx(3.0)
    assert aggregate(loss, mask, "bnpo").item() == pytest.approx(2.5)
    assert aggregate(loss, mask, "dr_grpo", max_completion_length=5).item() == pytest.approx(1.0)
    assert aggregate(loss, mask, "dapo", num_items_in_batch=8).item() == pytest.approx(1.25)
    assert aggregate(loss, mask, "dapo").item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(loss, mask, "ppo")


def _loop_loss(logps, old, adv, mask, eps_low, eps_high, level, beta, ref):
    """Plain loop over the formula, dapo aggregation (sum over tokens / token count)."""
    N, T = logps.shape
    total, count = 0.0, 0.0
    for i in range(N):
        lr = [logps[i, t] - old[i, t] for t in range(T)]
        if level == "sequence":
            n = sum(mask[i, t] for t in range(T))
            s = sum(lr[t] * mask[i, t] for t in range(T)) / max(n, 1)
            lr = [s] * T
        for t in range(T):
            if not mask[i, t]:
                continue
            a = adv[i, t] if adv.dim() == 2 else adv[i]
            rho = math.exp(lr[t])
            obj = min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
            kl = math.exp(ref[i, t] - logps[i, t]) - (ref[i, t] - logps[i, t]) - 1
            total += -obj + beta * kl
            count += 1
    return total / count


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("token_adv", [False, True])
def test_policy_loss_matches_loop(level, token_adv):
    g = torch.Generator().manual_seed(1)
    N, T = 5, 7
    logps = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    ref = logps + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, T, generator=g, dtype=torch.float64) if token_adv else torch.randn(N, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 1, 5, 6])
    mask = (torch.arange(T) < lengths[:, None]).double()
    loss, _ = policy_loss(logps, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                          importance_sampling_level=level, beta=0.05, ref_logps=ref)
    expected = _loop_loss(logps, old, adv, mask, 0.2, 0.28, level, 0.05, ref)
    assert loss.item() == pytest.approx(float(expected), abs=1e-9)


def test_gradient_flows_only_through_logps():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    # on-policy: d/dlogp of −ρA/2 per token = −ρA/2 = −0.5 each
    assert torch.allclose(lp.grad, torch.tensor([[-0.5, -0.5]]))


def test_loss_mask_zeroes_policy_term_keeps_normalizer():
    lp = torch.log(torch.tensor([[1.0, 1.0]]))
    loss, _ = policy_loss(lp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), loss_mask=torch.tensor([[1.0, 0.0]]))
    # only token 0 contributes −1, normalizer still 2 tokens → −0.5
    assert loss.item() == pytest.approx(-0.5)


def test_shape_errors():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), importance_sampling_level="seq")

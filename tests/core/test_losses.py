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
    assert m["clip_ratio/high_mean"].item() == pytest.approx(0.5) and m["clip_ratio/low_mean"].item() == 0.0


def test_clip_ratio_extremes_per_sequence_by_hand_and_against_a_loop():
    """TRL's clip_ratio/low_min and high_max: each sequence's share of clipped tokens, then the min / max over
    sequences (a sequence without tokens left out). ε = 0.2. Row 0, A = −1, ρ = [0.5, 1.0, 0.7, ·] (3 tokens):
    low-clipped 0.5 and 0.7 → 2/3. Row 1, A = −1, ρ = [0.5, 1, 1, 1]: 1/4. Row 2, A = +1, ρ = [1.5, 1.5, 1, 1]:
    high 2/4 = 0.5, low 0. Row 3: no tokens. low_min = min(2/3, 1/4, 0) = 0; high_max = max(0, 0, 0.5) = 0.5;
    region_mean over the 11 tokens: (2 + 1 + 2) / 11."""
    ratios = torch.tensor([[0.5, 1.0, 0.7, 1.0], [0.5, 1.0, 1.0, 1.0], [1.5, 1.5, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    _, m = policy_loss(torch.log(ratios), torch.zeros(4, 4), adv, mask, loss_type="bnpo")
    assert m["clip_ratio/low_min"].item() == 0.0 and m["clip_ratio/high_max"].item() == 0.5
    assert m["clip_ratio/region_mean"].item() == pytest.approx(5 / 11)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):  # against a plain loop over sequences
        ratios = torch.exp(torch.randn(6, 7, generator=g) * 0.3)
        mask = (torch.rand(6, 7, generator=g) > 0.3).float()
        adv = torch.randn(6, generator=g)
        _, m = policy_loss(torch.log(ratios), torch.zeros(6, 7), adv, mask, loss_type="grpo")
        lows, highs = [], []
        for i in range(6):
            kept = [t for t in range(7) if mask[i, t] > 0]
            if not kept:
                continue
            lows.append(sum(float(ratios[i, t] < 0.8 and adv[i] < 0) for t in kept) / len(kept))
            highs.append(sum(float(ratios[i, t] > 1.2 and adv[i] > 0) for t in kept) / len(kept))
        assert m["clip_ratio/low_min"].item() == pytest.approx(min(lows))
        assert m["clip_ratio/high_max"].item() == pytest.approx(max(highs))


def test_sapo_logs_no_clip_ratio_as_trl():
    _, m = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), loss_type="sapo")
    assert not [k for k in m if "clip" in k]


def test_sequence_ratio_worked_example():
    # the outcome seed's step 4–6 (one token here, so its "sum" of log-ratios and GSPO's mean agree; several tokens:
    # test_losses_audit.test_gspo_sequence_ratio_is_the_mean_log_ratio_of_real_tokens_by_hand): log-ratio 2.0 →
    # ratio e² = 7.389, clipped to 1.2, A = 1.24: min(7.389·1.24, 1.2·1.24) = 1.488, so the loss is −1.488.
    loss, m = policy_loss(torch.tensor([[2.0]]), torch.zeros(1, 1), torch.tensor([1.24]), torch.ones(1, 1),
                          importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-1.488, abs=1e-6)
    assert m["clip_ratio/region_mean"].item() == 1.0


def test_negative_advantage_low_clip_and_delta():
    # A = −1, ρ = 0.5 with ε_low 0.2: min(0.5·−1, 0.8·−1) = −0.8 → loss 0.8 (clip engaged, low)
    # ρ = 3 with δ = 2: min(min(3,2)·−1, 1.2·−1) = −2 → loss 2 (δ caps the unbounded side)
    lp = torch.log(torch.tensor([[0.5, 3.0]]))
    loss, m = policy_loss(lp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), loss_type="bnpo", delta=2.0)
    assert loss.item() == pytest.approx((0.8 + 2.0) / 2, abs=1e-6)
    assert m["clip_ratio/low_mean"].item() == pytest.approx(0.5)
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
    # log r = ∓2, where |x| ≠ x² and signs differ: k1 = −log r = [2, −2]; k2 = ½(log r)² = [2, 2];
    # k3 = e^{log r} − log r − 1 = [e^−2 + 1, e^2 − 3] = [1.135335, 4.389056]
    lp, ref = torch.tensor([-1.0, -3.0]), torch.tensor([-3.0, -1.0])
    assert k1(lp, ref).tolist() == [2.0, -2.0] and k2(lp, ref).tolist() == [2.0, 2.0]
    assert torch.allclose(k3(lp, ref), torch.tensor([math.exp(-2) + 1, math.exp(2) - 3]))


def test_kl_estimators_match_a_loop():
    """Elementwise on random (B, T) tensors against the definitions written out per token (log r = ref − logp)."""
    torch.manual_seed(0)
    lp, ref = -torch.rand(3, 5) * 4, -torch.rand(3, 5) * 4
    for est, one in ((k1, lambda x: -x), (k2, lambda x: 0.5 * x * x), (k3, lambda x: math.exp(x) - x - 1)):
        got = est(lp, ref)
        for b in range(3):
            for t in range(5):
                assert got[b, t].item() == pytest.approx(one(float(ref[b, t] - lp[b, t])), rel=1e-5, abs=1e-6)


def test_clip_ratio_metrics_with_asymmetric_epsilons():
    """ε_low 0.2, ε_high 0.28 (bnpo). Row 0: A = −1, ρ = [0.75, 0.85]: 0.75 < 1 − 0.2 is low-clipped, 0.85 is not;
    row 1: A = +1, ρ = [1.25, 1.3]: 1.3 > 1.28 is high-clipped, 1.25 is not (it would be under ε_high = ε_low).
    Each metric = 1 clipped token of the 4: 0.25 (a metric reading the other ε gives 0 or 0.5)."""
    lp = torch.log(torch.tensor([[0.75, 0.85], [1.25, 1.3]]))
    _, m = policy_loss(lp, torch.zeros(2, 2), torch.tensor([-1.0, 1.0]), torch.ones(2, 2), loss_type="bnpo",
                       epsilon_high=0.28)
    assert m["clip_ratio/low_mean"].item() == pytest.approx(0.25)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(0.25)


def test_cispo_clip_ratio_counts_positive_advantages_only():
    # CISPO caps the weight at ε_max = epsilon_high itself (TRL's reading, not 1 + ε): ρ = 3 > 2 on both rows; only
    # the row with Â > 0 counts as clipped: 1 of 2 tokens = 0.5 (counting both would give 1)
    lp = torch.log(torch.tensor([[3.0], [3.0]]))
    _, m = policy_loss(lp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1), loss_type="cispo",
                       epsilon_high=2.0)
    assert m["cispo_clip_ratio"].item() == pytest.approx(0.5)


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


# ---- loss types beyond the clipped surrogate (TRL 1.16's names) ------------------------------------------------------
def test_cispo_worked_example():
    # ρ = [0.5, 3.0] (old log-probs 0, so log π = log ρ = [−0.693147, 1.098612]), A = 1, ε_max = epsilon_high = 2:
    # weights sg[min(ρ, 2)] = [0.5, 2]; ℓ = −w·A·log π = [0.346574, −2.197225]; dapo over 2 tokens: −0.925326.
    # d/dlog π = −w·A / 2 = [−0.25, −1.0] (the weight is detached: no gradient through ρ)
    lp = torch.log(torch.tensor([[0.5, 3.0]])).requires_grad_()
    loss, m = policy_loss(lp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), loss_type="cispo", epsilon_high=2.0)
    assert loss.item() == pytest.approx(-0.925326, abs=1e-6)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-0.25, -1.0]]))
    assert m["cispo_clip_ratio"].item() == pytest.approx(0.5) and "clip_ratio/high_mean" not in m  # ρ = 3 > ε_max, A > 0 (TRL)


def test_sapo_worked_example():
    # row 0: ρ = 1.5, A = +1, τ_pos = 1:    ℓ = −σ(1·0.5)·4/1·1        = −0.622459·4      = −2.489837
    # row 1: ρ = 0.5, A = −1, τ_neg = 1.05: ℓ = −σ(1.05·−0.5)·4/1.05·−1 = 0.371684·3.809524 = 1.415939
    # grpo aggregation (one token each): mean = (−2.489837 + 1.415939)/2 = −0.536949
    lp = torch.log(torch.tensor([[1.5], [0.5]]))
    loss, _ = policy_loss(lp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1), loss_type="sapo")
    assert loss.item() == pytest.approx(-0.536949, abs=1e-6)


def test_sapo_gradient_equals_the_clipped_surrogate_on_policy():
    # on-policy (ρ = 1) the gate's slope is τ·σ'(0)·4/τ = 1, so SAPO's gradient equals GRPO's there
    g = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    adv, mask = torch.randn(3, generator=g, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    grads = []
    for loss_type in ("sapo", "grpo"):
        lp = lp0.clone().requires_grad_()
        loss, _ = policy_loss(lp, lp0, adv, mask, loss_type=loss_type)
        loss.backward()
        grads.append(lp.grad)
    assert torch.allclose(grads[0], grads[1])


def test_luspo_aggregation_sums_tokens_then_averages_sequences():
    # per-token [[1, 2, 3], [4, 9, 9]], mask [[1, 1, 1], [1, 0, 0]]: sequence sums 6 and 4 → mean 5
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    assert aggregate(loss, torch.tensor([[1, 1, 1], [1, 0, 0]]), "luspo").item() == pytest.approx(5.0)


def test_bias_corrected_kl_has_the_same_value_and_the_extra_gradient():
    # one token, on-policy (ρ = 1), A = 0, β = 0.1, log π = −1, log π_ref = −2:
    # k3 = e^{−1} − (−1) − 1 = 0.367879; ∂k3/∂log π = 1 − e^{ref − log π} = 1 − 0.367879 = 0.632121
    # plain:      β·k3, gradient β·0.632121 = 0.0632121
    # corrected:  β·ρ·k3, same value at ρ = 1, gradient β·(k3·∂ρ/∂log π + ∂k3) = β·(0.367879 + 0.632121) = 0.1
    out = {}
    for corrected in (False, True):
        lp = torch.tensor([[-1.0]], requires_grad=True)
        loss, _ = policy_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 1), beta=0.1,
                              ref_logps=torch.tensor([[-2.0]]), use_bias_correction_kl=corrected)
        loss.backward()
        out[corrected] = (loss.item(), lp.grad.item())
    assert out[False][0] == pytest.approx(0.0367879, abs=1e-6) and out[True][0] == pytest.approx(0.0367879, abs=1e-6)
    assert out[False][1] == pytest.approx(0.0632121, abs=1e-6) and out[True][1] == pytest.approx(0.1, abs=1e-6)


def test_kl_metric_is_the_term_beta_multiplies_as_trl_logs_it():
    """TRL logs `kl` = masked mean of per_token_kl *after* the bias correction (ρ·k3). Off-policy, one real token
    (the second is padding): log π = −1, log π_θold = −1.5, log π_ref = −2 ⇒ ρ = e^{0.5} = 1.648721,
    k3 = e^{−1} − (−1) − 1 = 0.367879; logged kl: plain 0.367879, corrected ρ·k3 = e^{−0.5} = 0.606531."""
    lp, old, ref = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-1.5, -3.0]]), torch.tensor([[-2.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    _, plain = policy_loss(lp, old, torch.zeros(1), mask, beta=0.1, ref_logps=ref)
    _, corrected = policy_loss(lp, old, torch.zeros(1), mask, beta=0.1, ref_logps=ref, use_bias_correction_kl=True)
    assert plain["kl"].item() == pytest.approx(0.367879, abs=1e-6)
    assert corrected["kl"].item() == pytest.approx(0.606531, abs=1e-6)


def _trl_loss(logps, old, adv, mask, *, loss_type, level, beta, ref, bias_kl, eps_low, eps_high, delta,
              tau_pos, tau_neg, max_len):
    """TRL 1.16's GRPOTrainer._compute_loss for one micro-batch, one process, no accumulation (transcribed from its
    formulas; num_items_in_batch = the mask's token count)."""
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    log_ratio = logps - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if bias_kl:
            kl = kl * coef_1
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * logps
    elif loss_type == "vespo":  # get_gamma_weights at TRL's default k, λ, without a sampler correction
        with torch.no_grad():
            log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
            k, lam = torch.where(adv >= 0, 2.0, 3.0), torch.where(adv >= 0, 3.0, 2.0)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        per_token = -phi * adv * logps
    elif loss_type == "sapo":
        t = torch.where(adv > 0, tau_pos, tau_neg)
        per_token = -torch.sigmoid(t * (coef_1 - 1)) * 4 / t * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        per_token = per_token + beta * kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    if loss_type in ("cispo", "dapo", "vespo"):
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bias_kl", [False, True])
def test_every_loss_type_matches_trl_value_and_gradient(loss_type, level, bias_kl):
    g = torch.Generator().manual_seed(7)
    N, T = 6, 5
    base = -torch.rand(N, T, generator=g, dtype=torch.float64) * 2
    old = base + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)
    ref = base + 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = (torch.arange(T) < torch.tensor([5, 2, 1, 4, 3, 5])[:, None]).double()
    kw = dict(eps_low=0.2, eps_high=5.0 if loss_type == "cispo" else 0.28,
              delta=None if loss_type in ("cispo", "sapo", "vespo") else 1.5,
              tau_pos=1.0, tau_neg=1.05, max_len=T)
    ours_lp, trl_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    ours, _ = policy_loss(ours_lp, old, adv, mask, loss_type=loss_type, epsilon_low=kw["eps_low"],
                          epsilon_high=kw["eps_high"], delta=kw["delta"], importance_sampling_level=level, beta=0.04,
                          ref_logps=ref, use_bias_correction_kl=bias_kl, max_completion_length=T,
                          num_items_in_batch=mask.sum())
    theirs = _trl_loss(trl_lp, old, adv, mask, loss_type=loss_type, level=level, beta=0.04, ref=ref, bias_kl=bias_kl, **kw)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_lp.grad, trl_lp.grad, atol=1e-12)

"""loss_type='vespo' (the gamma sequence weight) and the off-policy sequence mask (off_policy_mask_threshold): worked
numbers, a loop, and TRL 1.16's own functions (GRPOTrainer.get_gamma_weights / get_off_policy_mask)."""

import math

import pytest
import torch

from groupwise.core.importance import sampling_weights
from groupwise.core.losses import gamma_weights, off_policy_mask, policy_loss

VESPO = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)  # TRL's defaults


def test_gamma_weight_worked_example():
    # one sequence, token log-ratios 0.1 and −0.3 (a third column is padding, its −5 is masked out):
    #   log w = 0.1 − 0.3 = −0.2, w = e^−0.2 = 0.818731
    #   Â ≥ 0 (k = 2, λ = 3): log φ = 3 + 2·(−0.2) − 3·0.818731 = 0.143808, φ = 1.154662
    #   Â < 0 (k = 3, λ = 2): log φ = 2 + 3·(−0.2) − 2·0.818731 = −0.237462, φ = 0.788627
    #   with a token weight 0.5 from the sampler correction (padding's weight 1 adds log 1 = 0):
    #     log w = −0.2 + ln 0.5 = −0.893147, w = 0.409365, log φ = 3 − 1.786294 − 1.228096 = −0.014390, φ = 0.985713
    log_ratio = torch.tensor([[0.1, -0.3, -5.0]] * 2, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 2, dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    phi = gamma_weights(adv, log_ratio, mask, None, **VESPO)
    assert phi.shape == (2, 1)
    assert phi[0, 0].item() == pytest.approx(1.154662, abs=1e-6)
    assert phi[1, 0].item() == pytest.approx(0.788627, abs=1e-6)
    is_weights = torch.tensor([[1.0, 0.5, 1.0]] * 2, dtype=torch.float64)
    assert gamma_weights(adv, log_ratio, mask, is_weights, **VESPO)[0, 0].item() == pytest.approx(0.985713, abs=1e-6)
    # φ(1) = e^λ · 1 · e^−λ = 1 for either sign: on-policy, vespo is the plain policy gradient
    assert torch.allclose(gamma_weights(adv, torch.zeros_like(log_ratio), mask, None, **VESPO),
                          torch.ones(2, 1, dtype=torch.float64), atol=1e-12)


def test_vespo_loss_and_gradient_by_hand():
    # ℓ_t = −φ Â log π_t (φ detached), dapo normaliser (num_items_in_batch = 2 real tokens):
    #   Â = 1, φ = 1.154662 (log-ratios 0.1, −0.3 as above): loss = −1.154662 · (−1 − 2) / 2 = 1.731993
    #   ∂loss/∂log π_t = −φ Â / 2 = −0.577331 on both real tokens, 0 on padding
    old = torch.tensor([[-1.1, -1.7, -3.0]], dtype=torch.float64)
    lp = torch.tensor([[-1.0, -2.0, -9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, metrics = policy_loss(lp, old, torch.tensor([1.0], dtype=torch.float64), mask, loss_type="vespo",
                                num_items_in_batch=2.0)
    assert loss.item() == pytest.approx(1.731993, abs=1e-6)
    assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(1.154662, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.577331, -0.577331, 0.0]], dtype=torch.float64),
                               atol=1e-6, rtol=0)


def test_vespo_refuses_one_weight_per_sequence():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="token_"):
        policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), loss_type="vespo", is_weights=torch.ones(2, 1),
                    num_items_in_batch=6.0)


def test_off_policy_mask_worked_example():
    # log π_θ = −1 on both tokens of each row; δ = 0.5; KL_t = log π_sampler − log π_θ:
    #   row 0  Â = −1, sampler (−0.2, −0.6): KL (0.8, 0.4), mean 0.6 > 0.5 and Â < 0   → dropped
    #   row 1  Â = −2, sampler (−0.9, −1.3): KL (0.1, −0.3), mean −0.1 ≤ 0.5           → kept
    #   row 2  Â = +1, sampler (0, 0):        KL (1, 1), mean 1 > 0.5 but Â ≥ 0        → kept
    #   row 3  Â = −1, sampler (NaN, −0.6):  an unscored token is no evidence (KL 0): mean (0 + 0.4)/2 = 0.2 → kept
    lp = torch.full((4, 2), -1.0, dtype=torch.float64)
    sampler = torch.tensor([[-0.2, -0.6], [-0.9, -1.3], [0.0, 0.0], [float("nan"), -0.6]], dtype=torch.float64)
    adv = torch.tensor([[-1.0], [-2.0], [1.0], [-1.0]], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.float64)
    keep = off_policy_mask(adv, lp, sampler, mask, 0.5)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0, 1.0]
    # in the loss (dapo, on-policy ratio 1, so ℓ_t = −Â): row 0 dropped, row 1 2 + 2, row 2 −1 − 1, row 3 1 + 1;
    # Σ = 4 over num_items_in_batch = 8 tokens → 0.5; ∂/∂log π_t = −Â / 8: row 0 0, row 1 0.25, row 2 −0.125,
    # row 3 0.125
    lp = lp.clone().requires_grad_()
    loss, _ = policy_loss(lp, lp.detach(), adv.flatten(), mask, off_policy_mask_threshold=0.5, sampling_logps=sampler,
                          num_items_in_batch=8.0)
    assert loss.item() == pytest.approx(0.5, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[0.0, 0.0], [0.25, 0.25], [-0.125, -0.125], [0.125, 0.125]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected, atol=1e-12, rtol=0)
    # without sampler log-probs the mask measures the KL from π_θold, here π_θ itself: nothing is dropped
    off, _ = policy_loss(lp.detach(), lp.detach(), adv.flatten(), mask, off_policy_mask_threshold=0.5,
                         num_items_in_batch=8.0)
    assert off.item() == pytest.approx((4 - 2 + 2 + 2) / 8, abs=1e-12)


def test_off_policy_mask_with_token_advantages_keeps_each_tokens_sign():
    # process supervision: Â per token. Row KL mean 0.6 > 0.5, so the tokens with Â_t < 0 are dropped, Â_t ≥ 0 kept
    lp = torch.full((1, 3), -1.0)
    sampler = torch.tensor([[-0.2, -0.6, -0.4]])  # KL 0.8, 0.4, 0.6: mean 0.6
    adv = torch.tensor([[0.5, -1.0, 0.0]])
    assert off_policy_mask(adv, lp, sampler, torch.ones(1, 3), 0.5).tolist() == [[1.0, 0.0, 1.0]]


def test_off_policy_mask_keeps_a_kl_exactly_at_the_threshold():
    # TRL: dropped where mean KL > δ. log π_θ = −1, sampler (−0.5, −0.5): KL (0.5, 0.5), mean 0.5 = δ → kept;
    # δ = 0.25 → dropped (all values exact in binary)
    lp, sampler, adv = torch.full((1, 2), -1.0), torch.full((1, 2), -0.5), torch.tensor([[-1.0]])
    assert off_policy_mask(adv, lp, sampler, torch.ones(1, 2), 0.5).tolist() == [[1.0]]
    assert off_policy_mask(adv, lp, sampler, torch.ones(1, 2), 0.25).tolist() == [[0.0]]


def _loop_gamma(adv, log_ratio, mask, is_weights, k_pos, lam_pos, k_neg, lam_neg):
    out = []
    for i in range(log_ratio.size(0)):
        s = sum(max(-20.0, min(20.0, float(log_ratio[i, t]))) * float(mask[i, t]) for t in range(log_ratio.size(1)))
        if is_weights is not None:
            s += sum(max(math.log(1e-8), min(20.0, math.log(float(w)) if w > 0 else -math.inf))
                     for w in is_weights[i])
        s = max(math.log(1e-8), min(20.0, s))
        k, lam = (k_pos, lam_pos) if float(adv[i, 0]) >= 0 else (k_neg, lam_neg)
        out.append(math.exp(lam + k * s - lam * math.exp(s)))
    return torch.tensor(out, dtype=torch.float64).unsqueeze(-1)


def _random(seed, N=8, T=6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    old[0] = lp[0] + 4.0  # a sequence far off-policy: w hits the clamp
    sampler = old + 0.2 * torch.randn(N, T, generator=g, dtype=torch.float64)
    sampler[1, 2] = float("nan")  # a token the sampler could not score
    lengths = torch.tensor([T, 1, 3, T, 2, 5, 4, T])[:N]
    mask = (torch.arange(T) < lengths[:, None]).double()
    adv = torch.randn(N, 1, generator=g, dtype=torch.float64)
    adv[0], adv[1], adv[2] = -1.0, -0.5, 0.0  # far off-policy with Â < 0 (dropped), mildly off (δ decides), Â = 0
    return lp, old, sampler, mask, adv


@pytest.mark.parametrize("mode", [None, "token_truncate", "token_mask"])
def test_gamma_weights_match_a_loop(mode):
    lp, old, sampler, mask, adv = _random(3)
    weights = None if mode is None else sampling_weights(old, sampler, mask, mode=mode, clip_min=0.8, clip_max=1.2)[0]
    options = dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=4.0, vespo_lambda_neg=0.5)
    ours = gamma_weights(adv, lp - old, mask, weights, **options)
    assert torch.allclose(ours, _loop_gamma(adv, lp - old, mask, weights, 1.5, 2.5, 4.0, 0.5), atol=1e-12)


@pytest.mark.parametrize("mode", [None, "token_truncate", "token_mask"])
def test_gamma_weights_and_off_policy_mask_match_trl(mode):
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    lp, old, sampler, mask, adv = _random(11)
    weights = None if mode is None else sampling_weights(old, sampler, mask, mode=mode, clip_min=0.8, clip_max=1.2)[0]
    theirs = GRPOTrainer.get_gamma_weights(adv, lp - old, mask, weights, k_pos=2.0, lambda_pos=3.0, k_neg=3.0,
                                           lambda_neg=2.0)
    assert torch.allclose(gamma_weights(adv, lp - old, mask, weights, **VESPO), theirs, atol=1e-12)
    for threshold in (0.0, 0.05, 0.5):
        trl_mask = GRPOTrainer.get_off_policy_mask(adv, lp, sampler, mask, threshold)
        assert torch.equal(off_policy_mask(adv, lp, sampler, mask, threshold), trl_mask)
        assert 0 < trl_mask.sum() < len(trl_mask)  # each case drops some and keeps some


def _trl_compute_loss(lp, old, adv, mask, *, loss_type, beta, ref, weights, sampler, threshold, num_items):
    """TRL 1.16's GRPOTrainer._compute_loss for one micro-batch on one process (token level, no accumulation),
    transcribed for the parts these tests reach: OPSM, vespo or dapo, the vLLM correction, the KL (bias-corrected)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    if threshold is not None:
        keep = GRPOTrainer.get_off_policy_mask(adv, lp, sampler if sampler is not None else old, mask, threshold)
    log_ratio = lp - old
    coef_1 = torch.exp(log_ratio)
    kl = (torch.exp(ref - lp) - (ref - lp) - 1) * coef_1
    if loss_type == "vespo":
        phi = GRPOTrainer.get_gamma_weights(adv, log_ratio, mask, weights)
        per_token = -phi * adv * lp
    else:
        coef_2 = torch.clamp(coef_1, 0.8, 1.28)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if threshold is not None:
        per_token = per_token * keep
    if weights is not None and loss_type != "vespo":
        per_token = per_token * weights
    per_token = per_token + beta * kl
    return (per_token * mask).sum() / num_items


@pytest.mark.parametrize("loss_type", ["vespo", "dapo"])
@pytest.mark.parametrize("mode", [None, "token_truncate", "token_mask"])
@pytest.mark.parametrize("threshold", [None, 0.05])
def test_loss_with_vespo_and_off_policy_mask_matches_trl(loss_type, mode, threshold):
    pytest.importorskip("trl")
    base, old, sampler, mask, adv = _random(5)
    ref = base + 0.1
    weights = None if mode is None else sampling_weights(old, sampler, mask, mode=mode, clip_min=0.8, clip_max=1.2)[0]
    # TRL reads the sampler's log-probs for OPSM when vLLM produced them (with or without the correction)
    sampling = sampler if mode is not None else None
    ours_lp, trl_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    ours, metrics = policy_loss(ours_lp, old, adv.flatten(), mask, loss_type=loss_type, epsilon_high=0.28, beta=0.04,
                                ref_logps=ref, use_bias_correction_kl=True, num_items_in_batch=mask.sum(),
                                is_weights=weights, off_policy_mask_threshold=threshold, sampling_logps=sampling)
    theirs = _trl_compute_loss(trl_lp, old, adv, mask, loss_type=loss_type, beta=0.04, ref=ref, weights=weights,
                               sampler=sampling, threshold=threshold, num_items=mask.sum())
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_lp.grad, trl_lp.grad, atol=1e-12)
    if loss_type == "vespo":  # TRL's global_masked_mean of φ (N, 1): the mean over sequences (metrics are float32)
        from trl.trainer.grpo_trainer import GRPOTrainer

        phi = GRPOTrainer.get_gamma_weights(adv, base - old, mask, weights)
        assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(phi.mean().item(), rel=1e-6)

"""Importance-sampling correction for the sampler's numerics (groupwise.core.importance), against hand-worked values
and TRL 1.16's formulas for every mode."""

import math

import pytest
import torch

from groupwise.core.importance import IS_MODES, sampling_weights
from groupwise.core.losses import policy_loss

OLD = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
SAMPLING = torch.tensor([[-1.5, -2.0], [-1.0, -0.5]])
MASK = torch.tensor([[1, 1], [1, 0]])


def test_weights_by_hand():
    # d = (old − sampling)·mask = [[0.5, 0], [0, 0 (masked)]]
    # token:    exp(d) = [[1.648721, 1], [1, 1]];  truncate at 1.5 → [[1.5, 1], [1, 1]]
    # sequence: exp(Σ d) = [1.648721, 1];          mask outside [0, 1.5] → [0, 1], masked fraction 1/2
    w, m = sampling_weights(OLD, SAMPLING, MASK, mode="token_truncate", clip_max=10.0)
    assert torch.allclose(w, torch.tensor([[math.exp(0.5), 1.0], [1.0, 1.0]]))
    w, _ = sampling_weights(OLD, SAMPLING, MASK, mode="token_truncate", clip_max=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, 1.0], [1.0, 1.0]]))
    w, m = sampling_weights(OLD, SAMPLING, MASK, mode="sequence_mask", clip_max=1.5)
    assert torch.allclose(w, torch.tensor([[0.0], [1.0]])) and m["importance_sampling_ratio/masked_fraction"] == 0.5
    # |d| over the 3 real tokens: [0.5, 0, 0] → mean 1/6, max 0.5 (the masked token's 0.5 is not counted)
    assert m["sampling_logp_difference/mean"].item() == pytest.approx(0.5 / 3)
    assert m["sampling_logp_difference/max"].item() == pytest.approx(0.5)


def test_ratio_metrics_by_hand_with_a_token_the_sampler_did_not_score():
    """old = [[−1, −2], [−1, −1]], sampler = [[−1.5, −2], [−0.5, NaN]] (NaN: a token the sampler gave no log-prob),
    all 4 tokens real. d = old − sampler = [[0.5, 0], [−0.5, NaN → 0]]; token_truncate at 10: weights
    [e^0.5, 1, e^−0.5, 1] → min e^−0.5 = 0.606531, mean (e^0.5 + 2 + e^−0.5)/4 = 1.063716, max e^0.5 = 1.648721.
    |d| over the 3 scored tokens [0.5, 0, 0.5]: mean 1/3 (the unscored token left out: 1/4 if it counted as 0)."""
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    sampler = torch.tensor([[-1.5, -2.0], [-0.5, float("nan")]])
    _, m = sampling_weights(old, sampler, torch.ones(2, 2), mode="token_truncate", clip_max=10.0)
    assert m["importance_sampling_ratio/min"].item() == pytest.approx(math.exp(-0.5))
    assert m["importance_sampling_ratio/mean"].item() == pytest.approx((math.exp(0.5) + 2 + math.exp(-0.5)) / 4)
    assert m["importance_sampling_ratio/max"].item() == pytest.approx(math.exp(0.5))
    assert m["sampling_logp_difference/mean"].item() == pytest.approx(1 / 3)
    assert m["sampling_logp_difference/max"].item() == pytest.approx(0.5)


def _trl(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, the vLLM importance-sampling ratio (transcribed)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    seq = mode in ["sequence_mask", "sequence_truncate"]
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if seq else diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        lo = clip_min if clip_min is not None else -math.inf
        hi = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)
    return ratio


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 2.0), (None, 1.2)])
def test_every_mode_matches_trl(mode, clip):
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    sampling = old + 0.3 * torch.randn(6, 7, generator=g, dtype=torch.float64)
    sampling[1, 2] = float("nan")  # a token the sampler could not score
    mask = (torch.arange(7) < torch.tensor([7, 4, 1, 6, 3, 5])[:, None]).double()
    ours, _ = sampling_weights(old, sampling, mask, mode=mode, clip_min=clip[0], clip_max=clip[1])
    assert torch.allclose(ours, _trl(old, sampling, mask, mode, *clip))


@pytest.mark.parametrize("mode", IS_MODES)
def test_no_op_when_sampler_and_trainer_agree(mode):
    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(4, 5, generator=g)
    mask = torch.ones(4, 5)
    w, m = sampling_weights(lp, lp.clone(), mask, mode=mode)
    assert torch.equal(w, torch.ones_like(w)) and m["importance_sampling_ratio/masked_fraction"] == 0.0
    adv = torch.randn(4, generator=g)
    old = lp + 0.1
    plain, _ = policy_loss(lp, old, adv, mask)
    corrected, _ = policy_loss(lp, old, adv, mask, is_weights=w)
    assert torch.equal(plain, corrected)


def test_weights_scale_the_policy_term_not_the_kl():
    # one token, on-policy, A = 1: policy term −1; k3(log π −1, ref −2) = e^−1; β = 0.1; weight 2:
    # loss = 2·(−1) + 0.1·0.367879 = −1.963212
    lp = torch.tensor([[-1.0]])
    loss, _ = policy_loss(lp, lp, torch.ones(1), torch.ones(1, 1), beta=0.1, ref_logps=torch.tensor([[-2.0]]),
                          is_weights=torch.tensor([[2.0]]))
    assert loss.item() == pytest.approx(-2.0 + 0.1 * math.exp(-1), abs=1e-6)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_truncation_without_a_bound_is_refused_as_trl_refuses_it(mode):
    """TRL 1.16's GRPOConfig raises when a *_truncate mode has neither clip_min nor clip_max (its torch.clamp could
    not run); groupwise returned the raw weights, e.g. exp(0.5) = 1.648721 for OLD/SAMPLING's first token, unclipped."""
    with pytest.raises(ValueError, match=r"At least one of `vllm_importance_sampling_clip_min` or "
                                         r"`vllm_importance_sampling_clip_max` must be set"):
        sampling_weights(OLD, SAMPLING, MASK, mode=mode, clip_min=None, clip_max=None)
    # a mask mode without bounds masks nothing: exp(Σd) = [1.648721, 1] per sequence (TRL: bounds −inf, +inf)
    w, m = sampling_weights(OLD, SAMPLING, MASK, mode="sequence_mask", clip_min=None, clip_max=None)
    assert torch.allclose(w, torch.tensor([[math.exp(0.5)], [1.0]])) and m["importance_sampling_ratio/max"] == w.max()


@pytest.mark.parametrize("clip", [(2.0, 2.0), (3.0, 1.5)])
def test_a_lower_bound_not_below_the_upper_is_refused_as_trl_refuses_it(clip):
    """TRL: clip_min must be less than clip_max. groupwise masked every weight (w < 3 or w > 1.5 holds for all w:
    [[0], [0]] for sequence_mask) or clamped them all to clip_max, silently."""
    for mode in IS_MODES:
        with pytest.raises(ValueError, match=rf"vllm_importance_sampling_clip_min \({clip[0]}\) must be less than "
                                             rf"vllm_importance_sampling_clip_max \({clip[1]}\)"):
            sampling_weights(OLD, SAMPLING, MASK, mode=mode, clip_min=clip[0], clip_max=clip[1])


def test_metrics_by_hand_for_token_mask_with_a_lower_bound():
    # d = [[0.5, 0], [0, (pad)]]; token weights exp(d) = [[1.648721, 1], [1, 1]], window [1.2, 1.5]:
    # 1.648721 > 1.5 masked, the three 1s < 1.2 masked -> every real weight 0; masked fraction 3/3 = 1
    w, m = sampling_weights(OLD, SAMPLING, MASK, mode="token_mask", clip_min=1.2, clip_max=1.5)
    assert torch.equal(w[MASK.bool()], torch.zeros(3)) and m["importance_sampling_ratio/masked_fraction"] == 1.0
    assert (m["importance_sampling_ratio/min"], m["importance_sampling_ratio/mean"],
            m["importance_sampling_ratio/max"]) == (0.0, 0.0, 0.0)
    # the padded token: d = 0, exp(0) = 1 < 1.2, masked as well (TRL masks the whole tensor; the loss mask drops it)
    assert w[1, 1] == 0.0

"""Process-supervision advantages (DeepSeekMath §4.1.3): hand-worked values for every scale / std and the edge cases
(a step ending on the last token, two steps ending on one token, a completion without steps, an unscored step,
a group of one step), and a plain loop over Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)} for every estimator."""

import math
import random

import pytest
import torch

from groupwise.core.advantages import process_advantages


def test_step_values_stay_exact_next_to_large_ones():
    # scale="none" (r̃ = r − mean, no division). Group: completion 0 steps [−1e8 + 1, 1e8] ending at tokens 1, 3;
    # completion 1 steps [−1, 0] ending at 1, 3. mean = (−1e8 + 1 + 1e8 − 1 + 0) / 4 = 0, so r̃ = r.
    # completion 0: step 0's value = (−1e8 + 1) + 1e8 = 1 (tokens 0–1), step 1's = 1e8 (tokens 2–3);
    # completion 1: −1 + 0 = −1 (tokens 0–1), 0 (tokens 2–3).
    # A float32 difference-of-running-sums gave tokens 0–1 of completion 0 the value 0 (1 is below 1e8's ulp, 8).
    rewards, ends = [[[-1e8 + 1, 1e8], [-1.0, 0.0]]], [[[1, 3], [1, 3]]]
    adv = process_advantages(rewards, ends, 4, scale="none")
    assert adv[0, 0].tolist() == [1.0, 1.0, 1e8, 1e8]
    assert adv[0, 1].tolist() == [-1.0, -1.0, 0.0, 0.0]
    # rloo (no scaling either): completion 0's baseline is completion 1's mean step reward −0.5, so its steps are
    # [−1e8 + 1.5, 1e8 + 0.5] → values [2, 1e8 + 0.5]; completion 1's baseline (−1e8 + 1 + 1e8)/2 = 0.5 → [−1.5, −0.5]
    # → values [−2, −0.5]
    rloo = process_advantages(rewards, ends, 4, estimator="rloo")
    assert rloo[0, 0, :2].tolist() == [2.0, 2.0] and rloo[0, 1].tolist() == [-2.0, -2.0, -0.5, -0.5]
    # step_return (returns-to-go, centred per step index; scale "none" does not divide): completion 0 returns
    # [(−1e8 + 1) + 1e8, 1e8] = [1, 1e8], completion 1 [−1, 0]. Index 0: {1, −1}, mean 0 → [1, −1];
    # index 1: {1e8, 0}, mean 5e7 → [5e7, −5e7].
    ret = process_advantages(rewards, ends, 4, scale="none", form="step_return")
    assert ret[0, 0].tolist() == [1.0, 1.0, 5e7, 5e7] and ret[0, 1].tolist() == [-1.0, -1.0, -5e7, -5e7]


# Two prompts, G = 2, T = 3.
# prompt 0: completion 0 steps [1, 0] ending at tokens 0 and 2 (= T − 1, the last token); completion 1 one step [1]
#           ending at 1. R_0 = {1, 0, 1}.
# prompt 1: completion 0 steps [0, 0], completion 1 one step [0]: all equal, no signal (0 under every scale here).
REWARDS = [[[1.0, 0.0], [1.0]], [[0.0, 0.0], [0.0]]]
ENDS = [[[0, 2], [1]], [[0, 1], [2]]]


@pytest.mark.parametrize("options,r", [
    # group, population: mean 2/3, std √((1/9 + 4/9 + 1/9)/3) = √(2/9) = 0.471405
    #   r̃ = [(1/3)/0.471405, (−2/3)/0.471405] = [0.707107, −1.414214], [0.707107]
    ({"scale": "group", "std": "population"}, (0.707107, -1.414214, 0.707107)),
    # group, Bessel: std √((6/9)/2) = √(1/3) = 0.577350 → [0.577350, −1.154701], [0.577350]
    ({"scale": "group", "std": "unbiased"}, (0.577350, -1.154701, 0.577350)),
    # batch: centred by the group mean as above, divided by the population std of all six rewards
    #   [1, 0, 1, 0, 0, 0]: mean 1/3, std √((2·(2/3)² + 4·(1/3)²)/6) = √(2/9) = 0.471405 — the same numbers here
    ({"scale": "batch", "std": "population"}, (0.707107, -1.414214, 0.707107)),
    # none: r − mean only → [1/3, −2/3], [1/3]
    ({"scale": "none"}, (1 / 3, -2 / 3, 1 / 3)),
])
def test_process_scales_by_hand(options, r):
    a, b, c = r  # r̃ of prompt 0: completion 0 steps (a, b), completion 1 step c
    adv = process_advantages(REWARDS, ENDS, 3, eps=0.0, **options)
    # completion 0: token 0 (step 0's end) gets a + b, tokens 1–2 (step 1, ending on the last token) get b;
    # completion 1: tokens 0–1 get c, token 2 (after its last step) gets 0
    expected = torch.tensor([[[a + b, b, b], [c, c, 0.0]], [[0.0] * 3, [0.0] * 3]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_process_edge_cases_by_hand():
    # G = 3, T = 4. Completion 0: steps [2, NaN (unscored), 0] ending at 0, 2, 2 (two steps end on token 2);
    # completion 1: no steps; completion 2: one step [1] ending at 3.
    # R = {2, 0, 1} (the unscored step is left out): mean 1, population std √((1 + 1 + 0)/3) = 0.816497
    # r̃: completion 0 [1.224745, 0 (unscored), −1.224745], completion 2 [0]
    # completion 0: token 0 → 1.224745 + 0 − 1.224745 = 0; tokens 1–2 → 0 − 1.224745 = −1.224745; token 3 → 0
    adv = process_advantages([[[2.0, None, 0.0], [], [1.0]]], [[[0, 2, 2], [], [3]]], 4, eps=0.0)
    torch.testing.assert_close(adv[0], torch.tensor([[0.0, -1.224745, -1.224745, 0.0], [0.0] * 4, [0.0] * 4]),
                               atol=1e-5, rtol=1e-5)
    # one step in the whole group: std 0, no signal, 0 everywhere (not NaN); likewise a group with no steps at all
    assert torch.equal(process_advantages([[[0.7], []]], [[[1], []]], 2), torch.zeros(1, 2, 2))
    assert torch.equal(process_advantages([[[], []]], [[[], []]], 2), torch.zeros(1, 2, 2))


def _r_tilde_loop(rewards, estimator, scale="group", std="population", eps=1e-4):
    """r̃ per (b, g, j) by the formulas, written out (None = unscored: left out, r̃ = 0)."""
    def mean_sd(vals):
        if not vals:
            return 0.0, 0.0
        m = sum(vals) / len(vals)
        d = len(vals) if std == "population" else len(vals) - 1
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / d) if d > 0 else 0.0
        return m, (sd if max(vals) > min(vals) else 0.0)

    groups = [[v for row in group for v in row if v is not None] for group in rewards]
    centred = [[[None if v is None else (v - mean_sd(groups[b])[0] if mean_sd(groups[b])[1] > 0 else 0.0)
                 for v in row] for row in group] for b, group in enumerate(rewards)]
    everything = [v for group in groups for v in group]
    every_centred = [v for group in centred for row in group for v in row if v is not None]
    out = []
    for b, group in enumerate(rewards):
        out_b = []
        for g, row in enumerate(group):
            out_g = []
            for j, v in enumerate(row):
                if v is None:
                    out_g.append(0.0)
                elif estimator == "rloo":
                    others = [x for h, other in enumerate(group) if h != g for x in other if x is not None]
                    out_g.append(v - sum(others) / len(others) if others else 0.0)
                elif estimator == "reinforce_plus_plus_baseline":
                    sd = mean_sd(every_centred)[1]
                    out_g.append(centred[b][g][j] / (sd + eps) if sd > 0 else 0.0)
                else:
                    sd = mean_sd(groups[b] if scale == "group" else everything)[1]
                    c = centred[b][g][j]
                    out_g.append(c if scale == "none" else (c / (sd + eps) if sd > 0 else 0.0))
            out_b.append(out_g)
        out.append(out_b)
    return out


def _process_loop(rewards, ends, T, **kw):
    r_tilde = _r_tilde_loop(rewards, **kw)
    out = torch.zeros(len(rewards), len(rewards[0]), T, dtype=torch.float64)
    for b in range(len(rewards)):
        for g in range(len(rewards[b])):
            for t in range(T):
                out[b, g, t] = sum(r for r, e in zip(r_tilde[b][g], ends[b][g]) if e >= t)
    return out


@pytest.mark.parametrize("estimator,options", [
    ("grpo", {"scale": "group", "std": "population"}), ("grpo", {"scale": "group", "std": "unbiased"}),
    ("grpo", {"scale": "batch", "std": "population"}), ("grpo", {"scale": "batch", "std": "unbiased"}),
    ("grpo", {"scale": "none"}), ("rloo", {}), ("reinforce_plus_plus_baseline", {"std": "population"}),
    ("reinforce_plus_plus_baseline", {"std": "unbiased"}),
])
def test_process_matches_loop_for_every_estimator(estimator, options):
    rng = random.Random(7)
    T = 10
    rewards, ends = [], []
    for b in range(5):
        rb, eb = [], []
        for g in range(3):
            k = rng.randint(0, 4)
            e = sorted(rng.choice(range(T)) for _ in range(k))  # repeats: several steps may end on one token
            if k and rng.random() < 0.3:
                e[-1] = T - 1  # a step ending exactly on the last token
            rb.append([None if rng.random() < 0.15 else rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in e])
            eb.append(e)
        rewards.append(rb)
        ends.append(eb)
    rewards[1] = [[0.5] * len(row) for row in rewards[1]]  # a group without signal
    opts = {**options, **({"eps": 1e-4} if estimator != "rloo" else {})}
    got = process_advantages(rewards, ends, T, estimator=estimator, **opts)
    expected = _process_loop(rewards, ends, T, estimator=estimator, **opts)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_step_spread_reads_what_the_form_compares():
    """The 'no signal' test of dynamic sampling and process/zero_std_groups: a group has a signal exactly when the
    chosen form's advantages are not all 0. Group 0: rewards [[1, 1], [1, 1, 1]] (equal rewards, step counts 2 and
    3): suffix_sum sees one value, spread 0, advantages 0; step_return sees returns [2, 1] and [3, 2, 1]: index 0
    {2, 3} population std 0.5, index 1 {1, 2} 0.5, index 2 {1} 0 → 0.5, and its advantages are ±1. Group 1:
    rewards [[0, 1], [1, 0]]: suffix_sum spread 0.5 (values {0, 1, 1, 0}); returns [1, 1] and [1, 0]: index 0
    {1, 1} std 0, index 1 {1, 0} 0.5 → 0.5. Group 2: [[1, None], [1, 1]]: suffix_sum {1, 1, 1} spread 0;
    returns [?, ?] and [2, 1]: one return per index → 0 (its step_return advantages are all 0)."""
    from groupwise.core.advantages import step_spread

    rewards = [[[1.0, 1.0], [1.0, 1.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]], [[1.0, None], [1.0, 1.0]]]
    ends = [[[1, 3], [1, 3, 5]], [[1, 3], [1, 3]], [[1, 3], [1, 3]]]
    assert step_spread(rewards, "suffix_sum").tolist() == [0.0, 0.5, 0.0]
    assert step_spread(rewards, "step_return").tolist() == [0.5, 0.5, 0.0]
    for form in ("suffix_sum", "step_return"):
        adv = process_advantages(rewards, ends, 6, form=form)
        assert ((adv.abs() > 0).flatten(1).any(-1) == (step_spread(rewards, form) > 1e-6)).all(), form
    assert step_spread([[[], []]], "step_return").tolist() == [0.0]  # no steps anywhere


def test_step_spread_under_rloo_needs_two_completions_with_scored_steps():
    """rloo's baseline for a step of completion i is the mean of the *other* completions' step rewards: when only one
    completion of the group has a scored step (the others have none, or only unscored ones), every advantage is 0,
    so the group has no signal, whatever the spread of that completion's own steps. Group 0: [[0, 1], []]; group 1:
    [[0, 1], [None, None]]; group 2: [[0, 1], [0.5]]: steps {0, 1, 0.5}, spread √(1/6) = 0.4082, and completion 0's
    steps get 0 − 0.5 and 1 − 0.5 (≠ 0). grpo compares all steps of the group, one completion's too: 0.5, 0.5."""
    from groupwise.core.advantages import step_spread

    rewards = [[[0.0, 1.0], []], [[0.0, 1.0], [None, None]], [[0.0, 1.0], [0.5]]]
    ends = [[[1, 3], []], [[1, 3], [1, 3]], [[1, 3], [1]]]
    got = step_spread(rewards, "suffix_sum", "rloo").tolist()
    assert got[:2] == [0.0, 0.0] and got[2] == pytest.approx((1 / 6) ** 0.5)
    assert step_spread(rewards, "suffix_sum", "grpo").tolist()[:2] == [0.5, 0.5]
    for form in ("suffix_sum", "step_return"):
        for estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            adv = process_advantages(rewards, ends, 6, form=form, estimator=estimator)
            has = (adv.abs() > 0).flatten(1).any(-1)
            assert (has == (step_spread(rewards, form, estimator) > 1e-6)).all(), (form, estimator, has)


def test_a_round_without_a_single_step_has_zero_spread_and_zero_advantages():
    """Every completion blank, or its only step cut (score_truncated_step=False): K = 0 steps. suffix_sum's spread
    took a std over an empty axis (IndexError in amax) in the process/zero_std_groups metric and dynamic sampling;
    both forms now give 0, as the advantages are."""
    from groupwise.core.advantages import process_advantages, step_spread

    rewards = [[[], []], [[], []]]  # (B=2, G=2, K=0)
    for form in ("suffix_sum", "step_return"):
        assert step_spread(rewards, form).tolist() == [0.0, 0.0], form
    assert process_advantages([[[], []]], [[[], []]], 4).abs().sum() == 0

import math
import random

import pytest
import torch

from groupwise.core.advantages import outcome_advantages, process_advantages


def test_outcome_worked_example():
    # DeepSeekMath §4.1.2 by hand: r = [8.5, 6.2, 4.1]; mean = 18.8/3 = 6.2667
    # population std = sqrt((2.2333² + 0.0667² + 2.1667²)/3) = sqrt(9.6867/3) = 1.7969
    # r̃ = [2.2333/1.7969, −0.0667/1.7969, −2.1667/1.7969] = [1.2429, −0.0371, −1.2058]
    adv = outcome_advantages(torch.tensor([[8.5, 6.2, 4.1]]))
    assert torch.allclose(adv, torch.tensor([[1.2429, -0.0371, -1.2058]]), atol=2e-4)
    assert [round(x, 2) for x in adv[0].tolist()] == [1.24, -0.04, -1.21]


def test_unbiased_std_is_bessel():
    # r = [1, 0]: mean 0.5; Bessel std = sqrt((0.25 + 0.25)/1) = 0.70711 → ±0.5/0.70711 = ±0.70711
    # population std = 0.5 → ±1.0
    r = torch.tensor([[1.0, 0.0]])
    assert torch.allclose(outcome_advantages(r, std="unbiased", eps=0), torch.tensor([[0.70711, -0.70711]]), atol=1e-5)
    assert torch.allclose(outcome_advantages(r, eps=0), torch.tensor([[1.0, -1.0]]))


def test_scale_batch_and_none():
    # group 0: [1, 3] mean 2; group 1: [0, 0] mean 0.  All rewards [1, 3, 0, 0]: mean 1,
    # population std = sqrt((0 + 4 + 1 + 1)/4) = sqrt(1.5) = 1.22474
    r = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    batch = outcome_advantages(r, scale="batch", eps=0)
    assert torch.allclose(batch, torch.tensor([[-1 / 1.22474, 1 / 1.22474], [0.0, 0.0]]), atol=1e-5)
    none = outcome_advantages(r, scale="none")
    assert torch.equal(none, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]))


def test_nan_rewards_are_left_out():
    # [2, NaN, 0]: stats over [2, 0] → mean 1, population std 1 → [1, 0 (NaN), −1]
    adv = outcome_advantages(torch.tensor([[2.0, float("nan"), 0.0]]), eps=0)
    assert torch.equal(adv, torch.tensor([[1.0, 0.0, -1.0]]))
    all_nan = outcome_advantages(torch.full((1, 3), float("nan")))
    assert torch.equal(all_nan, torch.zeros(1, 3))


def test_equal_and_near_equal_groups_stay_small():
    assert torch.equal(outcome_advantages(torch.full((2, 4), 0.7)), torch.zeros(2, 4))
    # float noise of 1e-7 on equal rewards: with eps 1e-4 the advantage stays ≤ ~1e-3, never ±1.
    noisy = torch.tensor([[0.5, 0.5 + 1e-7, 0.5 - 1e-7, 0.5]], dtype=torch.float64)
    adv = outcome_advantages(noisy)
    assert adv.abs().max() < 2e-3 and not torch.isnan(adv).any()


@pytest.mark.parametrize("estimator,options,expected", [
    # group 3 = [0, 1, 0.5]: mean 0.5, population std √((0.25 + 0.25 + 0) / 3) = 0.408248 → ±1.224745, 0
    ("grpo", {"eps": 0.0}, [[0.0] * 3, [0.0] * 3, [-1.224745, 1.224745, 0.0]]),
    # centred: 0 ×6 and [−0.5, 0.5, 0]; batch std √(0.5 / 9) = 0.235702 → ±2.121320, 0
    ("reinforce_plus_plus_baseline", {"eps": 0.0}, [[0.0] * 3, [0.0] * 3, [-2.121320, 2.121320, 0.0]]),
])
def test_an_all_equal_group_is_exactly_zero_also_at_eps_0(estimator, options, expected):
    """[0.1, 0.1, 0.1]: the float mean is 0.1 + 2e-17 (0.30000000000000004 / 3), so each deviation divided by the
    std of the deviations alone (eps = 0) was −1 for every completion; [1, 1, 1] was 0 / 0 = NaN. Both are 0."""
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.5]], dtype=torch.float64)
    out = normalize_rewards(r.unsqueeze(-1), estimator, **options).squeeze(-1)
    assert torch.equal(out[:2], torch.zeros(2, 3))
    assert torch.allclose(out, torch.tensor(expected), atol=1e-6)
    # process supervision: equal step rewards across the group (two steps each, all 0.1) give 0 on every token
    steps = process_advantages([[[0.1, 0.1], [0.1, 0.1]]], [[[0, 2], [1, 3]]], 4, estimator=estimator, **options)
    assert torch.equal(steps, torch.zeros(1, 2, 4))


def _outcome_loop(rewards, scale, std, eps):
    out = torch.zeros_like(rewards)
    vals_all = [v for v in rewards.flatten().tolist() if not math.isnan(v)]
    def sd(vals):
        if not vals:
            return 0.0
        m = sum(vals) / len(vals)
        d = len(vals) if std == "population" else len(vals) - 1
        return math.sqrt(sum((v - m) ** 2 for v in vals) / d) if d > 0 else 0.0
    for b in range(rewards.size(0)):
        vals = [v for v in rewards[b].tolist() if not math.isnan(v)]
        mean = sum(vals) / len(vals) if vals else 0.0
        for g in range(rewards.size(1)):
            r = rewards[b, g].item()
            if math.isnan(r):
                continue
            if scale == "group":
                out[b, g] = (r - mean) / (sd(vals) + eps)
            elif scale == "batch":
                out[b, g] = (r - mean) / (sd(vals_all) + eps)
            else:
                out[b, g] = r - mean
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["population", "unbiased"])
def test_outcome_matches_loop(scale, std):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(6, 5, generator=g, dtype=torch.float64)
    r[torch.rand(6, 5, generator=g) < 0.2] = float("nan")
    r[2] = 1.5  # an all-equal group
    expected = _outcome_loop(r, scale, std, 1e-4)
    assert torch.allclose(outcome_advantages(r, scale=scale, std=std), expected.float(), atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="scale"):
        outcome_advantages(torch.zeros(1, 2), scale="grp")
    with pytest.raises(ValueError, match="std"):
        outcome_advantages(torch.zeros(1, 2), std="sample")
    with pytest.raises(ValueError, match=r"\(B, G\)"):
        outcome_advantages(torch.zeros(4))


def test_process_worked_example():
    # DeepSeekMath §4.1.3 by hand: three identical outputs with step rewards [0.8, 0.9, 0.7, 1.0].
    # R has 12 values, mean 0.85, population std = sqrt((.0025+.0025+.0225+.0225)/4) = sqrt(.0125) = 0.11180
    # r̃ = [−0.4472, 0.4472, −1.3416, 1.3416]; advantage at step j's end = Σ_{k ≥ j} r̃_k
    #   = [0.0, 0.4472, 0.0, 1.3416]  (rounding std to 0.11 first would give 1.36)
    steps = [[[0.8, 0.9, 0.7, 1.0]] * 3]
    ends = [[[1, 3, 5, 7]] * 3]  # each step two tokens long
    adv = process_advantages(steps, ends, num_tokens=9, eps=0)
    expected_per_step = torch.tensor([0.0, 0.44721, 0.0, 1.34164])
    for g in range(3):
        assert torch.allclose(adv[0, g, [1, 3, 5, 7]], expected_per_step, atol=1e-4)
        # tokens inside a step share the step's advantage; tokens after the last step get 0
        assert torch.allclose(adv[0, g, [0, 2, 4, 6]], expected_per_step, atol=1e-4)
        assert adv[0, g, 8] == 0


def _process_loop(step_rewards, step_ends, T, std, eps):
    B, G = len(step_rewards), len(step_rewards[0])
    out = torch.zeros(B, G, T, dtype=torch.float64)
    for b in range(B):
        R = [r for g in range(G) for r in step_rewards[b][g] if r is not None]
        mean = sum(R) / len(R) if R else 0.0
        d = len(R) if std == "population" else len(R) - 1
        sd = math.sqrt(sum((r - mean) ** 2 for r in R) / d) if d > 0 else 0.0
        for g in range(G):
            for t in range(T):
                out[b, g, t] = sum(
                    (r - mean) / (sd + eps)
                    for r, e in zip(step_rewards[b][g], step_ends[b][g])
                    if e >= t and r is not None
                )
    return out


@pytest.mark.parametrize("std", ["population", "unbiased"])
def test_process_matches_loop_on_ragged_input(std):
    rng = random.Random(0)
    T = 12
    step_rewards, step_ends = [], []
    for b in range(4):
        rs_b, es_b = [], []
        for g in range(3):
            k = rng.randint(0, 5)  # K_i may be 0
            ends = sorted(rng.sample(range(T), k))
            rs = [None if rng.random() < 0.1 else rng.uniform(-1, 1) for _ in range(k)]
            rs_b.append(rs)
            es_b.append(ends)
        step_rewards.append(rs_b)
        step_ends.append(es_b)
    adv = process_advantages(step_rewards, step_ends, T, std=std)
    assert torch.allclose(adv.double(), _process_loop(step_rewards, step_ends, T, std, 1e-4), atol=1e-5)


def test_process_bad_input():
    with pytest.raises(ValueError, match="outside"):
        process_advantages([[[1.0]]], [[[5]]], num_tokens=3)
    with pytest.raises(ValueError, match="ascending"):
        process_advantages([[[1.0, 2.0]]], [[[2, 1]]], num_tokens=3)
    with pytest.raises(ValueError, match="step ends"):
        process_advantages([[[1.0, 2.0]]], [[[1]]], num_tokens=3)
    with pytest.raises(ValueError, match="step end 1.5 is not a whole token index"):
        process_advantages([[[1.0, 2.0]]], [[[1.5, 2]]], num_tokens=3)  # int() would have ended step 1 at token 1
    # a whole float (numpy / JSON) is the same index: one step ending at token 1 of 3, G = 1 so r̃ = 0 everywhere
    assert process_advantages([[[1.0]]], [[[1.0]]], num_tokens=3).tolist() == [[[0.0, 0.0, 0.0]]]


# ---- the estimator registry: RLOO and REINFORCE++-baseline ----------------------------------------------------------
from groupwise.core.advantages import ESTIMATORS, masked_mean_std, normalize_rewards  # noqa: E402


def test_rloo_by_hand():
    # r = [3, 1, 2]: baselines are the means of the others: (1+2)/2 = 1.5, (3+2)/2 = 2.5, (3+1)/2 = 2
    # → [3 − 1.5, 1 − 2.5, 2 − 2] = [1.5, −1.5, 0]  (= G/(G−1) · (r − mean) = 1.5 · [1, −1, 0])
    assert torch.equal(outcome_advantages(torch.tensor([[3.0, 1.0, 2.0]]), estimator="rloo"),
                       torch.tensor([[1.5, -1.5, 0.0]]))
    # NaN is left out of the baselines: [3, NaN, 1] → [3 − 1, 0, 1 − 3] = [2, 0, −2]
    assert torch.equal(outcome_advantages(torch.tensor([[3.0, float("nan"), 1.0]]), estimator="rloo"),
                       torch.tensor([[2.0, 0.0, -2.0]]))
    # a completion whose group has no other scored completion has no baseline: 0
    assert torch.equal(outcome_advantages(torch.tensor([[5.0, float("nan")]]), estimator="rloo"), torch.zeros(1, 2))


def test_reinforce_plus_plus_baseline_by_hand():
    # groups [1, 3] (mean 2) and [5, 5] (mean 5): centred c = [−1, 1, 0, 0] (its batch mean is 0),
    # population std of c = sqrt((1 + 1 + 0 + 0)/4) = 0.70711 → c / 0.70711 = [−1.41421, 1.41421, 0, 0]
    adv = outcome_advantages(torch.tensor([[1.0, 3.0], [5.0, 5.0]]), estimator="reinforce_plus_plus_baseline", eps=0)
    assert torch.allclose(adv, torch.tensor([[-1.41421, 1.41421], [0.0, 0.0]]), atol=1e-5)
    # not grpo's scale="batch", which divides by the std of the raw rewards [1, 3, 5, 5] (= 1.65831)
    batch = outcome_advantages(torch.tensor([[1.0, 3.0], [5.0, 5.0]]), scale="batch", eps=0)
    assert torch.allclose(batch, torch.tensor([[-0.60302, 0.60302], [0.0, 0.0]]), atol=1e-5)
    # std="unbiased" (reward_std): Bessel's std of c = sqrt((1 + 1 + 0 + 0)/3) = 0.81650 → [−1.22474, 1.22474, 0, 0]
    unbiased = outcome_advantages(torch.tensor([[1.0, 3.0], [5.0, 5.0]]), estimator="reinforce_plus_plus_baseline",
                                  std="unbiased", eps=0)
    assert torch.allclose(unbiased, torch.tensor([[-1.22474, 1.22474], [0.0, 0.0]]), atol=1e-5)


def test_rloo_over_steps_by_hand():
    # G = 2. Completion 0 has steps [1, 0] ending at tokens 1, 3; completion 1 has one step [1] ending at token 2.
    # Step baselines are the other completion's mean step reward: completion 0 → 1, completion 1 → 0.5.
    # r̃: completion 0 [0, −1], completion 1 [0.5].  Â = Σ_{end ≥ t} r̃:
    # completion 0: t = 0, 1 → 0 + (−1) = −1; t = 2, 3 → −1.   completion 1: t = 0..2 → 0.5; t = 3 → 0.
    adv = process_advantages([[[1.0, 0.0], [1.0]]], [[[1, 3], [2]]], num_tokens=4, estimator="rloo")
    assert torch.equal(adv, torch.tensor([[[-1.0, -1.0, -1.0, -1.0], [0.5, 0.5, 0.5, 0.0]]]))


def _flat_groups(rewards):  # (B, G, K) with NaN → per group: [(g, value)] of the valid entries
    return [[(g, v) for g in range(rewards.size(1)) for v in rewards[b, g].tolist() if not math.isnan(v)]
            for b in range(rewards.size(0))]


def _rloo_loop(rewards):
    out = torch.zeros_like(rewards)
    for b, group in enumerate(_flat_groups(rewards)):
        for g in range(rewards.size(1)):
            others = [v for h, v in group if h != g]
            for k in range(rewards.size(2)):
                r = rewards[b, g, k].item()
                if not math.isnan(r) and others:
                    out[b, g, k] = r - sum(others) / len(others)
    return out


def _reinforce_pp_loop(rewards, eps, unbiased=False):
    centred = {}
    for b, group in enumerate(_flat_groups(rewards)):
        mean = sum(v for _, v in group) / len(group) if group else 0.0
        for g in range(rewards.size(1)):
            for k in range(rewards.size(2)):
                if not math.isnan(rewards[b, g, k].item()):
                    centred[b, g, k] = rewards[b, g, k].item() - mean
    vals = list(centred.values())
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - unbiased))
    out = torch.zeros_like(rewards)
    for (b, g, k), v in centred.items():
        out[b, g, k] = (v - m) / (sd + eps)
    return out


@pytest.mark.parametrize("K", [1, 4])  # outcome rewards, and ragged step rewards padded with NaN
def test_estimators_match_loops(K):
    g = torch.Generator().manual_seed(1)
    r = torch.randn(5, 4, K, generator=g, dtype=torch.float64)
    r[torch.rand(5, 4, K, generator=g) < 0.3] = float("nan")
    r[1] = 0.25  # an all-equal group
    r[2, :3] = float("nan")  # one scored completion only: RLOO has no baseline for it
    assert torch.allclose(normalize_rewards(r, "rloo").double(), _rloo_loop(r), atol=1e-5)
    assert torch.allclose(normalize_rewards(r, "reinforce_plus_plus_baseline", eps=1e-4).double(),
                          _reinforce_pp_loop(r, 1e-4), atol=1e-5)
    assert torch.allclose(normalize_rewards(r, "reinforce_plus_plus_baseline", eps=1e-4, std="unbiased").double(),
                          _reinforce_pp_loop(r, 1e-4, unbiased=True), atol=1e-5)


def test_estimator_registry_rejects_what_it_does_not_take():
    assert set(ESTIMATORS) == {"grpo", "rloo", "reinforce_plus_plus_baseline"}
    with pytest.raises(ValueError, match=r"'rloo' takes no option\(s\) \['scale'\]"):
        outcome_advantages(torch.zeros(1, 2), estimator="rloo", scale="group")
    with pytest.raises(ValueError, match="advantage_estimator='ppo' is not one of"):
        outcome_advantages(torch.zeros(1, 2), estimator="ppo")


def test_masked_mean_std_by_hand():
    # [1, NaN, 3]: mean 2; population std 1; Bessel std sqrt(2/1) = 1.41421; an empty row: 0, 0
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("nan")] * 3])
    valid = ~torch.isnan(x)
    mean, sd, n = masked_mean_std(torch.nan_to_num(x), valid, -1)
    assert mean.view(-1).tolist() == [2.0, 0.0] and sd.view(-1).tolist() == [1.0, 0.0] and n.view(-1).tolist() == [2, 0]
    _, bessel, _ = masked_mean_std(torch.nan_to_num(x), valid, -1, std="unbiased")
    assert bessel[0].item() == pytest.approx(1.41421, abs=1e-5)


# ---- step_advantage="step_return": returns-to-go normalised per step index ------------------------------------------
def test_step_return_worked_example():
    """One prompt, G = 3, T = 5. Step rewards [[1], [0, 0.5], [0, 1]], step ends [[2], [1, 3], [0, 4]].
    Returns-to-go: row 0 [1]; row 1 [0.5, 0.5]; row 2 [1, 1].
    Step index 0, rows {0, 1, 2}: values {1, 0.5, 1}, mean 5/6, population std sqrt(((1/6)² + (1/3)² + (1/6)²)/3)
      = sqrt(1/18) = 0.23570: row 0 (1/6)/0.23570 = 0.70711, row 1 (−1/3)/0.23570 = −1.41421, row 2 0.70711.
    Step index 1, rows {1, 2}: values {0.5, 1}, mean 0.75, std 0.25: row 1 −1, row 2 +1.
    Tokens: row 0 t0–2 → 0.70711, t3–4 → 0; row 1 t0–1 → −1.41421, t2–3 → −1, t4 → 0; row 2 t0 → 0.70711, t1–4 → 1.
    (The paper's suffix sum on the same input, for contrast: all five rewards {1, 0, 0.5, 0, 1}, mean 0.5, std
    sqrt(0.2) = 0.44721, so r̃ = ±1.11803 or 0, and row 1 gets −1.11803 + 0 at t0–1 and 0 at t2–3.)"""
    rewards, ends = [[[1.0], [0.0, 0.5], [0.0, 1.0]]], [[[2], [1, 3], [0, 4]]]
    a, b = 1 / (6 * math.sqrt(1 / 18)), 1 / (3 * math.sqrt(1 / 18))
    expected = torch.tensor([[[a, a, a, 0, 0], [-b, -b, -1, -1, 0], [a, 1, 1, 1, 1]]])
    got = process_advantages(rewards, ends, 5, form="step_return", eps=0.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    paper = process_advantages(rewards, ends, 5, eps=0.0)
    c = 0.5 / math.sqrt(0.2)
    torch.testing.assert_close(paper[0, 1], torch.tensor([-c, -c, 0, 0, 0]), atol=1e-5, rtol=1e-5)


def _step_return_loop(rewards, ends, T, estimator="grpo", eps=1e-4):
    """The formula written out: for each prompt b and step index j, the returns-to-go G_{i,j} of the completions that
    have a step j, normalised (grpo: population z-score; rloo: minus the others' mean); every token of step j gets
    its value, tokens after the last step 0. A return over an unscored (None/NaN) step is unknown: that completion
    is left out of index j's statistics and its step j gets 0."""
    def unscored(v):
        return v is None or math.isnan(v)

    B, G = len(rewards), len(rewards[0])
    out = torch.zeros(B, G, T, dtype=torch.float64)
    for b in range(B):
        ret = [[None if any(unscored(v) for v in rewards[b][g][j:]) else sum(rewards[b][g][j:])
                for j in range(len(rewards[b][g]))] for g in range(G)]
        K = max(len(r) for r in ret)
        for j in range(K):
            have = [g for g in range(G) if len(ret[g]) > j and ret[g][j] is not None]
            vals = [ret[g][j] for g in have]
            mean = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
            for g in have:
                if estimator == "grpo":
                    v = (ret[g][j] - mean) / (sd + eps)
                else:  # rloo
                    others = [ret[h][j] for h in have if h != g]
                    v = ret[g][j] - sum(others) / len(others) if others else 0.0
                start = ends[b][g][j - 1] + 1 if j else 0
                for t in range(start, ends[b][g][j] + 1):
                    out[b, g, t] = v
    return out.float()


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_step_return_matches_loop_on_ragged_input(estimator):
    rng = random.Random(3)
    T, B, G = 12, 3, 4
    rewards, ends = [], []
    for _ in range(B):
        rg, eg = [], []
        for _ in range(G):
            k = rng.randint(0, 5)
            e = sorted(rng.sample(range(T), k))
            rg.append([rng.choice([None, float("nan")]) if rng.random() < 0.15
                       else rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in e])
            eg.append(e)
        rewards.append(rg)
        ends.append(eg)
    opts = {"eps": 1e-4} if estimator == "grpo" else {}
    got = process_advantages(rewards, ends, T, estimator=estimator, form="step_return", **opts)
    torch.testing.assert_close(got, _step_return_loop(rewards, ends, T, estimator), atol=1e-5, rtol=1e-5)


def test_step_return_leaves_unscored_returns_out():
    """An unscored step makes its own return and every earlier one unknown: left out of the step index's
    statistics, value 0 (as under suffix_sum), never counted as a reward of 0. One prompt, G = 3, T = 2, step ends
    [0, 1] for every row; rewards row 0 [None, None] (the step function failed), row 1 [1, 1], row 2 [NaN, 0].
    Returns-to-go: row 0 [?, ?]; row 1 [2, 1]; row 2 [?, 0].
    Index 0: only row 1 has a return: no comparison, all 0 (the old code counted rows 0 and 2 as returns 0 and 0:
      mean 2/3, row 0 got −0.70711).
    Index 1: rows {1, 2} with returns {1, 0}: mean 0.5, population std 0.5 → row 1 +1, row 2 −1; row 0 0.
    Tokens (t0 = step 0, t1 = step 1): row 0 [0, 0]; row 1 [0, 1]; row 2 [0, −1]."""
    rewards, ends = [[[None, None], [1.0, 1.0], [float("nan"), 0.0]]], [[[0, 1]] * 3]
    got = process_advantages(rewards, ends, 2, form="step_return", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([[[0.0, 0.0], [0.0, 1.0], [0.0, -1.0]]]))
    # the audit's case: the unscored row gets 0, as under suffix_sum
    for form in ("suffix_sum", "step_return"):
        got = process_advantages([[[None, None], [1.0, 1.0]]], [[[0, 1], [0, 1]]], 2, form=form)
        assert (got[0, 0] == 0).all()


@pytest.mark.parametrize("second_step", [0.5, 0.6])
def test_step_return_is_unbiased_when_length_does_not_matter(second_step):
    """The property the variant exists for. One decision: after step 1 the model stops (one step, reward 1.0) or
    continues with probability p (two steps, rewards [s, s]); the decision is among step 1's tokens, so the score
    function of a completion's step 1 is ∂log π/∂θ = 1 − p (continue) or −p (stop), for p = sigmoid(θ).
    True gradient of the expected return: J = (1 − p)·1 + p·2s, dJ/dθ = (2s − 1)·p(1 − p): 0 for s = 0.5 (length
    does not matter), > 0 for s = 0.6 (continuing is better).
    The expectation of the estimator E[(1/G) Σ_i A_i(step 1) · score_i] is computed exactly by enumerating all 2^G
    stop/continue patterns of a group (G = 4, p = 0.3), with rloo (leave-one-out, the exactly unbiased baseline).
    step_return: 0 for s = 0.5, positive for s = 0.6. The paper's suffix sum: clearly negative for s = 0.5 (its
    baseline (K_i − j)·μ grows with the number of steps, so it pushes toward stopping)."""
    import itertools

    G, p = 4, 0.3

    def expected_gradient(form):
        total = 0.0
        for pattern in itertools.product([0, 1], repeat=G):  # 1 = continue
            prob = math.prod(p if c else 1 - p for c in pattern)
            rewards = [[[second_step, second_step] if c else [1.0] for c in pattern]]
            ends = [[[0, 1] if c else [0] for c in pattern]]
            adv = process_advantages(rewards, ends, 2, estimator="rloo", form=form)[0, :, 0].double()
            score = torch.tensor([(1 - p) if c else -p for c in pattern], dtype=torch.float64)
            total += prob * float((adv * score).mean())
        return total

    ours, paper = expected_gradient("step_return"), expected_gradient("suffix_sum")
    if second_step == 0.5:
        assert abs(ours) < 1e-7
        assert paper < -0.01  # biased toward stopping
    else:
        assert ours > 0.01  # the true gradient's sign


def test_step_return_equals_outcome_grpo_for_one_step():
    """With one step per completion the return is the step reward, normalised over the group: outcome GRPO on it,
    given to every token up to the step's end."""
    r = torch.tensor([[0.2, 1.0, 0.0, 0.7]])
    got = process_advantages([[[v] for v in r[0].tolist()]], [[[3]] * 4], 5, form="step_return")
    torch.testing.assert_close(got[0, :, :4], outcome_advantages(r)[0][:, None].expand(4, 4))
    assert (got[0, :, 4] == 0).all()
    with pytest.raises(ValueError, match="step_advantage='paper' is not one of"):
        process_advantages([[[1.0]]], [[[0]]], 1, form="paper")


def test_rewards_near_the_float64_limit_keep_their_advantages():
    # [1e300, 0, 0, 0]: mean 2.5e299, deviations (7.5e299, −2.5e299 ×3), population std = 1e300·√3/4 = 4.330127e299;
    # Â = (0.75·4/√3, −0.25·4/√3) = (1.7320508, −0.5773503). Squared directly the deviations overflow (1e599): the
    # std was inf and every advantage 0. The scaling by a power of two leaves ordinary sets' bits unchanged (the
    # loop tests above compare exactly)
    r = torch.tensor([[1e300, 0.0, 0.0, 0.0], [-1e308, 1e308, 0.0, 0.0]], dtype=torch.float64)
    adv = outcome_advantages(r, eps=0)
    assert torch.allclose(adv[0], torch.tensor([1.7320508, -0.5773503, -0.5773503, -0.5773503]), atol=1e-6)
    # [−1e308, 1e308, 0, 0]: mean 0, std = 1e308·√(2/4) = 7.0710678e307: Â = (−√2, √2, 0, 0)
    assert torch.allclose(adv[1], torch.tensor([-1.4142136, 1.4142136, 0.0, 0.0]), atol=1e-6)

"""The vectorised combinations against plain loops: reward functions → one reward (weighted NaN-skipping sum),
step-reward functions → one reward per step, and outcome + process advantages (supervision='both')."""

import math
import random

import pytest
import torch

from groupwise.core.supervision import token_advantages
from groupwise.rewards.combine import combine_rewards, weighted_nansum
from groupwise.rewards.process import compute_step_rewards, load_process_reward_sources


def _nansum_loop(values, weights):  # [[v_f]] rows → Σ_f w_f v_f over the non-NaN v_f, NaN when all are NaN
    out = []
    for row in values:
        terms = [w * v for v, w in zip(row, weights) if not math.isnan(v)]
        out.append(sum(terms) if terms else math.nan)
    return out


def test_weighted_nansum_matches_loop():
    g = torch.Generator().manual_seed(2)
    values = torch.randn(40, 3, generator=g, dtype=torch.float64)
    values[torch.rand(40, 3, generator=g) < 0.4] = float("nan")
    values[0] = float("nan")  # nothing scored this row
    weights = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    got = weighted_nansum(values, weights).tolist()
    expected = _nansum_loop(values.tolist(), weights.tolist())
    assert math.isnan(got[0]) and [math.isnan(x) for x in got] == [math.isnan(x) for x in expected]
    assert [x for x in got if not math.isnan(x)] == pytest.approx([x for x in expected if not math.isnan(x)])
    # sum_then_normalize is this sum per completion, (B, G, F) → (B, G)
    combined = combine_rewards(values.view(8, 5, 3), weights, aggregation="sum_then_normalize").view(-1).tolist()
    assert [x for x in combined if not math.isnan(x)] == pytest.approx([x for x in expected if not math.isnan(x)])


def test_step_rewards_of_several_functions_match_loop():
    rng = random.Random(4)
    steps = [[f"s{j}" for j in range(rng.randint(0, 4))] for _ in range(7)]
    tables = [[[None if rng.random() < 0.3 else rng.uniform(-1, 1) for _ in row] for row in steps] for _ in range(3)]
    funcs = [lambda steps, t=t, **_: t for t in tables]
    weights = [0.5, 1.0, -2.0]
    got, errors, totals = compute_step_rewards(load_process_reward_sources(funcs), torch.tensor(weights), ["p"] * 7,
                                               ["c"] * 7, steps, {})
    for i, row in enumerate(steps):
        expected = _nansum_loop([[math.nan if t[i][j] is None else t[i][j] for t in tables] for j in range(len(row))],
                                weights)
        assert len(got[i]) == len(row)
        for a, b in zip(got[i], expected):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)
    assert errors.tolist() == [0.0, 0.0, 0.0]
    for f, table in enumerate(tables):  # each function's own (sum, count) of the steps it scored
        scored = [v for row in table for v in row if v is not None]
        assert totals[f].tolist() == pytest.approx([sum(scored), len(scored)])


def test_supervision_both_matches_loop():
    g = torch.Generator().manual_seed(3)
    outcome, process = torch.randn(4, generator=g), torch.randn(4, 6, generator=g)
    got = token_advantages("both", outcome, process, outcome_weight=0.3, process_weight=2.0)
    for i in range(4):
        for t in range(6):
            assert got[i, t].item() == pytest.approx(0.3 * outcome[i].item() + 2.0 * process[i, t].item(), abs=1e-6)

"""Audit of dynamic sampling (groupwise.dynamic, DAPO): the refill on hand-built rounds (whole groups, the count per
process, the metrics, the bound when no group ever has a signal), two processes simulated by threads (their
collectives matched), the signal under supervision='both' with a zero weight, rounds of a rollout_func whose
optional fields differ, and determinism of a seeded run. TRL 1.16 has no dynamic sampling (grep finds only
`frac_reward_zero_std`), so there is no TRL metric to mirror besides that one."""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.dynamic import group_signal, refill, select_groups
from groupwise.types import Completions, Round, Scores, StepScores
from tests.conftest import small_args

G = 2


def _round(r: int, signal: list[bool], width: int = 3, logps: bool = False, env: bool = False) -> Round:
    """Round r with len(signal) groups of G rows. Row k of group g is tagged 10·r + g: its prompt and completion
    tokens, its reward; its advantage is 10·r + g + k/10, so a pick is readable from the batch."""
    n = len(signal) * G
    tag = [10 * r + i // G for i in range(n)]
    ids = torch.tensor(tag).unsqueeze(1).repeat(1, width)
    ones = torch.ones(n, width, dtype=torch.long)
    comp = Completions(ids.clone(), ones.clone(), ids.clone(), ones.clone(), torch.zeros(n, dtype=torch.bool),
                       [f"p{t}" for t in tag], [f"c{t}" for t in tag], {"tag": list(tag)},
                       torch.full((n, width), -0.5) if logps else None,
                       ones.clone() if env else None, [[width - 1]] * n if env else None)
    adv = torch.tensor([10 * r + i // G + (i % G) / 10 for i in range(n)])
    return Round(comp, adv, torch.tensor(tag, dtype=torch.float), None, None, torch.tensor(signal))


class _Single:
    device, world_size, rank, is_main = torch.device("cpu"), 1, 0, True

    def sum(self, t):
        return t

    def any(self, flag):
        return bool(flag)


def _ctx(max_rounds: int, dist=None):
    args = SimpleNamespace(num_generations=G, max_dynamic_sampling_rounds=max_rounds)
    return SimpleNamespace(args=args, dist=dist or _Single(), tokenizer=SimpleNamespace(pad_token_id=0))


def _sampler(signals: list[list[bool]]):
    calls = []

    def sample():
        calls.append(len(calls) + 1)
        return _round(len(calls), signals[len(calls) - 1])
    return sample, calls


def test_refill_keeps_whole_groups_in_order_and_counts_by_hand():
    """4 groups needed. Round 0: signals F T F T → keeps groups 1, 3 (2 dropped). Round 1: T F F F → keeps its
    group 0 (3 kept). Round 2: T T T F → 6 kept ≥ 4: stop. Batch = (0,1) (0,3) (1,0) (2,0), tags 1 3 10 20;
    extra_rounds 2, dropped_groups 2 (the first round's), unfilled 0."""
    sample, calls = _sampler([[True, False, False, False], [True, True, True, False]])
    chosen, metrics = refill(_ctx(4), _round(0, [False, True, False, True]), sample)
    assert calls == [1, 2]
    assert metrics == {"dynamic/dropped_groups": 2.0, "dynamic/extra_rounds": 2.0, "dynamic/unfilled_groups": 0.0}
    assert chosen.rewards.tolist() == [1, 1, 3, 3, 10, 10, 20, 20]  # whole groups, G rows each, contiguous
    assert chosen.advantages.tolist() == pytest.approx([1, 1.1, 3, 3.1, 10, 10.1, 20, 20.1])
    assert chosen.completions.columns["tag"] == [1, 1, 3, 3, 10, 10, 20, 20]
    assert chosen.completions.prompts == [f"p{t}" for t in (1, 1, 3, 3, 10, 10, 20, 20)]
    assert chosen.signal.tolist() == [True] * 4


@pytest.mark.parametrize("max_rounds", [0, 3])
def test_no_signal_ever_stops_at_the_bound_with_a_warning(max_rounds):
    """Every round flat: exactly max_rounds extra samples (no endless loop), then the first round's groups fill the
    batch in their order: tags 0 1 (dropped 2, unfilled 2), and one warning naming the setting."""
    sample, calls = _sampler([[False, False]] * 5)
    with pytest.warns(UserWarning, match="raise max_dynamic_sampling_rounds"):
        chosen, metrics = refill(_ctx(max_rounds), _round(0, [False, False]), sample)
    assert len(calls) == max_rounds
    assert metrics == {"dynamic/dropped_groups": 2.0, "dynamic/extra_rounds": float(max_rounds),
                       "dynamic/unfilled_groups": 2.0}
    assert chosen.rewards.tolist() == [0, 0, 1, 1]


def test_a_full_first_round_samples_nothing_and_warns_nothing():
    sample, calls = _sampler([])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen, metrics = refill(_ctx(4), _round(0, [True, True]), sample)
    assert calls == [] and metrics["dynamic/extra_rounds"] == 0.0 and chosen.rewards.tolist() == [0, 0, 1, 1]


class _Threads:
    """A 2-process Distributed stand-in: each rank is a thread; sum / any exchange values through a barrier, so a
    rank that loops once more than the other deadlocks (the barrier times out) — the collectives must match."""

    def __init__(self, rank: int, shared: dict):
        self.rank, self.world_size, self.device, self.shared = rank, 2, torch.device("cpu"), shared
        self.is_main = rank == 0

    def _exchange(self, value: float) -> float:
        b, slots = self.shared["barrier"], self.shared["slots"]
        slots[self.rank] = value
        b.wait(timeout=10)
        total = sum(slots)
        b.wait(timeout=10)
        return total

    def sum(self, t):
        return torch.tensor(self._exchange(float(t)))

    def any(self, flag):
        return self._exchange(float(flag)) > 0


@pytest.mark.parametrize("max_rounds, extra, unfilled", [(4, 2, 0), (1, 1, 1)])
def test_two_processes_refill_their_own_groups_in_step(max_rounds, extra, unfilled):
    """Rank 0's first round is full (T T); rank 1's is flat (F F). Both sample together: round 1 gives rank 1
    F T (1 kept), round 2 T F (2 kept): 2 extra rounds on both ranks, rank 0 discarding its extra groups. Dropped 2
    (rank 1's). With max 1 extra round rank 1 keeps (1,1) and refills with its first dropped group (0,0): unfilled 1.
    Both ranks log the same metrics."""
    shared = {"barrier": threading.Barrier(2), "slots": [0.0, 0.0]}
    firsts = {0: [True, True], 1: [False, False]}
    later = {0: [[True, True], [True, True]], 1: [[False, True], [True, False]]}
    out, errors = {}, []

    def run(rank):
        try:
            sample, calls = _sampler(later[rank])
            out[rank] = (*refill(_ctx(max_rounds, _Threads(rank, shared)), _round(0, firsts[rank]), sample), calls)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            shared["barrier"].abort()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert not errors, errors
    (c0, m0, calls0), (c1, m1, calls1) = out[0], out[1]
    assert len(calls0) == len(calls1) == extra
    assert m0 == m1 == {"dynamic/dropped_groups": 2.0, "dynamic/extra_rounds": float(extra),
                        "dynamic/unfilled_groups": float(unfilled)}
    assert c0.rewards.tolist() == [0, 0, 1, 1]  # rank 0 keeps its first round
    assert c1.rewards.tolist() == ([11, 11, 20, 20] if unfilled == 0 else [11, 11, 0, 0])
    assert c1.signal.tolist() == [True, unfilled == 0]


def _args(**kw):
    return GRPOConfig(num_generations=2, per_device_train_batch_size=2, **kw)


@pytest.mark.parametrize("w_o, w_p, signal", [(1.0, 1.0, True), (0.0, 1.0, False), (1.0, 0.0, True)])
def test_both_reads_only_terms_with_a_weight(w_o, w_p, signal):
    """supervision='both', one group: outcome rewards 1, 0 (spread), step rewards all 1 (none). Â = w_o·Â_o +
    w_p·Â_p: with w_o = 0 every advantage is 0, so the group has no signal (before: kept, as the outcome spread
    was read whatever its weight); the signal agrees with the advantages being nonzero somewhere."""
    from groupwise.core.advantages import outcome_advantages, process_advantages
    from groupwise.core.supervision import token_advantages

    args = _args(supervision="both", outcome_advantage_weight=w_o, process_advantage_weight=w_p)
    rewards = torch.tensor([[1.0, 0.0]])
    scores = Scores(rewards.unsqueeze(-1), rewards, ("r",), torch.zeros(1))
    steps = StepScores([[[1.0, 1.0], [1.0, 1.0]]], [[[1, 3], [1, 3]]], [], ("p",), torch.zeros(1),
                       torch.zeros(1, 2))
    got = group_signal(SimpleNamespace(args=args), scores, steps).tolist()
    adv = token_advantages("both", outcome_advantages(rewards).flatten(),
                           process_advantages(steps.rewards, steps.ends, 4).flatten(0, 1),
                           outcome_weight=w_o, process_weight=w_p)
    assert got == [signal] == [bool((adv != 0).any())]


def test_process_weight_zero_ignores_a_step_spread():
    """Outcome rewards equal (1, 1), step rewards 1 vs 0 (spread): kept with w_p = 1, dropped with w_p = 0."""
    rewards = torch.tensor([[1.0, 1.0]])
    scores = Scores(rewards.unsqueeze(-1), rewards, ("r",), torch.zeros(1))
    steps = StepScores([[[1.0], [0.0]]], [[[1], [1]]], [], ("p",), torch.zeros(1),
                       torch.zeros(1, 2))
    for w_p, signal in ((1.0, True), (0.0, False)):
        args = _args(supervision="both", process_advantage_weight=w_p)
        assert group_signal(SimpleNamespace(args=args), scores, steps).tolist() == [signal]


def test_rounds_whose_optional_fields_differ_are_merged():
    """A rollout_func may return log-probs or env_mask in one round only. Round 0 (width 3) has none, round 1
    (width 3) has log-probs −0.5 and env_mask 1s with one turn ending at 2. Picking one group of each: round 0's
    rows get NaN log-probs (unknown), tool_mask = completion_mask (all model tokens), one turn ending at its last
    token (index 2); columns present in both rounds only."""
    r0, r1 = _round(0, [True]), _round(1, [True], logps=True, env=True)
    r1 = dataclasses.replace(r1, completions=dataclasses.replace(r1.completions, columns={"tag": [10, 10],
                                                                                           "only_here": [1, 1]}))
    out = select_groups([r0, r1], [(0, 0), (1, 0)], G, 0).completions
    lp = out.sampling_logps
    assert torch.isnan(lp[:2]).all() and lp[2:].tolist() == [[-0.5] * 3] * 2
    assert out.tool_mask.tolist() == [[1] * 3] * 4
    assert out.turn_ends == [[2]] * 4
    assert out.columns == {"tag": [0, 0, 10, 10]}


def _collect_twice(tmp_path, tokenizer, name):
    from groupwise.tasks import toy

    def only_a_varies(completions, letter, **_):  # random (seeded) for 'a': a group of 'a' has spread
        return [float(torch.rand(())) if l == "a" else 1.0 for l in letter]

    data = [{"prompt": f"repeat {c}:", "letter": c} for c in "aabbccdd"]
    args = small_args(tmp_path / name, dynamic_sampling=True, max_dynamic_sampling_rounds=2, seed=3)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [only_a_varies], args=args,
                    train_dataset=data, processing_class=tokenizer)
    return [t._collect() for _ in range(2)]


def test_a_seeded_run_refills_alike(tmp_path, tokenizer):
    """The same seed twice (shuffled prompts, sampled completions, random rewards): the same batches and metrics."""
    a, b = _collect_twice(tmp_path, tokenizer, "a"), _collect_twice(tmp_path, tokenizer, "b")
    for x, y in zip(a, b):
        assert torch.equal(x.batch.input_ids, y.batch.input_ids)
        assert torch.equal(x.batch.advantages, y.batch.advantages)
        keys = [k for k in x.metrics if k.startswith("dynamic/")]
        assert keys and {k: x.metrics[k] for k in keys} == {k: y.metrics[k] for k in keys}
        assert x.batch.input_ids.size(0) % 4 == 0  # whole groups (G = 4)


def test_trl_has_no_dynamic_sampling_metric_but_frac_reward_zero_std():
    import trl.trainer.grpo_trainer as trl_grpo

    source = Path(trl_grpo.__file__).read_text()
    assert "dynamic_sampling" not in source and '"frac_reward_zero_std"' in source


def test_dynamic_sampling_runs_to_max_steps_past_the_epochs_it_was_planned_with(tmp_path, tokenizer):
    """max_steps=6 over 24 rows at 2 prompts a round plans 12 rounds' prompts = 1 epoch (state.num_train_epochs = 1),
    but dynamic sampling's refills read more prompts per step: the run stopped at step 4, once that epoch was read,
    with nothing said, and a resume with a larger max_steps trained nothing. With dynamic sampling the passes
    max_steps makes are unknown, as for a stream (state.num_train_epochs sys.maxsize): 6 steps, more than one
    epoch read; then 8 after a resume asking for 8."""
    from groupwise.tasks import toy

    def binary(completions, letter, **_):  # a random tiny model's groups mostly agree: refills
        return [1.0 if c in t else 0.0 for t, c in zip(completions, letter)]

    def run(max_steps, resume=None):
        args = small_args(tmp_path, num_generations=4, per_device_train_batch_size=8, max_completion_length=6,
                          max_steps=max_steps, learning_rate=1e-2, save_steps=2, dynamic_sampling=True)
        t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [binary], args=args,
                        train_dataset=toy.dataset(24), processing_class=tokenizer)
        t.train(resume_from_checkpoint=resume)
        return t

    first = run(6)
    assert first.global_step == 6 and first.sampler.progress() > 1  # 12 rounds of prompts planned: 1 epoch
    assert first.state.num_train_epochs == sys.maxsize
    assert run(8, resume=True).global_step == 8


def test_dynamic_sampling_with_epochs_alone_warns_that_the_planned_steps_will_not_all_run():
    """num_train_epochs alone plans max_steps (the schedule's length, the bar's total) from the prompts an epoch
    holds; the refills read more per step, so the epochs end the run first: said when the config is built, with
    the fix. With max_steps it trains that many steps (above), and nothing is said."""
    with pytest.warns(UserWarning, match=r"^dynamic_sampling=True with num_train_epochs=3 and no max_steps: .*"
                                         r"lr_scheduler_type='cosine' stops short of its end.*set max_steps"):
        GRPOConfig(dynamic_sampling=True, num_train_epochs=3, lr_scheduler_type="cosine")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(dynamic_sampling=True, max_steps=10)
        GRPOConfig(num_train_epochs=3)

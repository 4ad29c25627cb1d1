"""TRL 1.16's metrics, key by key: every key TRL's GRPOTrainer puts in `self._metrics` is logged by groupwise under
the same name (metrics.jsonl, state.log_history, on_log), with TRL's meaning — values worked out by hand from what
the reward functions saw, averaged over the logging window as TRL's `log()` averages its lists (one entry per
generation round for the rollout metrics, None when a window has no finite value), and `eval_`-prefixed in
evaluation."""

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import torch

from groupwise import GRPOTrainer
from groupwise.rollout_metrics import nanstd, zero_std_fraction
from groupwise.tasks import toy
from groupwise.text import encode_prompts
from tests.conftest import small_args, training_lines

# every literal key of TRL 1.16's self._metrics: when it is logged (the config that turns it on), or why not
ROLLOUT_KEYS = ["num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "completions/mean_terminated_length",
                "completions/min_terminated_length", "completions/max_terminated_length", "reward", "reward_std",
                "frac_reward_zero_std"]
TRL_KEYS = {
    **{k: "always" for k in ROLLOUT_KEYS}, "entropy": "always", "step_time": "train",
    **{f"clip_ratio/{k}": "clip loss types" for k in ("low_mean", "low_min", "high_mean", "high_max", "region_mean")},
    "kl": "beta", "policy_loss": "entropy_coef", "entropy_coef": "entropy_coef", "cispo_clip_ratio": "cispo",
    **{f"sampling/{k}": "importance sampling" for k in ("sampling_logp_difference/mean",
                                                         "sampling_logp_difference/max",
                                                         "importance_sampling_ratio/min",
                                                         "importance_sampling_ratio/mean",
                                                         "importance_sampling_ratio/max")},
    "tools/call_frequency": "tools (tests/test_agents_training.py)",
    "tools/failure_frequency": "tools (tests/test_agents_training.py)",
    "aux_loss": "MoE policies (tests/test_router_aux_loss.py)",
    "vespo/phi_seq_mean": "vespo",
}


def _trl_source() -> str:
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "trainer" / "grpo_trainer.py").read_text()


def test_the_key_table_is_trl_1_16s():
    """TRL_KEYS holds exactly the literal keys TRL's grpo_trainer.py appends to self._metrics (plus the
    f-string rewards/<name>/mean|std and log_metric names, checked by the runs below)."""
    source = _trl_source()
    literal = set(re.findall(r'self\._metrics\[(?:mode|"train")\]\["([^"]+)"\]', source))
    templated = set(re.findall(r'self\._metrics\[mode\]\[f"([^"]+)"\]', source))
    assert literal == set(TRL_KEYS)
    assert templated == {"rewards/{reward_func_name}/mean", "rewards/{reward_func_name}/std"}


def _length(completions, **_):
    return [float(len(c)) for c in completions]


def _probe(completions, log_metric, **_):
    log_metric("probe/value", 2.0)
    return [1.0] * len(completions)


def _run(tmp_path, funcs, eval_data=None, **kw):
    tok = toy.build_tokenizer()
    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), **kw)
    t = GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), list(funcs), args=args,
                    train_dataset=toy.dataset(12), eval_dataset=eval_data, processing_class=tok)
    t.train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "run" / "metrics.jsonl")]
    return t, lines


@pytest.mark.parametrize("kw, keys", [
    (dict(beta=0.04, entropy_coef=0.01, generation_dtype="float32"),
     {"kl", "policy_loss", "entropy_coef", *(k for k, v in TRL_KEYS.items() if v in ("clip loss types",
                                                                                      "importance sampling"))}),
    (dict(loss_type="cispo", epsilon_high=5.0), {"cispo_clip_ratio"}),
    (dict(loss_type="vespo", use_adaptive_entropy=True, generation_dtype="bfloat16",
          vllm_importance_sampling_mode="token_truncate", off_policy_mask_threshold=0.5),
     {"vespo/phi_seq_mean", "policy_loss", "entropy_coef",
      *(k for k, v in TRL_KEYS.items() if v == "importance sampling")}),
])
def test_training_logs_every_trl_key(tmp_path, kw, keys):
    t, lines = _run(tmp_path, [_length, _probe], max_steps=1, **kw)
    want = {*ROLLOUT_KEYS, "entropy", "step_time", *keys, "rewards/_length/mean", "rewards/_length/std",
            "rewards/_probe/mean", "rewards/_probe/std", "probe/value",
            "loss", "grad_norm", "learning_rate", "epoch"}  # transformers' Trainer adds the last four
    assert want <= set(lines[0]), want - set(lines[0])
    history = t.state.log_history[0]
    assert want <= set(history) and history["step"] == 1 and lines[0]["probe/value"] == 2.0
    absent = {"cispo_clip_ratio"} if "cispo_clip_ratio" not in keys else {"clip_ratio/low_mean", "kl"}
    absent |= {"vespo/phi_seq_mean"} - keys | ({"clip_ratio/low_mean"} if "vespo/phi_seq_mean" in keys else set())
    assert not absent & set(lines[0])  # each only where TRL logs it
    assert lines[0]["step_time"] > 0


def _stats(values):
    """TRL's nanmean / nanstd (Bessel) of one round; NaN when undefined."""
    kept = [v for v in values if v is not None]
    mean = statistics.fmean(kept) if kept else math.nan
    return mean, statistics.stdev(kept) if len(kept) > 1 else math.nan


def _window(per_round):
    """TRL's log(): the mean of a window's entries with NaN left out; None when none is left."""
    kept = [v for v in per_round if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def test_metric_values_by_hand_over_a_two_round_window(tmp_path):
    """Two rounds of 2 prompts × 4 completions, logged together (logging_steps 2). Per round, from what the reward
    functions were given (prompts, completion_ids) and returned: completions/* and num_tokens by TRL's formulas,
    rewards/<f>/mean|std (None rows left out, Bessel), reward / reward_std of the row sums (a row no function
    scored left out), frac_reward_zero_std; the line is the mean of the two rounds' values, NaN left out, and None
    where neither round had one (`h` never scores). f: round 1 [0, 1, 2, 3, 5, 5, 5, 5], round 2 all 7;
    g: round 1 [1, 1, 1, 1, None × 4], round 2 None. Row sums, round 1: [1, 2, 3, 4, 5, 5, 5, 5] (group 2 has no
    spread: frac 1/2); round 2: all 7 (frac 1)."""
    tok = toy.build_tokenizer()
    seen, values = [], {"f": [[0, 1, 2, 3, 5, 5, 5, 5], [7] * 8], "g": [[1] * 4 + [None] * 4, [None] * 8]}

    def f(prompts, completion_ids, log_metric, **_):
        seen.append((prompts, completion_ids))
        log_metric("probe", float(len(seen)))
        return [float(v) for v in values["f"][len(seen) - 1]]

    def g(completions, **_):
        return values["g"][len(seen) - 1]

    def h(completions, **_):
        return [None] * len(completions)

    t, lines = _run(tmp_path, [f, g, h], max_steps=2, logging_steps=2, lr_scheduler_type="linear")
    assert len(lines) == 1 and len(seen) == 2
    line, history = lines[0], t.state.log_history[0]
    rounds = []
    for r, (prompts, ids) in enumerate(seen):
        lengths = [len(x) for x in ids]
        truncated = [x[-1] not in (tok.eos_token_id, tok.pad_token_id) for x in ids]
        terminated = [n for n, cut in zip(lengths, truncated) if not cut] or [0]
        sums = [None if a is None and b is None else (a or 0) + (b or 0)
                for a, b in zip(values["f"][r], values["g"][r])]
        groups = [sums[:4], sums[4:]]
        rounds.append({
            "tokens": int(encode_prompts(prompts, tok, None)[1].sum()) + sum(lengths),
            "completions/mean_length": statistics.fmean(lengths), "completions/min_length": min(lengths),
            "completions/max_length": max(lengths), "completions/clipped_ratio": statistics.fmean(truncated),
            "completions/mean_terminated_length": statistics.fmean(terminated),
            "completions/min_terminated_length": min(terminated),
            "completions/max_terminated_length": max(terminated),
            "rewards/f/mean": _stats(values["f"][r])[0], "rewards/f/std": _stats(values["f"][r])[1],
            "rewards/g/mean": _stats(values["g"][r])[0], "rewards/g/std": _stats(values["g"][r])[1],
            "rewards/h/mean": math.nan, "rewards/h/std": math.nan,
            "reward": _stats(sums)[0], "reward_std": _stats(sums)[1],
            "frac_reward_zero_std": statistics.fmean(float(len(set(x)) == 1) for x in groups),
            "probe": float(r + 1)})
    assert [r["frac_reward_zero_std"] for r in rounds] == [0.5, 1.0]
    for key in rounds[0]:
        if key == "tokens":
            continue
        want = _window([float(r[key]) for r in rounds])
        if want is None:
            assert line[key] is None and history[key] is None, key
        else:
            assert line[key] == pytest.approx(want) and history[key] == pytest.approx(want), key
    assert line["rewards/g/mean"] == 1.0 and line["rewards/g/std"] == 0.0  # round 2 (all None) left out
    assert line["num_tokens"] == rounds[0]["tokens"] + rounds[1]["tokens"] == t.state.num_input_tokens_seen
    # transformers: the logging step's learning rate (linear decay over 2 steps: step 2 ran at half the rate),
    # the epoch (2 rounds of an epoch of 6)
    assert line["learning_rate"] == pytest.approx(5e-3) and line["epoch"] == pytest.approx(2 / 6)


def test_rollout_metrics_count_once_per_generation_round(tmp_path):
    """Two optimizer steps per round (steps_per_generation 2), logging_steps 3, max_steps 4. TRL appends a round's
    metrics when it generates (steps 1 and 3) and its loss metrics every step: the line of step 3 averages rounds 1
    and 2 (reward (1 + 4) / 2 = 2.5, not (1 + 1 + 4) / 3 over steps); the line of step 4 (the last step) has only
    the step's own metrics."""
    calls = []

    def constant(completions, log_metric, **_):
        calls.append(len(completions))
        log_metric("probe", float(len(calls)))
        return [1.0 if len(calls) == 1 else 4.0] * len(completions)

    t, lines = _run(tmp_path, [constant], max_steps=4, logging_steps=3, per_device_train_batch_size=4,
                    steps_per_generation=2)
    assert [x["step"] for x in lines] == [3, 4] and calls == [8, 8]
    assert lines[0]["reward"] == 2.5 and lines[0]["rewards/constant/mean"] == 2.5 and lines[0]["probe"] == 1.5
    assert lines[0]["num_tokens"] == t.state.num_input_tokens_seen
    for key in (*ROLLOUT_KEYS, "probe", "rewards/constant/mean"):
        assert key not in lines[1], key
    for key in ("loss", "entropy", "clip_ratio/low_mean", "step_time", "learning_rate", "grad_norm", "epoch"):
        assert key in lines[0] and key in lines[1], key


def test_evaluation_logs_trls_rollout_keys_with_the_eval_prefix(tmp_path):
    """evaluate(): TRL's rollout metrics as `eval_<name>`, over the eval set's completions (greedy: one per prompt,
    each its own group, so frac_reward_zero_std is 1 as in TRL), with the training's num_tokens."""
    seen = []

    def f(completion_ids, log_metric, **_):
        seen.extend(completion_ids)
        log_metric("probe", 3.0)
        return [float(len(x)) for x in completion_ids]

    t, _ = _run(tmp_path, [f], max_steps=1, eval_data=toy.dataset(3))
    seen.clear()
    out = t.evaluate()
    tok = t.tokenizer
    lengths = [len(x) for x in seen]
    terminated = [len(x) for x in seen if x[-1] == tok.eos_token_id] or [0]
    want = {"eval_num_tokens": t.state.num_input_tokens_seen, "eval_completions/mean_length": statistics.fmean(lengths),
            "eval_completions/min_length": min(lengths), "eval_completions/max_length": max(lengths),
            "eval_completions/clipped_ratio": statistics.fmean(x[-1] != tok.eos_token_id for x in seen),
            "eval_completions/mean_terminated_length": statistics.fmean(terminated),
            "eval_completions/min_terminated_length": min(terminated),
            "eval_completions/max_terminated_length": max(terminated),
            "eval_reward": statistics.fmean(lengths), "eval_reward_std": statistics.stdev(lengths),
            "eval_rewards/f/mean": statistics.fmean(lengths), "eval_rewards/f/std": statistics.stdev(lengths),
            "eval_frac_reward_zero_std": 1.0, "eval_probe": 3.0}
    assert len(seen) == 3
    for key, value in want.items():
        assert out[key] == pytest.approx(value), key
    assert t.state.log_history[-1]["eval_reward"] == out["eval_reward"]


def test_frac_reward_zero_std_follows_the_std_the_advantages_use():
    """TRL: is_std_zero per completion from the std its advantage divides by — its group's, or with
    scale_rewards='batch' (and normalize_then_sum) the batch's, so 0 or 1; a std of fewer than two scored rewards is
    NaN, never zero. Groups: [1, 1] (no spread), [1, 2], [NaN, 3] (one scored: not zero)."""
    from groupwise import GRPOConfig
    from groupwise import rollout as R
    from groupwise.distributed import Distributed

    rewards = torch.tensor([[1.0, 1.0], [1.0, 2.0], [math.nan, 3.0]])

    def frac(**kw):
        ctx = R.RolloutContext(args=GRPOConfig(num_generations=2, per_device_train_batch_size=6, **kw),
                               tokenizer=None, generator=None, dist=Distributed(), eos_token_ids=[2])
        return zero_std_fraction(ctx, rewards)

    assert frac() == pytest.approx(1 / 3) and frac(scale_rewards="none") == pytest.approx(1 / 3)
    assert frac(scale_rewards="batch") == 0.0 and frac(multi_objective_aggregation="normalize_then_sum") == 0.0
    assert zero_std_fraction(R.RolloutContext(
        args=GRPOConfig(num_generations=2, per_device_train_batch_size=6, scale_rewards="batch"), tokenizer=None,
        generator=None, dist=Distributed(), eos_token_ids=[2]), torch.full((3, 2), 5.0)) == 1.0
    assert math.isnan(nanstd(torch.tensor([math.nan, 3.0])))  # TRL's nanstd of one value: NaN, not 0


@pytest.mark.slow
def test_log_metric_is_averaged_over_every_process(tmp_path):
    """TRL gathers each log_metric name's sum and count over the processes: with 2 processes logging their rank,
    the training line and the evaluation both log 0.5 (not the main process's 0)."""
    from tests.launcher import torchrun

    proc = torchrun(Path(__file__).with_name("metrics_dist_worker.py"), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["rank"] for x in lines if "rank" in x] == [0.5]
    assert [x["eval_rank"] for x in lines if "eval_rank" in x] == [0.5]

"""TRL's reward-function protocol in full (async functions, trainer_state, log_metric, log_extra) and the trainer
habits TRL users rely on (callbacks, trainer.state, save_model, completions.jsonl)."""

import asyncio
import json
import math
import time
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from groupwise import GRPOTrainer
from groupwise.rewards import compute_rewards, load_reward_sources
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines


def _length(completions, **_):
    return [float(len(c)) for c in completions]


def _trainer(tmp_path, tokenizer, funcs=(_length,), **kw):
    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), **kw)
    return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), list(funcs), args=args,
                       train_dataset=toy.dataset(12), processing_class=tokenizer)


def test_async_reward_functions_run_concurrently():
    async def slow_a(completions, **_):
        await asyncio.sleep(0.6)
        return [1.0] * len(completions)

    async def slow_b(completions, **_):
        await asyncio.sleep(0.6)
        return [float(len(c)) for c in completions]

    start = time.perf_counter()
    rewards, errors = compute_rewards(load_reward_sources([slow_a, slow_b, _length]), ["p"] * 2, ["a", "bb"],
                                      [[1], [2, 2]], {})
    elapsed = time.perf_counter() - start
    assert rewards.tolist() == [[1.0, 1.0, 1.0], [1.0, 2.0, 2.0]] and errors.tolist() == [0.0, 0.0, 0.0]
    assert elapsed < 1.1, f"the two 0.6 s functions ran one after the other ({elapsed:.2f} s)"


def test_sync_functions_run_in_list_order_before_the_async_ones_as_in_trl():
    """TRL 1.16 calls the sync functions (and reward models) in list order, then awaits the async ones together: an
    async judge may read what an earlier sync function computed. groupwise ran the async ones first, so such a judge
    scored from an empty cache (0 where TRL gives 1), silently."""
    events, parsed = [], {}

    def parse(completions, **_):
        events.append("sync")
        parsed.update({c: len(c) for c in completions})
        return [0.0] * len(completions)

    async def judge(completions, **_):
        events.append("async")
        return [float(c in parsed) for c in completions]

    def last(completions, **_):
        events.append("sync 2")
        return [0.0] * len(completions)

    rewards, _ = compute_rewards(load_reward_sources([judge, parse, last]), ["p"] * 2, ["a", "bb"], [[1], [2]], {})
    assert events == ["sync", "sync 2", "async"] and rewards[:, 0].tolist() == [1.0, 1.0]


def test_async_reward_errors_are_isolated_by_row_like_sync_ones():
    async def fragile(completions, **_):
        return [1.0 / (len(c) - 2) for c in completions]  # "bb" divides by zero

    with pytest.warns(UserWarning, match="row 1"):
        rewards, errors = compute_rewards(load_reward_sources([fragile]), ["p"] * 2, ["a", "bb"], [[1], [2, 2]], {},
                                          on_error="nan")
    assert rewards[0, 0] == -1.0 and math.isnan(rewards[1, 0]) and errors.tolist() == [1.0]


def test_trainer_state_log_metric_and_log_extra_reach_reward_functions(tmp_path, tokenizer):
    seen = []

    def curriculum(completions, trainer_state, log_metric, log_extra, **_):
        """TRL's documented curriculum pattern: shape the reward by training progress."""
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        progress = trainer_state.global_step / trainer_state.max_steps
        log_metric("curriculum/progress", progress)
        log_extra("length", [len(c) for c in completions])
        return [float(len(c)) * (1 + progress) for c in completions]

    t = _trainer(tmp_path, tokenizer, funcs=[curriculum], max_steps=2)
    t.train()
    assert seen == [(0, 2), (1, 2)]  # called before steps 1 and 2
    lines = [json.loads(x) for x in training_lines(tmp_path / "run" / "metrics.jsonl")]
    assert [x["curriculum/progress"] for x in lines] == [0.0, 0.5]
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["step"] for r in rows} == {1, 2}  # 8 completions per logged step
    first = rows[0]
    assert first["length"] == len(first["completion"]) and set(first["rewards"]) == {"curriculum"}
    assert first["reward"] == first["rewards"]["curriculum"] and isinstance(first["advantage"], float)


def test_the_completions_reward_column_is_the_weighted_sum_under_normalize_then_sum(tmp_path, tokenizer):
    """completions.jsonl's `reward` is the `reward` metric's quantity, Σ_f w_f r_f of the raw values, under either
    aggregation; under normalize_then_sum it was the sum of z-scores (mean 0 in every group), which is not a reward.
    Per row: length (say 3) × 1 + the constant 2 × 0.5 = 3 + 1 = 4."""
    def two(completions, **_):
        return [2.0] * len(completions)

    t = _trainer(tmp_path, tokenizer, funcs=[_length, two], max_steps=1, reward_weights=[1.0, 0.5],
                 multi_objective_aggregation="normalize_then_sum")
    t.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for r in rows:
        assert r["rewards"]["two"] == 2.0
        assert r["reward"] == r["rewards"]["_length"] * 1.0 + 1.0


class Recorder(TrainerCallback):
    def __init__(self, stop_at=None):
        self.events, self.logs, self.stop_at = [], [], stop_at

    def on_train_begin(self, args, state, control, **kw):
        self.events.append(("on_train_begin", state.global_step))

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("on_step_end", state.global_step))
        if state.global_step == self.stop_at:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))

    def on_save(self, args, state, control, **kw):
        self.events.append(("on_save", state.global_step))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self.events.append(("on_evaluate", state.global_step, "eval_completions/mean_length" in metrics))

    def on_train_end(self, args, state, control, **kw):
        self.events.append(("on_train_end", state.global_step))


def test_callbacks_see_the_events_and_can_stop_the_run(tmp_path, tokenizer):
    recorder = Recorder(stop_at=2)
    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), max_steps=5, save_steps=0, eval_steps=100,
                      eval_strategy="steps")
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length], args=args,
                    train_dataset=toy.dataset(12), eval_dataset=toy.dataset(4), processing_class=tokenizer,
                    callbacks=[recorder])
    t.train()
    assert t.global_step == 2 and t.state.global_step == 2  # stopped by the callback, not by max_steps
    # a callback's stop is not the end of the schedule: no evaluation or save that was not due (transformers)
    assert recorder.events == [("on_train_begin", 0), ("on_step_end", 1), ("on_step_end", 2), ("on_train_end", 2)]
    assert [x["loss"] == x["loss"] for x in recorder.logs[:2]] == [True, True]  # on_log every step
    assert "train_runtime" in recorder.logs[2] and len(recorder.logs) == 3  # then the end-of-training line
    assert not (tmp_path / "run" / "checkpoint-2").exists()


class Flow(TrainerCallback):
    """Records every event; vetoes the save at step 2 (the default flow sets the flags before on_step_end)."""

    def __init__(self):
        self.seen = []

    def __getattribute__(self, name):
        if name.startswith("on_") and name != "on_step_end":
            return lambda args, state, control, **kw: self.seen.append((name, state.global_step, round(state.epoch or 0, 4)))
        return super().__getattribute__(name)

    def on_step_end(self, args, state, control, **kw):
        self.seen.append(("on_step_end", state.global_step, round(state.epoch, 4), control.should_save))
        if state.global_step == 2:
            control.should_save = False


def test_callback_flow_flags_events_and_list_as_transformers(tmp_path, tokenizer):
    """12 prompts, 2 per round (8 completions, G = 4), 2 optimizer steps per round (steps_per_generation 2):
    an epoch is 6 rounds = 12 steps, so state.epoch advances 1/12 per step; save_steps 2 sets should_save at
    steps 2 and 4 before on_step_end, and the callback's veto at step 2 is obeyed."""
    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), max_steps=4, save_steps=2,
                      per_device_train_batch_size=4, steps_per_generation=2)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length], args=args,
                    train_dataset=toy.dataset(12), processing_class=tokenizer, callbacks=[Flow])  # a class: built
    # transformers' list: its DefaultFlowCallback, the user's callbacks, its ProgressCallback (groupwise's stand-ins
    # are subclasses of those classes)
    from transformers import DefaultFlowCallback, ProgressCallback

    default_flow, flow, progress = t.callback_handler.callbacks
    assert isinstance(default_flow, DefaultFlowCallback) and isinstance(progress, ProgressCallback)
    assert isinstance(flow, Flow) and flow.seen == [("on_init_end", 0, 0)]
    t.add_callback(Recorder())
    assert isinstance(t.pop_callback(Recorder), Recorder) and t.pop_callback(Recorder) is None
    t.train()
    ends = [e for e in flow.seen if e[0] == "on_step_end"]
    assert ends == [("on_step_end", s, round(s / 12, 4), s % 2 == 0) for s in (1, 2, 3, 4)]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-4"]
    names = [e[0] for e in flow.seen]
    assert names[:4] == ["on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin"]
    assert names.count("on_pre_optimizer_step") == names.count("on_optimizer_step") == 4
    assert names[-1] == "on_train_end" and t.state.num_train_epochs == 1  # ceil(4 steps / 12 per epoch)
    t.remove_callback(flow)
    assert t.callback_handler.callbacks == [default_flow, progress]


def test_callback_handler_and_state_as_a_transformers_user_calls_them(tmp_path, tokenizer, caplog):
    """transformers' CallbackHandler interface (a Trainer subclass calls `self.callback_handler.on_log(args, state,
    control, logs)`), its list rules (an absent instance is a ValueError, a second callback of a class a logged
    warning), on_save with transformers' keywords only (a callback listing them without **kwargs crashed on an extra
    `checkpoint=`), and state.eval_steps 500 when eval_steps is unset (it was 0: `step % state.eval_steps` divided
    by zero)."""
    import logging

    from transformers import TrainerControl

    class Strict(TrainerCallback):  # transformers' keywords, no **kwargs
        def __init__(self):
            self.logs, self.saves = [], []

        def on_save(self, args, state, control, model=None, processing_class=None, optimizer=None,
                    lr_scheduler=None, train_dataloader=None, eval_dataloader=None):
            self.saves.append((state.global_step, model is not None, optimizer is not None, train_dataloader))

        def on_log(self, args, state, control, logs=None, model=None, processing_class=None, optimizer=None,
                   lr_scheduler=None, train_dataloader=None, eval_dataloader=None):
            self.logs.append(dict(logs))
            control.should_save = True

    class Mine(GRPOTrainer):  # transformers' Trainer.log, as subclasses copy it
        def log(self, logs, start_time=None):
            super().log(logs, start_time)
            self.control = self.callback_handler.on_log(self.args, self.state, self.control, {"mine": 1.0})

    strict = Strict()
    args = small_args(tmp_path, max_steps=2, save_steps=2)
    t = Mine(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length], args=args,
             train_dataset=toy.dataset(8), processing_class=tokenizer, callbacks=[strict])
    assert t.state.eval_steps == 500 and (t.state.logging_steps, t.state.save_steps) == (args.logging_steps, 2)
    handler = t.callback_handler
    assert handler.callback_list.split("\n") == ["DefaultFlowCallback", "Strict", "ProgressCallback"]
    assert handler.model is t.unwrapped and handler.optimizer is t.optimizer and handler.train_dataloader is None
    control = TrainerControl()
    assert handler.on_log(t.args, t.state, control, {"x": 2.0}) is control and control.should_save
    assert handler.on_step_begin(t.args, t.state, control) is control and not control.should_save  # cleared
    assert strict.logs == [{"x": 2.0}]
    t.train()
    assert {"mine": 1.0} in strict.logs and any("loss" in line for line in strict.logs)
    assert [s[:3] for s in strict.saves] == [(1, True, True), (2, True, True)]  # step 1: asked for in on_log
    with pytest.raises(ValueError, match="this Strict is not among the trainer's callbacks"):
        t.remove_callback(Strict())
    t.remove_callback(Recorder)  # an absent class: nothing, as in transformers
    with caplog.at_level(logging.WARNING, logger="groupwise.callbacks"):
        t.add_callback(Strict)
    assert "a Strict is already among the callbacks" in caplog.text


def test_resumed_history_drops_only_end_of_training_lines(tmp_path):
    """trim_jsonl keeps an evaluation logged with metric_key_prefix="train" (it writes train_runtime too) and drops
    only the end-of-training line (total_flos) and the steps after the checkpoint."""
    from groupwise.logging import trim_jsonl

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "reward": 0.5}, {"step": 1, "train_runtime": 0.3, "train_reward": 0.25},
             {"step": 2, "train_runtime": 9.0, "total_flos": 1.0, "train_loss": 0.1}, {"step": 3, "reward": 0.7}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert trim_jsonl(path, resume_step=2, run_id=None) == lines[:2]
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:3]  # the end line stays in the file


def test_state_log_history_survives_resume_and_save_model_loads(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, max_steps=2, save_steps=2)
    t.train()
    assert [x["step"] for x in t.state.log_history] == [1, 2, 2] and "reward" in t.state.log_history[0]
    assert "train_runtime" in t.state.log_history[2]  # the end-of-training line
    first = t.state.log_history[:2]
    resumed = _trainer(tmp_path, tokenizer, max_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    # the first call's end line is not part of the resumed history (transformers: the checkpoint's state, which
    # every process reads: not metrics.jsonl, which only the main process writes)
    assert [x["step"] for x in resumed.state.log_history] == [1, 2, 3, 3] and resumed.state.log_history[:2] == first
    assert ["train_runtime" in x for x in resumed.state.log_history] == [False, False, False, True]
    rows = [json.loads(x)["step"] for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert rows == [1] * 8 + [2] * 8 + [3] * 8  # completions survive resume without duplicates
    resumed.save_model(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for (n, a), (_, b) in zip(resumed.unwrapped.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a.cpu(), b.cpu()), n


def test_warmup_steps_as_transformers_reads_it():
    from groupwise import GRPOConfig

    # ≥ 1: steps; < 1: ceil(max_steps · fraction) = ceil(10 · 0.25) = 3; 0: warmup_ratio (int(0.5 · 10) = 5)
    assert GRPOConfig(warmup_steps=4).warmup(10) == 4
    assert GRPOConfig(warmup_steps=0.25).warmup(10) == 3
    assert GRPOConfig(warmup_ratio=0.5).warmup(10) == 5


def test_logging_first_step_data_seed_and_disable_tqdm(tmp_path, tokenizer, capsys):
    import ast

    t = _trainer(tmp_path, tokenizer, max_steps=3, logging_steps=5, logging_first_step=True, disable_tqdm=True)
    t.train()
    lines = [json.loads(x)["step"] for x in training_lines(tmp_path / "run" / "metrics.jsonl")]
    assert lines == [1, 3]  # step 1 (first), step 3 (last)
    out, err = capsys.readouterr()
    assert "GRPO" not in err  # no progress bar
    # each log line printed as transformers' PrinterCallback prints it: floats to 4 significant digits
    printed = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{")]
    assert [("loss" in p, "train_runtime" in p) for p in printed] == [(True, False), (True, False), (False, True)]
    assert printed[0]["loss"] == f"{t.state.log_history[0]['loss']:.4g}" and "total_flos" not in printed[2]
    order = lambda **kw: _trainer(tmp_path, tokenizer, **kw).sampler.next_round()  # noqa: E731
    assert order(seed=1, data_seed=7) == order(seed=2, data_seed=7)  # the prompt order follows data_seed alone
    assert order(seed=1, data_seed=7) != order(seed=1, data_seed=8)


class _FakeRun:
    """What the wandb tracker calls on a run: log, summary, define_metric, finish."""

    def __init__(self, **kw):
        self.init, self.logged, self.summary, self.defined, self.finished = kw, [], {}, [], None
        self.config = types.SimpleNamespace(update=lambda values, **kw: self.updates.append((values, kw)))
        self.updates = []

    def log(self, metrics):
        self.logged.append(metrics)

    def define_metric(self, name, **kw):
        self.defined.append((name, kw))

    def finish(self, exit_code=None):
        self.finished = exit_code  # None: not finished


def _fake_wandb(monkeypatch, run=None) -> list:
    """A wandb module whose init records _FakeRuns (returned list); `run`: a run the user already started."""
    import sys

    runs = []
    module = types.SimpleNamespace(run=run, init=lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return runs


class _FakeWriter:
    """torch.utils.tensorboard.SummaryWriter's calls, recorded."""
    made: list = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.texts = log_dir, [], []
        _FakeWriter.made.append(self)

    def add_scalar(self, k, v, step):
        self.scalars.append((k, v, step))

    def add_text(self, k, v):
        self.texts.append(k)

    def flush(self):
        pass

    def close(self):
        pass


def test_trackers_get_transformers_names_and_the_end_of_training_line(tmp_path, tokenizer, monkeypatch):
    """As transformers' WandbCallback / TensorBoardCallback: `x` → `train/x`, `eval_x` → `eval/x`; wandb steps on
    `train/global_step` and keeps train_runtime / train_loss / … in the run summary; TensorBoard writes under
    output_dir/runs/<date>_<host>. run_name names the wandb run. The end-of-training line (transformers' speed
    metrics) is logged once, to log_history, on_log and metrics.jsonl, and is train()'s `.metrics`."""
    import sys

    runs = _fake_wandb(monkeypatch)
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_FakeWriter))
    _FakeWriter.made = []
    seen = []

    class Spy(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen.append(dict(logs))

    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), max_steps=2, report_to=["wandb", "tensorboard"],
                      run_name="exp-7", eval_strategy="steps", eval_steps=2)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length], args=args, callbacks=[Spy],
                    train_dataset=toy.dataset(12), eval_dataset=toy.dataset(2), processing_class=tokenizer)
    result = t.train()
    run, writer = runs[0], _FakeWriter.made[0]
    # transformers' project (WANDB_PROJECT, default "huggingface"); finished at the end of train(), exit code 0
    assert run.init["name"] == "exp-7" and run.init["project"] == "huggingface" and run.finished == 0
    assert ("train/global_step", {}) in run.defined
    # step 1, step 2, its evaluation, the end line (its epoch; the rest is summary), as transformers logs them
    assert [m["train/global_step"] for m in run.logged] == [1, 2, 2, 2] and set(run.logged[3]) == {
        "train/epoch", "train/time/elapsed", "train/global_step"}
    assert "train/loss" in run.logged[0] and "train/reward" in run.logged[0] and "loss" not in run.logged[0]
    assert "eval/reward" in run.logged[2] and "eval/completions/mean_length" in run.logged[2]
    assert set(run.summary) == {"train_runtime", "train_samples_per_second", "train_steps_per_second",
                                "train_loss", "total_flos"}
    assert not any("train/train_runtime" in m for m in run.logged)  # the summary is not a series
    assert writer.log_dir.startswith(str(tmp_path / "run" / "runs") + "/") and writer.texts == ["args", "model_config"]
    assert ("train/loss", run.logged[0]["train/loss"], 1) in writer.scalars
    assert ("train/train_runtime", run.summary["train_runtime"], 2) in writer.scalars
    # the end-of-training line: 2 steps × per_device_train_batch_size 8 × 1 process = 16 samples
    end = seen[-1]
    assert set(end) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                        "train_loss", "epoch"} and end == result.metrics
    assert end["train_steps_per_second"] == pytest.approx(2 / end["train_runtime"], rel=1e-2)
    assert end["train_samples_per_second"] == pytest.approx(16 / end["train_runtime"], rel=1e-2)
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert end["train_loss"] == pytest.approx(sum(losses) / 2) == result.training_loss
    assert t.state.log_history[-1] == {**end, "step": 2}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["train_runtime"] == end["train_runtime"] and "time/elapsed" in lines[-1]
    # 6 × non-embedding parameters × tokens seen (prompt + completion, every process), μ = 1
    assert end["total_flos"] == pytest.approx(6 * t.model.num_parameters(exclude_embeddings=True) *
                                              t.state.num_input_tokens_seen)


def test_trl_trainer_attributes(tmp_path, tokenizer):
    """What TRL scripts read off a GRPOTrainer: the datasets as given, the tokenizer as processing_class, the reward
    functions in order, the accelerator, the reference model (None at β = 0), the scheduler."""
    train, evals = toy.dataset(8), toy.dataset(4)
    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), beta=0.04)
    trainer = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length, toy.letter_reward],
                          args=args, train_dataset=train, eval_dataset=evals, processing_class=tokenizer)
    assert trainer.train_dataset is train and trainer.eval_dataset is evals
    assert trainer.processing_class is tokenizer
    assert trainer.reward_funcs == [_length, toy.letter_reward]
    assert trainer.reward_processing_classes == [None, None]
    assert trainer.accelerator is trainer.dist.accelerator and trainer.is_world_process_zero()
    assert isinstance(trainer.ref_model, torch.nn.Module) and trainer.ref_model is not trainer.model
    assert trainer.lr_scheduler is trainer.scheduler and trainer.num_generations == args.num_generations
    assert _trainer(tmp_path / "b", tokenizer, beta=0.0).ref_model is None
    # TRL's reward_func_names / reward_weights (a float32 tensor, 1 each unless reward_weights) and transformers'
    # is_local_process_zero()
    assert trainer.reward_func_names == ["_length", "letter_reward"] and trainer.is_local_process_zero()
    assert torch.equal(trainer.reward_weights, torch.ones(2)) and trainer.reward_weights.dtype == torch.float32
    weighted = GRPOTrainer(trainer.model, [_length, toy.letter_reward], train_dataset=train, processing_class=tokenizer,
                           args=small_args(tmp_path, output_dir=str(tmp_path / "w"), reward_weights=[2.0, 0.5]))
    assert torch.equal(weighted.reward_weights, torch.tensor([2.0, 0.5]))


def test_reward_names_and_tokenizers_as_trl(tmp_path, tokenizer):
    """A functools.partial is named after the function it wraps (TRL's get_callable_name); a reward model passed
    without its tokenizer gets the one saved with it (config._name_or_path), as TRL loads it."""
    import functools

    from transformers import LlamaConfig, LlamaForSequenceClassification

    def weighted_len(completions, weight=1.0, **_):
        return [weight * len(c) for c in completions]

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    rm = LlamaForSequenceClassification.from_pretrained(tmp_path / "rm")
    sources = load_reward_sources([functools.partial(functools.partial(weighted_len, weight=2.0)), rm])
    assert [s.name for s in sources] == ["weighted_len", "rm"]
    assert sources[1].tokenizer.get_vocab() == tokenizer.get_vocab()
    rewards, _ = compute_rewards(sources[:1], ["p"], ["abc"], [[0]], {})
    assert rewards[0, 0].item() == 6.0
    # a reward model given as a path loads with model_init_kwargs, as TRL loads it
    from_path = load_reward_sources([str(tmp_path / "rm")], model_init_kwargs={"dtype": "bfloat16"})[0]
    assert from_path.model.dtype == torch.bfloat16 and from_path.name == "rm"
    assert load_reward_sources([str(tmp_path / "rm")])[0].model.dtype == torch.float32


def test_report_to_set_after_the_config_is_resolved_before_the_model_loads(tmp_path, tokenizer):
    """transformers reads report_to when the trainer is built: a value set on the config afterwards ("none" as a
    string) is resolved then; an unknown one is a one-line error before the model loads."""
    from groupwise import GRPOConfig
    from groupwise.config_base import ConfigError

    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), max_steps=1)
    args.report_to = "none"
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length], args=args,
                    train_dataset=toy.dataset(8), processing_class=tokenizer)
    assert t.args.report_to == []
    t.train()
    with pytest.raises(ConfigError, match="report_to=5 must be a tracker name or a list of them"):
        GRPOConfig(report_to=5)
    args.report_to = "tensorbored"
    with pytest.raises(ConfigError, match=r"report_to='tensorbored' is not one of \['none', 'all', 'tensorboard'"):
        GRPOTrainer(str(tmp_path / "no-such-model"), [_length], args=args, train_dataset=toy.dataset(8))


def test_a_user_s_wandb_run_is_used_and_a_failed_run_is_marked_failed(tmp_path, tokenizer, monkeypatch):
    """As transformers' WandbCallback: a run the user started (wandb.run) is used, its config updated, and left
    open. A run the tracker started is finished with exit code 1 when training fails (a callback raising), not as
    a success; a tracker that fails to open closes the ones opened before it."""
    import sys

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            raise RuntimeError("boom")

    users = _FakeRun()
    _fake_wandb(monkeypatch, run=users)
    t = _trainer(tmp_path, tokenizer, max_steps=1, report_to=["wandb"])
    t.train()
    assert users.logged and users.finished is None and users.updates[0][1] == {"allow_val_change": True}
    assert users.updates[0][0]["max_steps"] == 1  # the run's config
    runs = _fake_wandb(monkeypatch)
    t = _trainer(tmp_path, tokenizer, max_steps=2, report_to=["wandb"], overwrite_output_dir=True)
    t.add_callback(Boom)
    with pytest.raises(RuntimeError, match="boom"):
        t.train()
    assert runs[0].finished == 1
    runs = _fake_wandb(monkeypatch)

    def broken_writer(log_dir):
        raise OSError("disk full")

    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=broken_writer))
    t = _trainer(tmp_path, tokenizer, max_steps=1, report_to=["wandb", "tensorboard"], overwrite_output_dir=True)
    with pytest.raises(OSError, match="disk full"):
        t.train()
    assert runs[0].finished == 1  # the wandb run opened first is closed, as failed


def test_metrics_are_averaged_over_the_logging_window_as_trl():
    """TRL's log(): every metric is the mean of its values since the last log line, entropy_coef too (one value per
    optimizer step); transformers' learning_rate / grad_norm and TRL's running num_tokens are the last value."""
    from groupwise.logging import window_summary

    window = {"entropy_coef": [0.01, 0.02, 0.03], "reward": [1.0, float("nan"), 2.0], "learning_rate": [3.0, 2.0],
              "num_tokens": [10.0, 20.0]}
    # entropy_coef (0.01 + 0.02 + 0.03) / 3 = 0.02; reward: NaN (not measured) left out, (1 + 2) / 2 = 1.5
    assert window_summary(window, nan_inf_filter=True) == pytest.approx(
        {"entropy_coef": 0.02, "reward": 1.5, "learning_rate": 2.0, "num_tokens": 20.0})


def test_disable_tqdm_none_follows_transformers_verbosity(tmp_path):
    """transformers' TrainingArguments: disable_tqdm None becomes True when its logging is quieter than warnings
    when the arguments are built (not later: a log_level the trainer applies does not change it)."""
    import transformers

    from groupwise import GRPOConfig

    before = transformers.logging.get_verbosity()
    try:
        transformers.logging.set_verbosity_warning()
        assert GRPOConfig().disable_tqdm is False
        transformers.logging.set_verbosity_error()
        assert GRPOConfig().disable_tqdm is True and GRPOConfig(disable_tqdm=False).disable_tqdm is False
    finally:
        transformers.logging.set_verbosity(before)


def test_every_tracker_is_closed_even_when_one_fails_to(tmp_path):
    """A tracker failing to close (wandb unreachable at the end) does not leave the next one open; after a failed run
    it is only a warning, so the run's own error is the one raised."""
    from groupwise.logging import MetricsLogger
    from groupwise.trackers import Opened

    closed = []

    def unreachable(failed):
        raise ConnectionError("wandb unreachable")

    logger = MetricsLogger(str(tmp_path), [], enabled=True, config={})
    for failed in (False, True):
        logger.trackers = [Opened(lambda step, metrics: None, unreachable),
                           Opened(lambda step, metrics: None, closed.append)]
        if failed:
            with pytest.warns(RuntimeWarning, match="closing a tracker failed: ConnectionError: wandb unreachable"):
                logger.close(failed=True)
        else:
            with pytest.raises(ConnectionError, match="wandb unreachable"):
                logger.close()
    assert closed == [False, True] and logger.trackers == []


def test_training_arguments_properties_as_transformers_reads_them(tmp_path, monkeypatch):
    """args.process_index / should_save / to_json_string() … are read by TRL scripts and callbacks; GRPOConfig had
    none of them. One CPU process: the values transformers' TrainingArguments gives; under a launcher's
    environment (rank 1 of 2, local rank 1): that process's."""
    import json

    from transformers import TrainingArguments

    from groupwise import GRPOConfig

    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    ours = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, per_device_eval_batch_size=8,
                      warmup_ratio=0.1)
    theirs = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, warmup_steps=0.1,
                               use_cpu=True)
    for name in ("world_size", "process_index", "local_process_index", "should_log", "should_save", "n_gpu",
                 "device", "train_batch_size", "eval_batch_size", "parallel_mode", "ddp_timeout_delta",
                 "place_model_on_device"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.get_warmup_steps(95) == theirs.get_warmup_steps(95) == 10  # ⌈0.1 × 95⌉
    assert json.loads(ours.to_json_string())["per_device_train_batch_size"] == 8
    sanitized = ours.to_sanitized_dict()
    assert sanitized["train_batch_size"] == 8 and sanitized["report_to"] == str(ours.report_to)
    assert all(type(v) in (bool, int, float, str) for v in sanitized.values())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (ours.world_size, ours.process_index, ours.should_save, ours.should_log) == (2, 1, False, False)
    assert ours.parallel_mode.value == "distributed"  # a callback reading args.parallel_mode crashed
    monkeypatch.setenv("LOCAL_RANK", "0")  # the second machine's first process: logs there (log_on_each_node)
    assert ours.should_log and not ours.should_save
    ours.log_on_each_node = False
    assert not ours.should_log


def test_the_default_callbacks_can_be_removed_or_replaced_as_in_transformers(tmp_path, tokenizer, capsys):
    """transformers' habits: remove_callback(ProgressCallback) silences the bar and the printed log lines;
    pop_callback(DefaultFlowCallback) returns the flow and leaves nothing scheduled (no log line, no checkpoint;
    training still stops at max_steps, and its end line is logged); transformers' own DefaultFlowCallback put in
    its place schedules by transformers' rules, which do not log the last step when it is not a multiple of
    logging_steps (groupwise's flow does); disable_tqdm puts PrinterCallback in the list instead."""
    from transformers import DefaultFlowCallback, PrinterCallback, ProgressCallback

    def run(name, change=None, **kw):
        args = small_args(tmp_path, output_dir=str(tmp_path / name), max_steps=3, logging_steps=2, save_steps=3,
                          **kw)
        t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length], args=args,
                        train_dataset=toy.dataset(12), processing_class=tokenizer)
        if change:
            change(t)
        capsys.readouterr()
        t.train()
        out = capsys.readouterr()
        steps = [x["step"] for x in t.state.log_history if "loss" in x]
        return t, out.out + out.err, steps, sorted(p.name for p in (tmp_path / name).glob("checkpoint-*"))

    t, printed, steps, saved = run("default")
    assert steps == [2, 3] and saved == ["checkpoint-3"] and "'loss':" in printed and "GRPO" in printed
    t.evaluate(toy.dataset(2))  # transformers' ProgressCallback owns the prediction bar too
    assert "evaluation" in capsys.readouterr().err
    t, printed, steps, saved = run("quiet", lambda t: t.remove_callback(ProgressCallback))
    assert steps == [2, 3] and "'loss':" not in printed and "GRPO" not in printed
    assert not any(isinstance(c, ProgressCallback) for c in t.callback_handler.callbacks)
    t.evaluate(toy.dataset(2))
    assert "evaluation" not in capsys.readouterr().err
    popped = []
    t, printed, steps, saved = run("no_flow", lambda t: popped.append(t.pop_callback(DefaultFlowCallback)))
    assert isinstance(popped[0], DefaultFlowCallback) and t.global_step == 3
    assert steps == [] and saved == [] and "train_runtime" in t.state.log_history[-1]
    t, printed, steps, saved = run("transformers_flow", lambda t: (t.remove_callback(DefaultFlowCallback),
                                                                   t.add_callback(DefaultFlowCallback())))
    assert type(t.callback_handler.callbacks[-1]) is DefaultFlowCallback and steps == [2] and saved == ["checkpoint-3"]
    t, printed, steps, saved = run("printer", disable_tqdm=True)
    assert isinstance(t.callback_handler.callbacks[-1], PrinterCallback) and "'loss':" in printed
    assert "GRPO" not in printed


def test_a_model_init_kwargs_key_nothing_takes_names_the_key_and_the_nearest_word(tmp_path, model_dir):
    """transformers passes a key from_pretrained does not know on to the model's __init__: a TypeError traceback
    for a typo. Now one line naming the key and what it most likely meant."""
    from groupwise import ConfigError
    from groupwise.tasks import toy
    from tests.conftest import small_args

    args = small_args(tmp_path, model_init_kwargs={"attn_impl": "sdpa"})
    with pytest.raises(ConfigError, match=r"^model_init_kwargs key 'attn_impl' is taken neither by from_pretrained "
                                          r"nor by the model \(LlamaForCausalLM.__init__\(\) got an unexpected keyword "
                                          r"argument 'attn_impl'\); did you mean 'attn_implementation'\?$"):
        GRPOTrainer(model_dir, [toy.letter_reward], args=args, train_dataset=toy.dataset(8))


def test_a_warning_during_training_is_written_on_its_own_line_above_the_bar(tmp_path, tokenizer, capsys):
    """A warning raised while the training bar is drawn (here by a reward function at step 2) starts its own line:
    tqdm clears the bar, the warning is shown, the bar is drawn again. Before, it was appended to the bar's text
    ('GRPO:  33%|███▎ | 1/3 …/x.py:1: UserWarning: …'). pytest.warns still records it, and warnings.showwarning is
    the one from before once training ends."""
    import sys
    import warnings

    def warns(completions, **_):
        if _state["calls"] == 1:
            warnings.warn("the scorer's cache is cold", UserWarning)
        _state["calls"] += 1
        return [float(len(c)) for c in completions]

    def to_stderr(message, category, filename, lineno, file=None, line=None):  # Python's own showwarning, which
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))  # pytest replaces

    _state = {"calls": 0}
    t = _trainer(tmp_path, tokenizer, funcs=(warns,), max_steps=3)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = before = to_stderr
        t.train()
        assert warnings.showwarning is before
    err = capsys.readouterr().err
    shown = [piece for line in err.split("\n") for piece in line.split("\r")
             if "UserWarning: the scorer's cache is cold" in piece]
    assert len(shown) == 1 and "GRPO" not in shown[0]
    assert "GRPO" in err  # the bar was drawn
    _state["calls"] = 0
    with pytest.warns(UserWarning, match="the scorer's cache is cold"):
        _trainer(tmp_path / "again", tokenizer, funcs=(warns,), max_steps=3).train()

"""When the trainer logs, evaluates, saves and ends epochs, as transformers' Trainer decides it with its
DefaultFlowCallback and a user's callbacks (transformers 5.23 trainer.py: the inner loop's on_step_end then
_maybe_log_save_evaluate, on_epoch_end after the step loop ends whatever ended it, then _maybe_log_save_evaluate again;
each flag read when it is acted on)."""

import pytest
from transformers import TrainerCallback

from groupwise import GRPOTrainer
from groupwise.tasks import toy
from tests.conftest import small_args


class Recorder(TrainerCallback):
    """Every event with the step it came at; `act(name, state, control)` lets a test change the flags."""

    def __init__(self, act=None):
        self.events, self.act = [], act

    def __getattribute__(self, name):
        if not name.startswith("on_"):
            return object.__getattribute__(self, name)

        def event(args, state, control, **kwargs):
            self.events.append((name, state.global_step))
            if self.act is not None:
                self.act(name, state, control, **kwargs)
        return event

    def names(self):
        return [name for name, _ in self.events]


def _train(tmp_path, tokenizer, act=None, eval_rows=4, rewards=None, rows=16, **fields):
    recorder = Recorder(act)
    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    trainer = GRPOTrainer(model, rewards or toy.REWARD_FUNCS, args=small_args(tmp_path, **fields),
                          train_dataset=toy.dataset(rows), processing_class=tokenizer,
                          eval_dataset=toy.dataset(eval_rows, seed=1) if eval_rows else None, callbacks=[recorder])
    trainer.train()
    return trainer, recorder


def test_a_callback_stopping_mid_epoch_gets_the_epoch_end_and_its_log_evaluation_and_save(tmp_path, tokenizer):
    """Every strategy 'epoch', a callback stops training at step 1 of an 8-step epoch: transformers fires on_epoch_end
    after its loop breaks, and its DefaultFlowCallback logs, evaluates and saves there. groupwise fired no
    on_epoch_end, and step 1 was neither logged, evaluated nor saved."""
    def stop(name, state, control, **_):
        if name == "on_step_end" and state.global_step == 1:
            control.should_training_stop = True

    trainer, rec = _train(tmp_path, tokenizer, stop, max_steps=10, eval_strategy="epoch", save_strategy="epoch",
                          logging_strategy="epoch")
    tail = rec.names()[rec.names().index("on_step_end"):]
    assert tail == ["on_step_end", "on_epoch_end", "on_log", "on_prediction_step", "on_log", "on_evaluate",
                    "on_save", "on_log", "on_train_end"]  # one evaluation batch (4 prompts)
    assert (tmp_path / "out" / "checkpoint-1").is_dir()
    assert "loss" in trainer.state.log_history[0] and "eval_reward" in trainer.state.log_history[1]


def test_the_last_step_sets_should_training_stop_and_its_epoch_ends(tmp_path, tokenizer):
    """transformers' DefaultFlowCallback sets should_training_stop at max_steps before on_step_end (it stayed False),
    and the partial epoch training stops in ends (no on_epoch_end fired). on_epoch_end comes before the step's log
    and save (transformers: after them), so that they are one pass and the checkpoint holds the whole step."""
    seen = []

    def watch(name, state, control, **_):
        if state.global_step == 2 and name in ("on_step_end", "on_log", "on_train_end"):
            seen.append((name, control.should_training_stop))

    trainer, rec = _train(tmp_path, tokenizer, watch, eval_rows=None, max_steps=2)
    assert seen and all(stop for _, stop in seen) and trainer.control.should_training_stop
    assert rec.names()[-6:] == ["on_step_end", "on_epoch_end", "on_log", "on_save", "on_log", "on_train_end"]


def test_a_callback_cancels_the_evaluation_in_on_log_and_the_save_in_on_evaluate(tmp_path, tokenizer):
    """transformers reads the control after each event: an on_log that clears should_evaluate leaves the step
    unevaluated, an on_evaluate that clears should_save leaves it unsaved (groupwise acted on the flags as they stood
    before those events: 2 evaluations, 2 checkpoints)."""
    def no_eval(name, state, control, logs=None, **_):
        if name == "on_log" and logs and "loss" in logs:
            control.should_evaluate = False

    def no_save(name, state, control, **_):
        if name == "on_evaluate":
            control.should_save = False

    fields = dict(max_steps=2, eval_strategy="steps", eval_steps=1, save_steps=1)
    _, rec = _train(tmp_path / "a", tokenizer, no_eval, **fields)
    assert "on_evaluate" not in rec.names() and len(list((tmp_path / "a" / "out").glob("checkpoint-*"))) == 2
    _, rec = _train(tmp_path / "b", tokenizer, no_save, **fields)
    assert rec.names().count("on_evaluate") == 2 and "on_save" not in rec.names()
    assert not list((tmp_path / "b" / "out").glob("checkpoint-*"))


def _end_every_epoch(epochs):
    def end_epoch(name, state, control, **_):
        if name == "on_step_end":
            epochs.append(state.epoch)
            control.should_epoch_stop = True
    return end_epoch


def test_should_epoch_stop_ends_the_epoch_and_the_epochs_end_training(tmp_path, tokenizer):
    """transformers ends the epoch when a callback sets should_epoch_stop (it was ignored): 16 prompts, 2 per round,
    an epoch of 8 steps; stopped after every step, each step is the first of a new epoch (state.epoch 0.125, 1.125,
    2.125), with on_epoch_end / on_epoch_begin between them. num_train_epochs=3 plans 24 steps; transformers' loop
    runs 3 epochs, so training ends after step 3 (groupwise ran on to step 24)."""
    epochs = []
    trainer, rec = _train(tmp_path, tokenizer, _end_every_epoch(epochs), eval_rows=None, max_steps=-1,
                          num_train_epochs=3)
    assert trainer.state.max_steps == 24 and trainer.state.global_step == 3
    assert epochs == pytest.approx([0.125, 1.125, 2.125])
    steps = [(n, s) for n, s in rec.events if n in ("on_step_end", "on_epoch_end", "on_epoch_begin", "on_train_end")]
    assert steps == [("on_epoch_begin", 0), ("on_step_end", 1), ("on_epoch_end", 1), ("on_epoch_begin", 1),
                     ("on_step_end", 2), ("on_epoch_end", 2), ("on_epoch_begin", 2), ("on_step_end", 3),
                     ("on_epoch_end", 3), ("on_train_end", 3)]


def test_with_max_steps_the_epochs_transformers_derives_from_it_bound_training_too(tmp_path, tokenizer):
    """max_steps=3 with 8-step epochs: transformers' num_train_epochs is 3 // 8 + 1 = 1, so an epoch a callback
    ends at step 1 ends training (state.num_train_epochs says so)."""
    epochs = []
    trainer, _ = _train(tmp_path, tokenizer, _end_every_epoch(epochs), eval_rows=None, max_steps=3)
    assert trainer.state.num_train_epochs == 1 and trainer.state.global_step == 1 and len(epochs) == 1


@pytest.mark.parametrize("rows, max_steps, steps_per_generation", [(5, 6, 1), (5, 8, 2), (3, 5, 1)])
def test_max_steps_are_all_run_when_rounds_run_on_across_epochs(tmp_path, tokenizer, rows, max_steps,
                                                                  steps_per_generation):
    """5 prompts, 2 per round: rounds run on across epoch boundaries, so max_steps' rounds make more passes than
    max_steps ÷ rounds per epoch (ceil(5/2) = 3). Counting epochs that way ended a 6-step run at step 5 (and an
    8-step one with 2 steps per round at step 6, its end neither logged nor saved)."""
    trainer, rec = _train(tmp_path, tokenizer, eval_rows=None, rows=rows, max_steps=max_steps,
                          steps_per_generation=steps_per_generation)  # 2 prompts a step: 2 or 4 a round
    assert trainer.state.global_step == max_steps
    assert trainer.state.log_history[-2]["step"] == max_steps and "loss" in trainer.state.log_history[-2]


@pytest.mark.parametrize("event", ["on_train_begin", "on_epoch_begin"])
def test_should_training_stop_before_the_first_step_still_runs_one(tmp_path, tokenizer, event):
    """transformers reads should_training_stop after each step: set in on_train_begin or on_epoch_begin, one step
    runs, then the epoch ends (on_epoch_end) and training does. groupwise ran no step and fired no on_epoch_end.
    (With gradient_accumulation_steps > 1 transformers stops after one micro-batch, with no optimizer step:
    groupwise still runs one step, docs/trl_compat.md.)"""
    def stop(name, state, control, **_):
        if name == event:
            control.should_training_stop = True

    trainer, rec = _train(tmp_path, tokenizer, stop, eval_rows=None, max_steps=4)
    assert trainer.state.global_step == 1
    assert [n for n in rec.names() if n not in ("on_pre_optimizer_step", "on_optimizer_step", "on_log")] == [
        "on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end",
        "on_train_end"]


def test_should_training_stop_in_a_later_epoch_s_begin_runs_one_step_of_it(tmp_path, tokenizer):
    """Set in the second epoch's on_epoch_begin (after step 8 of 8-step epochs), transformers runs that epoch's
    first step and fires its on_epoch_end; groupwise stopped at once, leaving the epoch without an end."""
    def stop(name, state, control, **_):
        if name == "on_epoch_begin" and state.global_step > 0:
            control.should_training_stop = True

    trainer, rec = _train(tmp_path, tokenizer, stop, eval_rows=None, max_steps=-1, num_train_epochs=3)
    assert trainer.state.global_step == 9
    epochs = [(n, s) for n, s in rec.events if n in ("on_epoch_begin", "on_epoch_end", "on_train_end")]
    assert epochs == [("on_epoch_begin", 0), ("on_epoch_end", 8), ("on_epoch_begin", 8), ("on_epoch_end", 9),
                      ("on_train_end", 9)]


def test_eval_on_start_runs_before_the_first_epoch_begins(tmp_path, tokenizer):
    """transformers' _inner_training_loop: on_train_begin, the eval_on_start evaluation, then on_epoch_begin
    (groupwise evaluated after on_epoch_begin)."""
    _, rec = _train(tmp_path, tokenizer, max_steps=1, eval_on_start=True)
    names = [n for n in rec.names() if n not in ("on_prediction_step", "on_log")]
    assert names[:5] == ["on_init_end", "on_train_begin", "on_evaluate", "on_epoch_begin", "on_step_begin"]


def test_on_step_begin_comes_before_the_steps_generation(tmp_path, tokenizer):
    """TRL generates and scores inside training_step, after transformers' on_step_begin: a callback that changes
    the sampling there (a curriculum) acts on that step's rollout. groupwise generated first."""
    order = []

    def reward(completions, **_):
        order.append("rewards")
        return [0.0] * len(completions)

    def mark(name, state, control, **_):
        if name == "on_step_begin":
            order.append("on_step_begin")

    _train(tmp_path, tokenizer, mark, eval_rows=None, rewards=[reward], max_steps=2)
    assert order == ["on_step_begin", "rewards"] * 2


def test_a_signal_at_an_epochs_end_still_logs_evaluates_and_saves_the_epoch(tmp_path, tokenizer):
    """Every strategy 'epoch', 2 rounds per epoch: SIGTERM arriving during step 2 (an epoch's end). The epoch's log,
    evaluation and checkpoint are written before the run stops (the first version of the new flow skipped them);
    save_on_interrupt does not write a second checkpoint of that step."""
    import os
    import signal

    from groupwise.signals import TrainingInterrupted

    def term(name, state, control, **_):
        if name == "on_step_begin" and state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted, match="after step 2"):
        _train(tmp_path, tokenizer, term, max_steps=10, per_device_train_batch_size=32, eval_strategy="epoch",
               save_strategy="epoch", logging_strategy="epoch")
    import json

    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("step") for x in lines if "loss" in x] == [2] and any("eval_reward" in x for x in lines)
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2"]


def test_on_evaluate_sees_the_model_in_eval_mode_and_training_gets_it_back(tmp_path, tokenizer):
    """transformers' evaluation loop leaves the model in eval mode through on_log / on_evaluate (training_step sets
    train mode again): groupwise gave train mode back before them."""
    modes = []

    def record(name, state, control, model=None, **_):
        if name in ("on_evaluate", "on_step_end"):
            modes.append((name, model.training))

    _train(tmp_path, tokenizer, record, max_steps=2, eval_strategy="steps", eval_steps=1)
    assert modes == [("on_step_end", True), ("on_evaluate", False), ("on_step_end", True), ("on_evaluate", False)]


def test_the_first_signal_s_line_says_where_the_run_is(tmp_path, tokenizer, capsys):
    """A launcher's SIGTERM reaching a process stuck in a reward function is followed by its SIGKILL: the signal's
    line is all that process leaves, so it says where the run was (the loop's PHASES and the step)."""
    import os
    import signal

    from groupwise.signals import TrainingInterrupted

    def reward(completions, **_):
        os.kill(os.getpid(), signal.SIGTERM)  # while the rewards of step 1's round are scored
        return [float(len(c)) for c in completions]

    with pytest.raises(TrainingInterrupted, match="after step 1"):
        _train(tmp_path, tokenizer, eval_rows=None, rewards=[reward], max_steps=3)
    said = capsys.readouterr()
    assert ("groupwise: SIGTERM received: stopping after this optimizer step (again to stop at once); now in a round "
            "› scoring the completions (reward functions) at step 1") in said.out + said.err

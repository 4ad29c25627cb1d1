import json

import pytest
import torch

from groupwise import GRPOTrainer
from groupwise.rewards import RewardFunctionError
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines


def _run(tmp_path, tokenizer, out, crash_on_round=None, resume=None, **kw):
    calls = {"n": 0}

    def reward(completions, letter, log_extra, **_):
        calls["n"] += 1
        if crash_on_round is not None and calls["n"] == crash_on_round:
            raise RuntimeError("the machine went away")
        # uses the RNG too, as real reward functions may: the RNG state must be restored exactly
        noise = torch.rand(len(completions)) * 0.1
        log_extra("noise", [float(e) for e in noise])  # a completions.jsonl column (TRL's log_extra)
        return [r + float(e) for r, e in zip(toy.letter_reward(completions, letter), noise)]

    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    args = small_args(tmp_path, output_dir=str(tmp_path / out), **kw)
    t = GRPOTrainer(model, [reward], args=args, train_dataset=toy.dataset(12), processing_class=tokenizer)
    if crash_on_round is not None:
        with pytest.raises(RewardFunctionError, match="the machine went away"):
            t.train(resume_from_checkpoint=resume)
    else:
        t.train(resume_from_checkpoint=resume)
    return t


@pytest.mark.parametrize("kw, save_at", [
    (dict(max_steps=4, save_steps=2), 2),  # resume at a round boundary
    (dict(max_steps=6, save_steps=1, num_iterations=2), 3),  # resume inside a μ=2 round
])
def test_resume_is_bitwise_exact(tmp_path, tokenizer, kw, save_at):
    kw = {k: v for k, v in kw.items() if k != "optim_note"}
    straight = _run(tmp_path, tokenizer, "straight", **kw)
    # a run that dies when it starts its third generation round …
    _run(tmp_path, tokenizer, "crashed", crash_on_round=3, **kw)
    out = tmp_path / "crashed"
    assert not list(out.glob(".tmp-*")), "a half-written checkpoint was left behind"
    assert (out / f"checkpoint-{save_at}" / "trainer_state.json").exists()
    # … and is resumed from its checkpoint by a fresh process
    resumed = _run(tmp_path, tokenizer, "crashed", resume=str(out / f"checkpoint-{save_at}"), **kw)
    assert resumed.global_step == straight.global_step
    for (n, a), (_, b) in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.named_parameters()):
        assert torch.equal(a, b), f"{n} differs after resume"
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    steps = [json.loads(x)["step"] for x in training_lines(out / "metrics.jsonl")]
    assert steps == list(range(1, straight.global_step + 1))  # no duplicated lines after resume

    def rows(run):  # completions.jsonl: a round resumed in its middle logs its rows, log_extra columns included
        return [{k: v for k, v in json.loads(x).items() if k != "run_id"}
                for x in (tmp_path / run / "completions.jsonl").read_text().splitlines()]

    assert len(rows("straight")) == 8 * straight.global_step and "noise" in rows("straight")[-1]
    assert rows("crashed") == rows("straight")


def test_a_resume_between_log_lines_logs_the_lines_of_the_straight_run(tmp_path, tokenizer):
    """logging_steps=3, a checkpoint at step 2: the line of step 3 averages steps 1-3 in both runs (the metrics of
    steps 1-2 travel in the checkpoint; the resumed run's line used to average step 3 alone)."""
    kw = dict(max_steps=6, save_steps=2, logging_steps=3)
    _run(tmp_path, tokenizer, "straight", **kw)
    _run(tmp_path, tokenizer, "crashed", crash_on_round=3, **kw)
    _run(tmp_path, tokenizer, "crashed", resume=str(tmp_path / "crashed" / "checkpoint-2"), **kw)

    def lines(out):
        return [{k: v for k, v in json.loads(x).items()  # less wall-clock times and the run id
                 if not k.startswith("time/") and k not in ("run_id", "step_time")}
                for x in training_lines(tmp_path / out / "metrics.jsonl")]

    straight, resumed = lines("straight"), lines("crashed")
    assert [x["step"] for x in resumed] == [3, 6]
    assert resumed == straight


def test_checkpoint_has_no_pickles(tmp_path, tokenizer):
    _run(tmp_path, tokenizer, "run", max_steps=1, save_steps=1)
    files = {p.name for p in (tmp_path / "run" / "checkpoint-1").iterdir()}
    assert {"model.safetensors", "optimizer.safetensors", "rng_state_0.safetensors", "trainer_state.json"} <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl", ".pth"))]


def test_resume_rejects_a_non_checkpoint(tmp_path, tokenizer):
    from groupwise.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="holds no trainer_state.json: not a checkpoint written by groupwise"):
        _run(tmp_path, tokenizer, "x", resume=str(tmp_path))


def test_a_save_is_flushed_to_disk_before_the_rename(tmp_path, tokenizer, monkeypatch):
    """Every file of the checkpoint and its folder are fsynced before checkpoint-N exists (a power cut after the
    rotation deleted older checkpoints must not leave the newest one half on disk)."""
    import os

    import groupwise.checkpoint as ckpt

    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    _run(tmp_path, tokenizer, "run", max_steps=1, save_steps=1)
    folder = tmp_path / "run" / "checkpoint-1"
    tmp = str(tmp_path / "run" / ".tmp-checkpoint-1")
    files = {p.name for p in folder.iterdir()}
    assert {os.path.basename(s) for s in synced if os.path.dirname(s) == tmp} == files
    assert synced.index(tmp) > max(i for i, s in enumerate(synced) if os.path.dirname(s) == tmp)  # folder after files
    assert synced[-1] == str(tmp_path / "run")  # the rename itself


def test_resuming_from_an_older_checkpoint_sets_the_later_ones_aside(tmp_path, tokenizer):
    """A run saved checkpoints 1-4; resumed from checkpoint-2, it abandons 3 and 4. They are renamed, kept whole, so
    that after a crash before the resumed run's next save, resume_from_checkpoint=True continues from checkpoint-2
    (it used to pick the abandoned checkpoint-4, a finished run, and refuse), and the rotation cannot keep them over
    the resumed branch's checkpoints."""
    from safetensors.torch import load_file

    from groupwise.checkpoint import verify_checkpoint

    out = tmp_path / "run"
    _run(tmp_path, tokenizer, "run", max_steps=4, save_steps=1)
    with pytest.warns(UserWarning, match="set aside, not deleted: checkpoint-3.abandoned, checkpoint-4.abandoned"):
        _run(tmp_path, tokenizer, "run", crash_on_round=1, resume=str(out / "checkpoint-2"), max_steps=4, save_steps=1)
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-1", "checkpoint-2", "checkpoint-3.abandoned", "checkpoint-4.abandoned"]
    verify_checkpoint(out / "checkpoint-4.abandoned")
    t = _run(tmp_path, tokenizer, "run", resume=True, max_steps=4, save_steps=1, save_total_limit=2)
    assert t.global_step == 4 and sorted(p.name for p in out.glob("checkpoint-?")) == ["checkpoint-3", "checkpoint-4"]
    # the resumed branch is the straight run, replayed exactly
    new, old = load_file(out / "checkpoint-4" / "model.safetensors"), load_file(out / "checkpoint-4.abandoned" /
                                                                                "model.safetensors")
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)


def test_resuming_on_another_dataset_of_the_same_size_warns(tmp_path, tokenizer):
    """The checkpoint keeps a digest of the train dataset (its length and up to 64 rows spread over it); a resume on
    different rows of the same size used to continue silently, on the same prompt order over other prompts."""
    import warnings

    from groupwise.data import PromptData

    rows = toy.dataset(12)
    other = [dict(r, prompt=r["prompt"] + " please") for r in rows]
    assert PromptData(rows, "d").fingerprint() == PromptData([dict(r) for r in rows], "d").fingerprint()
    assert PromptData(rows, "d").fingerprint() != PromptData(other, "d").fingerprint()
    assert PromptData(rows, "d").fingerprint() != PromptData(rows[:11], "d").fingerprint()

    def trainer(data, **kw):
        args = small_args(tmp_path, output_dir=str(tmp_path / "run"), **kw)
        return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward], args=args,
                           train_dataset=data, processing_class=tokenizer)

    trainer(rows, max_steps=1, save_steps=1).train()
    ckpt = str(tmp_path / "run" / "checkpoint-1")
    with pytest.warns(UserWarning, match="train_dataset is not the one .*checkpoint-1 was trained on"):
        trainer(other, max_steps=2).train(resume_from_checkpoint=ckpt)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*train_dataset is not the one")
        trainer(rows, max_steps=2).train(resume_from_checkpoint=ckpt)


def test_a_checkpoint_saved_before_the_round_fields_were_filled_in_resumes():
    """Checkpoints written before GRPOConfig filled in steps_per_generation / generation_batch_size (as TRL does)
    recorded None for both; they are derived from fields the resume compares too, so None matches. A value that
    differs still refuses."""
    from groupwise import GRPOConfig
    from groupwise.checkpoint import CheckpointError
    from groupwise.checkpoint_load import RESUME_FIELDS, check_resume

    args = GRPOConfig(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2)
    config = {k: getattr(args, k) for k in RESUME_FIELDS}
    state = {"world_size": 1, "global_step": 2, "config": {**config, "steps_per_generation": None,
                                                           "generation_batch_size": None}}
    check_resume("ckpt", state, args, world_size=1, max_steps=8)
    with pytest.raises(CheckpointError, match=r"steps_per_generation is 4 in ckpt but 2 now"):
        check_resume("ckpt", {**state, "config": {**config, "steps_per_generation": 4}}, args, world_size=1,
                     max_steps=8)


class _Killed(BaseException):
    """The process dies here (not an Exception: nothing on the way handles it)."""


def _die_between_the_renames(monkeypatch):
    """os.replace kills the save when it would rename the new .tmp-checkpoint-N into place: the step's previous
    checkpoint was just moved to .old-checkpoint-N (the re-save of a step dies between its two renames)."""
    import os

    real = os.replace

    def replace(src, dst):
        if os.path.basename(src).startswith(".tmp-checkpoint-"):
            raise _Killed
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("crash", ["re-save", "renamed", "renamed, partial tmp"])
def test_a_crash_while_a_save_replaces_its_step_loses_nothing(tmp_path, tokenizer, monkeypatch, crash):
    """A save of a step that has a checkpoint moves checkpoint-N to .old-checkpoint-N, renames the new folder into
    place, then deletes the old one. Killed between the two renames, the only complete copy of step N is
    .old-checkpoint-N: resume_from_checkpoint=True used to find no checkpoint (it is put back now), and the resumed
    run is the straight run, bitwise. 're-save': the crashed run's trainer saves step 2 again (its RNG and data
    position moved on since: the new copy, left complete in .tmp-checkpoint-2, is not the one to resume)."""
    import shutil

    from groupwise.checkpoint import verify_checkpoint

    kw = dict(max_steps=4, save_steps=2)
    straight = _run(tmp_path, tokenizer, "straight", **kw)
    crashed = _run(tmp_path, tokenizer, "crashed", crash_on_round=3, **kw)
    out = tmp_path / "crashed"
    before = {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir()}
    if crash == "re-save":
        with monkeypatch.context() as m:
            _die_between_the_renames(m)
            with pytest.raises(_Killed):
                crashed.save()
        verify_checkpoint(out / ".tmp-checkpoint-2")  # the new save was complete, only not in place yet
    else:
        (out / "checkpoint-2").rename(out / ".old-checkpoint-2")
        if crash == "renamed, partial tmp":
            shutil.copytree(out / ".old-checkpoint-2", out / ".tmp-checkpoint-2")
            (out / ".tmp-checkpoint-2" / "checksums.json").unlink()
            (out / ".tmp-checkpoint-2" / "model.safetensors").unlink()
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == [".old-checkpoint-2"] + (
        [] if crash == "renamed" else [".tmp-checkpoint-2"])
    with pytest.warns(RuntimeWarning, match="checkpoint-2 put back from .old-checkpoint-2"):
        resumed = _run(tmp_path, tokenizer, "crashed", resume=True, **kw)
    assert resumed.global_step == straight.global_step == 4
    for (n, a), (_, b) in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.named_parameters()):
        assert torch.equal(a, b), f"{n} differs after resume"
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    steps = [json.loads(x)["step"] for x in training_lines(out / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]  # resumed at step 2, not from scratch
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir()} == before  # the step-2 save, whole
    assert not list(out.glob(".old-*"))
    assert not list(out.glob(".tmp-*"))  # the crashed save's folder (a whole checkpoint's size) is removed


def test_a_save_left_unfinished_is_removed_from_this_runs_folder_only(tmp_path):
    """A crash during a save leaves .tmp-checkpoint-N, as large as a checkpoint and never resumed from: resuming
    into this output_dir, or the next save of any step, removes it (it stayed until that same step was saved
    again). Another folder's (resume_from_checkpoint naming a checkpoint elsewhere) may be a running save: kept;
    and a save never removes its own folder in progress."""
    from groupwise.checkpoint import put_back_replaced

    mine, other = tmp_path / "mine", tmp_path / "other"
    for root in (mine, other):
        for name in (".tmp-checkpoint-3", ".tmp-checkpoint-5", "checkpoint-2"):
            (root / name).mkdir(parents=True)
            (root / name / "model.safetensors").write_bytes(b"x")
    put_back_replaced(other, ours=False)
    assert sorted(p.name for p in other.iterdir()) == [".tmp-checkpoint-3", ".tmp-checkpoint-5", "checkpoint-2"]
    put_back_replaced(mine, writing=mine / ".tmp-checkpoint-5")
    assert sorted(p.name for p in mine.iterdir()) == [".tmp-checkpoint-5", "checkpoint-2"]
    put_back_replaced(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoint-2"]


def test_a_crashed_replace_of_a_later_step_is_set_aside_when_an_earlier_checkpoint_resumes(tmp_path, tokenizer):
    """Killed while replacing checkpoint-4, then resumed from checkpoint-2 by name: .old-checkpoint-4 is put back
    and set aside with the abandoned branch (checkpoint-4.abandoned, whole); the resumed run's save of step 4 used to
    delete it as its own leftover."""
    from groupwise.checkpoint import verify_checkpoint

    out = tmp_path / "run"
    _run(tmp_path, tokenizer, "run", max_steps=4, save_steps=2)
    (out / "checkpoint-4").rename(out / ".old-checkpoint-4")
    with (pytest.warns(RuntimeWarning, match="checkpoint-4 put back from .old-checkpoint-4"),
          pytest.warns(UserWarning, match="set aside, not deleted: checkpoint-4.abandoned")):
        _run(tmp_path, tokenizer, "run", resume=str(out / "checkpoint-2"), max_steps=4, save_steps=2)
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2", "checkpoint-4",
                                                                 "checkpoint-4.abandoned"]
    verify_checkpoint(out / "checkpoint-4.abandoned")


@pytest.mark.parametrize("limit", [None, 0, -1])
def test_save_total_limit_of_0_or_less_is_no_limit_as_in_transformers(tmp_path, limit):
    """transformers' rotate_checkpoints does nothing for None or <= 0; -1 used to be refused by the config, and the
    rotation would have kept only the protected checkpoint."""
    from groupwise import GRPOConfig
    from groupwise.checkpoint import _rotate

    assert GRPOConfig(save_total_limit=limit).save_total_limit == limit
    for step in (1, 2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"run_id": "r"}))
    _rotate(tmp_path, limit, "r", keep={tmp_path / "checkpoint-3"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    _rotate(tmp_path, 1, "r", keep={tmp_path / "checkpoint-3"})  # while 1 keeps the protected one only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def test_a_set_aside_killed_between_its_renames_is_finished_before_a_resume_looks(tmp_path, monkeypatch):
    """Resuming run r at step 2 sets its checkpoints 3 and 4 aside. Killed after the first rename, checkpoint-4 was
    left under its name, and resume_from_checkpoint=True then picked the abandoned branch's end. The intent is
    written first; the next put_back_replaced (every resume and save calls it) finishes the renames. Another run's
    checkpoint-5 is left alone."""
    import json as json_
    import os

    from groupwise.checkpoint import SETTING_ASIDE, put_back_replaced, set_aside_later

    root = tmp_path / "out"
    for step, run in ((1, "r"), (2, "r"), (3, "r"), (4, "r"), (5, "other")):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text(json_.dumps({"run_id": run}))
    real, renamed = os.rename, []

    class Killed(BaseException):
        pass

    def rename(src, dst):
        if renamed:
            raise Killed
        renamed.append(src)
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr("pathlib.Path.rename", lambda self, target: rename(self, target))
    with pytest.raises(Killed):
        set_aside_later(root, 2, "r")
    monkeypatch.undo()
    assert (root / SETTING_ASIDE).exists() and (root / "checkpoint-4").exists()
    with pytest.warns(UserWarning, match="resumed at step 2: the later checkpoints .* set aside, not deleted: "
                                         "checkpoint-4.abandoned"):
        put_back_replaced(root)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3.abandoned",
                                                      "checkpoint-4.abandoned", "checkpoint-5"]


def test_a_resume_with_more_steps_follows_the_new_schedule_from_its_first_step(tmp_path, tokenizer):
    """Linear decay, checkpoint at step 2 of 4, resumed with max_steps=6: step 3 ran at the old schedule's rate
    (1e-2 · (4 − 2) / 4 = 5e-3) and only step 4 on at the new one's (transformers does the same); now step 3 runs at
    1e-2 · (6 − 2) / 6. A changed learning_rate has no effect on resume (the optimizer's state holds the base
    rate), as in transformers: now a warning says so."""
    from transformers import TrainerCallback

    rates = []

    class Rate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            rates.append(trainer.optimizer.param_groups[0]["lr"])

    def build(**kw):
        args = small_args(tmp_path, output_dir=str(tmp_path / "run"), lr_scheduler_type="linear", **kw)
        return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward], args=args,
                           train_dataset=toy.dataset(12), processing_class=tokenizer, callbacks=[Rate()])

    trainer = build(max_steps=4, save_steps=2)
    trainer.train()
    assert rates == pytest.approx([1e-2, 1e-2 * 3 / 4, 1e-2 * 2 / 4, 1e-2 * 1 / 4])
    rates.clear()
    trainer = build(max_steps=6)
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert rates == pytest.approx([1e-2 * 4 / 6, 1e-2 * 3 / 6, 1e-2 * 2 / 6, 1e-2 * 1 / 6])
    trainer = build(max_steps=6, learning_rate=0.5, weight_decay=0.1)
    with pytest.warns(UserWarning, match=r"resume: learning_rate=0.5 \(saved: 0.01\), weight_decay=0.1 \(saved: 0.0\) "
                                         r"differs from .*checkpoint-2, whose optimizer state and learning-rate "
                                         r"schedule resume as saved: the new value has no effect"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))


def test_eval_completions_of_a_resumed_run_equal_the_straight_runs(tmp_path, tokenizer):
    """eval_completions.jsonl: a run evaluated after every step dies in the evaluation of step 3 (its rows written),
    resumes from checkpoint-2: the lines after step 2 are dropped and replayed, so the file equals the straight
    run's (less the run id): steps 1-4, one line per eval prompt each."""
    from transformers import TrainerCallback

    class DiesAtStep3(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("the machine went away")

    def run(out, resume=None, callbacks=()):
        args = small_args(tmp_path, output_dir=str(tmp_path / out), max_steps=4, save_steps=2, eval_strategy="steps",
                          eval_steps=1)
        t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward], args=args,
                        train_dataset=toy.dataset(12), eval_dataset=toy.dataset(3, seed=1),
                        processing_class=tokenizer, callbacks=list(callbacks))
        t.train(resume_from_checkpoint=resume)

    def lines(out):
        return [{k: v for k, v in json.loads(x).items() if k != "run_id"}
                for x in (tmp_path / out / "eval_completions.jsonl").read_text().splitlines()]

    run("straight")
    with pytest.raises(RuntimeError, match="the machine went away"):
        run("crashed", callbacks=[DiesAtStep3()])
    assert [x["step"] for x in lines("crashed")] == [1] * 3 + [2] * 3 + [3] * 3  # step 3's rows, then the crash
    run("crashed", resume=str(tmp_path / "crashed" / "checkpoint-2"))
    assert [x["step"] for x in lines("straight")] == [s for s in (1, 2, 3, 4) for _ in range(3)]
    assert lines("crashed") == lines("straight")

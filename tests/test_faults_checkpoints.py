"""Fault injection around checkpoints: a previous run is never destroyed (output_dir, rotation, a checkpoint of the
same step), a save killed at any point leaves nothing resume accepts, and a damaged, mismatched or unfinished
checkpoint is refused naming the file or field (tests/test_faults.py has the other faults)."""

import json
import os
import signal
from pathlib import Path

import pytest

from groupwise import GRPOTrainer
from groupwise.checkpoint import CheckpointError, verify_checkpoint
from groupwise.cli import main
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines
from tests.faults_support import _config, _exit_and_first_line, _length, _run_script, _trainer


# ---- resumes that cannot continue exactly ----------------------------------------------------------------------------
def test_a_resume_that_cannot_continue_exactly_is_refused_by_name(tmp_path, tokenizer):
    _trainer(tmp_path, tokenizer, max_steps=2, save_steps=1, num_iterations=2).train()  # checkpoint-1: mid-round
    ckpt = str(tmp_path / "run" / "checkpoint-1")
    with pytest.raises(CheckpointError, match=r"resume: optim is .* but 'sgd' now; resume with the same value \(the "
                                              r"saved optimizer state is this optimizer's\)"):
        _trainer(tmp_path, tokenizer, max_steps=3, num_iterations=2, optim="sgd").train(resume_from_checkpoint=ckpt)
    with pytest.raises(CheckpointError, match=r"checkpoint-1 stopped inside a generation round built without "
                                              r"ref_logps \(beta changed since\)"):
        _trainer(tmp_path, tokenizer, max_steps=3, num_iterations=2, beta=0.1).train(resume_from_checkpoint=ckpt)
    import warnings

    def resume_on(dataset):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length],
                    args=small_args(tmp_path, output_dir=str(tmp_path / "run"), max_steps=3, num_iterations=2),
                    train_dataset=dataset, processing_class=tokenizer).train(resume_from_checkpoint=ckpt)

    with warnings.catch_warnings():  # refused at once: not first warned that "the run continues its prompt order"
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match="the checkpoint's train_dataset had 12 rows, this one has 16: "
                                                  "resume with the same dataset"):
            resume_on(toy.dataset(16))
    # the same rows as a stream: its cursor is not an epoch's order (it went back to the row of the epoch's position)
    from datasets import Dataset

    with pytest.raises(CheckpointError, match=r"checkpoint-1 was trained on a dataset of rows as train_dataset, this "
                                              r"run gives a stream: resume with the same kind"):
        resume_on(Dataset.from_list(toy.dataset(12)).to_iterable_dataset())
    from types import SimpleNamespace

    from groupwise.checkpoint_load import check_resume

    stream_state = {"global_step": 1, "world_size": 1, "data": None, "sampler": {"epoch": 0, "position": 4}}
    with pytest.raises(CheckpointError, match=r"ckpt was trained on a stream as train_dataset, this run gives a "
                                              r"dataset of rows"):  # the reverse: a stream's checkpoint on rows
        check_resume("ckpt", stream_state, SimpleNamespace(max_steps=3), world_size=1, max_steps=3, data="ab12",
                     rows=12)
    check_resume("ckpt", stream_state, SimpleNamespace(max_steps=3), world_size=1, max_steps=3, data=None)  # a stream
    # train(resume_from_checkpoint=False) starts a new run whatever the config says (it resumed before): refused here
    # because output_dir holds a run
    with pytest.raises(CheckpointError, match="already holds a run"):
        _trainer(tmp_path, tokenizer, max_steps=3, num_iterations=2, resume_from_checkpoint=ckpt).train(
            resume_from_checkpoint=False)


# ---- 5. never destroy a previous run ----------------------------------------------------------------------------------
def test_a_new_run_refuses_another_runs_output_dir(tmp_path, tokenizer, model_dir, capsys):
    _trainer(tmp_path, tokenizer, max_steps=1, save_steps=1).train()
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match=r"already holds a run \(checkpoint-1, completions.jsonl, metrics.jsonl\)"):
        _trainer(tmp_path, tokenizer, max_steps=1).train()
    cfg = _config(tmp_path, model_dir)
    code, line = _exit_and_first_line(capsys, ["train", cfg])
    assert code == 2 and "already holds a run" in line and "overwrite_output_dir=True" in line
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before  # untouched
    assert main(["train", cfg, "--overwrite_output_dir", "--max_steps", "1", "--save_steps", "0"]) == 0
    assert [json.loads(x)["step"] for x in training_lines(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_rotation_only_deletes_this_runs_checkpoints(tmp_path, tokenizer):
    _trainer(tmp_path, tokenizer, out="other", max_steps=1, save_steps=1).train()
    _trainer(tmp_path, tokenizer, max_steps=2, save_steps=1).train()
    os.rename(tmp_path / "other" / "checkpoint-1", tmp_path / "run" / "checkpoint-50")  # another run's, newer
    _trainer(tmp_path, tokenizer, max_steps=4, save_steps=1, save_total_limit=1).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-50"]


def test_a_resumed_run_never_writes_over_another_runs_checkpoint_of_the_same_step(tmp_path, tokenizer):
    """Another run's checkpoint-3 sits in this run's output_dir; resuming this run from its checkpoint-2 reaches step
    3 and must not replace it (it used to delete it and write its own): the save refuses, the folder is untouched."""
    _trainer(tmp_path, tokenizer, out="other", max_steps=3, save_steps=3).train()
    _trainer(tmp_path, tokenizer, max_steps=2, save_steps=2).train()
    os.rename(tmp_path / "other" / "checkpoint-3", tmp_path / "run" / "checkpoint-3")
    before = (tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_bytes()
    with pytest.raises(CheckpointError, match=r"checkpoint-3 belongs to another run \(run_id .*it is left as it is"):
        _trainer(tmp_path, tokenizer, max_steps=4, save_steps=1).train(
            resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert (tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_bytes() == before
    verify_checkpoint(tmp_path / "run" / "checkpoint-3")


def test_torn_metrics_line_is_skipped_on_resume_and_lines_carry_the_run_id(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, max_steps=2, save_steps=2)
    t.train()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "loss/pol')  # the crash came mid-write
    # lines 1-3: steps 1, 2 and the end-of-training line (at step 2)
    with pytest.warns(RuntimeWarning, match=r"line 4 is not valid JSON \(a crash mid-write\?\); dropped"):
        _trainer(tmp_path, tokenizer, max_steps=3).train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [(x["step"], "train_runtime" in x) for x in lines] == [(1, False), (2, False), (2, True), (3, False),
                                                                  (3, True)]
    assert {x["run_id"] for x in lines} == {t.run_id}


# ---- 6. faults during saves; corrupted or mismatched checkpoints ------------------------------------------------------
@pytest.fixture
def saved(tmp_path, tokenizer):
    """A run of 2 steps with a checkpoint inside its μ = 2 round (step 1) and one at its end (step 2)."""
    _trainer(tmp_path, tokenizer, max_steps=2, save_steps=1, num_iterations=2).train()
    return tmp_path / "run"


def _flip_a_bit_in_tensor_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + 5] ^= 0x10  # inside the first tensor, past the JSON header
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda c: _flip_a_bit_in_tensor_data(c / "model.safetensors"), "model.safetensors does not match its checksum"),
    (lambda c: (c / "optimizer.safetensors").write_bytes((c / "optimizer.safetensors").read_bytes()[:100]),
     "optimizer.safetensors does not match its checksum"),
    (lambda c: (c / "trainer_state.json").write_text((c / "trainer_state.json").read_text().replace('"global_step": 1',
                                                                                                   '"global_step": 0')),
     "trainer_state.json does not match its checksum"),
    (lambda c: (c / "rollout_0.safetensors").unlink(), "rollout_0.safetensors is missing"),
    (lambda c: (c / "checksums.json").unlink(), "has no checksums.json"),
])
def test_resume_refuses_a_damaged_checkpoint_naming_the_file(saved, tmp_path, tokenizer, model_dir, capsys, damage,
                                                              message):
    ckpt = saved / "checkpoint-1"
    assert (ckpt / "rollout_0.safetensors").exists()  # saved inside the round
    damage(ckpt)
    with pytest.raises(CheckpointError, match=message):
        _trainer(tmp_path, tokenizer, max_steps=2, num_iterations=2).train(resume_from_checkpoint=str(ckpt))
    code, line = _exit_and_first_line(capsys, ["train", _config(tmp_path, model_dir), "--num_iterations", "2",
                                               "--resume_from_checkpoint", str(ckpt)])
    assert code == 2 and message in line


def test_resume_refuses_a_model_the_weights_do_not_fit(saved, tmp_path, tokenizer):
    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), max_steps=4, num_iterations=2)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=48), [_length], args=args,
                    train_dataset=toy.dataset(12), processing_class=tokenizer)
    with pytest.raises(CheckpointError, match=r"checkpoint does not match the model \(size mismatch for"):
        t.train(resume_from_checkpoint=str(saved / "checkpoint-2"))


def test_resume_refuses_a_finished_or_differently_laid_out_run(saved, tmp_path, tokenizer):
    with pytest.raises(CheckpointError, match=r"checkpoint-2 is at step 2, which is not before max_steps=2: raise "
                                              r"max_steps to train further; it holds that run's trained model "
                                              r"\(from_pretrained\('.*checkpoint-2'\)"):
        _trainer(tmp_path, tokenizer, max_steps=2, num_iterations=2).train(
            resume_from_checkpoint=str(saved / "checkpoint-2"))
    with pytest.raises(CheckpointError, match=r"resume: num_generations is 4 in .* but 2 now"):
        _trainer(tmp_path, tokenizer, max_steps=4, num_iterations=2, num_generations=2).train(
            resume_from_checkpoint=str(saved / "checkpoint-2"))


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [1, 3, 6, "manifest"])
def test_a_kill_during_a_save_never_leaves_a_checkpoint_resume_accepts(tmp_path, kill_at):
    """The process is SIGKILLed at the kill_at-th file write of its first save (or while writing checksums.json):
    whatever is left on disk, no checkpoint-N folder that resume accepts exists, and a later run resumes from an
    earlier, complete checkpoint."""
    proc = _run_script(tmp_path, f"""
        import os, signal
        import groupwise.checkpoint as C
        import groupwise.checkpoint_files as F
        from groupwise import GRPOTrainer
        from groupwise.tasks import toy
        from tests.conftest import small_args
        from pathlib import Path
        writes = {{"n": 0}}
        def killing(real):
            def wrapped(*a, **k):
                out = real(*a, **k)
                writes["n"] += 1
                if writes["n"] == {kill_at!r}:
                    os.kill(os.getpid(), signal.SIGKILL)
                return out
            return wrapped
        for module in (C, F):  # every file a save writes: safetensors and JSON, from either module
            module.save_file, module.write_json = killing(module.save_file), killing(module.write_json)
        if {kill_at!r} == "manifest":
            C.sha256_of = lambda p: os.kill(os.getpid(), signal.SIGKILL)
        tok = toy.build_tokenizer()
        args = small_args(Path({str(tmp_path)!r}), max_steps=2, save_steps=1)
        GRPOTrainer(toy.build_model(tok, hidden_size=32), [lambda completions, **_: [float(len(c)) for c in completions]],
                    args=args, train_dataset=toy.dataset(8), processing_class=tok).train()
    """).wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    out = tmp_path / "out"
    for folder in out.glob("checkpoint-*"):
        verify_checkpoint(folder)  # anything under a checkpoint-N name is complete
    for folder in out.glob(".tmp-checkpoint-*"):
        with pytest.raises(CheckpointError):
            verify_checkpoint(folder)


# ---- checkpoints from earlier versions; other runs' metrics lines ----------------------------------------------------
def test_checkpoints_from_before_checksums_resume_with_a_warning(saved, tmp_path, tokenizer):
    ckpt = saved / "checkpoint-2"
    (ckpt / "checksums.json").unlink()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["run_id"]  # what earlier versions wrote
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.warns(RuntimeWarning, match="predates checksums"):
        _trainer(tmp_path, tokenizer, max_steps=3, num_iterations=2).train(resume_from_checkpoint=str(ckpt))


def test_resume_leaves_other_runs_metrics_lines_alone(saved, tmp_path, tokenizer):
    metrics = saved / "metrics.jsonl"
    foreign = json.dumps({"step": 7, "run_id": "someone-else", "loss": 1.0})
    metrics.write_text(metrics.read_text() + foreign + "\n")
    _trainer(tmp_path, tokenizer, max_steps=3, num_iterations=2).train(
        resume_from_checkpoint=str(saved / "checkpoint-2"))
    lines = metrics.read_text().splitlines()
    assert foreign in lines and [json.loads(x)["step"] for x in training_lines(metrics) if x != foreign] == [1, 2, 3]


def test_a_full_disk_is_one_line_naming_the_way_back(monkeypatch, capsys):
    """A save stopped by a full disk ended in a 49-line traceback; the checkpoint before it is intact (checkpoints
    are written aside and renamed), so the line says to free space and resume."""
    import errno

    from groupwise import cli

    def full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "run/.tmp-checkpoint-6/model.safetensors")

    monkeypatch.setattr(cli, "_main", full)
    monkeypatch.setattr("groupwise.distributed._FAILED", False)
    assert cli.main(["train", "config.yaml"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("groupwise: run stopped: [Errno 28] No space left on device")
    assert "resume with resume_from_checkpoint=True" in err and "last complete checkpoint-N is intact" in err

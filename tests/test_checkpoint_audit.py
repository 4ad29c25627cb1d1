"""resume_from_checkpoint=True picks the newest checkpoint it can resume from: a newer checkpoint-N folder that is
not a complete checkpoint (copied in part, files missing, written with save_only_model) is passed over, named; a
checkpoint a crashed save left as .old-checkpoint-N is put back first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from groupwise.checkpoint import (CheckpointError, _write_manifest, claim_output_dir, latest_checkpoint, publish,
                                 put_back_replaced, resume_folder, verify_checkpoint)
from groupwise.config_base import ConfigError
from tests.conftest import small_args


def _checkpoint(root: Path, step: int, *, manifest: bool = True, **state) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "run_id": "r", **state}))
    if manifest:
        _write_manifest(folder)
    return folder


def test_resume_true_passes_over_newer_folders_that_are_not_complete_checkpoints(tmp_path):
    good = _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 3, model_only=True)
    (_checkpoint(tmp_path, 4) / "model.safetensors").unlink()  # a partial copy
    _checkpoint(tmp_path, 5, manifest=False)
    (tmp_path / "checkpoint-6").mkdir()  # an empty folder
    with pytest.warns(RuntimeWarning, match=r"resuming from checkpoint-2; newer folders are not complete checkpoints: "
                                            r"checkpoint-6 \(no readable trainer_state.json\); checkpoint-5 \(no "
                                            r"checksums.json\); checkpoint-4 \(model.safetensors missing\); "
                                            r"checkpoint-3 \(saved with save_only_model=True\)"):
        assert resume_folder(True, tmp_path) == str(good)


def test_resume_true_with_no_complete_checkpoint_says_so(tmp_path):
    _checkpoint(tmp_path, 3, model_only=True)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in output_dir .* \(checkpoint-3 \(saved with "
                                              r"save_only_model=True\)\); start a new run"):
        latest_checkpoint(tmp_path)


def test_a_checkpoint_from_before_checksums_is_still_picked(tmp_path):
    old = _checkpoint(tmp_path, 7, manifest=False, run_id=None)  # earlier versions wrote neither
    assert latest_checkpoint(tmp_path) == str(old)


@pytest.mark.slow
def test_a_save_failing_on_one_process_stops_every_process_with_its_message(tmp_path):
    """Rank 1 cannot write its files: rank 0 used to wait in the save's barrier (until ddp_timeout, or until the
    dead peer's socket closed, with gloo's 'Connection closed by peer'); now both stop at once, rank 0 naming rank
    1's error. Nothing is left under a checkpoint-N name."""
    import time

    from tests.launcher import torchrun

    start = time.perf_counter()
    # grace=60: the launcher would stop the other process 60 s after the first failed; it must stop by itself
    proc = torchrun(Path(__file__).with_name("checkpoint_audit_worker.py"), tmp_path / "out", grace=60)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 50, (seconds, out[-3000:])
    assert "writing checkpoint-1 failed on another process: OSError: [Errno 28] No space left on device" in out
    assert not list((tmp_path / "out").glob("checkpoint-*"))


# ---- a save that replaces a step's checkpoint and dies between its two renames ----------------------------------
def _replaced(root: Path, step: int, **state) -> Path:
    """checkpoint-<step> as a crash between the renames of its replacement leaves it: .old-checkpoint-<step>."""
    return _checkpoint(root, step, **state).rename(root / f".old-checkpoint-{step}")


def test_a_checkpoint_a_crashed_replace_set_aside_is_put_back_and_resumed(tmp_path):
    _checkpoint(tmp_path, 2)
    _replaced(tmp_path, 3)
    with pytest.warns(RuntimeWarning, match=r"checkpoint-3 put back from .old-checkpoint-3 \(a save replacing it "
                                            r"was interrupted\)"):
        assert resume_folder(True, tmp_path) == str(tmp_path / "checkpoint-3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    verify_checkpoint(tmp_path / "checkpoint-3")
    with pytest.warns(RuntimeWarning, match="put back"):  # a resume from a named checkpoint puts it back too
        _replaced(tmp_path / "b", 3)
        _checkpoint(tmp_path / "b", 2)
        assert resume_folder(str(tmp_path / "b" / "checkpoint-2"), tmp_path / "b") == str(tmp_path / "b" /
                                                                                         "checkpoint-2")
    assert (tmp_path / "b" / "checkpoint-3").is_dir() and not (tmp_path / "b" / ".old-checkpoint-3").exists()


def test_the_leftover_of_a_replace_that_finished_is_deleted_unless_another_runs(tmp_path):
    _checkpoint(tmp_path, 3)
    _replaced(tmp_path / "x", 3).rename(tmp_path / ".old-checkpoint-3")  # the rename happened, the delete did not
    assert put_back_replaced(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "x"]
    _replaced(tmp_path / "y", 3, run_id="other").rename(tmp_path / ".old-checkpoint-3")
    put_back_replaced(tmp_path)
    assert (tmp_path / ".old-checkpoint-3").is_dir()  # not this run's: nothing of it is deleted


def test_the_rotation_counts_a_put_back_checkpoint_and_never_deletes_one_unrecovered(tmp_path):
    """checkpoint-4 was being replaced when the run died; the next save (step 5, save_total_limit=2) puts it back
    before rotating: checkpoints 4 and 5 are kept, 3 goes (it used to keep 3 and 5, and leave 4 out of sight)."""
    _checkpoint(tmp_path, 3)
    _replaced(tmp_path, 4)
    tmp = _checkpoint(tmp_path / "new", 5).rename(tmp_path / ".tmp-checkpoint-5")
    with pytest.warns(RuntimeWarning, match="checkpoint-4 put back"):
        publish(tmp, tmp_path / "checkpoint-5", tmp_path, 5, 2, "r")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "new") == ["checkpoint-4", "checkpoint-5"]
    verify_checkpoint(tmp_path / "checkpoint-4")


def test_a_new_run_counts_a_set_aside_checkpoint_as_the_previous_runs(tmp_path):
    _replaced(tmp_path, 3)
    with pytest.raises(CheckpointError, match=r"already holds a run \(.old-checkpoint-3\)"):
        claim_output_dir(tmp_path, overwrite=False)
    claim_output_dir(tmp_path, overwrite=True)
    assert not list(tmp_path.iterdir())


def test_overwrite_output_dir_deletes_the_previous_runs_final_model_too(tmp_path):
    """A LoRA run's adapter files left beside a new full run's weights made from_pretrained(output_dir) apply the
    old adapter to the new model (and a full model left beside a new adapter loaded as neither). A folder that
    holds no run (no checkpoint, no metrics) is a model or the user's folder: left as it is."""
    _checkpoint(tmp_path, 2)
    final = ["adapter_config.json", "adapter_model.safetensors", "model.safetensors", "config.json", "README.md",
             "model-00001-of-00002.safetensors", "model.safetensors.index.json", "trainer_state.json",
             "eval_results.json", "tokenizer.json", "chat_template.jinja", "special_tokens_map.json",
             "groupwise_prm.json"]  # an old chat template would load with a new tokenizer that has none
    kept = ["notes.txt", "data.jsonl"]
    for name in final + kept + ["metrics.jsonl"]:
        (tmp_path / name).write_text("{}")
    (tmp_path / "additional_chat_templates").mkdir()  # transformers loads every template there
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    claim_output_dir(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    # a run folder with no model at its top (say a project folder holding a run's metrics): its README stays; the
    # run's state and results go (save_metrics would merge the new run's into the old all_results.json)
    for name in ("metrics.jsonl", "README.md", "config.json", "all_results.json", "trainer_state.json",
                 "eval_completions.jsonl"):
        (tmp_path / name).write_text("{}")
    claim_output_dir(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["README.md", "config.json"])
    # `groupwise eval` before training (a baseline) leaves its results and completions: not a run, so a new run
    # may train there; overwrite_output_dir deletes them with a run's outputs (above)
    for name in ("eval_results.json", "eval_completions.jsonl"):
        (tmp_path / name).write_text("{}")
    claim_output_dir(tmp_path, overwrite=False)
    assert {"eval_results.json", "eval_completions.jsonl"} <= {p.name for p in tmp_path.iterdir()}
    for name in ("eval_results.json", "eval_completions.jsonl"):
        (tmp_path / name).unlink()
    for name in ("README.md", "config.json"):
        (tmp_path / name).unlink()
    # training in place (output_dir is the folder the policy was loaded from): its model stays
    for name in ("metrics.jsonl", "model.safetensors", "config.json"):
        (tmp_path / name).write_text("{}")
    claim_output_dir(tmp_path, overwrite=True, model_folder=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["config.json", "model.safetensors"])
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).unlink()
    (tmp_path / "metrics.jsonl").write_text("{}")  # a run that saved no checkpoint: nothing to resume
    with pytest.raises(CheckpointError, match=r"already holds a run \(metrics.jsonl\): choose another output_dir, "
                                              r"or set overwrite_output_dir=True"):
        claim_output_dir(tmp_path, overwrite=False)
    (tmp_path / "metrics.jsonl").unlink()
    model_folder = tmp_path / "model"
    model_folder.mkdir()
    for name in ("model.safetensors", "config.json"):
        (model_folder / name).write_text("{}")
    claim_output_dir(model_folder, overwrite=True)
    assert sorted(p.name for p in model_folder.iterdir()) == ["config.json", "model.safetensors"]


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, tokenizer, monkeypatch):
    """A folder under a file, or a place that refuses writes, failed when the trackers opened (after the data and the
    model), as a NotADirectoryError / PermissionError traceback, or as 'a file the run uses went missing' (/proc)."""
    from groupwise import GRPOTrainer
    from groupwise.checkpoint import check_writable
    from groupwise.tasks import toy

    (tmp_path / "notes.txt").write_text("x")
    loads = []
    monkeypatch.setattr("groupwise.trainer.load_policy", lambda *a, **k: loads.append(a))
    with pytest.raises(ConfigError, match=r"^output_dir='.*notes\.txt/run' lies under '.*notes\.txt', which is a "
                                          r"file, not a folder: choose another output_dir$"):
        GRPOTrainer("unused", [toy.letter_reward], args=small_args(tmp_path, output_dir=str(tmp_path / "notes.txt" /
                                                                                              "run")),
                    train_dataset=toy.dataset(8), processing_class=tokenizer)
    assert loads == []
    locked = tmp_path / "locked"
    locked.mkdir()
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryDirectory", refuse)  # root writes anywhere: the refusal simulated
    with pytest.raises(ConfigError, match=r"^output_dir='.*locked/out' cannot be written \(PermissionError in "
                                          r"'.*locked': Permission denied\): choose a writable folder$"):
        check_writable(locked / "out")
    monkeypatch.undo()
    check_writable(locked / "out" / "deeper")  # a writable parent: fine, and nothing is left behind
    assert list(locked.iterdir()) == []
    with pytest.raises(ConfigError, match=r"^output_dir='.*notes\.txt' is a file, not a folder"):
        check_writable(tmp_path / "notes.txt")
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # the probe would pass in its parent; makedirs would fail
    with pytest.raises(ConfigError, match=r"^output_dir='.*link/run': '.*link' is a symbolic link to a missing "
                                          r"target"):
        check_writable(tmp_path / "link" / "run")

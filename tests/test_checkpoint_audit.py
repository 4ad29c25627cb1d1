"""resume_from_checkpoint=True picks the newest checkpoint it can resume from: a newer checkpoint-N folder that is
not a complete checkpoint (copied in part, files missing, written with save_only_model) is passed over, named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from groupwise.checkpoint import CheckpointError, _write_manifest, latest_checkpoint, resume_folder


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
    import os
    import subprocess
    import sys
    import time

    root = Path(__file__).parents[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "tests" / "checkpoint_audit_worker.py"), str(tmp_path / "out")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 50, (seconds, out[-3000:])
    assert "writing checkpoint-1 failed on another process: OSError: [Errno 28] No space left on device" in out
    assert not list((tmp_path / "out").glob("checkpoint-*"))

"""Real multi-process runs with 2 (or 4) CPU processes (gloo): one launched by torch.distributed.run as users do, the
others forked from tests/launcher.py's server with torchrun's environment (the same runs without ~7 s of imports)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import training_lines
from tests.launcher import torchrun

WORKER = str(Path(__file__).with_name("dist_worker.py"))
ROOT = Path(__file__).parents[1]


def _launch(nproc: int, mode: str, out: Path, real_torchrun: bool = False) -> None:
    """dist_worker.py MODE OUT on `nproc` processes: forked from tests/launcher.py's preloaded server, or with
    `real_torchrun` as a user launches it (`python -m torch.distributed.run`, every process importing from scratch)."""
    if nproc == 1 and mode == "same":  # one process: in this one
        from tests import dist_worker

        out.mkdir(parents=True, exist_ok=True)
        return dist_worker.same(out)
    if real_torchrun:
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER,
               mode, str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    else:
        proc = torchrun(WORKER, mode, out, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_two_processes_give_the_same_advantages_loss_and_step_as_one(tmp_path):
    _launch(1, "same", tmp_path / "one")
    _launch(2, "same", tmp_path / "two")
    one = json.loads((tmp_path / "one" / "result_0.json").read_text())
    two = [json.loads((tmp_path / "two" / f"result_{r}.json").read_text()) for r in (0, 1)]
    # "process": supervision='both' with step rewards; "entropy": top_entropy_quantile=0.5; "fp16": dapo under fp16
    # (float16 autocast, the loss scaled on each process, the all-reduced gradient unscaled)
    for loss_type in ("dapo", "grpo", "process", "entropy", "fp16"):
        # group 1 is split over the two processes: rewards are gathered before the group statistics
        assert two[0][loss_type]["advantages"] == one[loss_type]["advantages"]
        assert two[0][loss_type]["local"] + two[1][loss_type]["local"] == one[loss_type]["local"]
        assert two[0][loss_type]["loss"] == pytest.approx(one[loss_type]["loss"], abs=1e-6)
        w1 = load_file(str(tmp_path / "one" / f"weights_{loss_type}.safetensors"))
        w2 = load_file(str(tmp_path / "two" / f"weights_{loss_type}.safetensors"))
        # fp16: each process's gradient is rounded to float16 before the all-reduce sums them (one process rounds the
        # full sum once): 6e-5 apart measured, within float16's precision of an update of ~0.1 (lr 1)
        atol = 2e-4 if loss_type == "fp16" else 1e-6
        for name in w1:
            assert torch.allclose(w1[name], w2[name], atol=atol), (loss_type, name)


@pytest.mark.slow
def test_two_process_training_run(tmp_path):
    _launch(2, "train", tmp_path, real_torchrun=True)  # the launch users type
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["world"] == 2 and results[0]["checksum"] == results[1]["checksum"]  # replicas stay in sync
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "rng_state_0.safetensors").exists() and (ckpt / "rng_state_1.safetensors").exists()
    assert len(training_lines(tmp_path / "metrics.jsonl")) == 2  # only the main process writes


@pytest.mark.slow
def test_each_process_samples_its_first_round_from_the_policy_it_trains(tmp_path):
    """A LoRA adapter is built on every process (its A matrices drawn from the process's seed); DDP gives every
    process rank 0's, but a generation_dtype replica copied before that kept process 1's own until step 1."""
    _launch(2, "replica", tmp_path)
    assert [json.loads((tmp_path / f"result_{r}.json").read_text())["same"] for r in (0, 1)] == [True, True]
    # then trainer.end() (TRL's scripts call it; it did not exist) destroyed the process group on both
    assert [json.loads((tmp_path / f"result_{r}.json").read_text())["group_left"] for r in (0, 1)] == [True, True]


@pytest.mark.slow
def test_subgroups_are_consecutive_processes(tmp_path):
    """vLLM's tensor-parallel groups (and TRL's): ranks [0, 2) and [2, 4) of 4 processes; each process gathers its
    group's objects in rank order."""
    _launch(4, "groups", tmp_path)
    assert [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(4)] == [[0, 1], [0, 1], [2, 3],
                                                                                             [2, 3]]


@pytest.mark.slow
def test_a_stop_asked_on_one_process_at_an_epoch_begin_and_a_main_only_save_model_end_together(tmp_path):
    """4 prompts, 2 per round: an epoch is 2 steps. The main process's callback asks to stop at the second epoch's
    on_epoch_begin: both run that epoch's first step, as transformers, and stop after step 3 (process 1 went on to
    step 4's collectives and waited there until ddp_timeout). save_model() on the main process alone returns (it
    waited in a barrier until ddp_timeout)."""
    _launch(2, "one_rank", tmp_path)
    assert [json.loads((tmp_path / f"result_{r}.json").read_text())["step"] for r in (0, 1)] == [3, 3]
    assert (tmp_path / "final" / "model.safetensors").exists()

"""Launches of tests/dist_worker.py's `run` mode on 2 CPU processes (gloo), for the FSDP2 tests.

A launch costs more than a short run (two processes setting up gloo and building a model on a small machine), so
runs that need not start in fresh processes share one launch (`runs`); a resumed run always gets its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.launcher import torchrun

WORKER = str(Path(__file__).with_name("dist_worker.py"))
# FSDP2 with a sharded reference that TR-DPO moves every step (its shards are in the checkpoint) and the KL term
TR_DPO = dict(max_steps=4, save_steps=2, fsdp="full_shard", beta=0.04, sync_ref_model=True, ref_model_sync_steps=1,
              ref_model_mixup_alpha=0.5)


VLLM_STANDIN = str(Path(__file__).with_name("vllm_standin"))


def launch(out: Path, spec, nproc: int = 2) -> subprocess.CompletedProcess:
    """dist_worker.py run OUT on `nproc` processes with RUN_SPEC `spec` (one run's dict, or a list of runs); the
    vLLM stand-in importable when a run sets use_vllm."""
    env = {"RUN_SPEC": json.dumps(spec)}
    if any(s.get("use_vllm") for s in (spec if isinstance(spec, list) else [spec])):
        env["PYTHONPATH"] = VLLM_STANDIN
    return torchrun(WORKER, "run", out, nproc=nproc, env=env, timeout=600)


def _check(proc: subprocess.CompletedProcess) -> None:
    """The launch succeeded; else its output, the first traceback first (the process that failed first: the other
    one's error, a broken connection, comes after it and would push it out of the tail)."""
    first = proc.stderr.find("Traceback")
    head = proc.stderr[first:first + 4000] + "\n[…]\n" if first >= 0 else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + head + proc.stderr[-5000:]


def run(out: Path, nproc: int = 2, **spec) -> None:
    """One run in fresh processes, which must succeed."""
    _check(launch(out, spec, nproc))


def runs(*specs: dict, nproc: int = 2) -> None:
    """Runs one after another in the same processes (2, or `nproc`), each in its spec's "out" folder; all must
    succeed."""
    _check(launch(Path(specs[0]["out"]), [{**s, "out": str(s["out"])} for s in specs], nproc))


def returned(out: Path) -> bool:
    """Both processes of a `runs` run in `out` came back from it."""
    return all((out / f"returned_{r}").exists() for r in (0, 1))


def tr_dpo_runs(base: Path) -> tuple[Path, Path]:
    """TR_DPO straight to step 4, and the same run dying right after its step-2 checkpoint was written: (straight,
    crashed) folders. Resuming the crashed run is the caller's, in fresh processes."""
    straight, crashed = base / "straight", base / "crashed"
    runs(dict(out=straight, **TR_DPO), dict(out=crashed, crash_after=2, **TR_DPO))
    return straight, crashed

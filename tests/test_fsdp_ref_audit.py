"""FSDP2 + TR-DPO (sync_ref_model) resumed from a checkpoint written before the reference model was sharded: such a
checkpoint holds one full ref_model.safetensors instead of ref_model_shard_<rank> files. It used to fail on load
(a full state dict loaded into DTensor parameters); each process now takes its shards of the full tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

WORKER = str(Path(__file__).with_name("dist_worker.py"))
ROOT = Path(__file__).parents[1]
KW = dict(max_steps=4, save_steps=2, fsdp="full_shard", beta=0.04, sync_ref_model=True, ref_model_sync_steps=1,
          ref_model_mixup_alpha=0.5)


def _run(out: Path, **spec) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "RUN_SPEC": json.dumps(spec),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, "run", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _as_unsharded_reference(ckpt: Path) -> None:
    """Rewrite a checkpoint the way groupwise wrote it before the reference was sharded: the two processes' dim-0
    shards of every tensor concatenated into one ref_model.safetensors (FSDP2's Shard(0) layout), checksums redone."""
    from groupwise.checkpoint import _write_manifest

    shards = [load_file(str(ckpt / f"ref_model_shard_{r}.safetensors")) for r in (0, 1)]
    full = {k: torch.cat([s[k] for s in shards]) if shards[0][k].dim() else shards[0][k] for k in shards[0]}
    save_file(full, str(ckpt / "ref_model.safetensors"))
    for r in (0, 1):
        (ckpt / f"ref_model_shard_{r}.safetensors").unlink()
    (ckpt / "checksums.json").unlink()
    _write_manifest(ckpt)


@pytest.mark.slow
def test_fsdp2_resumes_a_checkpoint_with_an_unsharded_reference_exactly(tmp_path):
    _run(tmp_path / "straight", **KW)
    _run(tmp_path / "old", crash_after=2, **KW)
    ckpt = tmp_path / "old" / "checkpoint-2"
    _as_unsharded_reference(ckpt)
    _run(tmp_path / "old", resume=str(ckpt), **KW)
    a, b = load_file(str(tmp_path / "straight" / "weights.safetensors")), load_file(str(tmp_path / "old" /
                                                                                        "weights.safetensors"))
    assert a.keys() == b.keys()
    for name in a:  # the reference is the straight run's: same KL term, same updates
        assert torch.equal(a[name], b[name]), name

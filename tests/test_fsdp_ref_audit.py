"""FSDP2 + TR-DPO (sync_ref_model) resumed from a checkpoint written before the reference model was sharded: such a
checkpoint holds one full ref_model.safetensors instead of ref_model_shard_<rank> files. It used to fail on load
(a full state dict loaded into DTensor parameters); each process now takes its shards of the full tensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fsdp_support import TR_DPO, run


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
def test_fsdp2_resumes_a_checkpoint_with_an_unsharded_reference_exactly(tmp_path, tr_dpo_fsdp_runs):
    """TR_DPO straight to step 4 against the same run crashed after its step-2 checkpoint (shared with
    test_fsdp.py's crash test), that checkpoint rewritten unsharded and resumed in fresh processes."""
    straight, crashed = tr_dpo_fsdp_runs
    shutil.copytree(crashed, tmp_path / "old")
    ckpt = tmp_path / "old" / "checkpoint-2"
    _as_unsharded_reference(ckpt)
    run(tmp_path / "old", resume=str(ckpt), **TR_DPO)
    a, b = load_file(str(straight / "weights.safetensors")), load_file(str(tmp_path / "old" / "weights.safetensors"))
    assert a.keys() == b.keys()
    for name in a:  # the reference is the straight run's: same KL term, same updates
        assert torch.equal(a[name], b[name]), name

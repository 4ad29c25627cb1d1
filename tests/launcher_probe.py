"""Run by tests/test_launcher.py under torch.distributed.run and under tests/launcher.py: writes OUT/probe_<rank>.json
with the launcher variables this process sees and the sum of every process's rank over gloo (env:// rendezvous)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":
    out = Path(sys.argv[1])
    seen = {k: v for k, v in os.environ.items()
            if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                     "TORCH_NCCL_ASYNC_ERROR_HANDLING") or k.startswith("TORCHELASTIC_")}
    total = None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        rank = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(rank)
        total = rank.item()
        dist.destroy_process_group()
    (out / f"probe_{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"env": seen, "sum": total}))

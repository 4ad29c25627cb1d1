"""Stand-in for vllm.distributed.weight_transfer.nccl_common (vLLM ≥ 0.28): the group that joins the trainer (rank 0)
and the server's workers (ranks rank_offset…) for weight transfer.

vLLM builds a StatelessProcessGroup (a TCP store hosted by rank 0 at master_address:master_port, outside
torch.distributed's global group) and a PyNcclCommunicator over it, whose `broadcast(tensor, src)` the packed
transfer calls. The stand-in keeps that rendezvous and that interface but carries a gloo group, so the weights travel
through real torch.distributed collectives on the CPU (threads of one process or separate processes alike).

    trainer_init(init_info) -> communicator                   (rank 0; what TRL's client calls)
    stateless_init_process_group(address, port, rank, world_size, device) -> communicator   (the worker end)
    communicator.broadcast(tensor, src), communicator.group.store / .socket (TRL's close_communicator clears them)
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# groupwise refuses to push weights from a CPU process over vLLM's NCCL engine; this transport runs on the CPU
CPU_WEIGHT_TRANSFER = True
TIMEOUT = datetime.timedelta(seconds=30)  # rendezvous and each collective: a peer that never comes fails, not hangs


@dataclass(frozen=True)
class NCCLWeightTransferInitInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


class StatelessProcessGroup:
    """vllm.distributed.utils.StatelessProcessGroup's fields: rank 0 hosts the store (its listening end is `socket`)."""

    def __init__(self, rank: int, world_size: int, store, socket=None):
        self.rank, self.world_size, self.store, self.socket = rank, world_size, store, socket

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int) -> StatelessProcessGroup:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
        return cls(rank, world_size, store, socket=store if rank == 0 else None)


class GlooCommunicator:
    """PyNcclCommunicator's interface (`group`, `broadcast`) over a gloo process group on the CPU."""

    def __init__(self, group: StatelessProcessGroup, device=None):
        self.group, self.device = group, torch.device("cpu")
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("weight_transfer", group.store), group.rank,
                                        group.world_size, TIMEOUT)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(f"stand-in weight transfer: tensors must be on the CPU, got {tensor.device}")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()


def stateless_init_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                                 device=None) -> GlooCommunicator:
    return GlooCommunicator(StatelessProcessGroup.create(master_address, master_port, rank, world_size), device)


def trainer_init(init_info: NCCLWeightTransferInitInfo | dict) -> GlooCommunicator:
    """The trainer's end: always rank 0 (vLLM's signature: a dict or the init-info dataclass)."""
    get = init_info.get if isinstance(init_info, dict) else lambda k: getattr(init_info, k)
    return stateless_init_process_group(get("master_address"), int(get("master_port")), 0, int(get("world_size")))

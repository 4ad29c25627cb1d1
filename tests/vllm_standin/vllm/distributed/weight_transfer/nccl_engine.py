"""Stand-in for vllm.distributed.weight_transfer.nccl_engine before vLLM 0.28: the trainer end as static methods
(`NCCLWeightTransferEngine.trainer_init(init_info)`, `.trainer_send_weights(iterator, trainer_args)`), with `packed`
chosen per update (vLLM 0.28 moved it to the init info). Same group and packing as nccl_common / packed_tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer import nccl_common
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

CPU_WEIGHT_TRANSFER = True


@dataclass
class NCCLTrainerSendWeightsArgs:
    group: Any
    src: int = 0
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    packed: bool = False


class NCCLWeightTransferEngine:
    @staticmethod
    def trainer_init(init_info) -> nccl_common.GlooCommunicator:
        return nccl_common.trainer_init(init_info)

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]],
                             trainer_args: NCCLTrainerSendWeightsArgs) -> None:
        post = trainer_args.post_iter_func or (lambda item: item[1])
        if trainer_args.packed:
            packed_nccl_broadcast_producer(iterator, trainer_args.group, trainer_args.src, post)
        else:  # one broadcast per tensor
            for item in iterator:
                trainer_args.group.broadcast(post(item).detach().contiguous(), src=trainer_args.src)

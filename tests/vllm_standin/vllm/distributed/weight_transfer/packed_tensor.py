"""Stand-in for vllm.distributed.weight_transfer.packed_tensor: the packed broadcast of the NCCL weight-transfer
engine, on the CPU (no CUDA streams, one buffer at a time).

The producer (trainer) walks (name, tensor) pairs, flattens each to bytes and concatenates them into a uint8 chunk,
closing the chunk once it holds more than `buffer_size_bytes`; each chunk is one `group.broadcast(chunk, src)`. The
consumer (each worker) walks the same (name, (shape, dtype)) metadata in the same order, so it knows every chunk's
size before it receives it, and unpacks it into tensors. Both ends must use the same buffer size."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024  # vLLM's default: both ends must agree


def unpack_tensor(packed_tensor: torch.Tensor, names: list[str], shapes: list[list[int]], dtypes: list[torch.dtype],
                  tensor_sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    parts = packed_tensor.split(tensor_sizes)
    return [(name, part.contiguous().view(dtype).view(*shape))
            for name, shape, dtype, part in zip(names, shapes, dtypes, parts)]


def packed_nccl_broadcast_producer(iterator: Iterator[tuple[str, torch.Tensor]], group: Any, src: int,
                                   post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
                                   buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                                   num_buffers: int = 2) -> None:
    chunk: list[torch.Tensor] = []
    size = 0
    for item in iterator:
        flat = post_iter_func(item).detach().contiguous().view(torch.uint8).view(-1)
        chunk.append(flat.cpu())
        size += flat.numel()
        if size > buffer_size_bytes:
            group.broadcast(torch.cat(chunk), src=src)
            chunk, size = [], 0
    if chunk:
        group.broadcast(torch.cat(chunk), src=src)


def packed_nccl_broadcast_consumer(iterator: Iterator[tuple[str, tuple[list[int], torch.dtype]]], group: Any,
                                   src: int, post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None],
                                   buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, num_buffers: int = 2,
                                   device: torch.device | str = "cpu") -> None:
    meta: list[tuple[str, list[int], torch.dtype, int]] = []
    size = 0

    def receive():
        packed = torch.empty(size, dtype=torch.uint8, device=device)
        group.broadcast(packed, src=src)
        names, shapes, dtypes, sizes = zip(*meta)
        post_unpack_func(unpack_tensor(packed, list(names), list(shapes), list(dtypes), list(sizes)))

    for name, (shape, dtype) in iterator:
        nbytes = math.prod(shape) * dtype.itemsize
        meta.append((name, list(shape), dtype, nbytes))
        size += nbytes
        if size > buffer_size_bytes:
            receive()
            meta, size = [], 0
    if meta:
        receive()

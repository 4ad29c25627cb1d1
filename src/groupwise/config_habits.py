"""transformers' TrainingArguments properties and helpers that TRL scripts and callbacks read from `args`
(`args.process_index`, `args.should_save`, `args.to_json_string()`, …), with transformers' meanings, for
GRPOConfig. The process layout is read from torch.distributed once it is initialised (the trainer initialises it),
else from the launcher's environment (WORLD_SIZE, RANK, LOCAL_RANK), as accelerate reads it."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class TrainingArgumentsHabits:
    @property
    def world_size(self) -> int:
        """The number of processes (transformers: accelerate's num_processes)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
        return _env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        """This process's rank among all processes."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return _env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def should_log(self) -> bool:
        """Does this process log? The main process, or each machine's with log_on_each_node (transformers)."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def should_save(self) -> bool:
        """Does this process write the checkpoint's shared files? The main process (groupwise has no
        save_on_each_node)."""
        return self.process_index == 0

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on CUDA (one per process, as under DDP), 0 on the CPU."""
        return 1 if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in (
            "1", "true", "yes") else 0

    @property
    def device(self) -> torch.device:
        """The device this process trains on: its local GPU, else the CPU."""
        return torch.device("cuda", self.local_process_index) if self.n_gpu else torch.device("cpu")

    @property
    def parallel_mode(self):
        """transformers' ParallelMode: DISTRIBUTED with several processes, else NOT_PARALLEL (one device per
        process: never NOT_DISTRIBUTED's several GPUs in one process)."""
        from transformers.training_args import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def ddp_timeout_delta(self):
        """ddp_timeout as a datetime.timedelta (transformers)."""
        import datetime

        return datetime.timedelta(seconds=self.ddp_timeout)

    @property
    def place_model_on_device(self) -> bool | None:
        """transformers 5: None (no integration decides it)."""
        return None

    @property
    def train_batch_size(self) -> int:
        """transformers: per_device_train_batch_size × max(1, n_gpu)."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """transformers: per_device_eval_batch_size × max(1, n_gpu)."""
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    def every(self, name: str, max_steps: int) -> int | None:
        """logging_steps / save_steps / eval_steps in optimizer steps: a fraction below 1 of max_steps, rounded up;
        None when unset (transformers' TrainerState.compute_steps then leaves the state's default, 500)."""
        value = getattr(self, name)
        if value is None:
            return None
        return math.ceil(max_steps * value) if 0 < value < 1 else int(value)

    def warmup(self, max_steps: int) -> int:
        """Warm-up steps of a run of max_steps: warmup_steps as transformers 5 reads it, else warmup_ratio."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        if self.warmup_steps > 0:
            return math.ceil(max_steps * self.warmup_steps)
        return math.ceil(self.warmup_ratio * max_steps)  # transformers 4's rounding

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warm-up steps of a run of num_training_steps (warmup_steps, or warmup_ratio of the run)."""
        return self.warmup(num_training_steps)

    def to_json_string(self) -> str:
        """to_dict() as indented JSON (the hub token hidden), as transformers writes a run's arguments."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """to_dict() with the batch sizes added and every value that is not a bool / int / float / str / tensor
        written as text (transformers' form for TensorBoard's hparams)."""
        values = {**self.to_dict(), "train_batch_size": self.train_batch_size,
                  "eval_batch_size": self.eval_batch_size}
        return {k: v if type(v) in (bool, int, float, str, torch.Tensor) else str(v) for k, v in values.items()}

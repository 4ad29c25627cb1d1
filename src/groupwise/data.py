"""Prompt datasets and the seeded, resumable order in which a run visits them."""

from __future__ import annotations

import math
from typing import Any

import torch


class PromptData:
    """A `datasets.Dataset` or a list of dicts with a `prompt` column; other columns reach reward functions."""

    def __init__(self, data: Any, name: str):
        if data is None:
            raise ValueError(f"{name} is required")
        columns = getattr(data, "column_names", None)
        if columns is None:
            if not isinstance(data, (list, tuple)) or not all(isinstance(r, dict) for r in data):
                raise TypeError(f"{name} must be a datasets.Dataset or a list of dicts, got {type(data).__name__}")
            missing = [i for i, r in enumerate(data) if "prompt" not in r]
            if missing:
                raise ValueError(f"{name} row {missing[0]} has no 'prompt' column (keys: {sorted(data[missing[0]])})")
        elif "prompt" not in columns:
            raise ValueError(f"{name} has no 'prompt' column (columns: {columns}); rename the column holding the "
                             "prompts to 'prompt'")
        if len(data) == 0:
            raise ValueError(f"{name} is empty")
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.data[int(i)])


class PromptSampler:
    """Hands out `per_round` prompt indices at a time, epoch after epoch, each epoch a seeded permutation.
    Its state (epoch, position) is all a checkpoint needs to continue the same order."""

    def __init__(self, size: int, per_round: int, *, shuffle: bool, seed: int):
        self.size, self.per_round, self.shuffle, self.seed = size, per_round, shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next_round(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.per_round:
            order = self._order(self.epoch)
            take = order[self.position:self.position + self.per_round - len(out)]
            out += take
            self.position += len(take)
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def rounds_per_epoch(self) -> int:
        return math.ceil(self.size / self.per_round)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

"""The seeded, resumable order in which a run visits its prompts: `per_round` of them for each generation round,
epoch after epoch (PromptSampler, over a PromptData), or as a stream hands them out (StreamSampler, over a
StreamData). A sampler's state_dict is all a checkpoint needs to continue the same order."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from groupwise.data import StreamData


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

    def end_epoch(self) -> bool:
        """End the epoch now (transformers' control.should_epoch_stop): the next round starts the next epoch's
        order. False when the epoch had just ended anyway."""
        if self.position == 0:
            return False
        self.epoch, self.position = self.epoch + 1, 0
        return True

    def progress(self) -> float:
        """Epochs done, fractional."""
        return self.epoch + self.position / self.size

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size", self.size) != self.size:  # (checkpoints before the size was saved: not checked)
            from groupwise.checkpoint import CheckpointError

            raise CheckpointError(f"resume: the checkpoint's train_dataset had {state['size']} rows, this one has "
                                  f"{self.size}: resume with the same dataset (the order of the prompts depends on it)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class StreamSampler:
    """The run's rows in order, `per_round` at a time; state: how many rows were handed out."""

    def __init__(self, data: StreamData, per_round: int):
        self.data, self.per_round, self.position = data, per_round, 0

    def next_round(self) -> list[int]:
        out = list(range(self.position, self.position + self.per_round))
        self.position += self.per_round
        self.data[out[-1]]  # every process reads the whole round, so all learn where the stream ends at once
        return out

    def end_epoch(self) -> bool:
        """A stream's epochs end where the stream does: a callback cannot end one early."""
        warnings.warn("control.should_epoch_stop has no effect on a streamed train_dataset (an IterableDataset): "
                      "its epochs end where the stream does", UserWarning, stacklevel=3)
        return False

    def progress(self) -> float:
        """Epochs done (fractional); unknown until the stream has ended once: 0."""
        return self.position / self.data.length if self.data.length else 0.0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
        self.data.seek(self.position)

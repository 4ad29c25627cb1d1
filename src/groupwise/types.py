"""Typed records passed between the stages of a GRPO step. Group structure is an explicit (B, G) axis.

Shape glossary: B prompts, G completions per prompt, N rows (completions on this process), P prompt tokens,
T completion tokens, F reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from groupwise.text import trim_to_mask


@dataclass(frozen=True)
class Completions:
    """What generation produced on this process: N rows, the rows of a group contiguous."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool: no EOS within max_completion_length
    prompts: list[Any]  # (N) the prompt as given: text or chat messages
    completions: list[Any]  # (N) decoded text, or [{"role": "assistant", "content": text}] for chat prompts
    columns: dict[str, list[Any]]  # reward-function kwargs, one value per row: the other dataset columns, and
    #                                `environments` (the rollouts' instances) with an environment_factory (TRL)
    sampling_logps: torch.Tensor | None = None  # (N, T) the sampler's log-probs (IS correction, off-policy mask)
    # multi-turn rollouts with tools (groupwise.agents); None without tools. completion_ids then interleave model
    # turns and tool tokens (model turn 1 + tool results + next assistant header + model turn 2 + …), completion_mask
    # covers all of them (attention), and the loss sees completion_mask * tool_mask (rollout.build_batch)
    tool_mask: torch.Tensor | None = None  # (N, T) 1 on model-generated tokens, 0 on tool / env tokens and padding
    turn_ends: list[list[int]] | None = None  # (N)[K_i] index in completion_ids of each model turn's last token
    tool_calls: torch.Tensor | None = None  # (N,) tool calls each rollout made
    tool_failures: torch.Tensor | None = None  # (N,) of which failed: exception, unknown tool, timeout
    tool_timeouts: torch.Tensor | None = None  # (N,) of which overran tool_timeout

    @property
    def lengths(self) -> torch.Tensor:  # (N,) generated tokens: tool / environment tokens are not counted (TRL)
        return self.loss_mask.sum(-1)

    @property
    def loss_mask(self) -> torch.Tensor:  # (N, T) the tokens the model generated: what the loss and its statistics see
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def token_lists(self) -> list[list[int]]:  # (N)[length] completion tokens, EOS included, no padding
        return trim_to_mask(self.completion_ids, self.completion_mask)


@dataclass(frozen=True)
class Scores:
    """Outcome rewards of the whole generation round (all processes), with the group axis explicit."""

    per_func: torch.Tensor  # (B, G, F) NaN = could not be scored
    rewards: torch.Tensor  # (B, G) combined over functions (groupwise.rewards.combine), NaN where nothing scored
    names: tuple[str, ...]  # (F) reward function names
    errors: torch.Tensor  # (F,) exceptions turned into NaN (on_reward_error="nan")


@dataclass(frozen=True)
class StepScores:
    """Step rewards of the whole generation round (process supervision), ragged per completion."""

    rewards: list[list[list[float]]]  # [B][G][K_i] combined step rewards, NaN = unscored
    ends: list[list[list[int]]]  # [B][G][K_i] token index where each step ends
    texts: list[list[str]]  # (N)[K_i] step texts of this process's rows
    names: tuple[str, ...]  # (F) process reward function names
    errors: torch.Tensor  # (F,)
    totals: torch.Tensor  # (F, 2) float64: each function's sum and count of the step rewards it gave (NaN left out)


@dataclass(frozen=True)
class Round:
    """One scored generation round on this process: its N rows, their advantages and what logging shows of them.
    `scores` / `step_scores` cover the whole round (all processes) and are None once rows of several rounds are
    mixed (dynamic sampling)."""

    completions: Completions
    advantages: torch.Tensor  # (N,) outcome, or (N, T) token-level
    rewards: torch.Tensor  # (N,) TRL's reward of each row: Σ_f w_f r_f of the raw values, NaN when nothing scored
    per_func: torch.Tensor | None  # (N, F) each outcome reward function's value, NaN = unscored
    steps: list[list[tuple[str, float]]] | None  # (N)[K_i] (step text, step reward), process supervision
    signal: torch.Tensor | None  # (N / G,) bool per local group: a learning signal? (dynamic sampling only)
    scores: Scores | None = None
    step_scores: StepScores | None = None

    def first_token_advantages(self) -> list[float]:  # (N) the whole completion's under outcome supervision
        return (self.advantages if self.advantages.dim() == 1 else self.advantages[:, 0]).tolist()


@dataclass(frozen=True)
class TrainBatch:
    """Everything the update needs for N rows; produced by the rollout, consumed by groupwise.update."""

    input_ids: torch.Tensor  # (N, P + T) prompt then completion
    attention_mask: torch.Tensor  # (N, P + T)
    completion_mask: torch.Tensor  # (N, T) tokens that enter the loss and its statistics: model-generated tokens
    #                                 (Completions.loss_mask: tool tokens 0), 0 for rows mask_truncated_completions drops
    advantages: torch.Tensor  # (N,) outcome, or (N, T) token-level (process supervision)
    old_logps: torch.Tensor | None = None  # (N, T) π_θold; None when fully on-policy (then logps.detach())
    ref_logps: torch.Tensor | None = None  # (N, T) π_ref; None when beta = 0
    is_weights: torch.Tensor | None = None  # (N, T) or (N, 1) importance weights for the sampler's numerics
    sampling_logps: torch.Tensor | None = None  # (N, T) the sampler's log-probs, for the off-policy mask (NaN: none)

    def rows(self, start: int, stop: int) -> "TrainBatch":
        return replace(self, **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[start:stop]
                                for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "TrainBatch":
        return cls(**tensors)


@dataclass(frozen=True)
class Rollout:
    """What one `groupwise.rollout.collect` call returns: the batch to train on, the round's metrics, and the rows
    behind the batch for logging (None for a round restored from a checkpoint)."""

    batch: TrainBatch
    metrics: dict[str, float]
    round: Round | None = None

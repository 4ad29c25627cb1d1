"""TRL's shaping rewards of `trl grpo` under the same names and protocol: `think_format_reward` (is the reasoning in
one <think>…</think> block at the start?) and `get_soft_overlong_punishment` (DAPO's length penalty near the
completion budget). Pure Python: no tokenizer, no model."""

from __future__ import annotations

import re
from typing import Any

from groupwise.rewards.math import _text

# TRL's pattern and flags, unchanged: "<think>" at the very start, no second "<think>" anywhere after it, then a
# "</think>"; anything may follow (even another "</think>")
THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when a completion (text, or TRL's conversational form: its first message's content) starts with
    "<think>", contains no other "<think>" and closes it with "</think>"; 0.0 otherwise (leading whitespace, a
    missing or nested tag). Never None."""
    return [1.0 if THINK_FORMAT.match(_text(c)) else 0.0 for c in completions]


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (the DAPO paper's Eq. 13, as TRL implements it) for a completion of
    |y| = len(completion_ids) tokens, with L = max_completion_len and C = soft_punish_cache:

        0                   if |y| <= L - C
        ((L - C) - |y|) / C if L - C < |y| <= L   (0 → -1 linearly inside the last C tokens)
        -1                  if |y| > L

    It only penalises; a short completion is never rewarded. C = 0 gives 0 up to L and -1 beyond. A class, not a
    closure, so it pickles; `__name__` is TRL's, so metrics are `rewards/soft_overlong_punishment_reward/…`."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __repr__(self) -> str:
        return (f"SoftOverlongPunishment(max_completion_len={self.max_completion_len}, "
                f"soft_punish_cache={self.soft_punish_cache})")

    def __call__(self, completion_ids: list[Any], **kwargs) -> list[float]:
        start = self.max_completion_len - self.soft_punish_cache  # L - C: the last length that goes unpunished
        rewards = []
        for ids in completion_ids:
            n = len(ids)
            if n <= start:
                rewards.append(0.0)
            elif n <= self.max_completion_len:
                rewards.append((start - n) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """TRL's factory: the reward function punishing completions longer than max_completion_len - soft_punish_cache
    tokens (SoftOverlongPunishment gives the formula). Not itself a reward function: call it first."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


# the instance `trl grpo --reward_funcs get_soft_overlong_punishment` uses (trl/scripts/grpo.py's fixed arguments)
trl_grpo_soft_overlong_punishment = get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)

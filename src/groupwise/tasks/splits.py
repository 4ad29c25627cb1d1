"""Train / held-out splits of the built-in generated tasks: a problem is held out when a hash of its text says so,
so no held-out problem is ever drawn for training, whatever the seed."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

HELD_OUT_PERCENT = 10


def is_held_out(problem: str) -> bool:
    """True for HELD_OUT_PERCENT % of problem texts (sha256 of the text, so fixed across runs and machines)."""
    return int(hashlib.sha256(problem.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def draw_problems(make_problem: Callable[[random.Random], str], n: int, *, split: str, seed: int,
                  stream: str) -> list[str]:
    """n distinct problems of the split ('train' or 'test') from make_problem(rng), rng seeded by
    f"{stream}{split}-{seed}" (so each task's stream of problems is its own)."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} is not 'train' or 'test'")
    rng = random.Random(f"{stream}{split}-{seed}")
    seen: set[str] = set()
    out = []
    while len(out) < n:
        p = make_problem(rng)
        if p in seen or is_held_out(p) != (split == "test"):
            continue
        seen.add(p)
        out.append(p)
    return out

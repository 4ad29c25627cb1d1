"""The entropy bonus's coefficient c in L − c·H̄: fixed (`entropy_coef`), or adapted (`use_adaptive_entropy`, the
adaptive entropy control of Skywork-OR1, TRL 1.16's rule).

Adapted, with H the mean token entropy of the last optimizer step (over every process's tokens the policy term acts
on; H = ∞ before the first step), target H*, step δ and bounds [c_min, c_max]:

    applied coefficient       c  if H ≤ H*  else 0         (the bonus acts only once entropy has fallen to the target)
    after each step           c ← min(c + δ, c_max)  if H ≤ H*  else  max(c − δ, c_min)

so c grows while entropy stays collapsed and decays once it recovers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class EntropyControl:
    coef: float  # c: the bonus's coefficient now (the initial entropy_coef, then adapted)
    adaptive: bool = False
    target: float = 0.2  # H*, nats per token
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005
    last_entropy: float = math.inf  # H of the last optimizer step

    @classmethod
    def from_config(cls, args) -> EntropyControl:
        return cls(args.entropy_coef, args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_min,
                   args.entropy_coef_max, args.entropy_coef_delta)

    @property
    def enabled(self) -> bool:
        """Does the loss carry the bonus term at all? Always when adaptive: c may grow back from 0."""
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient of this optimizer step's bonus (fixed for every micro-batch of the step)."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropy: float) -> None:
        """After an optimizer step: H of that step (all processes) moves c by one step (adaptive only)."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON: an infinite or NaN entropy is written as None)."""
        finite = math.isfinite(self.last_entropy)
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy if finite else None}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["entropy_coef"])
        last = state["last_world_entropy"]
        self.last_entropy = math.inf if last is None else float(last)

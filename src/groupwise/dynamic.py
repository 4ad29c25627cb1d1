"""Dynamic sampling (DAPO, Yu et al. 2025): groups whose rewards have no spread carry no learning signal (their
advantages are all 0); `refill` drops them and samples further rounds until every process has as many groups with a
signal as it started with. It needs whole groups on each process (GRPOConfig checks the layout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from groupwise.core.advantages import step_spread
from groupwise.core.supervision import SUPERVISIONS
from groupwise.rollout_metrics import spread
from groupwise.types import Completions, Round, Scores, StepScores

if TYPE_CHECKING:
    from groupwise.rollout import RolloutContext


def group_signal(ctx: RolloutContext, scores: Scores | None, step_scores: StepScores | None) -> torch.Tensor:
    """(B,) bool over the round: does the group carry a learning signal? A group whose rewards have no spread —
    in what the supervision variant reads: outcome rewards, step rewards (as the step_advantage form compares them:
    step_return, the returns at each step index), or either — gets advantage 0."""
    variant = SUPERVISIONS[ctx.args.supervision]
    signal = torch.zeros(len(scores.rewards) if scores is not None else len(step_scores.rewards), dtype=torch.bool)
    if variant.outcome and scores is not None:
        signal |= spread(scores.rewards.unsqueeze(-1)) > 1e-6
    if variant.process and step_scores is not None:
        signal |= step_spread(step_scores.rewards, ctx.args.step_advantage) > 1e-6
    return signal


def refill(ctx: RolloutContext, first: Round, sample: Callable[[], Round]) -> tuple[Round, dict[str, float]]:
    """Keep the groups with a learning signal, sample further rounds (`sample()`, at most
    max_dynamic_sampling_rounds) until this process has as many as it started with, then fill any gap with dropped
    groups. Every process loops until all are full, so collectives stay matched."""
    G, dist = ctx.args.num_generations, ctx.dist
    need = first.completions.completion_ids.size(0) // G
    rounds, kept, spare = [first], [], []
    dropped = int(dist.sum(torch.tensor(float((~first.signal).sum()), device=dist.device)))
    extra = 0
    while True:
        r, rnd = len(rounds) - 1, rounds[-1]
        kept += [(r, g) for g in range(need) if rnd.signal[g]]
        spare += [(r, g) for g in range(need) if not rnd.signal[g]]
        if extra >= ctx.args.max_dynamic_sampling_rounds or not dist.any(len(kept) < need):
            break
        rounds.append(sample())
        extra += 1
    unfilled = max(0, need - len(kept))
    chosen = select_groups(rounds, kept[:need] + spare[:unfilled], G, ctx.tokenizer.pad_token_id)
    return chosen, {"dynamic/dropped_groups": float(dropped), "dynamic/extra_rounds": float(extra),
                    "dynamic/unfilled_groups": float(dist.sum(torch.tensor(float(unfilled), device=dist.device)))}


def select_groups(rounds: list[Round], picks: list[tuple[int, int]], G: int, pad_id: int) -> Round:
    """The rows of the picked (round, local group) pairs as one Round, re-padded (prompts left, completions right)."""
    rows = [(r, g * G + k) for r, g in picks for k in range(G)]
    comps = [rnd.completions for rnd in rounds]
    P = max(comps[r].prompt_ids.size(1) for r, _ in rows)
    T = max(comps[r].completion_ids.size(1) for r, _ in rows)

    def pad(t, width, left, value=0):
        return torch.nn.functional.pad(t, (width - t.size(-1), 0) if left else (0, width - t.size(-1)), value=value)

    def stack(get, width=None, left=False, value=0):
        return torch.stack([get(r, i) if width is None else pad(get(r, i), width, left, value) for r, i in rows])

    def optional(name, width=None):  # a per-row tensor field that may be None (the same in every round)
        if getattr(comps[0], name) is None:
            return None
        return stack(lambda r, i: getattr(comps[r], name)[i], width, False)

    comp = Completions(
        stack(lambda r, i: comps[r].prompt_ids[i], P, True, pad_id), stack(lambda r, i: comps[r].prompt_mask[i], P, True),
        stack(lambda r, i: comps[r].completion_ids[i], T, False, pad_id),
        stack(lambda r, i: comps[r].completion_mask[i], T, False), stack(lambda r, i: comps[r].truncated[i]),
        [comps[r].prompts[i] for r, i in rows], [comps[r].completions[i] for r, i in rows],
        {k: [comps[r].columns[k][i] for r, i in rows] for k in comps[0].columns},
        optional("sampling_logps", T), optional("tool_mask", T),
        None if comps[0].turn_ends is None else [comps[r].turn_ends[i] for r, i in rows],
        optional("tool_calls"), optional("tool_failures"), optional("tool_timeouts"))
    token_level = rounds[0].advantages.dim() == 2
    adv = stack(lambda r, i: rounds[r].advantages[i], T if token_level else None)
    steps = None if rounds[0].steps is None else [rounds[r].steps[i] for r, i in rows]
    per_func = None if rounds[0].per_func is None else stack(lambda r, i: rounds[r].per_func[i])
    return Round(comp, adv, stack(lambda r, i: rounds[r].rewards[i]), per_func, steps,
                 torch.stack([rounds[r].signal[g] for r, g in picks]))

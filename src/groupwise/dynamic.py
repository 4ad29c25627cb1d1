"""Dynamic sampling (DAPO, Yu et al. 2025): groups whose rewards have no spread carry no learning signal (their
advantages are all 0); `refill` drops them and samples further rounds until every process has as many groups with a
signal as it started with. It needs whole groups on each process (GRPOConfig checks the layout)."""

from __future__ import annotations

import warnings
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
    step_return, the returns at each step index), or either with a nonzero weight (supervision='both': a term
    weighted 0 adds nothing to the advantages) — gets advantage 0."""
    args = ctx.args
    variant = SUPERVISIONS[args.supervision]
    both = variant.outcome and variant.process
    signal = torch.zeros(len(scores.rewards) if scores is not None else len(step_scores.rewards), dtype=torch.bool)
    if variant.outcome and scores is not None and not (both and args.outcome_advantage_weight == 0):
        signal |= spread(scores.rewards.unsqueeze(-1)) > 1e-6
    if variant.process and step_scores is not None and not (both and args.process_advantage_weight == 0):
        signal |= step_spread(step_scores.rewards, args.step_advantage, args.advantage_estimator) > 1e-6
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
    total = float(dist.sum(torch.tensor(float(unfilled), device=dist.device)))
    if total and dist.is_main:  # once per run (warnings' default filter): the metric counts every batch
        warnings.warn("dynamic sampling: groups without a learning signal were left in the batch after "
                      "max_dynamic_sampling_rounds extra rounds (dynamic/unfilled_groups counts them): raise "
                      "max_dynamic_sampling_rounds, or check that the rewards can differ within a group",
                      UserWarning, stacklevel=2)
    return chosen, {"dynamic/dropped_groups": float(dropped), "dynamic/extra_rounds": float(extra),
                    "dynamic/unfilled_groups": total}


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

    def optional(name, width=None, fill=None):  # a per-row field that may be None; a rollout_func may return
        # log-probs or env_mask in some rounds only: `fill(c, i)` stands in for a row whose round lacks it
        if all(getattr(comps[r], name) is None for r, _ in rows):
            return None

        def get(r, i):
            field = getattr(comps[r], name)
            return fill(comps[r], i) if field is None else field[i]
        return get if width is False else stack(get, width, False)

    def unknown(c, i):  # no log-probs from the sampler: NaN on the row's tokens (no correction, no KL evidence)
        return torch.where(c.completion_mask[i].bool(), float("nan"), 0.0)

    def one_turn(c, i):  # no env_mask: the whole completion is one assistant turn
        n = int(c.completion_mask[i].sum())
        return [n - 1] if n else []

    turn_ends = optional("turn_ends", False, one_turn)
    comp = Completions(
        stack(lambda r, i: comps[r].prompt_ids[i], P, True, pad_id), stack(lambda r, i: comps[r].prompt_mask[i], P, True),
        stack(lambda r, i: comps[r].completion_ids[i], T, False, pad_id),
        stack(lambda r, i: comps[r].completion_mask[i], T, False), stack(lambda r, i: comps[r].truncated[i]),
        [comps[r].prompts[i] for r, i in rows], [comps[r].completions[i] for r, i in rows],
        {k: [comps[r].columns[k][i] for r, i in rows] for k in comps[0].columns
         if all(k in comps[r].columns for r, _ in rows)},  # a rollout_func's keys may differ between rounds
        optional("sampling_logps", T, unknown),
        optional("tool_mask", T, lambda c, i: c.completion_mask[i]),  # no env_mask: every token is the model's
        None if turn_ends is None else [turn_ends(r, i) for r, i in rows],
        optional("tool_calls"), optional("tool_failures"), optional("tool_timeouts"))
    token_level = rounds[0].advantages.dim() == 2
    adv = stack(lambda r, i: rounds[r].advantages[i], T if token_level else None)
    steps = None if rounds[0].steps is None else [rounds[r].steps[i] for r, i in rows]
    per_func = None if rounds[0].per_func is None else stack(lambda r, i: rounds[r].per_func[i])
    return Round(comp, adv, stack(lambda r, i: rounds[r].rewards[i]), per_func, steps,
                 torch.stack([rounds[r].signal[g] for r, g in picks]))

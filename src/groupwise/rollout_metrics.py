"""The rollout's metrics, under TRL's names and meanings (`round_metrics`, `sampling_metrics`) and the statistics
they share with the advantages' bookkeeping and evaluation (`trl_reward`, `nanstd`, `zero_std_fraction`, `spread`).
Values are over every process: each process contributes its own rows."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from groupwise.core.advantages import masked_mean_std, pack_steps, step_spread
from groupwise.rewards.combine import reward_weights, weighted_nansum
from groupwise.rewards.steps import SPLIT_MODES
from groupwise.types import Completions, Round, Scores, StepScores

if TYPE_CHECKING:
    from groupwise.rollout import RolloutContext


def trl_reward(ctx: RolloutContext, scores: Scores) -> torch.Tensor:  # (B, G)
    """TRL's `reward`: the weighted sum of the functions' values, whatever multi_objective_aggregation feeds the
    advantages (with normalize_then_sum, scores.rewards is the sum of z-scores, whose mean is 0 by construction)."""
    per_func = scores.per_func
    return weighted_nansum(per_func, reward_weights(ctx.args.reward_weights, per_func.size(-1)).to(per_func.dtype))


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* of (N,) completion lengths in generated tokens and (N,) bool truncated (cut at
    max_completion_length): the terminated ones end with EOS (their statistics 0 when none does)."""
    terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max())}


# their names (what evaluation reports besides the reward metrics: groupwise.best)
LENGTH_METRICS = tuple(length_metrics(torch.ones(1), torch.zeros(1, dtype=torch.bool)))


# ---- a round --------------------------------------------------------------------------------------------------------
def round_metrics(ctx: RolloutContext, rnd: Round) -> dict[str, float]:
    """TRL's names and meanings: completions/* (lengths in generated tokens, over all processes; the terminated
    ones end with EOS, 0 when none does), reward / reward_std (of Σ_f w_f r_f, whatever the
    multi_objective_aggregation) / rewards/<f>/mean|std (std with Bessel's correction, NaN left out),
    frac_reward_zero_std (zero_std_fraction), tools/*; and num_tokens, the round's
    prompt + completion tokens (the trainer makes it the running total TRL logs).
    groupwise's own: rewards/<f>/errors, process/*, tools/timeout_frequency."""
    dist, comp, scores = ctx.dist, rnd.completions, rnd.scores
    lengths = dist.gather(comp.lengths.float().to(dist.device)).cpu()
    truncated = dist.gather(comp.truncated.float().to(dist.device)).cpu().bool()
    m: dict[str, float] = {
        "num_tokens": float(dist.sum((comp.prompt_mask.sum() + comp.lengths.sum()).float().to(dist.device))),
        **length_metrics(lengths, truncated)}
    if rnd.step_scores is not None:
        m.update(process_metrics(rnd.step_scores, ctx.args.step_advantage, ctx.args.advantage_estimator,
                                 split_description(ctx.args)))
    if ctx.agent is not None and ctx.agent.toolbox.has_tools:
        m.update(tool_metrics(ctx, comp))
    if scores is None:
        return m
    reward = trl_reward(ctx, scores)
    m["reward"] = float(torch.nanmean(reward))
    m["reward_std"] = nanstd(reward)
    m["frac_reward_zero_std"] = zero_std_fraction(ctx, scores.rewards)
    for f, name in enumerate(scores.names):
        col = scores.per_func[..., f]
        m[f"rewards/{name}/mean"] = float(torch.nanmean(col)) if (~torch.isnan(col)).any() else float("nan")
        m[f"rewards/{name}/std"] = nanstd(col)
        m[f"rewards/{name}/errors"] = float(scores.errors[f])
    return m


def split_description(args) -> str:
    """How a step ends in this run, for messages: the step_split option it reads and its value."""
    field = SPLIT_MODES[args.step_split].reads
    return f"{field}={getattr(args, field)!r}" if field else "step_split='turn': each assistant turn"


def process_metrics(s: StepScores, form: str = "suffix_sum",  # GRPOConfig.step_advantage
                    estimator: str = "grpo",  # GRPOConfig.advantage_estimator
                    split: str = "the step marker") -> dict[str, float]:  # how steps end (split_description)
    per_completion = [row for group in s.rewards for row in group]
    if per_completion and not any(per_completion):  # the whole round (every process's) or evaluation: say so, once
        warnings.warn(f"no completion of this round or evaluation has a step to score ({split}), so step rewards "
                      "give no signal: check that completions end their steps so, or raise max_completion_length "
                      "(a step it cuts is left out unless score_truncated_step)", RuntimeWarning, stacklevel=2)
    elif per_completion and all(len(row) <= 1 for row in per_completion):  # e.g. a marker the policy never writes
        warnings.warn(f"every completion of this round or evaluation is one step at most ({split}): the step rewards "
                      "then score whole completions, as an outcome reward would; check that completions end their "
                      "steps so (with step_split='turn': that the policy calls tools), or raise "
                      "max_completion_length (a cut last step is left out unless score_truncated_step)",
                      RuntimeWarning, stacklevel=2)
    packed = pack_steps(s.rewards)  # (B, G, K)
    m = {"process/step_reward_mean": float(torch.nanmean(packed)) if packed.numel() else float("nan"),
         "process/steps_per_completion": sum(len(r) for r in per_completion) / len(per_completion),
         "process/no_step_completions": float(sum(1 for r in per_completion if not r)),
         # steps whose reward is None/NaN (a step function's error with on_reward_error='nan', a PRM cut): a count
         "process/unscored_steps": float(sum(1 for r in per_completion for v in r if v is None or v != v)),
         # a group where what the step_advantage form compares has no spread carries no signal (advantages all 0)
         "process/zero_std_groups": float((~(step_spread(s.rewards, form, estimator) > 1e-6)).sum())}
    for f, name in enumerate(s.names):  # each function's own step rewards (a step it left unscored left out)
        total, count = s.totals[f].tolist()
        m[f"process/{name}/mean"] = total / count if count else float("nan")
        m[f"process/{name}/errors"] = float(s.errors[f])
    return m


def tool_metrics(ctx: RolloutContext, comp: Completions) -> dict[str, float]:
    """TRL's tools/call_frequency (tool calls per rollout) and tools/failure_frequency (failed calls per call, 0
    without calls), and groupwise's tools/timeout_frequency (calls that overran tool_timeout, per call): summed over
    processes."""
    local = [comp.tool_calls.sum(), comp.tool_failures.sum(), comp.tool_timeouts.sum(), len(comp.tool_calls)]
    calls, failures, timeouts, rollouts = ctx.dist.sum(torch.tensor(local, dtype=torch.float,
                                                                     device=ctx.dist.device)).tolist()
    return {"tools/call_frequency": calls / rollouts, "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/timeout_frequency": timeouts / calls if calls else 0.0}


def spread(values: torch.Tensor) -> torch.Tensor:  # (B, G, K) with NaN → (B,) population std of each group
    values = values.double()  # large finite rewards must not overflow the squares
    return masked_mean_std(values, ~torch.isnan(values), (1, 2))[1].view(-1)


def zero_std_fraction(ctx: RolloutContext, rewards: torch.Tensor) -> float:  # (B, G) combined, NaN unscored
    """TRL's frac_reward_zero_std: the share of completions whose reward std (the one the advantages divide by) is 0:
    their group's, or the whole batch's when the scale is "batch" (then 0 or 1). A std of fewer than 2 scored
    rewards is NaN in TRL, never 0."""
    batch = ctx.args.estimator_options(outcome=True).get("scale") == "batch"
    sets = rewards.reshape(1, -1) if batch else rewards.reshape(rewards.size(0), -1)  # (sets, n)
    zero = (spread(sets.unsqueeze(-1)) < 1e-6) & ((~torch.isnan(sets)).sum(-1) >= 2)
    return float(zero.float().mean())


def nanstd(values: torch.Tensor) -> float:  # std of the non-NaN values, Bessel-corrected (TRL's nanstd); NaN for
    values = values.double()                 # fewer than 2 (TRL: 0 · 1/0)
    valid = ~torch.isnan(values)
    return float(masked_mean_std(values, valid, tuple(range(values.dim())), std="unbiased")[1]) \
        if valid.sum() > 1 else float("nan")


def sampling_metrics(ctx: RolloutContext, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """TRL's sampling/* metrics over all processes: min of minima, max of maxima, mean of the rest."""
    keys = sorted(stats)
    every = ctx.dist.gather(torch.stack([stats[k].float() for k in keys]).unsqueeze(0).to(ctx.dist.device)).cpu()
    out = {}
    for j, k in enumerate(keys):
        column = every[:, j]
        out[f"sampling/{k}"] = float(column.min() if k.endswith("/min") else column.max() if k.endswith("/max")
                                     else column.mean())
    return out

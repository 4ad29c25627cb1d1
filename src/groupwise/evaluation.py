"""Evaluation during or after training (trainer.evaluate()): every eval prompt completed greedily, or k sampled
completions per prompt (num_generations_eval), scored by the run's reward functions."""

from __future__ import annotations

from collections import defaultdict

import torch

from groupwise import rollout as R
from groupwise.checkpoint import rng_untouched
from groupwise.logging import window_mean
from groupwise.rewards import compute_rewards
from groupwise.rewards.combine import weighted_nansum
from groupwise.rollout import RolloutContext


@torch.no_grad()
def evaluate(ctx: RolloutContext, model, data, reward_sources: list, state) -> dict[str, float]:
    """Complete every eval prompt and score it: greedily, one completion per prompt (num_generations_eval None),
    or k sampled completions per prompt at the training temperature (num_generations_eval = k). Returns TRL's
    names, which the trainer prefixes with metric_key_prefix ("eval_"): reward (weighted), rewards/<func>/mean
    (over all completions), completions/mean_length, the names reward functions log with log_metric, and, with
    k samples, rewards/<func>/mean@k and rewards/<func>/pass@k (the mean over prompts of the best of k: for 0/1
    rewards, the share of prompts solved at least once)."""
    dist, args = ctx.dist, ctx.args
    k = args.num_generations_eval or 1
    mine = list(range(dist.rank, len(data), dist.world_size))
    bs = args.per_device_eval_batch_size
    logged: dict[str, list[float]] = defaultdict(list)  # log_metric calls of the evaluation's reward calls
    kwargs = {"trainer_state": state, "log_metric": lambda name, value: logged[name].append(float(value)),
              "log_extra": lambda column, values: None}  # evaluation writes no completions.jsonl rows

    def local():  # this process's share; no collective inside, so it runs under run_together
        per_func, lengths = [], []
        for start in range(0, len(mine), bs):
            rows = [data[i] for i in mine[start:start + bs] for _ in range(k)]
            comp = R.generate(ctx, model, rows, greedy=args.num_generations_eval is None,
                              evaluation=True)
            rewards, _ = compute_rewards(reward_sources, comp.prompts, comp.completions, comp.token_lists(),
                                         comp.columns, on_error=args.on_reward_error,
                                         timeout=args.reward_timeout, extra=kwargs)
            per_func += rewards.tolist()
            lengths += comp.lengths.tolist()
        return per_func, lengths

    with rng_untouched():  # sampled evaluation must not move the training's random streams (exact resume)
        per_func, lengths = dist.run_together(local, "evaluation")
    lengths = torch.tensor(dist.gather_object(lengths), dtype=torch.float)
    out = {"completions/mean_length": float(lengths.mean())}
    out.update({name: window_mean(values, "measured") for name, values in logged.items()})  # this process's
    if not reward_sources:
        return out
    per_func = torch.tensor(dist.gather_object(per_func), dtype=torch.float).view(-1, len(reward_sources))
    # combined as in training: a row no function scored is left out, not counted as 0
    out["reward"] = float(torch.nanmean(weighted_nansum(per_func, ctx.reward_weights)))
    by_prompt = per_func.view(-1, k, len(reward_sources))  # (prompts, k, F)
    for f, src in enumerate(reward_sources):
        out[f"rewards/{src.name}/mean"] = float(torch.nanmean(per_func[:, f]))  # e.g. eval_rewards/accuracy/mean
        if args.num_generations_eval is not None:
            scores = by_prompt[:, :, f]
            best = torch.where(scores.isnan(), float("-inf"), scores).amax(1)  # unscored samples do not count
            out[f"rewards/{src.name}/mean@{k}"] = out[f"rewards/{src.name}/mean"]
            out[f"rewards/{src.name}/pass@{k}"] = float(best[best.isfinite()].mean())
    return out

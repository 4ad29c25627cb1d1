"""Evaluation during or after training (trainer.evaluate()): every eval prompt completed greedily, or k sampled
completions per prompt (num_generations_eval), scored by the run's reward functions."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from groupwise import rollout as R
from groupwise.checkpoint_files import rng_untouched
from groupwise.distributed import exact_dtype
from groupwise.generation import independently
from groupwise.rewards import compute_rewards
from groupwise.rewards.combine import combine_rewards, weighted_nansum
from groupwise.rollout import RolloutContext
from groupwise.rollout_metrics import length_metrics, nanstd, process_metrics, split_description, zero_std_fraction
from groupwise.types import StepScores


@torch.no_grad()
def evaluate(ctx: RolloutContext, model, data, reward_sources: list, state,
             on_batch: Callable[[], None] | None = None, progress: bool = True,
             samples: list | None = None) -> dict[str, float]:
    """Complete every eval prompt and score it: greedily, one completion per prompt (num_generations_eval None),
    or k sampled completions per prompt at the training temperature (num_generations_eval = k). Returns TRL's
    names and meanings over the whole eval set, which the trainer prefixes with metric_key_prefix ("eval_"):
    num_tokens (the training's running total), completions/* (as in training), reward / reward_std (weighted),
    rewards/<func>/mean|std (over all completions), frac_reward_zero_std (k completions of a prompt are a group;
    1 with one completion per prompt, as TRL), tools/*, the names reward functions log with log_metric (the mean
    of every process's calls), and, with k samples, rewards/<func>/mean@k and rewards/<func>/pass@k (the mean
    over prompts of the best of k: for 0/1 rewards, the share of prompts solved at least once); with process
    reward functions, training's process/* metrics (steps split and scored as in training, a prompt's k completions
    being a group). `on_batch` is called after each of this process's batches (callbacks' on_prediction_step); with
    `progress` (the trainer has a ProgressCallback, as transformers' owns the prediction bar) a bar counts the main
    process's batches. `samples`: when a list, every completion's row is appended to it on the main process, in
    dataset order (eval_completions.jsonl's rows: index (the dataset row), sample (0…k−1), prompt, completion,
    each reward function's value, reward (Σ w·r, as the metric), step rewards, log_extra columns)."""
    dist, args = ctx.dist, ctx.args
    k = args.num_generations_eval or 1
    mine = list(range(dist.rank, len(data), dist.world_size))
    bs = args.per_device_eval_batch_size
    logged: dict[str, list[float]] = defaultdict(list)  # log_metric calls of the evaluation's reward calls
    columns: dict[str, list] = defaultdict(list)  # log_extra calls of the batch's reward calls
    kwargs = {"trainer_state": state, "log_metric": lambda name, value: logged[name].append(float(value)),
              "log_extra": lambda column, values: columns[column].extend(values)}

    process = bool(ctx.process_sources)
    step_errors = torch.zeros(len(ctx.process_sources))
    step_totals = torch.zeros(len(ctx.process_sources), 2, dtype=torch.float64)

    def local():  # this process's share, under run_together. Within independently() (entered by every process
        # together, left before run_together's own collective) a collective generator's calls are matched
        per_func, lengths, truncated, tools, steps, rows = [], [], [], [0.0, 0.0], [], []
        with independently(ctx.generator, model), tqdm(total=math.ceil(len(mine) / bs), desc="evaluation",
                                                       leave=False, disable=not progress or not
                                                       dist.is_main) as bar:
            for start in range(0, len(mine), bs):
                score_batch(mine[start:start + bs], per_func, lengths, truncated, tools, steps, rows)
                bar.update()
                if on_batch is not None:
                    on_batch()
        return per_func, lengths, truncated, tools, steps, {n: [sum(v), len(v)] for n, v in logged.items()}, rows

    def score_batch(indices, per_func, lengths, truncated, tools, steps, rows):
        columns.clear()
        comp = R.generate(ctx, model, [data[i] for i in indices for _ in range(k)],
                          greedy=args.num_generations_eval is None, evaluation=True)
        rewards = split = step_rewards = None
        if reward_sources:  # none under process supervision alone
            rewards, _ = compute_rewards(reward_sources, comp.prompts, comp.completions, comp.token_lists(),
                                         comp.columns, on_error=args.on_reward_error, timeout=args.reward_timeout,
                                         extra=kwargs)
            per_func += rewards.tolist()
        lengths += comp.lengths.tolist()
        truncated += comp.truncated.tolist()
        if comp.tool_calls is not None:
            tools[0] += float(comp.tool_calls.sum())
            tools[1] += float(comp.tool_failures.sum())
        if process:  # the step rewards, split and scored as in training (groupwise.rollout.score_steps)
            split, step_rewards, errors, totals = R.local_step_rewards(ctx, comp, kwargs)
            steps += [(r, list(s.ends)) for r, s in zip(step_rewards, split)]
            step_errors.add_(errors)
            step_totals.add_(totals)
        if samples is not None:
            rows += sample_rows(comp, [i for i in indices for _ in range(k)], k, rewards, split, step_rewards)

    def sample_rows(comp, index, k, rewards, split, step_rewards) -> list[dict]:
        """The batch's eval_completions.jsonl rows (the log_extra columns with one value per completion)."""
        n = len(comp.prompts)
        extra = {c: v for c, v in columns.items() if len(v) == n}
        combined = None if rewards is None else weighted_nansum(rewards, ctx.reward_weights)
        out = []
        for j in range(n):
            row = {"index": index[j], "sample": j % k, "prompt": comp.prompts[j], "completion": comp.completions[j]}
            if rewards is not None:
                row["rewards"] = {src.name: float(rewards[j, f]) for f, src in enumerate(reward_sources)}
                row["reward"] = float(combined[j])
            if split is not None:
                row["steps"] = [[text, float(r)] for text, r in zip(split[j].texts, step_rewards[j])]
            out.append({**row, **{c: v[j] for c, v in extra.items()}})
        return out

    # sampled evaluation must not move the training's random streams (exact resume)
    with rng_untouched():
        per_func, lengths, truncated, tools, steps, calls, rows = dist.run_together(local, "evaluation")
    if samples is not None:
        every = dist.gather_object(rows)
        if dist.is_main:
            samples += sorted(every, key=lambda row: (row["index"], row["sample"]))
    lengths = torch.tensor(dist.gather_object(lengths), dtype=torch.float)
    truncated = torch.tensor(dist.gather_object(truncated), dtype=torch.bool)
    out = {"num_tokens": float(state.num_input_tokens_seen),  # TRL: the training's running total
           **length_metrics(lengths, truncated)}
    if ctx.agent is not None and ctx.agent.toolbox.has_tools:  # TRL's tools/*, over every process's rollouts
        called, failed = dist.sum(torch.tensor(tools)).tolist()
        out.update({"tools/call_frequency": called / len(lengths),
                    "tools/failure_frequency": failed / called if called else 0.0})
    for name, (total, count) in _merge(dist.gather_object([calls])).items():  # log_metric: all processes' calls
        out[name] = total / count
    if process:  # training's process/* metrics over the eval set, a prompt's k completions being a group
        every = dist.gather_object(steps)  # a prompt's k rows stay together (each process evaluates whole prompts)
        groups = [every[i:i + k] for i in range(0, len(every), k)]
        scores = StepScores([[r for r, _ in g] for g in groups], [[e for _, e in g] for g in groups], [],
                            tuple(s.name for s in ctx.process_sources), dist.sum(step_errors.to(dist.device)).cpu(),
                            dist.sum(step_totals.to(dist.device, exact_dtype(dist.device))).cpu().double())
        out.update(process_metrics(scores, args.step_advantage, args.advantage_estimator, split_description(args)))
    if not reward_sources:
        return out
    per_func = torch.tensor(dist.gather_object(per_func), dtype=torch.float).view(-1, len(reward_sources))
    # combined as in training: a row no function scored is left out, not counted as 0
    reward = weighted_nansum(per_func, ctx.reward_weights)
    out["reward"], out["reward_std"] = float(torch.nanmean(reward)), nanstd(reward)
    by_prompt = per_func.view(-1, k, len(reward_sources))  # (prompts, k, F)
    combined = combine_rewards(by_prompt, ctx.reward_weights, aggregation=args.multi_objective_aggregation,
                               std=args.reward_std, eps=args.advantage_eps)
    batch = args.estimator_options(outcome=True).get("scale") == "batch"  # TRL: one completion, std 0 by definition
    out["frac_reward_zero_std"] = 1.0 if k == 1 and not batch else zero_std_fraction(ctx, combined)
    for f, src in enumerate(reward_sources):
        out[f"rewards/{src.name}/mean"] = float(torch.nanmean(per_func[:, f]))  # e.g. eval_rewards/accuracy/mean
        out[f"rewards/{src.name}/std"] = nanstd(per_func[:, f])
        if args.num_generations_eval is not None:
            scores = by_prompt[:, :, f]
            best = torch.where(scores.isnan(), float("-inf"), scores).amax(1)  # unscored samples do not count
            out[f"rewards/{src.name}/mean@{k}"] = out[f"rewards/{src.name}/mean"]
            out[f"rewards/{src.name}/pass@{k}"] = float(best[best.isfinite()].mean())
    return out


def _merge(calls: list[dict[str, list[float]]]) -> dict[str, tuple[float, float]]:
    """Each process's {name: [sum, count]} of log_metric calls → {name: (sum, count)} over all processes."""
    merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for process in calls:
        for name, (total, count) in process.items():
            merged[name][0] += total
            merged[name][1] += count
    return {name: (total, count) for name, (total, count) in sorted(merged.items()) if count}

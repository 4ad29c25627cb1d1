"""One generation round: prompts → completions → rewards (gathered over processes) → advantages → TrainBatch.

No optimizer here. Rows are laid out (b, g) over the whole round and each process owns a contiguous slice of
them, so a group may span processes: rewards are gathered before the group statistics and every process keeps
its own slice of the advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from groupwise.core.advantages import process_advantages
from groupwise.generation.base import completion_masks, encode_prompts, is_conversational, trim_to_mask
from groupwise.modeling import batched_logps
from groupwise.rewards import combine_rewards, compute_rewards
from groupwise.rewards.process import compute_step_rewards
from groupwise.rewards.steps import StepSplitter
from groupwise.supervision import token_advantages
from groupwise.types import Completions, Scores, StepScores, TrainBatch


@dataclass
class RolloutContext:
    """What a rollout needs besides the prompts; built once by the trainer."""

    args: Any  # GRPOConfig
    tokenizer: Any
    generator: Any  # groupwise.generation.Generator
    reward_sources: list
    reward_weights: torch.Tensor  # (F,)
    eos_token_ids: list[int]
    dist: Any  # groupwise.distributed.Distributed
    process_sources: list | None = None  # process reward functions (supervision 'process' / 'both')
    process_weights: torch.Tensor | None = None  # (F_p,)
    splitter: StepSplitter | None = None


def generate(ctx: RolloutContext, model, rows: list[dict[str, Any]], *, greedy: bool = False) -> Completions:
    """Sample one completion per row (rows already repeated G times, group rows contiguous)."""
    args, tok = ctx.args, ctx.tokenizer
    prompts = [r["prompt"] for r in rows]
    prompt_ids, prompt_mask = encode_prompts(prompts, tok, args.max_prompt_length, args.chat_template_kwargs)
    device = ctx.dist.device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    completion_ids = ctx.generator(model, prompt_ids, prompt_mask, greedy=greedy)  # (N, T)
    mask, truncated = completion_masks(completion_ids, ctx.eos_token_ids, args.max_completion_length)
    completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, tok.pad_token_id))
    texts = tok.batch_decode(trim_to_mask(completion_ids, mask), skip_special_tokens=True)
    completions: list[Any] = texts
    if is_conversational(prompts[0]):
        completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    return Completions(prompt_ids, prompt_mask, completion_ids, mask, truncated, prompts, completions, columns)


def score(ctx: RolloutContext, comp: Completions) -> Scores:
    """Rewards on this process, gathered over all processes, then combined and group-normalised."""
    args, G = ctx.args, ctx.args.num_generations
    local, errors = compute_rewards(ctx.reward_sources, comp.prompts, comp.completions, comp.token_lists(),
                                    comp.columns, on_error=args.on_reward_error)
    per_func = ctx.dist.gather(local.to(ctx.dist.device)).cpu()  # (B·G, F), rank order = row order
    errors = ctx.dist.sum(errors.to(ctx.dist.device)).cpu()
    per_func = per_func.view(-1, G, per_func.size(-1))  # (B, G, F)
    rewards, advantages = combine_rewards(per_func, ctx.reward_weights, aggregation=args.multi_objective_aggregation,
                                          scale=args.scale_rewards, std=args.reward_std, eps=args.advantage_eps)
    return Scores(per_func, rewards, advantages, tuple(s.name for s in ctx.reward_sources), errors)


def score_steps(ctx: RolloutContext, comp: Completions) -> StepScores:
    """Split this process's completions into steps, score them, gather the round, §4.1.3 token advantages."""
    args, G, tok = ctx.args, ctx.args.num_generations, ctx.tokenizer
    steps = []
    for ids, cut in zip(comp.token_lists(), comp.truncated.tolist()):
        s = ctx.splitter.split(ids, tok, ends_with_eos=not cut, truncated=cut)
        if s.truncated_last and not args.score_truncated_step:
            s = s.drop_last()  # a step cut mid-way is not judged; its tokens get advantage 0
        steps.append(s)
    texts = [list(s.texts) for s in steps]
    rewards, errors = compute_step_rewards(ctx.process_sources, ctx.process_weights, comp.prompts, comp.completions,
                                           texts, comp.columns, on_error=args.on_reward_error)
    gathered = ctx.dist.gather_object([(r, list(s.ends)) for r, s in zip(rewards, steps)])  # (B·G) rank order
    errors = ctx.dist.sum(errors.to(ctx.dist.device)).cpu()
    B = len(gathered) // G
    all_rewards = [[gathered[b * G + g][0] for g in range(G)] for b in range(B)]
    all_ends = [[gathered[b * G + g][1] for g in range(G)] for b in range(B)]
    adv = process_advantages(all_rewards, all_ends, args.max_completion_length, std=args.reward_std,
                             eps=args.advantage_eps)  # (B, G, max_completion_length)
    return StepScores(all_rewards, all_ends, texts, adv, tuple(s.name for s in ctx.process_sources), errors)


def local_advantages(ctx: RolloutContext, comp: Completions, scores: Scores | None,
                     step_scores: StepScores | None) -> torch.Tensor:  # (N,) or (N, T)
    """This process's advantages, outcome / process / both as configured (groupwise.supervision)."""
    args, T = ctx.args, comp.completion_ids.size(1)
    outcome = None if scores is None else local_slice(ctx, scores.advantages)  # (N,)
    process = None if step_scores is None else local_slice(ctx, step_scores.advantages)[:, :T]  # (N, T)
    adv = token_advantages(args.supervision, outcome, process, outcome_weight=args.outcome_advantage_weight,
                           process_weight=args.process_advantage_weight)
    return adv.to(comp.completion_ids.device)


def group_signal(ctx: RolloutContext, scores: Scores | None, step_scores: StepScores | None) -> torch.Tensor:
    """(B,) bool over the round: does the group carry a learning signal? A group whose rewards (outcome) and step
    rewards (process) all have zero spread gets advantage 0 everywhere."""
    signal = None
    if scores is not None:
        signal = _group_std(scores.rewards) > 1e-6
    if step_scores is not None:
        steps = torch.tensor([bool(_nanstd(torch.tensor([r for row in g for r in row] or [float("nan")])) > 1e-6)
                              for g in step_scores.rewards])
        signal = steps if signal is None else signal | steps
    return signal


def local_groups(ctx: RolloutContext, per_group: torch.Tensor) -> torch.Tensor:
    """This process's entries of a (B, …) per-group tensor (whole groups per process, as dynamic sampling needs)."""
    n = per_group.size(0) // ctx.dist.world_size
    return per_group[ctx.dist.rank * n:(ctx.dist.rank + 1) * n]


def select_groups(comps: list[Completions], advs: list[torch.Tensor], picks: list[tuple[int, int]], G: int,
                  pad_id: int) -> tuple[Completions, torch.Tensor]:
    """Rows of the picked (round, local group) pairs, re-padded into one Completions and one advantage tensor."""
    rows = [(r, g * G + k) for r, g in picks for k in range(G)]
    P = max(comps[r].prompt_ids.size(1) for r, _ in rows)
    T = max(comps[r].completion_ids.size(1) for r, _ in rows)
    pad = lambda t, w, left, v=0: torch.nn.functional.pad(t, (w - t.size(-1), 0) if left else (0, w - t.size(-1)), value=v)  # noqa: E731
    def stack(get, w, left, v=0):
        return torch.stack([pad(get(comps[r])[i], w, left, v) for r, i in rows])
    comp = Completions(
        stack(lambda c: c.prompt_ids, P, True, pad_id), stack(lambda c: c.prompt_mask, P, True),
        stack(lambda c: c.completion_ids, T, False, pad_id), stack(lambda c: c.completion_mask, T, False),
        torch.stack([comps[r].truncated[i] for r, i in rows]),
        [comps[r].prompts[i] for r, i in rows], [comps[r].completions[i] for r, i in rows],
        {k: [comps[r].columns[k][i] for r, i in rows] for k in comps[0].columns})
    if advs[0].dim() == 1:
        adv = torch.stack([advs[r][i] for r, i in rows])
    else:
        adv = torch.stack([pad(advs[r][i], T, False) for r, i in rows])
    return comp, adv


def local_slice(ctx: RolloutContext, t: torch.Tensor) -> torch.Tensor:
    """This process's rows of a (B, G, …) tensor of the whole round."""
    flat = t.reshape(-1, *t.shape[2:])
    n = flat.size(0) // ctx.dist.world_size
    return flat[ctx.dist.rank * n:(ctx.dist.rank + 1) * n]


def build_batch(ctx: RolloutContext, comp: Completions, advantages: torch.Tensor, *, model, ref_model,
                need_old_logps: bool) -> TrainBatch:
    args = ctx.args
    loss_mask = comp.completion_mask
    if args.mask_truncated_completions:
        loss_mask = loss_mask * (~comp.truncated).unsqueeze(-1).long()
    input_ids = torch.cat([comp.prompt_ids, comp.completion_ids], dim=1)
    attention_mask = torch.cat([comp.prompt_mask, comp.completion_mask], dim=1)
    T = comp.completion_ids.size(1)
    old = ref = None
    if need_old_logps:  # the policy moves before some micro-batches are used: keep π_θold explicitly
        old = batched_logps(model, input_ids, attention_mask, T, temperature=args.temperature,
                            batch_size=args.per_device_train_batch_size, chunk_tokens=args.logprob_chunk_tokens)
    if ref_model is not None:  # β > 0 only
        ref = batched_logps(ref_model, input_ids, attention_mask, T, temperature=args.temperature,
                            batch_size=args.per_device_train_batch_size, chunk_tokens=args.logprob_chunk_tokens)
    return TrainBatch(input_ids, attention_mask, loss_mask, advantages, old, ref)


def rollout_metrics(ctx: RolloutContext, comp: Completions, scores: Scores | None,
                    step_scores: StepScores | None = None) -> dict[str, float]:
    dist = ctx.dist
    lengths = dist.gather(comp.lengths.float().to(dist.device)).cpu()
    truncated = dist.gather(comp.truncated.float().to(dist.device)).cpu()
    m: dict[str, float] = {
        "gen/mean_length": float(lengths.mean()),
        "gen/min_length": float(lengths.min()),
        "gen/max_length": float(lengths.max()),
        "gen/clipped_ratio": float(truncated.mean()),
    }
    if step_scores is not None:
        m.update(_process_metrics(step_scores))
    if scores is None:
        return m
    m["reward/mean"] = float(torch.nanmean(scores.rewards))
    m["reward/std"] = float(_nanstd(scores.rewards.flatten()))
    m["reward/frac_zero_std_groups"] = float((_group_std(scores.rewards) < 1e-6).float().mean())
    for f, name in enumerate(scores.names):
        col = scores.per_func[..., f].flatten()
        m[f"reward/{name}/mean"] = float(torch.nanmean(col)) if (~torch.isnan(col)).any() else float("nan")
        m[f"reward/{name}/std"] = float(_nanstd(col))
        m[f"reward/{name}/errors"] = float(scores.errors[f])
    return m


def _process_metrics(s: StepScores) -> dict[str, float]:
    per_completion = [row for group in s.rewards for row in group]
    flat = torch.tensor([r for row in per_completion for r in row] or [float("nan")])
    group_std = [_nanstd(torch.tensor([r for row in group for r in row] or [float("nan")])) for group in s.rewards]
    m = {"process/step_reward_mean": float(torch.nanmean(flat)),
         "process/steps_per_completion": sum(len(r) for r in per_completion) / len(per_completion),
         "process/no_step_completions": float(sum(1 for r in per_completion if not r)),
         # a group whose step rewards have no spread carries no signal (all its advantages are 0)
         "process/zero_std_groups": float(sum(1 for v in group_std if not (v > 1e-6)))}
    for f, name in enumerate(s.names):
        m[f"process/{name}/errors"] = float(s.errors[f])
    return m


def _nanstd(x: torch.Tensor) -> torch.Tensor:
    x = x[~torch.isnan(x)]
    return x.std(unbiased=False) if x.numel() else torch.tensor(float("nan"))


def _group_std(r: torch.Tensor) -> torch.Tensor:  # (B, G) → (B,)
    return torch.stack([_nanstd(row) if (~torch.isnan(row)).sum() > 1 else torch.tensor(0.0) for row in r])

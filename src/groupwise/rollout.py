"""One generation round: prompts → completions → rewards (gathered over processes) → advantages → TrainBatch.

No optimizer here. Rows are laid out (b, g) over the whole round and each process owns a contiguous slice of
them, so a group may span processes: rewards are gathered before the group statistics and every process keeps
its own slice of the advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from groupwise.generation.base import completion_masks, encode_prompts, is_conversational
from groupwise.modeling import batched_logps
from groupwise.rewards import combine_rewards, compute_rewards
from groupwise.types import Completions, Scores, TrainBatch


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
    texts = tok.batch_decode([ids[: int(m.sum())] for ids, m in zip(completion_ids.tolist(), mask)],
                             skip_special_tokens=True)
    completions: list[Any] = texts
    if is_conversational(prompts[0]):
        completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    return Completions(prompt_ids, prompt_mask, completion_ids, mask, truncated, prompts, completions, columns)


def score(ctx: RolloutContext, comp: Completions) -> Scores:
    """Rewards on this process, gathered over all processes, then combined and group-normalised."""
    args, G = ctx.args, ctx.args.num_generations
    ids = [row[: int(m.sum())] for row, m in zip(comp.completion_ids.tolist(), comp.completion_mask)]
    local, errors = compute_rewards(ctx.reward_sources, comp.prompts, comp.completions, ids, comp.columns,
                                    on_error=args.on_reward_error)
    per_func = ctx.dist.gather(local.to(ctx.dist.device)).cpu()  # (B·G, F), rank order = row order
    errors = ctx.dist.sum(errors.to(ctx.dist.device)).cpu()
    per_func = per_func.view(-1, G, per_func.size(-1))  # (B, G, F)
    rewards, advantages = combine_rewards(per_func, ctx.reward_weights, aggregation=args.multi_objective_aggregation,
                                          scale=args.scale_rewards, std=args.reward_std, eps=args.advantage_eps)
    return Scores(per_func, rewards, advantages, tuple(s.name for s in ctx.reward_sources), errors)


def local_slice(ctx: RolloutContext, t: torch.Tensor) -> torch.Tensor:
    """This process's rows of a (B, G, …) tensor of the whole round."""
    flat = t.reshape(-1, *t.shape[2:])
    n = flat.size(0) // ctx.dist.world_size
    return flat[ctx.dist.rank * n:(ctx.dist.rank + 1) * n]


def build_batch(ctx: RolloutContext, comp: Completions, scores: Scores, *, model, ref_model,
                need_old_logps: bool) -> TrainBatch:
    args = ctx.args
    advantages = local_slice(ctx, scores.advantages).to(comp.completion_ids.device)  # (N,)
    loss_mask = comp.completion_mask
    if args.mask_truncated_completions:
        loss_mask = loss_mask * (~comp.truncated).unsqueeze(-1).long()
    input_ids = torch.cat([comp.prompt_ids, comp.completion_ids], dim=1)
    attention_mask = torch.cat([comp.prompt_mask, comp.completion_mask], dim=1)
    T = comp.completion_ids.size(1)
    old = ref = None
    if need_old_logps:  # the policy moves before some micro-batches are used: keep π_θold explicitly
        old = batched_logps(model, input_ids, attention_mask, T, temperature=args.temperature,
                            batch_size=args.per_device_train_batch_size)
    if ref_model is not None:  # β > 0 only
        ref = batched_logps(ref_model, input_ids, attention_mask, T, temperature=args.temperature,
                            batch_size=args.per_device_train_batch_size)
    return TrainBatch(input_ids, attention_mask, loss_mask, advantages, old, ref)


def rollout_metrics(ctx: RolloutContext, comp: Completions, scores: Scores) -> dict[str, float]:
    dist = ctx.dist
    lengths = dist.gather(comp.lengths.float().to(dist.device)).cpu()
    truncated = dist.gather(comp.truncated.float().to(dist.device)).cpu()
    m: dict[str, float] = {
        "reward/mean": float(torch.nanmean(scores.rewards)),
        "reward/std": float(_nanstd(scores.rewards.flatten())),
        "reward/frac_zero_std_groups": float((_group_std(scores.rewards) < 1e-6).float().mean()),
        "gen/mean_length": float(lengths.mean()),
        "gen/min_length": float(lengths.min()),
        "gen/max_length": float(lengths.max()),
        "gen/clipped_ratio": float(truncated.mean()),
    }
    for f, name in enumerate(scores.names):
        col = scores.per_func[..., f].flatten()
        m[f"reward/{name}/mean"] = float(torch.nanmean(col)) if (~torch.isnan(col)).any() else float("nan")
        m[f"reward/{name}/std"] = float(_nanstd(col))
        m[f"reward/{name}/errors"] = float(scores.errors[f])
    return m


def _nanstd(x: torch.Tensor) -> torch.Tensor:
    x = x[~torch.isnan(x)]
    return x.std(unbiased=False) if x.numel() else torch.tensor(float("nan"))


def _group_std(r: torch.Tensor) -> torch.Tensor:  # (B, G) → (B,)
    return torch.stack([_nanstd(row) if (~torch.isnan(row)).sum() > 1 else torch.tensor(0.0) for row in r])

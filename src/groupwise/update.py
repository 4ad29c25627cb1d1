"""μ iterations × micro-batches of one generation batch → optimizer steps: logps → loss → backward → step.

Loss scaling under accumulation and data parallelism (the silent-wrong-gradient trap, transformers #34191):
each process's micro-batch loss is scaled so that, after DDP averages gradients over W processes and k micro-batches
are summed, the step's gradient equals the gradient of the aggregated loss over the whole window. The aggregation
says which rule applies (groupwise.core.aggregation, `spans_step`):
    normaliser spans the step (dapo)          ℓ_i · W   (ℓ_i already divides by the window's tokens, all processes)
    normaliser local to the micro-batch       ℓ_i / k   (grpo, bnpo, dr_grpo, luspo)
An entropy bonus (entropy_coef = c) subtracts c · H̄_i / k per micro-batch, H̄_i its mean token entropy, so the step
maximises c times the window's mean of micro-batch entropies whatever the loss type's normaliser (TRL's definition);
c is fixed, or adapted after every step from the step's entropy over all processes (groupwise.core.entropy).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from groupwise.config_base import ConfigError
from groupwise.core.aggregation import aggregation
from groupwise.core.entropy import EntropyControl
from groupwise.core.losses import LOSS_TYPES
from groupwise.core.logprobs import top_entropy_mask
from groupwise.distributed import exact_dtype
from groupwise.core.losses import policy_loss
from groupwise.types import TrainBatch

# metrics that are an extreme over sequences (core.losses.policy_loss): per micro-batch the extreme over every
# process's sequences, then the mean over the step's micro-batches (TRL's clip_ratio/low_min, clip_ratio/high_max)
EXTREMES = {"clip_ratio/low_min": False, "clip_ratio/high_max": True}  # name → largest

if TYPE_CHECKING:
    from groupwise.config import GRPOConfig
    from groupwise.distributed import Distributed


@dataclass
class UpdateContext:
    args: GRPOConfig
    dist: Distributed
    model: torch.nn.Module  # groupwise.modeling.PolicyForLogps, possibly wrapped by accelerate
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    event: Callable[[str], None] = lambda name: None  # the trainer's callbacks: on_(pre_)optimizer_step
    entropy: EntropyControl | None = None  # the bonus's coefficient (from args when None); checkpointed when adapted
    router_aux_loss_coef: float = 0.0  # weight of a MoE model's router loss (groupwise.loading.router_aux_loss_coef)

    def __post_init__(self):
        if self.entropy is None:
            self.entropy = EntropyControl.from_config(self.args)


def windows(batch: TrainBatch, micro_batch_size: int, steps_per_generation: int, num_iterations: int,
            gradient_accumulation_steps: int) -> list[list[TrainBatch]]:
    """Micro-batches in training order (μ passes over the batch), grouped into optimizer steps."""
    rows = batch.input_ids.size(0)
    if rows != micro_batch_size * steps_per_generation:  # rows past the last micro-batch would never be trained on
        raise ValueError(f"a generation batch of {rows} rows per process is not steps_per_generation="
                         f"{steps_per_generation} micro-batches of {micro_batch_size} rows")
    micro = [batch.rows(k * micro_batch_size, (k + 1) * micro_batch_size)
             for _ in range(num_iterations) for k in range(steps_per_generation)]
    k = gradient_accumulation_steps
    return [micro[i:i + k] for i in range(0, len(micro), k)]


class MicroBatchLoss(NamedTuple):
    loss: torch.Tensor  # the aggregated policy loss (+ β·KL), before accumulation / data-parallel scaling
    entropy: tuple[torch.Tensor, torch.Tensor] | None  # (Σ H_t, tokens) over the acting tokens; None without a bonus
    aux_loss: torch.Tensor | None  # a MoE model's router load-balancing loss (differentiable); None when unweighted
    metrics: dict[str, torch.Tensor]  # this process's means (`counts` says what each divides by)


def micro_batch_loss(ctx: UpdateContext, mb: TrainBatch, num_items: torch.Tensor | None,
                     counts: dict[str, torch.Tensor] | None = None) -> MicroBatchLoss:
    """One micro-batch's loss terms and metrics (`counts`, when given, is filled with what each mean divides by)."""
    args = ctx.args
    mask = mb.completion_mask
    bonus = ctx.entropy.enabled
    router = ctx.router_aux_loss_coef != 0.0
    logps, entropies, *aux = ctx.model(mb.input_ids, mb.attention_mask, mask.size(1), temperature=args.temperature,
                                       compute_entropy=True, entropy_grad=bonus,  # PolicyForLogps, maybe in DDP
                                       **({"aux_loss": True} if router else {}))
    old = logps.detach() if mb.old_logps is None else mb.old_logps
    loss_mask = None if args.top_entropy_quantile >= 1.0 else \
        top_entropy_mask(entropies.detach(), mask, args.top_entropy_quantile, gather=ctx.dist.gather_ragged)
    loss, metrics = policy_loss(
        logps, old, mb.advantages, mask, loss_type=args.loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high, delta=args.delta, sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
        importance_sampling_level=args.importance_sampling_level, beta=args.beta, ref_logps=mb.ref_logps,
        use_bias_correction_kl=args.use_bias_correction_kl, max_completion_length=args.max_completion_length,
        num_items_in_batch=num_items, loss_mask=loss_mask, is_weights=mb.is_weights,
        off_policy_mask_threshold=args.off_policy_mask_threshold, sampling_logps=mb.sampling_logps,
        metric_counts=counts)
    metrics["entropy"] = (entropies.detach() * mask).sum() / mask.sum().clamp(min=1)
    if counts is not None:
        counts["entropy"] = mask.sum()
    acting_entropy = None
    if bonus:  # over the tokens the policy term acts on (the top-entropy ones when top_entropy_quantile < 1), as TRL
        acting = mask if loss_mask is None else mask * loss_mask
        acting_entropy = (entropies * acting).sum(), acting.sum().to(entropies.dtype)
    if router:
        if not aux[0].requires_grad:  # reentrant activation checkpointing computes the router logits without grad
            raise ConfigError("router_aux_loss_coef: the router loss carries no gradient (activation checkpointing "
                              "with use_reentrant=True?): set gradient_checkpointing_kwargs={'use_reentrant': False}, "
                              "or router_aux_loss_coef=0.0")
        metrics["aux_loss"] = aux[0].detach()  # TRL's aux_loss: the mean over processes and micro-batches
    return MicroBatchLoss(loss, acting_entropy, aux[0] if router else None, metrics)


def optimizer_step(ctx: UpdateContext, window: list[TrainBatch]) -> dict[str, float]:
    """Accumulate the window's micro-batches and take one optimizer step (skipped if anything is not finite)."""
    args, dist, model = ctx.args, ctx.dist, ctx.model
    k = len(window)
    num_items = None
    if aggregation(LOSS_TYPES[args.loss_type].aggregation).spans_step:
        num_items = dist.sum(sum(mb.completion_mask.sum() for mb in window).float())  # the step's tokens, all processes
        scale = float(dist.world_size)
    else:
        scale = 1.0 / k
    sums: dict[str, float] = defaultdict(float)
    extremes: dict[str, list[float]] = defaultdict(list)  # per micro-batch, then over processes (EXTREMES)
    weighted: dict[str, list[float]] = defaultdict(list)  # per micro-batch: this process's mean · count, count
    step_loss, step_total, finite = 0.0, 0.0, True
    coef = ctx.entropy.applied()  # the same for every micro-batch of the step
    window_entropy = torch.zeros(2, dtype=exact_dtype(dist.device), device=dist.device)  # Σ H_t, tokens: the step's, this process
    for i, mb in enumerate(window):
        with dist.no_sync(model, skip_sync=i < k - 1):
            counts: dict[str, torch.Tensor] = {}
            loss, acting_entropy, aux_loss, metrics = micro_batch_loss(ctx, mb, num_items, counts)
            total = loss * scale
            if aux_loss is not None:  # + coef · aux_i / k: scaled for accumulation only, as TRL
                total = total + ctx.router_aux_loss_coef * aux_loss / k
            if acting_entropy is not None:  # L − c·H̄: each micro-batch's mean token entropy, averaged over the window
                entropy_sum, tokens = acting_entropy
                total = total - coef * (entropy_sum / tokens.clamp(min=1)) / k
                window_entropy += torch.stack([entropy_sum.detach(), tokens.detach()]).to(window_entropy)
            dist.backward(total)
        finite = finite and bool(torch.isfinite(loss.detach()))
        step_loss += float(loss.detach()) * scale
        step_total += float(total.detach())
        for name, value in metrics.items():
            if name in EXTREMES:
                extremes[name].append(float(value))
            elif name in counts:
                weighted[name] += [float(value) * float(counts[name]), float(counts[name])]
            else:
                sums[name] += float(value) / k
    params = [p for p in model.parameters() if p.requires_grad]
    loss_scale = dist.loss_scale  # fp16: the scale these gradients carry (None otherwise)
    dist.unscale(ctx.optimizer)
    grad_norm = dist.clip_grad_norm(params, args.max_grad_norm)
    loss_finite = not dist.any(not finite)
    skipped = not loss_finite or not math.isfinite(float(grad_norm))
    # fp16: gradients that overflow under a scale ≥ 1 are the loss scale's search (it halves; transformers skips the
    # step silently likewise); below 1 they overflow float16 by themselves, a non-finite step like any other
    overflow = skipped and loss_finite and loss_scale is not None and loss_scale >= 1.0
    if skipped and not overflow:
        warnings.warn(f"non-finite loss or gradient (loss {step_loss}, grad norm {float(grad_norm)}): "
                      "optimizer step skipped, weights left untouched", RuntimeWarning, stacklevel=2)
    learning_rate = ctx.scheduler.get_last_lr()[0]  # the rate this step used (transformers logs it)
    ctx.event("on_pre_optimizer_step")  # fired at every step, skipped or not, as transformers' loop fires them
    if not skipped:
        ctx.optimizer.step()
    dist.update_scale()  # within the step, as accelerate's optimizer.step() updates the scale
    ctx.event("on_optimizer_step")
    if not skipped:
        ctx.scheduler.step()  # a skipped step does not advance the schedule either (optimizer_step_was_skipped)
    ctx.optimizer.zero_grad(set_to_none=True)
    # average over processes: `loss` is Σ_i (ℓ_i·scale − c·H̄_i/k), the objective minimised (TRL's loss), whose mean
    # over ranks is the step's; policy_loss (logged with an entropy bonus, as TRL) leaves the bonus out
    # and the means (kl, entropy, clip ratios): per micro-batch Σ_processes mean·count / Σ_processes count, TRL's
    # global_masked_mean (token-weighted over processes), then the mean over the window's micro-batches
    keys, means = ["loss", "policy_loss", *sorted(sums)], sorted(weighted)
    dtype = exact_dtype(dist.device)
    values = dist.sum(torch.tensor([step_total, step_loss, *(sums[n] for n in keys[2:]),
                                    *(x for n in means for x in weighted[n])], device=dist.device, dtype=dtype))
    out = dict(zip(keys, (values[:len(keys)] / dist.world_size).tolist()))
    pairs = values[len(keys):].view(len(means), k, 2)  # (metric, micro-batch, [Σ mean·count, Σ count])
    out.update(zip(means, (pairs[..., 0] / pairs[..., 1].clamp(min=1.0)).mean(-1).tolist()))
    if ctx.entropy.enabled:  # adapted: from the step's entropy over every process's acting tokens (TRL logs the new c)
        if ctx.entropy.adaptive:
            totals = dist.sum(window_entropy)
            ctx.entropy.observe(float(totals[0] / totals[1].clamp(min=1.0)))
        out["entropy_coef"] = ctx.entropy.coef
    else:
        del out["policy_loss"]
    for name, largest in EXTREMES.items():  # each micro-batch's extreme over all processes, averaged over the window
        if name in extremes:
            out[name] = float(torch.nanmean(dist.extreme(torch.tensor(extremes[name]), largest)))
    out["grad_norm"] = float(grad_norm)
    out["learning_rate"] = learning_rate
    out["train/skipped"] = float(skipped)
    if loss_scale is not None:
        out["train/loss_scale"] = loss_scale
        out["train/overflow"] = float(overflow)
    return out

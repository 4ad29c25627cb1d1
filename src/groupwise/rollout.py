"""The rollout: `collect(ctx, model)` runs prompts → completions → rewards → advantages → TrainBatch and returns one
`Rollout` record. No optimizer here.

Rows are laid out (b, g) over the whole round and each process owns a contiguous slice of them (Distributed.shard),
so a group may span processes: rewards are gathered before the group statistics and every process keeps its own
slice of the advantages. With dynamic sampling (DAPO) groups without a learning signal are dropped and refilled
from further rounds (`refill`), which needs whole groups on each process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from groupwise.agents.parsing import as_completions
from groupwise.config_base import ConfigError
from groupwise.core.advantages import outcome_advantages, process_advantages
from groupwise.core.importance import sampling_weights
from groupwise.core.supervision import token_advantages
from groupwise.custom_rollout import rollout_completions
from groupwise.distributed import exact_dtype
from groupwise.dynamic import group_signal, refill
from groupwise.generation import independently
from groupwise.modeling import batched_logps, embedding_rows
from groupwise.rewards import RewardSource, combine_rewards, compute_rewards
from groupwise.rewards.combine import reward_weights
from groupwise.rewards.process import PROCESS_REWARD_KEYWORDS, compute_step_rewards
from groupwise.rewards.sources import NEVER_PASSED, REWARD_KEYWORDS
from groupwise.rewards.steps import TOOL_TEXT_STEPS, StepSplitter
from groupwise.rollout_metrics import round_metrics, sampling_metrics, trl_reward
from groupwise.text import (completion_masks, encode_prompts, is_conversational, pad_rows, pad_to_multiple,
                            trim_to_mask)
from groupwise.types import Completions, Round, Rollout, Scores, StepScores, TrainBatch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from groupwise.adapters import Reference
    from groupwise.agents import Agent, Turns
    from groupwise.config import GRPOConfig
    from groupwise.data import PromptData
    from groupwise.order import PromptSampler
    from groupwise.distributed import Distributed
    from groupwise.generation import Generator


@dataclass(frozen=True, kw_only=True)
class RolloutContext:
    """What a rollout needs besides the model; built once by the trainer."""

    args: GRPOConfig
    tokenizer: PreTrainedTokenizerBase
    generator: Generator | None  # None only for callers that score given completions (tests)
    dist: Distributed
    eos_token_ids: list[int]
    reward_sources: list[RewardSource] = dataclasses.field(default_factory=list)
    process_sources: list[RewardSource] = dataclasses.field(default_factory=list)
    splitter: StepSplitter | None = None  # needed with process_sources
    reward_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # TRL's trainer_state, log_metric, log_extra
    data: PromptData | None = None  # what `collect` draws prompts from
    sampler: PromptSampler | None = None  # which prompts, round after round
    reference: Reference | None = None  # π_ref of the KL term, β > 0 only (groupwise.adapters.Reference)
    policy_logps: torch.nn.Module | None = None  # the trainer's PolicyForLogps (sharded with fsdp): π_θold runs on it
    correct_sampling: bool = False  # importance-correct for a sampler with other numerics (generation_dtype)
    agent: Agent | None = None  # tools / environments: multi-turn rollouts (groupwise.agents)
    rollout_func: Callable[[list], Any] | None = None  # TRL's rollout_func, given the trainer (groupwise.custom_rollout)
    need_old_logps: bool = False  # π_θold must be kept explicitly (the policy moves within a round)

    @property
    def reward_weights(self) -> torch.Tensor:  # (F,)
        return reward_weights(self.args.reward_weights, len(self.reward_sources))

    @property
    def process_weights(self) -> torch.Tensor:  # (F_p,)
        return reward_weights(self.args.process_reward_weights, len(self.process_sources))


# ---- the one call ---------------------------------------------------------------------------------------------------
def collect(ctx: RolloutContext, model) -> Rollout:
    """One generation batch: sample a round, measure it, (dynamic sampling) refill groups without signal, then the
    log-probs the update needs (π_θold when the policy moves within the round, π_ref when β > 0)."""
    clock = PhaseClock(ctx.dist.device)
    first = sample_round(ctx, model, clock)
    metrics = round_metrics(ctx, first)
    chosen = first
    if ctx.args.dynamic_sampling:
        chosen, dynamic = refill(ctx, first, lambda: sample_round(ctx, model, clock))
        metrics.update(dynamic)
    with clock("logprobs"):
        batch = build_batch(ctx, chosen, model, metrics)
    metrics.update(clock.metrics())  # time/generate, time/rewards, time/logprobs
    return Rollout(batch, metrics, chosen)


class PhaseClock:
    """Seconds spent per rollout phase (time/<phase> metrics); waits for the accelerator at each boundary so the
    time lands in the phase that queued the work."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {"generate": 0.0, "rewards": 0.0, "logprobs": 0.0}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] += time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


def sample_round(ctx: RolloutContext, model, clock: PhaseClock | None = None) -> Round:
    """The next B prompts × G completions: generate this process's rows, score them, advantages."""
    clock = clock or PhaseClock(ctx.dist.device)
    G = ctx.args.num_generations
    prompt_idx = ctx.sampler.next_round()  # B prompts of the whole round, same on every process
    rows = ctx.dist.shard([i for i in prompt_idx for _ in range(G)])  # group rows contiguous
    with clock("generate"):
        comp = generate(ctx, model, [ctx.data[i] for i in rows])
    with clock("rewards"):
        scores = score(ctx, comp) if ctx.reward_sources else None  # outcome rewards (B, G)
        step_scores = score_steps(ctx, comp) if ctx.process_sources else None  # step rewards [B][G][K]
    n = len(rows)
    rewards = torch.full((n,), float("nan")) if scores is None else ctx.dist.shard(trl_reward(ctx, scores).flatten())
    per_func = None if scores is None else ctx.dist.shard(scores.per_func.flatten(0, 1))  # (N, F)
    steps = None
    if step_scores is not None:
        local = ctx.dist.shard([r for group in step_scores.rewards for r in group])
        steps = [list(zip(texts, r)) for texts, r in zip(step_scores.texts, local)]
    # per local group; only dynamic sampling asks, and it keeps whole groups on each process
    signal = ctx.dist.shard(group_signal(ctx, scores, step_scores)) if ctx.args.dynamic_sampling else None
    return Round(comp, advantages(ctx, comp, scores, step_scores), rewards, per_func, steps, signal, scores,
                 step_scores)


# ---- stages ---------------------------------------------------------------------------------------------------------
def generate(ctx: RolloutContext, model, rows: list[dict[str, Any]], *, greedy: bool = False,
             evaluation: bool = False) -> Completions:
    """Sample one completion per row (rows already repeated G times, group rows contiguous); with tools or an
    environment (ctx.agent), one multi-turn conversation per row (groupwise.agents.turns), its processes calling the
    generator independently (they may run different numbers of turns); with a rollout_func (ctx.rollout_func), the
    user's function samples (groupwise.custom_rollout)."""
    args, tok, device = ctx.args, ctx.tokenizer, ctx.dist.device
    # the sampler's log-probs, for the importance correction and the off-policy mask
    want = (ctx.correct_sampling or args.keeps_sampling_logps) and not greedy and not evaluation

    def sample(prompt_ids, prompt_mask, **limit):  # left-padded prompts → Generated (one turn's, with tools)
        out = ctx.generator(model, prompt_ids.to(device), prompt_mask.to(device), greedy=greedy, logprobs=want,
                            **limit)  # a later tool turn's max_new_tokens
        if want and out.logprobs is None:
            needs, off = (("the importance-sampling correction", "vllm_importance_sampling_correction=False")
                          if ctx.correct_sampling else ("the off-policy mask", "off_policy_mask_threshold=None"))
            raise ValueError(f"generation_backend={args.generation_backend!r} returned no sampling log-probs, which "
                             f"{needs} needs: return Generated(ids, logprobs) when asked for them, or set {off}")
        return out

    if ctx.rollout_func is not None:
        required = want and (ctx.correct_sampling or args.corrects_sampling)  # the importance correction's
        # the off-policy mask reads them when given, else π_θold (as TRL)
        kept = want or args.off_policy_mask_threshold is not None and not greedy and not evaluation
        reserved = REWARD_KEYWORDS | (PROCESS_REWARD_KEYWORDS if ctx.process_sources else frozenset())

        def custom() -> Completions:
            return rollout_completions(
                ctx.rollout_func, rows, tokenizer=tok, eos_token_ids=ctx.eos_token_ids,
                max_completion_length=args.max_completion_length, logprobs=required, device=device,
                keep_logprobs=kept, vocab_size=embedding_rows(model) if model is not None else None, reserved=reserved)

        # training: a failure on one process (its output refused) stops every process; evaluation runs its
        # processes' different numbers of calls under run_together already (groupwise.evaluation)
        comp = custom() if evaluation else ctx.dist.run_together(custom, "rollout_func")
    elif ctx.agent is not None:
        def turns() -> Completions:
            with independently(ctx.generator, model):
                return _from_turns(ctx, ctx.agent.rollout(model, rows, sample, ctx.eos_token_ids))

        # training: an environment failing on one process (its reset) stops every process with it (each process
        # makes this call once per round); evaluation's processes make different numbers of calls, and its whole
        # share runs under run_together already (groupwise.evaluation)
        comp = turns() if evaluation else ctx.dist.run_together(turns, "the tool / environment rollout")
    else:
        prompts = [r["prompt"] for r in rows]
        prompt_ids, prompt_mask = encode_prompts(prompts, tok, args.max_prompt_length, args.chat_template_kwargs)
        out = sample(prompt_ids, prompt_mask)
        completion_ids = out.completion_ids  # (N, T)
        mask, truncated = completion_masks(completion_ids, ctx.eos_token_ids, args.max_completion_length,
                                           out.lengths)
        completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, tok.pad_token_id))
        completions = as_completions(tok, trim_to_mask(completion_ids, mask),
                                     [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)],
                                     is_conversational(prompts[0]))
        sampling_logps = out.logprobs[:, :completion_ids.size(1)].float() if want else None
        comp = Completions(prompt_ids.to(device), prompt_mask.to(device), completion_ids, mask, truncated, prompts,
                           completions, {}, sampling_logps)
    # pad_to_multiple_of: the training tensors' widths (generation saw the prompts unpadded)
    multiple, pad = args.pad_to_multiple_of, tok.pad_token_id
    prompt_ids, prompt_mask = pad_to_multiple(comp.prompt_ids, comp.prompt_mask, multiple, pad, side="left")
    completion_ids, mask = pad_to_multiple(comp.completion_ids, comp.completion_mask, multiple, pad, side="right")
    widen = {}
    for name in ("sampling_logps", "tool_mask"):  # 0 on the added columns
        if getattr(comp, name) is not None:
            widen[name] = pad_to_multiple(getattr(comp, name), comp.completion_mask, multiple, 0, side="right")[0]
    # dataset columns reach reward functions as keywords, unless remove_unused_columns (TRL: the prompt only)
    columns = {} if args.remove_unused_columns else {k: [r[k] for r in rows] for k in rows[0] if k not in NEVER_PASSED}
    columns.update(comp.columns)  # `environments` (TRL: also with remove_unused_columns)
    return dataclasses.replace(comp, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                               completion_mask=mask, columns=columns, **widen)


def _from_turns(ctx: RolloutContext, turns: Turns) -> Completions:
    """groupwise.agents.Turns (ragged lists) as a Completions record: prompts left-padded, completions, tool_mask and
    log-probs right-padded (tool_mask and log-probs 0 on padding)."""
    pad, device = ctx.tokenizer.pad_token_id, ctx.dist.device
    prompt_ids, prompt_mask = pad_rows(turns.prompt_ids, pad, side="left")
    completion_ids, mask = pad_rows(turns.completion_ids, pad, side="right")
    tool_mask, _ = pad_rows(turns.tool_mask, 0, side="right")  # same widths as completion_ids
    sampling_logps = None
    if turns.logprobs is not None:
        sampling_logps = pad_rows(turns.logprobs, 0.0, width=mask.size(1), dtype=torch.float)[0].to(device)
    columns = {} if turns.environments is None else {"environments": list(turns.environments)}
    return Completions(prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device), mask.to(device),
                       torch.tensor(turns.truncated, device=device), turns.prompts, turns.completions, columns,
                       sampling_logps, tool_mask.to(device), turns.turn_ends, torch.tensor(turns.tool_calls),
                       torch.tensor(turns.tool_failures), torch.tensor(turns.tool_timeouts))


def score(ctx: RolloutContext, comp: Completions) -> Scores:
    """Rewards on this process, gathered over all processes, combined over reward functions."""
    args, G = ctx.args, ctx.args.num_generations
    local, errors = ctx.dist.run_together(lambda: compute_rewards(
        ctx.reward_sources, comp.prompts, comp.completions, comp.token_lists(), comp.columns,
        on_error=args.on_reward_error, timeout=args.reward_timeout, extra=ctx.reward_kwargs), "a reward function")
    per_func = ctx.dist.gather(local.to(ctx.dist.device)).cpu()  # (B·G, F), rank order = row order
    errors = ctx.dist.sum(errors.to(ctx.dist.device)).cpu()
    per_func = per_func.view(-1, G, per_func.size(-1))  # (B, G, F)
    rewards = combine_rewards(per_func, ctx.reward_weights, aggregation=args.multi_objective_aggregation,
                              std=args.reward_std, eps=args.advantage_eps)
    return Scores(per_func, rewards, tuple(s.name for s in ctx.reward_sources), errors)


def score_steps(ctx: RolloutContext, comp: Completions) -> StepScores:
    """Split this process's completions into steps, score them, gather the round."""
    G = ctx.args.num_generations
    steps, rewards, errors, totals = ctx.dist.run_together(
        lambda: local_step_rewards(ctx, comp, ctx.reward_kwargs), "a process reward function")
    texts = [list(s.texts) for s in steps]
    gathered = ctx.dist.gather_object([(r, list(s.ends)) for r, s in zip(rewards, steps)])  # (B·G) rank order
    errors = ctx.dist.sum(errors.to(ctx.dist.device)).cpu()
    totals = ctx.dist.sum(totals.to(ctx.dist.device, exact_dtype(ctx.dist.device))).cpu().double()  # (MPS: float32)
    B = len(gathered) // G
    all_rewards = [[gathered[b * G + g][0] for g in range(G)] for b in range(B)]
    all_ends = [[gathered[b * G + g][1] for g in range(G)] for b in range(B)]
    return StepScores(all_rewards, all_ends, texts, tuple(s.name for s in ctx.process_sources), errors, totals)


def local_step_rewards(ctx: RolloutContext, comp: Completions,
                       extra: dict) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """This process's completions split into steps and scored: (steps, (N)[K_i] combined step rewards, (F,)
    errors, (F, 2) each function's sum and count of step rewards); `extra`: the keywords every process reward
    function gets (trainer_state, log_metric, …)."""
    args = ctx.args
    steps, dropped = split_steps(ctx, comp)
    rewards, errors, totals = compute_step_rewards(
        ctx.process_sources, ctx.process_weights, comp.prompts, comp.completions, [list(s.texts) for s in steps],
        comp.columns, on_error=args.on_reward_error, timeout=args.reward_timeout, extra=extra, dropped_last=dropped)
    return steps, rewards, errors, totals


def split_steps(ctx: RolloutContext, comp: Completions) -> tuple[list, list[bool]]:
    """This process's completions as steps (ctx.splitter), a last step cut by max_completion_length dropped unless
    score_truncated_step; with which rows dropped one."""
    args, tok = ctx.args, ctx.tokenizer
    steps, dropped = [], []
    turns = ctx.splitter.turns  # step_split="turn": the assistant turns are the steps
    if turns and comp.turn_ends is None:
        raise ValueError("step_split='turn' needs multi-turn rollouts: pass tools= or environment_factory= to "
                         "GRPOTrainer (or return env_mask from rollout_func), or choose another step_split")
    if not turns and comp.tool_mask is not None and bool(((comp.tool_mask == 0) & (comp.completion_mask != 0)).any()):
        raise ConfigError(TOOL_TEXT_STEPS.format(args.step_split))  # e.g. a rollout_func returning env_mask
    tool_masks = comp.tool_mask.tolist() if turns else None
    for i, (ids, no_eos) in enumerate(zip(comp.token_lists(), comp.truncated.tolist())):
        # cut by max_completion_length; a row that ended without EOS before it (a stop string or stop token) is
        # finished: its last step is judged (TRL's `truncated`, no EOS, still counts it for clipped_ratio)
        cut = no_eos and len(ids) >= args.max_completion_length
        if turns:
            s = ctx.splitter.split_turns(ids, tool_masks[i], comp.turn_ends[i], tok, truncated=cut)
        else:
            s = ctx.splitter.split(ids, tok, ends_with_eos=not no_eos, truncated=cut)
        dropped.append(s.truncated_last and not args.score_truncated_step)
        if dropped[-1]:
            s = s.drop_last()  # a step cut mid-way is not judged; its tokens get advantage 0
        steps.append(s)
    return steps, dropped


def advantages(ctx: RolloutContext, comp: Completions, scores: Scores | None,
               step_scores: StepScores | None) -> torch.Tensor:  # (N,) or (N, T)
    """This process's advantages: the estimator over the round's groups (groupwise.core.advantages), combined as
    the supervision variant says (groupwise.core.supervision)."""
    args, T = ctx.args, comp.completion_ids.size(1)
    outcome = process = None
    if scores is not None:  # estimator=… and the options it takes
        outcome = ctx.dist.shard(outcome_advantages(scores.rewards, **args.estimator_options(outcome=True)).flatten())
    if step_scores is not None:
        adv = process_advantages(step_scores.rewards, step_scores.ends, args.max_completion_length,
                                 form=args.step_advantage, **args.estimator_options())
        process = ctx.dist.shard(adv.flatten(0, 1))  # (N, max_completion_length)
        if process.size(1) < T:  # pad_to_multiple_of widened the batch past max_completion_length
            process = torch.nn.functional.pad(process, (0, T - process.size(1)))
        process = process[:, :T]  # (N, T)
    adv = token_advantages(args.supervision, outcome, process, outcome_weight=args.outcome_advantage_weight,
                           process_weight=args.process_advantage_weight)
    return adv.to(comp.completion_ids.device)


def build_batch(ctx: RolloutContext, rnd: Round, model, metrics: dict[str, float] | None = None) -> TrainBatch:
    """The update's tensors for a round: ids and masks, advantages, π_θold when needed, π_ref when β > 0, and the
    importance weights when the sampler's numerics differ from the trainer's (their statistics go to `metrics`)."""
    args, comp = ctx.args, rnd.completions
    # the one place the loss mask is made: model-generated tokens only (tool / environment tokens are context, seen
    # through attention_mask, never trained on); loss, entropy, KL, clip statistics, importance weights and the dapo
    # token count (num_items_in_batch) all read TrainBatch.completion_mask
    loss_mask = comp.loss_mask
    if args.mask_truncated_completions:
        loss_mask = loss_mask * (~comp.truncated).unsqueeze(-1).long()
    input_ids = torch.cat([comp.prompt_ids, comp.completion_ids], dim=1)
    attention_mask = torch.cat([comp.prompt_mask, comp.completion_mask], dim=1)
    T = comp.completion_ids.size(1)
    old = ref = weights = None
    # π_θold in the trainer's numerics: when the policy moves within the round, and for the importance correction
    if ctx.need_old_logps or ctx.correct_sampling:
        old = batched_logps(ctx.policy_logps or model, input_ids, attention_mask, T, temperature=args.temperature,
                            batch_size=args.per_device_train_batch_size, chunk_tokens=args.logprob_chunk_tokens)
    if ctx.correct_sampling:
        weights, stats = sampling_weights(old, comp.sampling_logps.to(old.device), loss_mask,
                                          mode=args.vllm_importance_sampling_mode,
                                          clip_min=args.vllm_importance_sampling_clip_min,
                                          clip_max=args.vllm_importance_sampling_clip_max)
        if metrics is not None:
            metrics.update(sampling_metrics(ctx, stats))
    if ctx.reference is not None:  # β > 0 only; with LoRA: the policy with its adapters disabled
        with ctx.reference.context(), ctx.dist.autocast():  # the trainer's precision, as π_θ
            ref = batched_logps(ctx.reference.logps_model, input_ids, attention_mask, T, temperature=args.temperature,
                                batch_size=args.per_device_train_batch_size, chunk_tokens=args.logprob_chunk_tokens)
    sampled = comp.sampling_logps if args.off_policy_mask_threshold is not None else None  # the mask's π_sampler
    return TrainBatch(input_ids, attention_mask, loss_mask, rnd.advantages, old, ref, weights, sampled)



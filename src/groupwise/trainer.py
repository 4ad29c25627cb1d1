"""GRPOTrainer: the loop. Each generation round: rollout (generate → score → advantages), then μ × micro-batch
updates grouped into optimizer steps; log, evaluate, checkpoint. TRL's constructor signature and field meanings."""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from typing import Any

import torch
from tqdm.auto import tqdm

from groupwise import rollout as R
from groupwise.checkpoint import load_checkpoint, save_checkpoint
from groupwise.config import GRPOConfig
from groupwise.data import PromptData, PromptSampler
from groupwise.distributed import Distributed
from groupwise.generation import GENERATORS
from groupwise.logging import MetricsLogger, print_completions
from groupwise.modeling import PolicyForLogps, disable_dropout
from groupwise.rewards import compute_rewards, load_reward_sources
from groupwise.rewards.process import load_process_reward_sources
from groupwise.rewards.steps import StepSplitter
from groupwise.types import TrainBatch
from groupwise.update import UpdateContext, optimizer_step, windows


class GRPOTrainer:
    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, process_reward_funcs=None):
        # ---- everything that can be checked without a model ----------------------------------------------------
        self.args = args = GRPOConfig() if args is None else args
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a groupwise.GRPOConfig, got {type(args).__name__}")
        self.dist = Distributed(bf16=args.bf16)
        self.layout = args.layout(self.dist.world_size)
        self.train_data = PromptData(train_dataset, "train_dataset")
        self.eval_data = PromptData(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        reward_funcs = _as_list(reward_funcs)
        process_reward_funcs = _as_list(process_reward_funcs)
        if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
            raise ValueError(f"reward_weights has {len(args.reward_weights)} entries for {len(reward_funcs)} reward functions")
        if args.supervision == "outcome" and process_reward_funcs:
            raise ValueError("process_reward_funcs were given but supervision='outcome': set supervision='process' "
                             "or 'both' (GRPOConfig) to use them")
        if args.supervision != "outcome" and not process_reward_funcs:
            raise ValueError(f"supervision={args.supervision!r} needs process_reward_funcs (one reward per step)")
        if args.supervision != "process" and not reward_funcs:
            raise ValueError(f"supervision={args.supervision!r} needs at least one outcome reward function")
        if args.process_reward_weights is not None and len(args.process_reward_weights) != len(process_reward_funcs):
            raise ValueError(f"process_reward_weights has {len(args.process_reward_weights)} entries for "
                             f"{len(process_reward_funcs)} process reward functions")
        if not isinstance(model, (str, torch.nn.Module)):
            raise TypeError(f"model must be a path / hub id or a transformers model, got {type(model).__name__}")
        if not isinstance(model, str) and args.model_init_kwargs:
            raise ValueError("model_init_kwargs only applies when model is a path; the model is already loaded")
        from transformers import set_seed

        set_seed(args.seed + self.dist.rank)  # each process samples different completions
        self.sampler = PromptSampler(len(self.train_data), self.layout.prompts_per_generation,
                                     shuffle=args.shuffle_dataset, seed=args.seed)
        steps_per_round = self.layout.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        self.steps_per_round = steps_per_round
        self.max_steps = args.max_steps if args.max_steps > 0 else \
            math.ceil(args.num_train_epochs * self.sampler.rounds_per_epoch()) * steps_per_round

        # ---- models --------------------------------------------------------------------------------------------
        policy, self.tokenizer = _load_policy(model, processing_class, args)
        self.ref_model = None
        if args.beta != 0.0:
            self.ref_model = copy.deepcopy(policy).eval().requires_grad_(False).to(self.dist.device)
        self.reward_sources = load_reward_sources(reward_funcs, reward_processing_classes,
                                                  trust_remote_code=args.trust_remote_code,
                                                  device=self.dist.device) if reward_funcs else []
        self.process_sources = load_process_reward_sources(
            process_reward_funcs, trust_remote_code=args.trust_remote_code,
            device=self.dist.device) if process_reward_funcs else []
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                      weight_decay=args.weight_decay)
        from transformers import get_scheduler

        warmup = args.warmup_steps or int(args.warmup_ratio * self.max_steps)
        self.scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                       num_training_steps=self.max_steps)
        # the policy is trained through PolicyForLogps: one forward returns log-probs without full logits
        self.model, self.optimizer = self.dist.prepare(PolicyForLogps(policy, args.logprob_chunk_tokens), optimizer)

        eos = _eos_ids(self.tokenizer, self.unwrapped)
        sampling = dict(max_completion_length=args.max_completion_length, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                        pad_token_id=self.tokenizer.pad_token_id, eos_token_ids=eos)
        if args.generation_backend == "fast":
            generator = GENERATORS["fast"](**sampling, group_size=args.num_generations)
        else:
            generator = GENERATORS["transformers"](**sampling, generation_kwargs=args.generation_kwargs)
        weights = torch.tensor(args.reward_weights or [1.0] * len(self.reward_sources), dtype=torch.float)
        process_weights = torch.tensor(args.process_reward_weights or [1.0] * len(self.process_sources))
        splitter = StepSplitter(args.step_split, delimiter=args.step_delimiter, pattern=args.step_pattern,
                                step_tag=args.step_tag)
        self.rollout_ctx = R.RolloutContext(args, self.tokenizer, generator, self.reward_sources, weights, eos,
                                            self.dist, self.process_sources, process_weights, splitter)
        self.update_ctx = UpdateContext(args, self.dist, self.model, self.optimizer, self.scheduler)
        # π_θold differs from π_θ for a micro-batch whenever an optimizer step happened since generation
        self.need_old_logps = args.num_iterations > 1 or self.layout.steps_per_generation > args.gradient_accumulation_steps
        self.global_step = 0
        self.skipped_steps = 0

    @property
    def unwrapped(self):
        """The Hugging Face model being trained (no distributed or log-prob wrapper)."""
        return self.dist.unwrap(self.model).model

    # ---- the loop -----------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None) -> dict[str, float]:
        args = self.args
        resume = resume_from_checkpoint or args.resume_from_checkpoint
        pending = self._resume(resume) if resume else None
        logger = MetricsLogger(args.output_dir, args.report_to, enabled=self.dist.is_main, config=args.to_dict(),
                               resume_step=self.global_step)
        bar = tqdm(total=self.max_steps, initial=self.global_step, desc="GRPO", disable=not self.dist.is_main)
        started = time.perf_counter()
        elapsed = lambda: {"time/elapsed": time.perf_counter() - started}  # noqa: E731  (this process's run)
        if self.eval_data is not None and self.global_step == 0:
            logger.log(0, {**self.evaluate(), **elapsed()})
        window_metrics: dict[str, list[float]] = defaultdict(list)
        last: dict[str, float] = {}
        while self.global_step < self.max_steps:
            tick = time.perf_counter()
            if pending is None:
                batch, round_metrics, comp, scores = self._rollout()
                round_metrics["time/generation"] = time.perf_counter() - tick
                round_step = 0
            else:
                batch, round_metrics, round_step = pending
                comp = scores = pending = None
            steps = windows(batch, self.layout.micro_batch_size, self.layout.steps_per_generation,
                            args.num_iterations, args.gradient_accumulation_steps)
            for window in steps[round_step:]:
                metrics = optimizer_step(self.update_ctx, window)
                self.global_step += 1
                round_step += 1
                self.skipped_steps += int(metrics["train/skipped"])
                metrics.update(round_metrics, **{"time/step": time.perf_counter() - tick, "train/skipped_steps": self.skipped_steps})
                tick = time.perf_counter()
                for k, v in metrics.items():
                    window_metrics[k].append(v)
                self._maybe_sync_ref()
                bar.update(1)
                if self.global_step % max(args.logging_steps, 1) == 0 or self.global_step == self.max_steps:
                    last = {k: _nanmean(v) for k, v in window_metrics.items()}
                    last["epoch"] = self.sampler.epoch + self.sampler.position / len(self.train_data)
                    last.update(elapsed())
                    logger.log(self.global_step, last)
                    window_metrics.clear()
                    bar.set_postfix({k.split("/")[-1]: f"{last[k]:.4g}" for k in
                                     ("reward/mean", "process/step_reward_mean", "loss/policy", "gen/mean_length")
                                     if k in last})
                    if args.log_completions and comp is not None and self.dist.is_main:
                        _print_round(self.global_step, comp, scores, self.rollout_ctx, args.num_completions_to_print)
                if args.save_steps and self.global_step % args.save_steps == 0 or self.global_step == self.max_steps:
                    self.save(batch if round_step < len(steps) else None, round_metrics, round_step)
                if self.eval_data is not None and (
                        (args.eval_steps and self.global_step % args.eval_steps == 0) or self.global_step == self.max_steps):
                    logger.log(self.global_step, {**self.evaluate(), **elapsed()})
                if self.global_step >= self.max_steps:
                    break
        bar.close()
        logger.close()
        self.dist.barrier()
        return last

    # ---- stages -------------------------------------------------------------------------------------------------
    def _rollout(self):
        ctx = self.rollout_ctx
        comp, scores, step_scores, advantages = self._generate_round()
        metrics = R.rollout_metrics(ctx, comp, scores, step_scores)
        if self.args.dynamic_sampling:
            comp, advantages, dyn = self._refill_groups(comp, scores, step_scores, advantages)
            metrics.update(dyn)
        batch = R.build_batch(ctx, comp, advantages, model=self.unwrapped, ref_model=self.ref_model,
                              need_old_logps=self.need_old_logps)
        return batch, metrics, comp, (scores, step_scores, advantages)

    def _generate_round(self):
        ctx, G, rank = self.rollout_ctx, self.args.num_generations, self.dist.rank
        prompt_idx = self.sampler.next_round()  # B prompts of the whole round, same on every process
        rows = [i for i in prompt_idx for _ in range(G)]  # (B·G) rows, group rows contiguous
        n = self.layout.local_rows
        local = [self.train_data[i] for i in rows[rank * n:(rank + 1) * n]]
        comp = R.generate(ctx, self.unwrapped, local)
        scores = R.score(ctx, comp) if self.reward_sources else None  # outcome rewards (B, G)
        step_scores = R.score_steps(ctx, comp) if self.process_sources else None  # step rewards [B][G][K]
        return comp, scores, step_scores, R.local_advantages(ctx, comp, scores, step_scores)  # (N,) or (N, T)

    def _refill_groups(self, comp, scores, step_scores, advantages):
        """DAPO dynamic sampling: keep the groups with a learning signal, generate further rounds (at most
        max_dynamic_sampling_rounds) until this process has as many as it started with, then fill any gap with
        dropped groups. Every process loops until all are full, so collectives stay matched."""
        ctx, G = self.rollout_ctx, self.args.num_generations
        need = comp.completion_ids.size(0) // G
        comps, advs, kept, spare = [comp], [advantages], [], []
        signal = R.local_groups(ctx, R.group_signal(ctx, scores, step_scores))
        dropped = int(self.dist.sum(torch.tensor(float((~signal).sum()), device=self.dist.device)))
        extra = 0
        while True:
            r = len(comps) - 1
            kept += [(r, g) for g in range(need) if signal[g]]
            spare += [(r, g) for g in range(need) if not signal[g]]
            if extra >= self.args.max_dynamic_sampling_rounds or not self.dist.any(len(kept) < need):
                break
            c, s, ss, a = self._generate_round()
            comps.append(c)
            advs.append(a)
            signal = R.local_groups(ctx, R.group_signal(ctx, s, ss))
            extra += 1
        unfilled = max(0, need - len(kept))
        picks = kept[:need] + spare[:unfilled]
        comp, advantages = R.select_groups(comps, advs, picks, G, self.tokenizer.pad_token_id)
        return comp, advantages.to(comp.completion_ids.device), {
            "dynamic/dropped_groups": float(dropped), "dynamic/extra_rounds": float(extra),
            "dynamic/unfilled_groups": float(self.dist.sum(torch.tensor(float(unfilled), device=self.dist.device)))}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completion of every eval prompt: eval/reward/mean (weighted) and eval/<func> per function."""
        ctx, data, dist = self.rollout_ctx, self.eval_data, self.dist
        mine = list(range(dist.rank, len(data), dist.world_size))
        per_func, lengths = [], []
        bs = self.args.per_device_eval_batch_size
        for start in range(0, len(mine), bs):
            rows = [data[i] for i in mine[start:start + bs]]
            comp = R.generate(ctx, self.unwrapped, rows, greedy=True)
            rewards, _ = compute_rewards(self.reward_sources, comp.prompts, comp.completions, comp.token_lists(),
                                         comp.columns, on_error=self.args.on_reward_error)
            per_func += rewards.tolist()
            lengths += comp.lengths.tolist()
        lengths = torch.tensor(dist.gather_object(lengths), dtype=torch.float)
        out = {"eval/mean_length": float(lengths.mean())}
        if not self.reward_sources:
            return out
        per_func = torch.tensor(dist.gather_object(per_func), dtype=torch.float).view(-1, len(self.reward_sources))
        out["eval/reward/mean"] = float(torch.nanmean(torch.nansum(per_func * self.rollout_ctx.reward_weights, -1)))
        for f, src in enumerate(self.reward_sources):
            out[f"eval/{src.name}"] = float(torch.nanmean(per_func[:, f]))  # e.g. eval/accuracy
        return out

    def _maybe_sync_ref(self) -> None:
        """TR-DPO (Gorbatovski et al. 2024): ref ← α·policy + (1−α)·ref every ref_model_sync_steps."""
        args = self.args
        if not args.sync_ref_model or self.global_step % args.ref_model_sync_steps:
            return
        with torch.no_grad():
            for ref_p, p in zip(self.ref_model.parameters(), self.unwrapped.parameters()):
                ref_p.mul_(1 - args.ref_model_mixup_alpha).add_(p.detach().to(ref_p.dtype), alpha=args.ref_model_mixup_alpha)

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save(self, pending: TrainBatch | None = None, round_metrics: dict | None = None, round_step: int = 0):
        state = {"global_step": self.global_step, "max_steps": self.max_steps, "sampler": self.sampler.state_dict(),
                 "skipped_steps": self.skipped_steps, "world_size": self.dist.world_size,
                 "round_step": round_step if pending is not None else 0,
                 "round_metrics": round_metrics if pending is not None else None}
        return save_checkpoint(self.args.output_dir, self.global_step, dist=self.dist, model=self.unwrapped,
                               tokenizer=self.tokenizer, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=state, pending=pending.tensors() if pending is not None else None,
                               ref_model=self.ref_model if self.args.sync_ref_model else None,
                               save_total_limit=self.args.save_total_limit)

    def _resume(self, path: str):
        state, pending = load_checkpoint(path, dist=self.dist, model=self.unwrapped, optimizer=self.optimizer,
                                         scheduler=self.scheduler, ref_model=self.ref_model)
        if state["world_size"] != self.dist.world_size:
            raise ValueError(f"{path} was saved by {state['world_size']} processes; resume with the same number "
                             f"(now {self.dist.world_size}) so the data split and RNG streams match")
        self.global_step, self.skipped_steps = state["global_step"], state["skipped_steps"]
        self.sampler.load_state_dict(state["sampler"])
        if pending is None:
            return None
        return TrainBatch.from_tensors(pending), state["round_metrics"], state["round_step"]


def _load_policy(model, processing_class, args: GRPOConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model, str):
        kwargs = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
        policy = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        tokenizer = processing_class or AutoTokenizer.from_pretrained(model, trust_remote_code=args.trust_remote_code)
    else:
        policy, tokenizer = model, processing_class
        if tokenizer is None:
            name = getattr(policy.config, "_name_or_path", "")
            if not name:
                raise ValueError("the model was passed as an object: pass its tokenizer as processing_class")
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise ValueError("the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token")
    if args.disable_dropout:
        disable_dropout(policy)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    policy.train()
    return policy, tokenizer


def _eos_ids(tokenizer, model) -> list[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (tokenizer.eos_token_id, gen_eos):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    if not ids:
        raise ValueError("no EOS token: the tokenizer and the model's generation_config both lack eos_token_id")
    return sorted(ids)


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(finite) / len(finite) if finite else float("nan")


def _as_list(funcs) -> list:
    if funcs is None:
        return []
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]


def _print_round(step: int, comp, scored, ctx, limit: int | None) -> None:
    scores, step_scores, advantages = scored
    n = len(comp.prompts)
    rewards = R.local_slice(ctx, scores.rewards).tolist() if scores is not None else [float("nan")] * n
    first_token_adv = (advantages if advantages.dim() == 1 else advantages[:, 0]).tolist()
    steps = None
    if step_scores is not None:
        G = ctx.args.num_generations
        lo = ctx.dist.rank * n
        step_rewards = [step_scores.rewards[(lo + i) // G][(lo + i) % G] for i in range(n)]
        steps = [list(zip(texts, r)) for texts, r in zip(step_scores.texts, step_rewards)]
    print_completions(step, comp.prompts, comp.completions, rewards, first_token_adv, limit, steps=steps)

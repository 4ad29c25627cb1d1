"""GRPOTrainer: the loop. Each generation round: rollout (generate → score → advantages), then μ × micro-batch
updates grouped into optimizer steps; log, evaluate, checkpoint. TRL's constructor signature and field meanings."""

from __future__ import annotations

import contextlib
import copy
import math
import signal
import threading
import time
import uuid
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from groupwise import rollout as R
from groupwise.checkpoint import CheckpointError, claim_output_dir, load_checkpoint, read_state, save_checkpoint
from groupwise.config import GRPOConfig
from groupwise.data import PromptData, PromptSampler
from groupwise.distributed import Distributed
from groupwise.generation import build_generator
from groupwise.loading import as_list, check_inputs, eos_token_ids, load_policy, load_tokenizer
from groupwise.logging import MetricsLogger, print_completions
from groupwise.modeling import PolicyForLogps
from groupwise.rewards import compute_rewards, load_reward_sources
from groupwise.rewards.combine import weighted_nansum
from groupwise.rewards.process import load_process_reward_sources
from groupwise.rewards.steps import StepSplitter
from groupwise.types import Rollout, Round, TrainBatch
from groupwise.update import UpdateContext, optimizer_step, windows


# fields a resumed run must share with the checkpoint for the data order and batch layout to continue exactly
RESUME_FIELDS = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                 "steps_per_generation", "generation_batch_size", "seed", "data_seed", "shuffle_dataset",
                 "dynamic_sampling")


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many non-finite steps in a row); the last good checkpoint is kept."""


class TrainingInterrupted(RuntimeError):
    """SIGINT / SIGTERM stopped the run after an optimizer step (a checkpoint written when save_on_interrupt)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class GRPOTrainer:
    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, process_reward_funcs=None):
        # everything that can be checked without a model comes first
        self.args = args = GRPOConfig() if args is None else args
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a groupwise.GRPOConfig, got {type(args).__name__}")
        self.dist = Distributed(bf16=args.bf16, timeout=args.ddp_timeout)
        self.layout = args.layout(self.dist.world_size)
        self.train_data = PromptData(train_dataset, "train_dataset")
        self.eval_data = PromptData(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        reward_funcs, process_reward_funcs = check_inputs(args, model, as_list(reward_funcs),
                                                           as_list(process_reward_funcs))
        from transformers import set_seed

        set_seed(args.seed + self.dist.rank)  # each process samples different completions
        self.sampler = PromptSampler(len(self.train_data), self.layout.prompts_per_generation,
                                     shuffle=args.shuffle_dataset, seed=args.seed if args.data_seed is None else args.data_seed)
        self.steps_per_round = self.layout.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        self.max_steps = args.max_steps if args.max_steps > 0 else \
            math.ceil(args.num_train_epochs * self.sampler.rounds_per_epoch()) * self.steps_per_round
        from transformers import TrainerControl, TrainerState

        # transformers' own records, as TRL users read them: state.global_step, state.log_history, …
        self.state = TrainerState(max_steps=self.max_steps, num_train_epochs=args.num_train_epochs,
                                  logging_steps=args.logging_steps, eval_steps=args.eval_steps, save_steps=args.save_steps,
                                  train_batch_size=args.per_device_train_batch_size,
                                  is_local_process_zero=self.dist.accelerator.is_local_main_process,
                                  is_world_process_zero=self.dist.is_main)
        self.control = TrainerControl()
        self.callbacks = list(callbacks or [])
        self._window: dict[str, list[float]] = defaultdict(list)  # metrics since the last log line (log_metric too)
        self._extra: dict[str, list] = defaultdict(list)  # log_extra columns of the current round
        # the tokenizer (cheap) checks every prompt's length; then the models and what is built around them
        self.tokenizer, max_positions = load_tokenizer(model, processing_class, args)
        for data in (self.train_data, self.eval_data):
            if data is not None:
                data.check_lengths(self.tokenizer, max_prompt_length=args.max_prompt_length,
                                   max_completion_length=args.max_completion_length, max_positions=max_positions,
                                   truncate_prompt=args.truncate_prompt, chat_template_kwargs=args.chat_template_kwargs)
        policy = load_policy(model, args)
        self.ref_model = self._build_reference(policy)
        self.reward_sources = load_reward_sources(reward_funcs, reward_processing_classes,
                                                  trust_remote_code=args.trust_remote_code,
                                                  device=self.dist.device) if reward_funcs else []
        self.process_sources = load_process_reward_sources(
            process_reward_funcs, trust_remote_code=args.trust_remote_code,
            device=self.dist.device) if process_reward_funcs else []
        self.model, self.optimizer, self.scheduler = self._build_optimization(policy)
        self.rollout_ctx = self._build_rollout()
        self.update_ctx = UpdateContext(args, self.dist, self.model, self.optimizer, self.scheduler)
        self.skipped_steps = 0
        self.consecutive_skipped = 0
        self.run_id = uuid.uuid4().hex[:12]  # kept across resumes: checkpoints and metrics lines carry it

    # ---- builders -----------------------------------------------------------------------------------------------
    def _build_reference(self, policy):
        """π_ref for the KL term (β > 0 only): a frozen copy of the initial policy."""
        if self.args.beta == 0.0:
            return None
        return copy.deepcopy(policy).eval().requires_grad_(False).to(self.dist.device)

    def _build_optimization(self, policy):
        """AdamW and the schedule; the policy is trained through PolicyForLogps (log-probs without full logits)."""
        args = self.args
        from transformers import get_scheduler

        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                      weight_decay=args.weight_decay)
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup(self.max_steps),
                                  num_training_steps=self.max_steps)
        model, optimizer = self.dist.prepare(PolicyForLogps(policy, args.logprob_chunk_tokens), optimizer)
        return model, optimizer, scheduler

    def _build_rollout(self) -> R.RolloutContext:
        args = self.args
        eos = eos_token_ids(self.tokenizer, self.unwrapped)
        return R.RolloutContext(
            args=args, tokenizer=self.tokenizer, dist=self.dist, eos_token_ids=eos,
            generator=build_generator(args, pad_token_id=self.tokenizer.pad_token_id, eos_token_ids=eos),
            reward_sources=self.reward_sources, process_sources=self.process_sources,
            splitter=StepSplitter.from_config(args), data=self.train_data, sampler=self.sampler,
            ref_model=self.ref_model,
            # TRL's reward-function keywords: curriculum from the state, metrics and completion columns out
            reward_kwargs={"trainer_state": self.state, "log_metric": self._log_metric, "log_extra": self._log_extra},
            # π_θold differs from π_θ for a micro-batch whenever an optimizer step happened since generation
            need_old_logps=args.num_iterations > 1 or self.layout.steps_per_generation > args.gradient_accumulation_steps)

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.state.global_step = value

    @property
    def unwrapped(self):
        """The Hugging Face model being trained (no distributed or log-prob wrapper)."""
        return self.dist.unwrap(self.model).model

    # ---- the loop -----------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None) -> dict[str, float]:
        resume = resume_from_checkpoint or self.args.resume_from_checkpoint
        if not resume:  # a new run never writes over another run's outputs (checked by the main process)
            self.dist.run_together(lambda: self.dist.is_main and claim_output_dir(
                self.args.output_dir, self.args.overwrite_output_dir), "checking output_dir")
        pending = self._resume(resume) if resume else None  # a round interrupted by the checkpoint, if any
        with self._signals_stop_the_run():
            self._begin()
            try:
                while not self._finished():
                    rollout, done = pending or (self._collect(), 0)
                    pending = None
                    for window in self._windows(rollout)[done:]:
                        metrics = optimizer_step(self.update_ctx, window)
                        done += 1
                        self._after_step(rollout, done, metrics)
                        if self._finished():
                            break
            finally:  # also when the run stops on an error or a signal: trackers flushed, progress bar closed
                self._bar.close()
                self._logger.close()
        return self._end()

    # ---- phases -------------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Metrics file, progress bar, clocks; the step-0 evaluation of a fresh run."""
        args = self.args
        self._logger = MetricsLogger(args.output_dir, args.report_to, enabled=self.dist.is_main,
                                     config=args.to_dict(), resume_step=self.global_step, run_id=self.run_id,
                                     resumed=self.global_step > 0)
        self._bar = tqdm(total=self.max_steps, initial=self.global_step, desc="GRPO",
                         disable=bool(args.disable_tqdm) or not self.dist.is_main)
        self._started = self._tick = time.perf_counter()
        self._window.clear()
        self._last: dict[str, float] = {}
        self.state.log_history = list(self._logger.history)  # a resumed run keeps what it logged before
        self._event("on_train_begin")
        if self.global_step:  # resumed: the sampler must see the restored weights
            self.rollout_ctx.generator.update_weights(self.unwrapped)
        if self.eval_data is not None and self.global_step == 0:
            self._logger.log(0, {**self.evaluate(), **self._elapsed()})

    def _collect(self) -> Rollout:
        """A fresh generation batch (groupwise.rollout.collect), timed."""
        self._tick = time.perf_counter()
        self._extra.clear()
        rollout = R.collect(self.rollout_ctx, self.unwrapped)
        rollout.metrics["time/generation"] = time.perf_counter() - self._tick
        return rollout

    def _windows(self, rollout: Rollout) -> list[list[TrainBatch]]:
        return windows(rollout.batch, self.layout.micro_batch_size, self.layout.steps_per_generation,
                       self.args.num_iterations, self.args.gradient_accumulation_steps)

    def _after_step(self, rollout: Rollout, done: int, metrics: dict[str, float]) -> None:
        """Counters, reference sync, logging, checkpoint, evaluation — after optimizer step `done` of the round."""
        args = self.args
        self.global_step += 1
        skipped = bool(metrics["train/skipped"])
        self.skipped_steps += skipped
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
        if self.consecutive_skipped >= args.max_consecutive_skipped_steps:
            raise TrainingStopped(
                f"{self.consecutive_skipped} optimizer steps in a row were skipped for a non-finite loss or gradient "
                f"(steps {self.global_step - self.consecutive_skipped + 1}–{self.global_step}; see the warnings and "
                "metrics.jsonl); stopping with the weights of the last good step untouched and the last checkpoint "
                "kept. Check the rewards, beta and learning_rate, or raise max_consecutive_skipped_steps")
        if not skipped:
            self.rollout_ctx.generator.update_weights(self.unwrapped)  # the sampler sees the new policy
        metrics.update(rollout.metrics, **{"time/step": time.perf_counter() - self._tick,
                                           "train/skipped_steps": self.skipped_steps})
        self._tick = time.perf_counter()
        for k, v in metrics.items():
            self._window[k].append(v)
        self._maybe_sync_ref()
        self._bar.update(1)
        self._event("on_step_end")
        # a callback may ask to stop (control.should_training_stop): every process stops at the same step
        self.control.should_training_stop = self.dist.any(self.control.should_training_stop)
        last_step = self._finished()
        control = self.control
        if (self.global_step % max(args.logging_steps, 1) == 0 or last_step or control.should_log
                or (args.logging_first_step and self.global_step == 1)):
            self._log(rollout)
        saved = args.save_steps and self.global_step % args.save_steps == 0 or last_step or control.should_save
        if saved:
            self._save_round(rollout, done)
        if self.eval_data is not None and ((args.eval_steps and self.global_step % args.eval_steps == 0) or last_step
                                           or control.should_evaluate):
            metrics = {**self.evaluate(), **self._elapsed()}
            self._logger.log(self.global_step, metrics)
            self.state.log_history.append({**metrics, "step": self.global_step})
            self._event("on_evaluate", metrics=metrics)
        control.should_log = control.should_save = control.should_evaluate = False
        if self.dist.any(bool(self._signals)) and not last_step:  # every process stops at the same step
            signum = self._signals[0] if self._signals else signal.SIGTERM
            if args.save_on_interrupt and not saved:
                self._save_round(rollout, done)
            where = f"; checkpoint-{self.global_step} written" if args.save_on_interrupt else ""
            raise TrainingInterrupted(signum, f"stopped by {signal.Signals(signum).name} after step "
                                              f"{self.global_step}{where}")

    def _save_round(self, rollout: Rollout, done: int) -> None:
        """A checkpoint at this step; a round not finished yet is saved with it, so resume replays it exactly."""
        unfinished = done < self.steps_per_round
        path = self.save(rollout.batch if unfinished else None, rollout.metrics, done)
        self._event("on_save", checkpoint=str(path))

    @contextlib.contextmanager
    def _signals_stop_the_run(self):
        """SIGINT / SIGTERM are recorded and end the run after the current optimizer step (`_after_step`); a second
        one interrupts at once. Only the main thread can install handlers; elsewhere signals keep their handlers."""
        self._signals: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        first: list[float] = []

        def handler(signum, frame):
            if self._signals:
                # launchers (torchrun, accelerate) forward the terminal's signal: a copy within 2 s is that, not a
                # second request; a later one stops at once
                if time.monotonic() - first[0] > 2.0:
                    raise KeyboardInterrupt
                return
            first.append(time.monotonic())
            self._signals.append(signum)
            tqdm.write(f"groupwise: {signal.Signals(signum).name} received: stopping after this optimizer step "
                       "(again to stop at once)")

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _log(self, rollout: Rollout) -> None:
        last = {k: _nanmean(v) for k, v in self._window.items()}
        last["epoch"] = self.sampler.epoch + self.sampler.position / len(self.train_data)
        last.update(self._elapsed())
        self._logger.log(self.global_step, last)
        self._window.clear()
        self._last = last
        self.state.epoch = last["epoch"]
        self.state.log_history.append({**last, "step": self.global_step})
        self._event("on_log", logs=last)
        if rollout.round is not None:
            rows = self.dist.gather_object(self._completion_rows(rollout.round))
            self._logger.log_completions(self.global_step, rows)
        self._bar.set_postfix({k.split("/")[-1]: f"{last[k]:.4g}" for k in
                               ("reward/mean", "process/step_reward_mean", "loss/policy", "gen/mean_length")
                               if k in last})
        if self.args.log_completions and rollout.round is not None and self.dist.is_main:
            _print_round(self.global_step, rollout.round, self.args.num_completions_to_print)

    def _finished(self) -> bool:
        return self.global_step >= self.max_steps or self.control.should_training_stop

    def _event(self, name: str, **kwargs) -> None:
        """Call `name` (on_train_begin, on_step_end, on_log, on_save, on_evaluate, on_train_end) on every callback,
        with transformers' arguments (args, state, control, model=…, …); a returned TrainerControl replaces ours."""
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, model=self.unwrapped, processing_class=self.tokenizer,
                            optimizer=self.optimizer, lr_scheduler=self.scheduler, **kwargs)
            if result is not None:
                self.control = result

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` reward keyword: a scalar averaged over the logging window, logged under `name`."""
        self._window[name].append(float(value))

    def _log_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra` reward keyword: a column of completions.jsonl, one value per completion of the call."""
        self._extra[column].extend(values)

    def _completion_rows(self, rnd: Round) -> list[dict]:
        """This process's rows of the logged round for completions.jsonl: prompt, completion, each reward function's
        value, the combined reward, the first token's advantage, step rewards, and log_extra columns (kept when they
        have one value per row)."""
        n = len(rnd.completions.prompts)
        names = [s.name for s in self.reward_sources]
        first_token = rnd.first_token_advantages()
        extra = {k: v for k, v in self._extra.items() if len(v) == n}
        rows = []
        for i in range(n):
            row = {"prompt": rnd.completions.prompts[i], "completion": rnd.completions.completions[i],
                   "reward": float(rnd.rewards[i]), "advantage": first_token[i]}
            if rnd.per_func is not None:
                row["rewards"] = {name: float(rnd.per_func[i, f]) for f, name in enumerate(names)}
            if rnd.steps is not None:
                row["steps"] = [[text, float(r)] for text, r in rnd.steps[i]]
            rows.append({**row, **{k: v[i] for k, v in extra.items()}})
        return rows

    def save_model(self, output_dir: str | None = None) -> None:
        """The policy (safetensors) and its tokenizer, loadable with from_pretrained (TRL / transformers' name)."""
        out = output_dir or self.args.output_dir
        if self.dist.is_main:
            self.unwrapped.save_pretrained(out, safe_serialization=True)
            self.tokenizer.save_pretrained(out)
        self.dist.barrier()

    def _end(self) -> dict[str, float]:
        self._event("on_train_end")
        self.dist.barrier()
        if self.dist.is_main:
            tqdm.write(f"groupwise: {self.global_step} optimizer steps, {self.skipped_steps} skipped as non-finite; "
                       f"outputs in {self.args.output_dir}")
        return self._last

    def _elapsed(self) -> dict[str, float]:
        return {"time/elapsed": time.perf_counter() - self._started}  # this process's run

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completion of every eval prompt: eval/reward/mean (weighted) and eval/<func> per function."""
        ctx, data, dist = self.rollout_ctx, self.eval_data, self.dist
        mine = list(range(dist.rank, len(data), dist.world_size))
        bs = self.args.per_device_eval_batch_size

        def local():  # this process's share; no collective inside, so it runs under run_together
            per_func, lengths = [], []
            for start in range(0, len(mine), bs):
                rows = [data[i] for i in mine[start:start + bs]]
                comp = R.generate(ctx, self.unwrapped, rows, greedy=True)
                rewards, _ = compute_rewards(self.reward_sources, comp.prompts, comp.completions, comp.token_lists(),
                                             comp.columns, on_error=self.args.on_reward_error,
                                             timeout=self.args.reward_timeout, extra=ctx.reward_kwargs)
                per_func += rewards.tolist()
                lengths += comp.lengths.tolist()
            return per_func, lengths

        per_func, lengths = dist.run_together(local, "evaluation")
        lengths = torch.tensor(dist.gather_object(lengths), dtype=torch.float)
        out = {"eval/mean_length": float(lengths.mean())}
        if not self.reward_sources:
            return out
        per_func = torch.tensor(dist.gather_object(per_func), dtype=torch.float).view(-1, len(self.reward_sources))
        # combined as in training: a row no function scored is left out, not counted as 0
        out["eval/reward/mean"] = float(torch.nanmean(weighted_nansum(per_func, ctx.reward_weights)))
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
                 "run_id": self.run_id, "config": {k: getattr(self.args, k) for k in RESUME_FIELDS},
                 "skipped_steps": self.skipped_steps, "world_size": self.dist.world_size,
                 "round_step": round_step if pending is not None else 0,
                 "round_metrics": round_metrics if pending is not None else None}
        return save_checkpoint(self.args.output_dir, self.global_step, dist=self.dist, model=self.unwrapped,
                               tokenizer=self.tokenizer, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=state, pending=pending.tensors() if pending is not None else None,
                               ref_model=self.ref_model if self.args.sync_ref_model else None,
                               save_total_limit=self.args.save_total_limit)

    def _resume(self, path: str):
        state = read_state(path)  # verified against its checksums before anything loads (once)
        if state["world_size"] != self.dist.world_size:
            raise CheckpointError(f"{path} was saved by {state['world_size']} processes; resume with the same number "
                             f"(now {self.dist.world_size}) so the data split and RNG streams match")
        if state["global_step"] >= self.max_steps:
            raise CheckpointError(f"{path} is at step {state['global_step']}, which is not before max_steps="
                             f"{self.max_steps}: raise max_steps to train further")
        for name, saved in state.get("config", {}).items():
            if getattr(self.args, name) != saved:
                raise CheckpointError(f"resume: {name} is {saved!r} in {path} but {getattr(self.args, name)!r} now; "
                                      "resume with the same value (the data order and batch layout depend on it)")
        pending = load_checkpoint(path, dist=self.dist, model=self.unwrapped, optimizer=self.optimizer,
                                  scheduler=self.scheduler, ref_model=self.ref_model)
        self.run_id = state.get("run_id", self.run_id)
        self.global_step, self.skipped_steps = state["global_step"], state["skipped_steps"]
        self.sampler.load_state_dict(state["sampler"])
        if pending is None:
            return None
        return Rollout(TrainBatch.from_tensors(pending), state["round_metrics"]), state["round_step"]


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(finite) / len(finite) if finite else float("nan")


def _print_round(step: int, rnd: Round, limit: int | None) -> None:
    comp = rnd.completions
    print_completions(step, comp.prompts, comp.completions, rnd.rewards.tolist(), rnd.first_token_advantages(), limit,
                      steps=rnd.steps)

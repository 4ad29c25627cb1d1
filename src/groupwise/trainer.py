"""GRPOTrainer: the loop. Each generation round: rollout (generate → score → advantages), then μ × micro-batch
updates grouped into optimizer steps; log, evaluate, checkpoint. TRL's constructor signature and field meanings."""

from __future__ import annotations

import math
import signal
import sys
import time
import uuid
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from groupwise import rollout as R
from groupwise.adapters import Reference, adapted_tied_embeddings, is_peft_model, peft_config_from_args, wrap
from groupwise.best import BestModel
from groupwise.callbacks import CallbackHandler, default_callbacks
from groupwise.agents import Toolbox, build_agent, default_train_dataset
from groupwise.checkpoint import check_writable, claim_output_dir, resume_folder
from groupwise.config import GRPOConfig
from groupwise.core.supervision import SUPERVISIONS
from groupwise.config_base import ConfigError
from groupwise.custom_rollout import check_rollout_func
from groupwise.data import PromptData, StreamData, each_dataset, is_stream
from groupwise.data_checks import check_same_everywhere
from groupwise.distributed import Distributed, empty_cache, mark_failed, phase_of, shared
from groupwise.generation import build_generator
from groupwise.order import PromptSampler, StreamSampler
from groupwise.guards import args_fingerprint, check_args_unchanged, check_overrides
from groupwise.hub import hub_token
from groupwise.loading import (as_list, check_combinations, check_inputs, eos_token_ids, load_policy, load_tokenizer,
                               policy_init_kwargs, router_aux_loss_coef)
from groupwise.habits import TrainResult, TransformersHabits
from groupwise.run_state import RunState
from groupwise.logging import set_log_level
from groupwise.signals import interrupted, stop_on_signals
from groupwise.modeling import disable_dropout
from groupwise.optim import build_training
from groupwise.sharding import check_layers_before_loading, full_state_dict, resolve as resolve_sharding
from groupwise.rewards import load_reward_sources
from groupwise.rewards.process import load_process_reward_sources
from groupwise.rewards.steps import StepSplitter
from groupwise.trackers import resolve_report_to
from groupwise.types import Rollout, TrainBatch
from groupwise.update import UpdateContext, optimizer_step, windows


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many non-finite steps in a row); the last good checkpoint is kept."""


class GRPOTrainer(RunState, TransformersHabits):
    # where a collective that waited ddp_timeout was (Distributed.naming_stuck_collectives): the loop's functions
    PHASES = {"_begin": "the start of training", "_collect": "a round", "generate": "generation",
              "score": "scoring the completions (reward functions)", "score_steps": "scoring the steps (step rewards)",
              "advantages": "the group statistics", "build_batch": "the reference / old-policy log-probs",
              "optimizer_step": "an optimizer step (the gradients' all-reduce)", "_evaluate_one": "an evaluation",
              "save": "saving a checkpoint", "_end": "the end of training",
              "save_model": "save_model() (with fsdp or push_to_hub every process must call it)",
              "_after_step": "the step's bookkeeping (callbacks, logging, checkpoint, evaluation)"}

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None,
                 process_reward_funcs=None):
        # everything that can be checked without a model comes first
        check_overrides(type(self), GRPOTrainer)  # a TRL method a subclass overrides that groupwise never calls
        self.args = args = GRPOConfig() if args is None else args
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a groupwise.GRPOConfig, got {type(args).__name__}")
        check_rollout_func(rollout_func, tools=bool(tools or environment_factory))
        check_writable(args.output_dir)
        self.rollout_func = rollout_func  # TRL's: the user's function samples the completions (custom_rollout.py)
        self.toolbox = Toolbox(tools, environment_factory) if tools or environment_factory else None  # envs probed
        self.dist = Distributed(bf16=args.bf16, timeout=args.ddp_timeout, backend=args.ddp_backend, ddp_kwargs={
            "find_unused_parameters": args.ddp_find_unused_parameters, "bucket_cap_mb": args.ddp_bucket_cap_mb,
            "broadcast_buffers": args.ddp_broadcast_buffers, "static_graph": args.ddp_static_graph},
            sharding=resolve_sharding(args.fsdp, args.fsdp_config), fp16=args.fp16)
        # transformers' should_log: each node's main process with log_on_each_node, else the main process only
        should_log = self.dist.is_local_main if args.log_on_each_node else self.dist.is_main
        set_log_level(args.log_level if should_log else args.log_level_replica)
        args.report_to = resolve_report_to(args.report_to)  # again: the field may have been set after the config
        self.layout = args.layout(self.dist.world_size)
        train_dataset = default_train_dataset(train_dataset, self.toolbox, args, self.layout.prompts_per_generation)
        stream = is_stream(train_dataset)
        if stream and args.max_steps <= 0:
            raise ConfigError("train_dataset is an IterableDataset: set max_steps (its length is unknown, so "
                              "num_train_epochs cannot say when to stop)")
        data_seed = args.seed if args.data_seed is None else args.data_seed
        self.train_data = StreamData(train_dataset, "train_dataset", shuffle_seed=data_seed if args.shuffle_dataset
                                     else None) if stream else PromptData(train_dataset, "train_dataset")
        # one dataset, or {name: dataset} (transformers: each evaluated, its metrics named eval_<name>_…)
        self.eval_data = self._eval_data(eval_dataset) if eval_dataset is not None else None
        if self.eval_data is None and (args.eval_strategy != "no" or args.eval_on_start):
            asked = f"eval_strategy={args.eval_strategy!r}" if args.eval_strategy != "no" else "eval_on_start=True"
            raise ConfigError(f"{asked} needs an eval_dataset (on the command line: eval_dataset_name), or turn it off")
        check_same_everywhere(self.dist, {"train_dataset": self.train_data, **(
            {d.name: d for d in self.eval_data.values()} if isinstance(self.eval_data, dict) else
            {"eval_dataset": self.eval_data})})
        # metric_for_best_model (state.best_metric, the best checkpoint) names one of these datasets' metrics
        self._best = BestModel(args, tuple(self.eval_data) if isinstance(self.eval_data, dict) else None)
        for needed_by in ("push_to_hub", "log_completions_hub_repo"):  # no credentials: stop now, not after training
            if getattr(args, needed_by):  # (only the main process uploads)
                self.dist.run_together(lambda: self.dist.is_main and hub_token(args, needed_by), "checking the hub token")
        self.optimizers = tuple(optimizers) if optimizers is not None else (None, None)
        if len(self.optimizers) != 2:
            raise TypeError("optimizers must be a tuple (optimizer, lr_scheduler); either may be None")
        reward_funcs, process_reward_funcs = check_inputs(args, model, as_list(reward_funcs),
                                                           as_list(process_reward_funcs), self.toolbox,
                                                           (self.train_data, *each_dataset(self.eval_data)),
                                                           custom_rollout=rollout_func is not None)
        self.peft_config = peft_config if peft_config is not None else peft_config_from_args(args)
        check_combinations(args, model=model, sharded=self.dist.sharding is not None, peft_config=peft_config,
                           optimizers=self.optimizers, quantization_config=quantization_config)
        from transformers import enable_full_determinism, set_seed

        # the same seed on every process while the models load (TRL: set_seed(args.seed) before creating them), so
        # weights drawn then (LoRA, keys missing from a checkpoint) agree; then each process samples its own completions
        (enable_full_determinism if args.full_determinism else set_seed)(args.seed)
        if args.tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        self.sampler = StreamSampler(self.train_data, self.layout.prompts_per_generation) if stream else \
            PromptSampler(len(self.train_data), self.layout.prompts_per_generation, shuffle=args.shuffle_dataset,
                          seed=data_seed)
        self.steps_per_round = self.layout.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        # num_train_epochs: the steps of that many passes over the prompts (rounds wrap around the epochs)
        self.max_steps = args.max_steps if args.max_steps > 0 else math.ceil(
            args.num_train_epochs * len(self.train_data) / self.layout.prompts_per_generation * self.steps_per_round)
        from transformers import TrainerControl, TrainerState

        # transformers' own records, as TRL users read them: state.global_step, state.log_history, …
        # with max_steps: the passes its rounds make (rounds run on across epochs); unknown for a stream, and with
        # dynamic sampling, whose refills read more prompts per step than planned (the planned passes ended the run
        # before max_steps)
        epochs = math.ceil(args.num_train_epochs) if args.max_steps <= 0 else \
            sys.maxsize if stream or args.dynamic_sampling else \
            math.ceil(math.ceil(self.max_steps / self.steps_per_round) * self.layout.prompts_per_generation
                      / len(self.train_data))
        every = {name: args.every(name, self.max_steps) for name in ("logging_steps", "eval_steps", "save_steps")}
        self.state = TrainerState(max_steps=self.max_steps, num_train_epochs=epochs,
                                  **{name: n for name, n in every.items() if n is not None},  # unset: 500
                                  train_batch_size=args.per_device_train_batch_size,
                                  is_local_process_zero=self.dist.accelerator.is_local_main_process,
                                  is_world_process_zero=self.dist.is_main)
        self.control = TrainerControl()
        self._window: dict[str, list[float]] = defaultdict(list)  # metrics since the last log line (log_metric too)
        self._extra: dict[str, list] = defaultdict(list)  # log_extra columns of the current round
        self._rows: list[dict] | None = None  # the current round's completions.jsonl rows, once gathered
        self._logged: dict[str, list[float]] = defaultdict(list)  # log_metric calls of the current round
        # the tokenizer (cheap) checks every prompt's length; then the models and what is built around them
        self.tokenizer, self._max_positions = load_tokenizer(model, processing_class, args)
        engine = args.vllm_max_model_length if args.use_vllm and args.vllm_mode == "colocate" else None
        # the sampler's context when lower than the model's (groupwise.data.check_lengths): a colocated engine's
        self._sampler_limit = None if engine is None else (engine, f"vllm_max_model_length={engine}")
        if SUPERVISIONS[args.supervision].process:  # a step marker the tokenizer cannot write would end no step
            StepSplitter.from_config(args).check_tokenizer(self.tokenizer)
        datasets = (self.train_data, *each_dataset(self.eval_data))
        for data in datasets:  # a rollout_func tokenizes its prompts itself (TRL: no check)
            if data is not None and self.rollout_func is None:  # a stream checks each row as it is read
                self._check_lengths(data)
        self.agent = build_agent(self.toolbox, self.tokenizer, args, datasets)  # tools
        if self.dist.sharding is not None and isinstance(model, str):  # fsdp's layer classes, before the weights load
            check_layers_before_loading(model, self.dist.sharding, policy_init_kwargs(args))
        policy = load_policy(model, args, quantization_config, self.dist.device)
        if self.peft_config is not None:
            policy = wrap(policy, self.peft_config, gradient_checkpointing=args.gradient_checkpointing)
            if args.disable_dropout:  # the adapters' own dropout too (lora_dropout)
                disable_dropout(policy)
        if args.use_vllm and (where := adapted_tied_embeddings(policy)):
            raise ConfigError(f"use_vllm with an adapter on the {where} of a model whose input embeddings and output "
                              "head are one tensor (tie_word_embeddings): vLLM receives merged weights, which cannot "
                              "hold both as trained (it would sample from another policy). Leave lm_head / "
                              "embed_tokens out of target_modules (and out of modules_to_save, or keep them there "
                              "with LoraConfig(ensure_weight_tying=True)), or sample with generation_backend='fast'")
        self.reference = Reference.of(policy, self.dist.device) if args.beta != 0.0 else None
        # environments' get_reward (TRL) and get_step_rewards (groupwise) are reward and step-reward sources too
        env_rewards, env_steps = (self.toolbox.reward_sources, self.toolbox.process_sources) if self.toolbox else ([], [])
        env_steps = env_steps if SUPERVISIONS[args.supervision].process else []  # outcome only: not read
        self.reward_sources = (load_reward_sources(reward_funcs, reward_processing_classes, device=self.dist.device,
                                                   trust_remote_code=args.trust_remote_code,
                                                   model_init_kwargs=args.model_init_kwargs,
                                                   chat_template_kwargs=args.chat_template_kwargs)
                               if reward_funcs else []) + env_rewards
        self.process_sources = (load_process_reward_sources(process_reward_funcs, device=self.dist.device,
                                trust_remote_code=args.trust_remote_code) if process_reward_funcs else []) + env_steps
        self.trained, self.optimizer, self.scheduler, self._replica = build_training(
            policy, args, self.dist, optimizers=self.optimizers, reference=self.reference, max_steps=self.max_steps)
        # each process samples its own completions: TRL's set_seed(args.seed, device_specific=True) once the models
        # are built, process 0 included, so what is sampled does not depend on what loading drew (LoRA's init)
        set_seed(args.seed + self.dist.rank)
        self.rollout_ctx = self._build_rollout()
        first, last = default_callbacks(args)  # transformers' order: the flow, the user's callbacks, the printing
        self.callback_handler = CallbackHandler([*first, *(callbacks or []), *last], model=self.unwrapped,
                                                processing_class=self.tokenizer,
                                                optimizer=self.optimizer, lr_scheduler=self.scheduler)
        self.update_ctx = UpdateContext(args, self.dist, self.trained, self.optimizer, self.scheduler, self._event,
                                        router_aux_loss_coef=router_aux_loss_coef(args, self.unwrapped.config))
        self.skipped_steps = self.consecutive_skipped = 0
        self._loss_sum, self._loss_steps = 0.0, 0  # this run's policy losses, for TrainResult.training_loss
        self._epochs_done = 0  # epochs whose end was seen (save / eval / logging_strategy "epoch")
        self._span = (0.0, 0.0)  # the sampler's progress (epochs) before and after the current round
        self.run_id = uuid.uuid4().hex[:12]  # kept across resumes: checkpoints and metrics lines carry it
        self._best.check_reward_names(tuple(s.name for s in self.reward_sources),
                                      tuple(s.name for s in self.process_sources))
        self._built_args = args_fingerprint(args)  # what the trainer was built from (train() refuses changes)
        self._event("on_init_end")
        start = getattr(self.rollout_ctx.generator, "start", None)  # last, after the seeding, as TRL builds vLLM's
        if start is not None:  # engine (it seeds the random streams as it starts; a resume restores them after it)
            self.dist.run_together(lambda: start(self.sampling_model), "starting the generation backend")
        read = getattr(self.rollout_ctx.generator, "context_limit", None)  # a vLLM server's own max_model_len
        if read is not None:
            limit = self.dist.broadcast_object(self.dist.run_together(read, "reading the vLLM server's context"))
            if limit is not None:  # for every dataset checked from now on too (evaluate(), a stream's rows)
                self._sampler_limit = (limit, f"the vLLM server's max_model_len={limit} (`vllm serve --max-model-len`)")
                for data in datasets:
                    if data is not None and self.rollout_func is None:
                        data.check_room(args.max_completion_length, self._sampler_limit)

    # ---- builders -----------------------------------------------------------------------------------------------
    def _build_rollout(self) -> R.RolloutContext:
        args = self.args
        eos = eos_token_ids(self.tokenizer, self.unwrapped)
        return R.RolloutContext(
            args=args, tokenizer=self.tokenizer, dist=self.dist, eos_token_ids=eos,
            generator=build_generator(args, pad_token_id=self.tokenizer.pad_token_id, eos_token_ids=eos, dist=self.dist),
            reward_sources=self.reward_sources, process_sources=self.process_sources,
            splitter=StepSplitter.from_config(args), data=self.train_data, sampler=self.sampler,
            reference=self.reference, agent=self.agent,
            rollout_func=None if self.rollout_func is None else lambda prompts: self.rollout_func(prompts, self),
            policy_logps=self.trained if self.dist.sharding is not None else self.dist.unwrap(self.trained),
            correct_sampling=args.corrects_sampling,
            # TRL's reward-function keywords: curriculum from the state, metrics and completion columns out
            reward_kwargs={"trainer_state": self.state, "log_metric": self._log_metric, "log_extra": self._log_extra},
            # π_θold differs from π_θ for a micro-batch whenever an optimizer step happened since generation: a round
            # of more than one step (TRL: unless gradient_accumulation_steps % (steps_per_generation × μ) == 0)
            need_old_logps=self.steps_per_round > 1)

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.state.global_step = value

    @property
    def unwrapped(self):
        """The Hugging Face model being trained (no distributed or log-prob wrapper)."""
        return self.dist.unwrap(self.trained).model

    @property
    def sampling_model(self):
        """What generation runs on: the policy, or with fsdp its unsharded replica (groupwise.sharding)."""
        return self._replica if self._replica is not None else self.unwrapped

    def _weights_changed(self) -> None:
        """After an optimizer step (or a resume): the replica and the sampler see the new weights."""
        if self._replica is not None:  # load_state_dict casts to the replica's dtype
            if self.dist.sharding is not None:  # gathered; of a LoRA policy the adapters only (the base is as copied)
                self._replica.load_state_dict(full_state_dict(self.unwrapped),
                                              strict=not is_peft_model(self.unwrapped))
            else:
                self._replica.load_state_dict(self.unwrapped.state_dict())
        self.rollout_ctx.generator.update_weights(self.sampling_model)

    def consolidated(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor] | None]:
        """What save_pretrained writes the trained weights from: (model, its state_dict or None for its own). The
        policy; with fsdp its unsharded replica, or when the replica is cast to generation_dtype the policy's
        gathered float32 weights (of a LoRA policy the adapters): a collective, called on every process."""
        if self.dist.sharding is None:
            return self.unwrapped, None
        if self.args.generation_dtype is None:
            return self._replica, None
        return self.unwrapped, full_state_dict(self.unwrapped)

    @property
    def model(self):
        """The Hugging Face model being trained, as `trainer.model` in TRL (the module that trains is `trained`:
        it wraps this one to return log-probs, inside DDP when several processes run)."""
        return self.unwrapped

    # ---- the loop -----------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainResult:
        """Train to max_steps. `resume_from_checkpoint`: a checkpoint-N/ folder, or True for the newest one in
        output_dir (transformers' meaning)."""
        self.dist.run_together(lambda: check_args_unchanged(self.args, self._built_args), "checking trainer.args")
        resume = resume_folder(self.args.resume_from_checkpoint if resume_from_checkpoint is None
                               else resume_from_checkpoint, self.args.output_dir)
        if not resume and self.global_step:  # it would run no step and report the first call's results
            raise ConfigError(f"train() was already called on this trainer, which is at step {self.global_step}: "
                              "build a new GRPOTrainer to train again (TRL's second call retrains from step 0)")
        if not resume:  # a new run never writes over another run's outputs (checked by the main process)
            self._window.clear()
            loaded_from = getattr(getattr(self.unwrapped, "config", None), "_name_or_path", None)  # in place: kept
            self.dist.run_together(lambda: self.dist.is_main and claim_output_dir(
                self.args.output_dir, self.args.overwrite_output_dir, loaded_from), "checking output_dir")
        self._restored_history = None
        pending = self._resume(resume) if resume else None  # a round interrupted by the checkpoint, if any
        self._logger = None
        failed = True
        with stop_on_signals(self._where) as self._signals, \
                self.dist.naming_stuck_collectives(self.PHASES, self._step_of):
            try:
                self._begin()
                while not self._finished():
                    clock = time.perf_counter()  # TRL's step_time: the step's generation (if any) and update
                    begun = pending is None  # on_step_begin comes before the step's generation, as TRL generates
                    if begun:  # inside transformers' training_step
                        self._event("on_step_begin")
                    rollout, done = pending or (self._collect(), 0)
                    pending = None
                    for window in self._windows(rollout)[done:]:
                        if not begun:
                            self._event("on_step_begin")
                        begun = False
                        metrics = optimizer_step(self.update_ctx, window)
                        metrics["step_time"], done = time.perf_counter() - clock, done + 1
                        self._after_step(rollout, done, metrics)
                        clock = time.perf_counter()
                        if self._finished():
                            break
                summary = self._summary()
                result = self._end(summary)  # on_train_end's callbacks may still log to the trackers
                failed = False
                return result
            except BaseException as e:  # an error of this process alone (not `shared`): its exit will not wait for
                mark_failed(e)  # the others, also when the script catches it or calls sys.exit (sys.last_value unset)
                raise
            finally:  # also when the run stops on an error or a signal: trackers closed (a failed run marked so)
                self.callback_handler.close_bars()  # later log lines (evaluate()) are not printed under a bar
                if self._logger is not None:
                    self._logger.close(failed)

    def _step_of(self, names: list[str]) -> str:
        """The step the loop is at, given its call stack's function names (in _after_step: the step just counted)."""
        return f"at step {self.global_step + ('_after_step' not in names)}"

    def _where(self, frame) -> str:
        """Where the loop is (PHASES) at `frame`, for the first signal's line: a process stuck in a reward function is
        killed by the launcher later, and that line is all it leaves."""
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        phase = phase_of(self.PHASES, names[::-1])
        return f"{phase} {self._step_of(names)}" if phase else ""

    # ---- phases -------------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Metrics file, progress bar, clocks; the step-0 evaluation of a fresh run."""
        args = self.args
        self._logger = self._open_trackers()
        self._started = self._tick = time.perf_counter()
        self._start_time = time.time()  # as transformers' train() passes it to log()
        self._first_step = self.global_step  # this call's steps, for the end-of-training speed line
        self._last: dict[str, float] = {}
        # a resumed run keeps what it logged before, on every process (its checkpoint's; an older checkpoint has
        # none: then the main process's metrics.jsonl lines up to the resumed step)
        restored = getattr(self, "_restored_history", None)
        self.state.log_history = list(self._logger.history) if restored is None else restored
        self._event_agreed("on_train_begin")  # a stop asked for on one process is every process's
        # resumed, or a replica (generation_dtype, fsdp) copied before DDP synced the processes' weights: refresh
        if self.global_step or self._replica is not None:
            self._weights_changed()
        if args.eval_on_start and self.global_step == 0:  # transformers: before the first epoch begins
            self.evaluate()
        self._begin_epoch()

    def _collect(self) -> Rollout:
        """A fresh generation batch (groupwise.rollout.collect), timed."""
        self._tick = time.perf_counter()
        self._extra.clear()
        self._rows = None
        start = self.sampler.progress()
        rollout = R.collect(self.rollout_ctx, self.sampling_model)
        self._span = (start, self.sampler.progress())
        self.state.num_input_tokens_seen += int(rollout.metrics["num_tokens"])  # TRL logs the running total
        self.state.total_flos += self._flos(rollout.metrics["num_tokens"])
        rollout.metrics["num_tokens"] = float(self.state.num_input_tokens_seen)
        rollout.metrics["time/rollout"] = time.perf_counter() - self._tick  # generate + rewards + logprobs
        rollout.metrics.update(self._flush_logged())  # log_metric: over every process's calls, as TRL
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
        if not metrics.get("train/overflow"):  # fp16's loss-scale search is not a failure
            self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
        if self.consecutive_skipped >= args.max_consecutive_skipped_steps:
            raise shared(TrainingStopped(  # every process skips the same steps (the finite check is all-reduced)
                f"{self.consecutive_skipped} optimizer steps in a row were skipped for a non-finite loss or gradient "
                f"(steps {self.global_step - self.consecutive_skipped + 1}–{self.global_step}; see the warnings and "
                "metrics.jsonl); stopping with the weights of the last good step untouched and the last checkpoint "
                "kept. Check the rewards, beta and learning_rate, or raise max_consecutive_skipped_steps"))
        if not skipped:
            self._weights_changed()  # the sampler sees the new policy
        if math.isfinite(metrics["loss"]):
            self._loss_sum, self._loss_steps = self._loss_sum + metrics["loss"], self._loss_steps + 1
        # a round's metrics count once, at its first step, as TRL's log averages its generations' (not its steps')
        metrics.update(rollout.metrics if done == 1 else {}, **{"time/step": time.perf_counter() - self._tick,
                                                                "train/skipped_steps": self.skipped_steps})
        self._tick = time.perf_counter()
        for k, v in metrics.items():
            self._window[k].append(v)
        start, end = self._span  # the round's share of an epoch, spread evenly over its optimizer steps (transformers)
        self.state.epoch = start + (end - start) * done / self.steps_per_round
        self._maybe_sync_ref()
        if args.torch_empty_cache_steps and self.global_step % args.torch_empty_cache_steps == 0:
            empty_cache(self.dist.device)
        epoch_end = done == self.steps_per_round and int(self.sampler.progress()) > self._epochs_done
        self._epochs_done = max(self._epochs_done, int(self.sampler.progress())) if epoch_end else self._epochs_done
        control = self.control
        # the loop ends at max_steps whatever the callbacks do; DefaultFlowCallback sets the "steps" strategies' flags
        # in on_step_end, and later callbacks may change them until each is acted on
        control.should_training_stop |= self.global_step >= self.max_steps
        self._event("on_step_end")
        signalled = self._agree()
        # the epoch ends at the end of a pass over the prompts, when training stops (transformers fires on_epoch_end
        # after its step loop, whatever ended it), or when a callback ends it; on_epoch_end comes before the step's
        # log / evaluation / save (transformers: after the "steps" strategies' ones), so that they are one pass and a
        # checkpoint holds the whole step (its log line, the best metric it may be)
        acted: set[str] = set()
        fired, new_epoch = self._epoch_end(epoch_end, done)
        self._log_evaluate_save(rollout, done, acted)
        if not fired and control.should_training_stop:  # asked for in on_log / on_evaluate (EarlyStoppingCallback)
            fired, new_epoch = self._epoch_end(False, done)
            self._log_evaluate_save(rollout, done, acted)
        last_step = self._finished()
        if signalled and not last_step:  # every process stops at the same step
            signum = self._signals[0] if self._signals else signal.SIGTERM
            if args.save_on_interrupt and "save" not in acted:
                self._save_round(rollout, done)
            where = "" if not args.save_on_interrupt else \
                f"; checkpoint-{self.global_step} written (the model only: save_only_model=True, not resumable)" \
                if args.save_only_model else \
                f"; checkpoint-{self.global_step} written: resume it with resume_from_checkpoint=True " \
                "(--resume_from_checkpoint true)"
            raise interrupted(signum, f"stopped by {signal.Signals(signum).name} after step "
                                      f"{self.global_step}{where}")
        if new_epoch and not last_step:
            self._begin_epoch()

    def _save_round(self, rollout: Rollout, done: int) -> None:
        """A checkpoint at this step; a round not finished yet is saved with it, so resume replays it exactly."""
        unfinished = done < self.steps_per_round
        if unfinished:
            self._round_rows(rollout)  # saved with the round, so that a resumed run logs its rows too
        path = self.save(rollout.batch if unfinished else None, rollout.metrics, done)
        self._best.saved(self.state, path)
        self._event("on_save")  # transformers' arguments only: the folder is output_dir/checkpoint-{global_step}
        if self.args.push_to_hub and self.args.hub_strategy != "end":
            self._push_save(path)  # the model; with 'checkpoint' / 'all_checkpoints' the checkpoint too

    def _event(self, name: str, **kwargs) -> None:
        """Call `name` (transformers' events) on every callback; a returned TrainerControl replaces ours."""
        self.control = self.callback_handler.call_event(name, self.args, self.state, self.control, **kwargs)

    def _end(self, summary: dict[str, float]) -> TrainResult:
        self._best_at_end()  # load_best_model_at_end; save_total_limit=1 keeps the best checkpoint only
        self._event("on_train_end")
        if self.args.push_to_hub and getattr(self, "_pushed_at", None) != self.global_step:  # not pushed at this step
            self.push_to_hub()
        self.dist.barrier()
        if self.dist.is_main:
            tqdm.write(f"groupwise: {self.global_step} optimizer steps, {self.skipped_steps} skipped as non-finite; "
                       f"outputs in {self.args.output_dir}")
        return TrainResult(self._last, self.global_step, summary["train_loss"], summary)

    def _maybe_sync_ref(self) -> None:
        args = self.args
        if args.sync_ref_model and self.global_step % args.ref_model_sync_steps == 0:
            # the trained weights in full precision (with fsdp the policy's shards and the reference's alike)
            self.reference.mix(self.unwrapped, args.ref_model_mixup_alpha)

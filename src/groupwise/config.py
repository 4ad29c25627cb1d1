"""GRPOConfig: every knob of a run, TRL's names and meanings where TRL has the field.

A TRL user switches by changing an import. A field TRL has and groupwise does not support, or a field nobody has,
is an error naming it (never silently ignored); `TRL_UNSUPPORTED` lists the former with the reason.
Validation runs in `__post_init__`, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from groupwise.config_base import ConfigError, StrictConfig, load_yaml, option
from groupwise.core.advantages import ESTIMATORS, SCALES, STDS
from groupwise.core.aggregation import AGGREGATIONS
from groupwise.core.losses import IMPORTANCE_SAMPLING_LEVELS
from groupwise.core.supervision import SUPERVISIONS
from groupwise.generation import BACKENDS
from groupwise.logging import TRACKERS
from groupwise.rewards.combine import MULTI_OBJECTIVE, MULTI_OBJECTIVE_OPTIONS
from groupwise.rewards.sources import ON_REWARD_ERROR
from groupwise.rewards.steps import SPLIT_MODES

__all__ = ["BatchLayout", "ConfigError", "GRPOConfig", "TRL_UNSUPPORTED", "load_yaml"]

# GRPOConfig fields an advantage estimator may take, by the estimator's option name (groupwise.core.advantages)
ESTIMATOR_OPTIONS = {"scale": "scale_rewards", "std": "reward_std", "eps": "advantage_eps"}

# TRL GRPOConfig / TrainingArguments fields that groupwise does not implement (yet), with what to do instead.
TRL_UNSUPPORTED: dict[str, str] = {
    "use_vllm": "vLLM generation is not implemented yet; generation uses transformers",
    "vllm_mode": "vLLM generation is not implemented yet",
    "vllm_server_host": "vLLM generation is not implemented yet",
    "vllm_server_port": "vLLM generation is not implemented yet",
    "vllm_gpu_memory_utilization": "vLLM generation is not implemented yet",
    "vllm_tensor_parallel_size": "vLLM generation is not implemented yet",
    "vllm_importance_sampling_correction": "vLLM generation is not implemented yet",
    "use_liger_loss": "Liger kernels are not used; log-probs are computed in row chunks instead",
    "use_transformers_paged": "paged generation is not implemented",
    "cache_implementation": "generation uses the model's default KV cache",
    "deepspeed": "launch with `accelerate launch --config_file …` (accelerate's DeepSpeed plugin) instead",
    "fsdp": "launch with `accelerate launch --config_file …` (accelerate's FSDP plugin) instead",
    "push_to_hub": "groupwise never uploads; push the checkpoint folder yourself",
    "hub_model_id": "groupwise never uploads",
    "torch_compile": "not supported",
    "use_cpu": "set ACCELERATE_USE_CPU=1 or CUDA_VISIBLE_DEVICES='' instead",
    "fp16": "use bf16=True (fp16 loss scaling is not implemented)",
    "save_strategy": "checkpoints are written every save_steps optimizer steps (and at the end)",
    "logging_strategy": "metrics are logged every logging_steps optimizer steps",
    "eval_strategy": "set eval_steps (and pass eval_dataset) instead",
    "vllm_enable_sleep_mode": "vLLM generation is not implemented yet",
    "ds3_gather_for_generation": "DeepSpeed ZeRO-3 generation gathering is not implemented",
    "use_peft": "pass a PEFT-wrapped model instead (LoRA support is not built in yet)",
}



@dataclass
class GRPOConfig(StrictConfig):
    """Configuration of a GRPO run (DeepSeekMath §4.1; arXiv 2402.03300). Field names follow TRL's GRPOConfig."""

    # ---- output, logging, checkpoints -------------------------------------------------------------------------
    output_dir: str = option("Folder for metrics.jsonl, checkpoint-N/ folders and the final model.", default="outputs/groupwise")
    run_name: str | None = option("Name of the run in the trackers (the wandb run name), as in TRL / transformers.", default=None)
    logging_first_step: bool = option("Also log the first optimizer step (TRL / transformers).", default=False)
    disable_tqdm: bool | None = option("Hide the progress bars (None: shown on the main process), as in TRL / transformers.", default=None)
    logging_steps: int = option("Log metrics (progress bar, metrics.jsonl, trackers) every this many optimizer steps.", default=10, ge=0)
    save_steps: int = option("Write checkpoint-N/ every this many optimizer steps (0: only at the end).", default=500, ge=0)
    save_total_limit: int | None = option("Keep at most this many checkpoint-N/ folders (oldest deleted first).", default=None, ge=1)
    report_to: str | list[str] = option("Extra trackers besides metrics.jsonl: 'none', 'tensorboard', 'wandb' or a list.", default="none", choices=("none", *TRACKERS))
    log_completions: bool = option("Print a table of prompts, completions and rewards every logging_steps.", default=False)
    num_completions_to_print: int | None = option("Rows printed when log_completions is on (None: all).", default=None)
    overwrite_output_dir: bool = option("Let a new (not resumed) run delete the checkpoints and metrics another run left in output_dir; without it such a run refuses to start.", default=False)
    save_on_interrupt: bool = option("On SIGINT / SIGTERM, write a checkpoint of the step reached before stopping (exit code 130 / 143).", default=True)
    max_consecutive_skipped_steps: int = option("Stop the run (exit ≠ 0, last good checkpoint kept) after this many optimizer steps in a row were skipped for a non-finite loss or gradient.", default=5, ge=1)
    resume_from_checkpoint: str | None = option("Path of a checkpoint-N/ folder to resume from exactly.", default=None)
    data_seed: int | None = option("Seed of the prompt order alone (None: seed), as in TRL / transformers.", default=None)
    seed: int = option("Seed of the data order, sampling and anything random in the run.", default=42)

    # ---- optimisation -----------------------------------------------------------------------------------------
    learning_rate: float = option("AdamW learning rate.", default=1e-6, gt=0)
    weight_decay: float = option("AdamW weight decay.", default=0.0, ge=0)
    adam_beta1: float = option("AdamW β1.", default=0.9, ge=0, lt=1)
    adam_beta2: float = option("AdamW β2.", default=0.999, ge=0, lt=1)
    adam_epsilon: float = option("AdamW ε.", default=1e-8, gt=0)
    max_grad_norm: float = option("Clip the global gradient norm to this value (0: no clipping).", default=1.0, ge=0)
    lr_scheduler_type: str = option("transformers scheduler name: 'linear', 'cosine', 'constant', 'constant_with_warmup', ….", default="linear")
    warmup_steps: float = option("Linear warm-up: this many optimizer steps when ≥ 1, that fraction of max_steps (rounded up) when < 1 — transformers 5's meaning; 0: use warmup_ratio.", default=0.0, ge=0)
    warmup_ratio: float = option("Fraction of max_steps used for linear warm-up.", default=0.0, ge=0, le=1)
    max_steps: int = option("Optimizer steps to train; -1: derive from num_train_epochs.", default=-1, ge=-1)
    num_train_epochs: float = option("Passes over the prompt dataset when max_steps is -1.", default=1.0, gt=0)
    per_device_train_batch_size: int = option("Completions (not prompts) per micro-batch on each process (TRL meaning).", default=8, ge=1)
    gradient_accumulation_steps: int = option("Micro-batches accumulated into one optimizer step.", default=1, ge=1)
    ddp_timeout: float = option("Seconds a collective operation may wait for the other processes (TRL / transformers' name): a process that dies makes the others stop within this time.", default=1800.0, gt=0)
    bf16: bool = option("Train in bfloat16 mixed precision (through accelerate).", default=False)
    gradient_checkpointing: bool = option("Recompute activations in the backward pass to save memory.", default=False)
    shuffle_dataset: bool = option("Shuffle the prompts each epoch (seeded).", default=True)
    disable_dropout: bool = option("Set dropout to 0 in the policy and reference model (RL needs log-probs without noise).", default=True)
    model_init_kwargs: dict | None = option("kwargs for AutoModelForCausalLM.from_pretrained when the model is a path.", default=None)
    logprob_chunk_tokens: int = option("Completion tokens whose logits exist at once when computing log-probs (the output head runs in checkpointed chunks; the (N, T, V) logits never exist).", default=1024, ge=1)
    trust_remote_code: bool = option("Allow model repositories to run their own code. Off unless you ask for it.", default=False)

    # ---- generation -------------------------------------------------------------------------------------------
    num_generations: int = option("G: completions sampled per prompt (the group of DeepSeekMath §4.1).", default=8, ge=2)
    steps_per_generation: int | None = option("Micro-batches per process that one generation round feeds (default: gradient_accumulation_steps).", default=None, ge=1)
    generation_batch_size: int | None = option("Completions per generation round over all processes (alternative to steps_per_generation).", default=None, ge=1)
    max_prompt_length: int | None = option("Keep only the last this many prompt tokens (None: no truncation).", default=512, ge=1)
    truncate_prompt: str = option("Prompts longer than max_prompt_length: 'left' keeps their last max_prompt_length tokens (TRL's behaviour; counted in a warning when the dataset is checked), 'error' stops before the model loads, naming the first such row.", default="left", choices=("left", "error"))
    max_completion_length: int = option("Maximum completion tokens; longer completions are truncated (and known as such).", default=256, ge=1)
    temperature: float = option("Sampling temperature; log-probs are computed at the same temperature.", default=1.0, gt=0)
    top_p: float = option("Nucleus sampling mass.", default=1.0, gt=0, le=1)
    top_k: int = option("Keep the k most likely tokens (0: off).", default=0, ge=0)
    min_p: float | None = option("Drop tokens below min_p × the top probability (None: off).", default=None, ge=0, le=1)
    repetition_penalty: float = option("transformers' repetition penalty (1.0: off).", default=1.0, gt=0)
    generation_kwargs: dict | None = option("Extra transformers GenerationConfig fields (transformers backend only).", default=None)
    generation_backend: str = option("Generation backend (groupwise.generation); 'fast' prefills each prompt once per group and drops finished rows, with generate()'s processors.", default="fast", choices=BACKENDS)
    chat_template_kwargs: dict | None = option("Extra kwargs for tokenizer.apply_chat_template on conversational prompts.", default=None)

    # ---- GRPO objective ---------------------------------------------------------------------------------------
    beta: float = option("β: weight of the k3 KL penalty to the reference model (DeepSeekMath eq. 3–4). 0: no reference model.", default=0.0, ge=0)
    epsilon: float = option("ε_low: lower clip of the importance ratio, clip(ρ, 1−ε, 1+ε_high) (PPO/GRPO).", default=0.2, gt=0, lt=1)
    epsilon_high: float | None = option("ε_high: upper clip (DAPO 'clip-higher'); defaults to epsilon.", default=None, gt=0)
    delta: float | None = option("δ: cap on the unclipped ratio, two-sided clipping (INTELLECT-2); > 1 + ε_high.", default=None)
    importance_sampling_level: str = option("'token' ratio per token (GRPO) or 'sequence' (GSPO, exp of the mean log-ratio).", default="token", choices=IMPORTANCE_SAMPLING_LEVELS)
    num_iterations: int = option("μ: policy updates per generation batch (DeepSeekMath Alg. 1).", default=1, ge=1)
    loss_type: str = option("Loss aggregation (groupwise.core.aggregation): what the masked per-token loss sum is divided by.", default="dapo", choices=AGGREGATIONS)
    scale_rewards: str | bool = option("Advantage scaling: 'group' (DeepSeekMath), 'batch', 'none' (Dr. GRPO); True='group', False='none'.", default="group")
    advantage_estimator: str = option("How rewards become advantages, for outcome and step rewards alike (groupwise.core.advantages; the default is DeepSeekMath §4.1.2/§4.1.3). Each estimator reads only the options it takes among scale_rewards, reward_std and advantage_eps; setting another is an error.", default="grpo", choices=ESTIMATORS)
    reward_std: str = option("Std in the normalisation: 'population' (1/G, DeepSeekMath's std) or 'unbiased' (Bessel, TRL).", default="population", choices=STDS)
    advantage_eps: float = option("Added to the std before dividing, so near-equal rewards do not become ±1 advantages.", default=1e-4, ge=0)
    reward_weights: list[float] | None = option("One weight per reward function (default: all 1).", default=None)
    multi_objective_aggregation: str = option("'sum_then_normalize' (weighted sum, then group-normalise) or 'normalize_then_sum' (normalise each function, then weighted sum).", default="sum_then_normalize", choices=MULTI_OBJECTIVE)
    reward_timeout: float | None = option("Seconds one reward-function call may take (None, the default: no limit). With a limit the call runs in a daemon thread: an overrun scores that call's rows NaN (unscored, counted in reward/<func>/errors), the run goes on and the stuck call cannot keep the process alive. Reward code that relies on signal.alarm (math_verify's default timeout) only works without a limit.", default=None, gt=0)
    on_reward_error: str = option("An exception in a reward function: 'raise' (stop, naming the function and row) or 'nan' (score NaN, counted in reward/<func>/errors).", default="raise", choices=ON_REWARD_ERROR)
    mask_truncated_completions: bool = option("Leave completions that hit max_completion_length out of the loss (DAPO).", default=False)
    top_entropy_quantile: float = option("Train only on this top fraction of tokens by entropy (1.0: all tokens).", default=1.0, gt=0, le=1)
    sync_ref_model: bool = option("Move the reference model toward the policy every ref_model_sync_steps (TR-DPO).", default=False)
    ref_model_mixup_alpha: float = option("TR-DPO α: ref ← α·policy + (1−α)·ref.", default=0.6, ge=0, le=1)
    ref_model_sync_steps: int = option("Optimizer steps between TR-DPO reference syncs.", default=512, ge=1)

    # ---- process supervision (DeepSeekMath §4.1.3) ------------------------------------------------------------
    supervision: str = option("'outcome' (§4.1.2, one advantage per completion), 'process' (§4.1.3, token t gets the sum of the normalised rewards of the steps ending at or after t) or 'both' (w_o·outcome + w_p·process) (groupwise.core.supervision).", default="outcome", choices=SUPERVISIONS)
    step_split: str = option("How completions split into steps: 'delimiter' (step_delimiter), 'regex' (each step_pattern match ends a step) or 'tag' (step_tag after each step).", default="delimiter", choices=SPLIT_MODES)
    step_delimiter: str = option("Text that ends a step when step_split='delimiter'.", default="\n")
    step_pattern: str | None = option("Regex whose matches end steps when step_split='regex'.", default=None)
    step_tag: str | None = option("Step tag after each step when step_split='tag' (Math-Shepherd 'ки', Qwen2.5-Math-PRM '<extra_0>').", default=None)
    score_truncated_step: bool = option("Score the last step of a completion cut by max_completion_length (False: leave it out; its tokens get advantage 0).", default=False)
    process_reward_weights: list[float] | None = option("One weight per process reward function (default: all 1).", default=None)
    outcome_advantage_weight: float = option("w_o in supervision='both': Â = w_o·Â_outcome + w_p·Â_process.", default=1.0)
    process_advantage_weight: float = option("w_p in supervision='both'.", default=1.0)

    # ---- dynamic sampling (DAPO, Yu et al. 2025) ---------------------------------------------------------------
    dynamic_sampling: bool = option("Drop groups that carry no signal (all rewards equal; for process supervision all step rewards equal) and refill the batch from further prompts (DAPO). Needs whole groups per process.", default=False)
    max_dynamic_sampling_rounds: int = option("Extra generation rounds at most per batch when refilling; groups still missing are taken from the dropped ones (counted in dynamic/unfilled_groups).", default=4, ge=0)

    # ---- evaluation -------------------------------------------------------------------------------------------
    eval_steps: int | None = option("Evaluate on eval_dataset every this many optimizer steps (None: only at start and end if eval_dataset is given).", default=None, ge=1)
    per_device_eval_batch_size: int = option("Prompts per generation batch during evaluation.", default=16, ge=1)

    UNSUPPORTED = TRL_UNSUPPORTED

    def __post_init__(self) -> None:
        if self.scale_rewards is True:  # TRL's boolean spellings
            self.scale_rewards = "group"
        elif self.scale_rewards is False:
            self.scale_rewards = "none"
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        super().__post_init__()  # types, finiteness and the constraints declared on each field, then validate()
        self.report_to = [r for r in self.report_to if r != "none"]

    def validate(self) -> None:
        """Rules that span several fields (single-field rules are declared on the fields)."""
        if self.scale_rewards not in SCALES:
            raise ConfigError(f"scale_rewards={self.scale_rewards!r} is not one of {list(SCALES)} (or True / False)")
        taken = ESTIMATORS[self.advantage_estimator].options
        read = set(taken) | set(MULTI_OBJECTIVE_OPTIONS[self.multi_objective_aggregation])
        for opt, name in ESTIMATOR_OPTIONS.items():
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            if opt not in read and getattr(self, name) != default:
                raise ConfigError(f"{name}={getattr(self, name)!r} has no effect with advantage_estimator="
                                  f"{self.advantage_estimator!r} (it reads {[ESTIMATOR_OPTIONS[o] for o in taken] or 'none of them'}); "
                                  f"remove {name} or choose advantage_estimator='grpo'")
        if self.generation_kwargs and not BACKENDS[self.generation_backend].generation_kwargs:
            raise ConfigError(f"generation_kwargs {sorted(self.generation_kwargs)} need generation_backend="
                              "'transformers' (the fast sampler supports temperature, top_p, top_k, min_p and "
                              "repetition_penalty)")
        SPLIT_MODES[self.step_split].check(step_delimiter=self.step_delimiter, step_pattern=self.step_pattern,
                                           step_tag=self.step_tag)
        if not self.output_dir or "\x00" in self.output_dir:
            raise ConfigError(f"output_dir={self.output_dir!r} is not a usable folder name")
        if os.path.isfile(self.output_dir):
            raise ConfigError(f"output_dir={self.output_dir!r} is a file; give a folder")
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and self.delta <= 1 + eps_high:
            raise ConfigError(f"delta must be > 1 + epsilon_high = {1 + eps_high}, got {self.delta}")
        if self.sync_ref_model and self.beta == 0:
            raise ConfigError("sync_ref_model=True needs beta > 0: with beta = 0 there is no reference model to sync")
        if self.max_steps == 0:
            raise ConfigError("max_steps must be ≥ 1, or -1 to derive it from num_train_epochs")
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError("set steps_per_generation or generation_batch_size, not both")
        for name in ("reward_weights", "process_reward_weights"):
            weights = getattr(self, name)
            if weights is not None and not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                               and math.isfinite(w) for w in weights):
                raise ConfigError(f"{name} must be a list of finite numbers, got {weights!r}")
        # torchrun / accelerate export WORLD_SIZE; the trainer checks again with the real process count
        self.layout(world_size=int(os.environ.get("WORLD_SIZE", "1")))

    def warmup(self, max_steps: int) -> int:
        """Warm-up steps of a run of max_steps: warmup_steps as transformers 5 reads it, else warmup_ratio."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        if self.warmup_steps > 0:
            return math.ceil(max_steps * self.warmup_steps)
        return int(self.warmup_ratio * max_steps)

    def estimator_options(self) -> dict[str, Any]:
        """`estimator=` and the options the chosen advantage estimator takes, read from their fields."""
        taken = ESTIMATORS[self.advantage_estimator].options
        return {"estimator": self.advantage_estimator, **{o: getattr(self, ESTIMATOR_OPTIONS[o]) for o in taken}}

    def layout(self, world_size: int) -> "BatchLayout":
        """Resolve the batch arithmetic for `world_size` processes; raises ConfigError naming the fields."""
        per_round = self.per_device_train_batch_size * world_size
        if self.generation_batch_size is not None:
            if self.generation_batch_size % per_round:
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} must be divisible by "
                    f"per_device_train_batch_size × processes = {per_round}")
            steps = self.generation_batch_size // per_round
        else:
            steps = self.steps_per_generation or self.gradient_accumulation_steps
        gen_batch = per_round * steps
        if gen_batch % self.num_generations:
            raise ConfigError(
                f"the generation batch (per_device_train_batch_size={self.per_device_train_batch_size} × "
                f"{world_size} process(es) × steps_per_generation={steps} = {gen_batch} completions) must be divisible "
                f"by num_generations={self.num_generations}; valid per_device_train_batch_size values here: "
                f"{[b for b in range(1, 4 * self.num_generations + 1) if b * world_size * steps % self.num_generations == 0][:6]}")
        if self.dynamic_sampling and (gen_batch // world_size) % self.num_generations:
            raise ConfigError(
                f"dynamic_sampling needs whole groups on each process: {gen_batch // world_size} completions per "
                f"process is not a multiple of num_generations={self.num_generations}")
        if (steps * self.num_iterations) % self.gradient_accumulation_steps:
            raise ConfigError(
                f"steps_per_generation × num_iterations = {steps * self.num_iterations} must be a multiple of "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, so an optimizer step never spans two "
                "generation batches")
        return BatchLayout(world_size, steps, gen_batch, gen_batch // self.num_generations, self.num_generations,
                           self.per_device_train_batch_size)


@dataclass(frozen=True)
class BatchLayout:
    """How a generation round is laid out (TRL semantics: batch sizes count completions)."""

    world_size: int
    steps_per_generation: int  # micro-batches per process per round
    generation_batch_size: int  # completions per round, all processes
    prompts_per_generation: int  # B of the round, all processes
    num_generations: int  # G
    micro_batch_size: int  # completions per micro-batch per process

    @property
    def local_rows(self) -> int:
        return self.generation_batch_size // self.world_size

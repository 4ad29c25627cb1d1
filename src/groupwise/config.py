"""GRPOConfig: every knob of a run, TRL's names and meanings where TRL has the field.

A TRL user switches by changing an import. A field TRL has and groupwise does not support, or a field nobody has,
is an error naming it (never silently ignored); `TRL_UNSUPPORTED` lists the former with the reason.
Validation runs in `__post_init__`, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from groupwise.core.aggregation import AGGREGATIONS
from groupwise.core.advantages import STDS
from groupwise.core.losses import IMPORTANCE_SAMPLING_LEVELS
from groupwise.supervision import SUPERVISION


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


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

SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE = ("sum_then_normalize", "normalize_then_sum")
REPORT_TO = ("none", "tensorboard", "wandb")
ON_REWARD_ERROR = ("raise", "nan")
STEP_SPLITS = ("delimiter", "regex", "tag")


def _help(text: str, **kw) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass
class GRPOConfig:
    """Configuration of a GRPO run (DeepSeekMath §4.1; arXiv 2402.03300). Field names follow TRL's GRPOConfig."""

    # ---- output, logging, checkpoints -------------------------------------------------------------------------
    output_dir: str = _help("Folder for metrics.jsonl, checkpoint-N/ folders and the final model.", default="outputs/groupwise")
    logging_steps: int = _help("Log metrics (progress bar, metrics.jsonl, trackers) every this many optimizer steps.", default=10)
    save_steps: int = _help("Write checkpoint-N/ every this many optimizer steps (0: only at the end).", default=500)
    save_total_limit: int | None = _help("Keep at most this many checkpoint-N/ folders (oldest deleted first).", default=None)
    report_to: str | list[str] = _help("Extra trackers besides metrics.jsonl: 'none', 'tensorboard', 'wandb' or a list.", default="none")
    log_completions: bool = _help("Print a table of prompts, completions and rewards every logging_steps.", default=False)
    num_completions_to_print: int | None = _help("Rows printed when log_completions is on (None: all).", default=None)
    resume_from_checkpoint: str | None = _help("Path of a checkpoint-N/ folder to resume from exactly.", default=None)
    seed: int = _help("Seed of the data order, sampling and anything random in the run.", default=42)

    # ---- optimisation -----------------------------------------------------------------------------------------
    learning_rate: float = _help("AdamW learning rate.", default=1e-6)
    weight_decay: float = _help("AdamW weight decay.", default=0.0)
    adam_beta1: float = _help("AdamW β1.", default=0.9)
    adam_beta2: float = _help("AdamW β2.", default=0.999)
    adam_epsilon: float = _help("AdamW ε.", default=1e-8)
    max_grad_norm: float = _help("Clip the global gradient norm to this value (0: no clipping).", default=1.0)
    lr_scheduler_type: str = _help("transformers scheduler name: 'linear', 'cosine', 'constant', 'constant_with_warmup', ….", default="linear")
    warmup_steps: int = _help("Linear warm-up steps (overrides warmup_ratio when > 0).", default=0)
    warmup_ratio: float = _help("Fraction of max_steps used for linear warm-up.", default=0.0)
    max_steps: int = _help("Optimizer steps to train; -1: derive from num_train_epochs.", default=-1)
    num_train_epochs: float = _help("Passes over the prompt dataset when max_steps is -1.", default=1.0)
    per_device_train_batch_size: int = _help("Completions (not prompts) per micro-batch on each process (TRL meaning).", default=8)
    gradient_accumulation_steps: int = _help("Micro-batches accumulated into one optimizer step.", default=1)
    bf16: bool = _help("Train in bfloat16 mixed precision (through accelerate).", default=False)
    gradient_checkpointing: bool = _help("Recompute activations in the backward pass to save memory.", default=False)
    shuffle_dataset: bool = _help("Shuffle the prompts each epoch (seeded).", default=True)
    disable_dropout: bool = _help("Set dropout to 0 in the policy and reference model (RL needs log-probs without noise).", default=True)
    model_init_kwargs: dict | None = _help("kwargs for AutoModelForCausalLM.from_pretrained when the model is a path.", default=None)
    logprob_chunk_tokens: int = _help("Completion tokens whose logits exist at once when computing log-probs (the output head runs in checkpointed chunks; the (N, T, V) logits never exist).", default=1024)
    trust_remote_code: bool = _help("Allow model repositories to run their own code. Off unless you ask for it.", default=False)

    # ---- generation -------------------------------------------------------------------------------------------
    num_generations: int = _help("G: completions sampled per prompt (the group of DeepSeekMath §4.1).", default=8)
    steps_per_generation: int | None = _help("Micro-batches per process that one generation round feeds (default: gradient_accumulation_steps).", default=None)
    generation_batch_size: int | None = _help("Completions per generation round over all processes (alternative to steps_per_generation).", default=None)
    max_prompt_length: int | None = _help("Keep only the last this many prompt tokens (None: no truncation).", default=512)
    max_completion_length: int = _help("Maximum completion tokens; longer completions are truncated (and known as such).", default=256)
    temperature: float = _help("Sampling temperature; log-probs are computed at the same temperature.", default=1.0)
    top_p: float = _help("Nucleus sampling mass.", default=1.0)
    top_k: int = _help("Keep the k most likely tokens (0: off).", default=0)
    min_p: float | None = _help("Drop tokens below min_p × the top probability (None: off).", default=None)
    repetition_penalty: float = _help("transformers' repetition penalty (1.0: off).", default=1.0)
    generation_kwargs: dict | None = _help("Extra transformers GenerationConfig fields (transformers backend only).", default=None)
    generation_backend: str = _help("'fast' (groupwise's sampler: prompt encoded once per group, finished rows leave the batch, growing KV cache; same processors as generate()) or 'transformers' (model.generate).", default="fast")
    chat_template_kwargs: dict | None = _help("Extra kwargs for tokenizer.apply_chat_template on conversational prompts.", default=None)

    # ---- GRPO objective ---------------------------------------------------------------------------------------
    beta: float = _help("β: weight of the k3 KL penalty to the reference model (DeepSeekMath eq. 3–4). 0: no reference model.", default=0.0)
    epsilon: float = _help("ε_low: lower clip of the importance ratio, clip(ρ, 1−ε, 1+ε_high) (PPO/GRPO).", default=0.2)
    epsilon_high: float | None = _help("ε_high: upper clip (DAPO 'clip-higher'); defaults to epsilon.", default=None)
    delta: float | None = _help("δ: cap on the unclipped ratio, two-sided clipping (INTELLECT-2); > 1 + ε_high.", default=None)
    importance_sampling_level: str = _help("'token' ratio per token (GRPO) or 'sequence' (GSPO, exp of the mean log-ratio).", default="token")
    num_iterations: int = _help("μ: policy updates per generation batch (DeepSeekMath Alg. 1).", default=1)
    loss_type: str = _help("Loss aggregation: 'grpo' (DeepSeekMath), 'bnpo', 'dr_grpo' (Dr. GRPO), 'dapo' (DAPO).", default="dapo")
    scale_rewards: str | bool = _help("Advantage scaling: 'group' (DeepSeekMath), 'batch', 'none' (Dr. GRPO); True='group', False='none'.", default="group")
    reward_std: str = _help("Std in the normalisation: 'population' (1/G, the seeds' definition) or 'unbiased' (Bessel, TRL).", default="population")
    advantage_eps: float = _help("Added to the std before dividing, so near-equal rewards do not become ±1 advantages.", default=1e-4)
    reward_weights: list[float] | None = _help("One weight per reward function (default: all 1).", default=None)
    multi_objective_aggregation: str = _help("'sum_then_normalize' (weighted sum, then group-normalise) or 'normalize_then_sum' (normalise each function, then weighted sum).", default="sum_then_normalize")
    on_reward_error: str = _help("An exception in a reward function: 'raise' (stop, naming the function and row) or 'nan' (score NaN, counted in reward/<func>/errors).", default="raise")
    mask_truncated_completions: bool = _help("Leave completions that hit max_completion_length out of the loss (DAPO).", default=False)
    top_entropy_quantile: float = _help("Train only on this top fraction of tokens by entropy (1.0: all tokens).", default=1.0)
    sync_ref_model: bool = _help("Move the reference model toward the policy every ref_model_sync_steps (TR-DPO).", default=False)
    ref_model_mixup_alpha: float = _help("TR-DPO α: ref ← α·policy + (1−α)·ref.", default=0.6)
    ref_model_sync_steps: int = _help("Optimizer steps between TR-DPO reference syncs.", default=512)

    # ---- process supervision (DeepSeekMath §4.1.3) ------------------------------------------------------------
    supervision: str = _help("'outcome' (§4.1.2, one advantage per completion), 'process' (§4.1.3, token t gets the sum of the normalised rewards of the steps ending at or after t) or 'both' (weighted sum of the two).", default="outcome")
    step_split: str = _help("How completions split into steps: 'delimiter' (step_delimiter), 'regex' (each step_pattern match ends a step) or 'tag' (step_tag after each step).", default="delimiter")
    step_delimiter: str = _help("Text that ends a step when step_split='delimiter'.", default="\n")
    step_pattern: str | None = _help("Regex whose matches end steps when step_split='regex'.", default=None)
    step_tag: str | None = _help("Step tag after each step when step_split='tag' (Math-Shepherd 'ки', Qwen2.5-Math-PRM '<extra_0>').", default=None)
    score_truncated_step: bool = _help("Score the last step of a completion cut by max_completion_length (False: leave it out; its tokens get advantage 0).", default=False)
    process_reward_weights: list[float] | None = _help("One weight per process reward function (default: all 1).", default=None)
    outcome_advantage_weight: float = _help("w_o in supervision='both': Â = w_o·Â_outcome + w_p·Â_process.", default=1.0)
    process_advantage_weight: float = _help("w_p in supervision='both'.", default=1.0)

    # ---- dynamic sampling (DAPO, Yu et al. 2025) ---------------------------------------------------------------
    dynamic_sampling: bool = _help("Drop groups that carry no signal (all rewards equal; for process supervision all step rewards equal) and refill the batch from further prompts (DAPO). Needs whole groups per process.", default=False)
    max_dynamic_sampling_rounds: int = _help("Extra generation rounds at most per batch when refilling; groups still missing are taken from the dropped ones (counted in dynamic/unfilled_groups).", default=4)

    # ---- evaluation -------------------------------------------------------------------------------------------
    eval_steps: int | None = _help("Evaluate on eval_dataset every this many optimizer steps (None: only at start and end if eval_dataset is given).", default=None)
    per_device_eval_batch_size: int = _help("Prompts per generation batch during evaluation.", default=16)

    def __new__(cls, *args, **kwargs):
        _reject_unknown(kwargs, {f.name for f in dataclasses.fields(cls)})
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, f.type, getattr(self, f.name)))
        if self.scale_rewards is True:
            self.scale_rewards = "group"
        elif self.scale_rewards is False:
            self.scale_rewards = "none"
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to == "none" else [self.report_to]
        self.report_to = [r for r in self.report_to if r != "none"]
        self.validate()

    # ------------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        _choice("loss_type", self.loss_type, tuple(AGGREGATIONS))
        _choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        _choice("reward_std", self.reward_std, STDS)
        _choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        _choice("multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE)
        _choice("on_reward_error", self.on_reward_error, ON_REWARD_ERROR)
        _choice("supervision", self.supervision, tuple(SUPERVISION))
        _choice("generation_backend", self.generation_backend, ("fast", "transformers"))
        if self.generation_backend == "fast" and self.generation_kwargs:
            raise ConfigError(f"generation_kwargs {sorted(self.generation_kwargs)} need generation_backend="
                              "'transformers' (the fast sampler supports temperature, top_p, top_k, min_p and "
                              "repetition_penalty)")
        _choice("step_split", self.step_split, STEP_SPLITS)
        if self.step_split == "regex":
            if not self.step_pattern:
                raise ConfigError("step_split='regex' needs step_pattern")
            try:
                re.compile(self.step_pattern)
            except re.error as e:
                raise ConfigError(f"step_pattern={self.step_pattern!r} is not a valid regex: {e}") from None
        if self.step_split == "tag" and not self.step_tag:
            raise ConfigError("step_split='tag' needs step_tag")
        if self.step_split == "delimiter" and not self.step_delimiter:
            raise ConfigError("step_delimiter must be a non-empty string")
        for r in self.report_to:
            _choice("report_to", r, REPORT_TO)
        if self.num_generations < 2:
            raise ConfigError(f"num_generations must be ≥ 2 (a group of one has no relative advantage), got {self.num_generations}")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations", "max_completion_length",
                     "per_device_eval_batch_size", "ref_model_sync_steps", "logprob_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("logging_steps", "save_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"epsilon must be in (0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ConfigError(f"epsilon_high must be > 0, got {self.epsilon_high}")
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and self.delta <= 1 + eps_high:
            raise ConfigError(f"delta must be > 1 + epsilon_high = {1 + eps_high}, got {self.delta}")
        if self.beta < 0:
            raise ConfigError(f"beta must be ≥ 0, got {self.beta}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be ≥ 0 (0: off), got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] or None, got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 < self.top_entropy_quantile <= 1:
            raise ConfigError(f"top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ConfigError(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.sync_ref_model and self.beta == 0:
            raise ConfigError("sync_ref_model=True needs beta > 0: with beta = 0 there is no reference model to sync")
        if self.max_dynamic_sampling_rounds < 0:
            raise ConfigError(f"max_dynamic_sampling_rounds must be ≥ 0, got {self.max_dynamic_sampling_rounds}")
        if self.advantage_eps < 0:
            raise ConfigError(f"advantage_eps must be ≥ 0, got {self.advantage_eps}")
        if self.max_steps == 0 or (self.max_steps < 0 and self.num_train_epochs <= 0):
            raise ConfigError("set max_steps > 0, or max_steps = -1 with num_train_epochs > 0")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length must be ≥ 1 or None, got {self.max_prompt_length}")
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError("set steps_per_generation or generation_batch_size, not both")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ConfigError(f"steps_per_generation must be ≥ 1, got {self.steps_per_generation}")
        if self.reward_weights is not None and not all(isinstance(w, (int, float)) for w in self.reward_weights):
            raise ConfigError(f"reward_weights must be a list of numbers, got {self.reward_weights!r}")
        # torchrun / accelerate export WORLD_SIZE; the trainer checks again with the real process count
        self.layout(world_size=int(os.environ.get("WORLD_SIZE", "1")))

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

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GRPOConfig":
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str) -> "GRPOConfig":
        return cls.from_dict(load_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def load_yaml(path: str) -> dict[str, Any]:
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(values).__name__}")
    return values


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def _coerce(name: str, annotation: str, value: Any) -> Any:
    """Check a value against the field's annotation (e.g. 'float | None'); YAML/CLI strings such as '1e-3'
    become numbers. A mismatch is a ConfigError naming the field."""
    allowed = [a.strip() for a in annotation.split("|")]
    if value is None:
        if "None" in allowed:
            return None
        raise ConfigError(f"{name} must not be None")
    for a in allowed:
        t = _SCALARS.get(a)
        if t is bool and isinstance(value, bool):
            return value
        if t in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            if t is int and float(value) != int(value):
                continue
            return t(value)
        if t is str and isinstance(value, str):
            return value
        if a.startswith(("list", "dict")) and isinstance(value, (list, tuple, dict)):
            return list(value) if a.startswith("list") else value
    if isinstance(value, str):  # '1e-3' from YAML 1.1 or the command line
        for a in allowed:
            if a in ("float", "int"):
                try:
                    number = float(value)
                except ValueError:
                    continue
                if a == "float" or number.is_integer():
                    return _SCALARS[a](number)
    raise ConfigError(f"{name}={value!r} must be of type {annotation}")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")


def _reject_unknown(kwargs: dict[str, Any], known: set[str], owner: str = "GRPOConfig") -> None:
    for key in kwargs:
        if key in known:
            continue
        if key in TRL_UNSUPPORTED:
            raise ConfigError(f"{owner}: TRL field {key!r} is not supported by groupwise: {TRL_UNSUPPORTED[key]} "
                              "(docs/trl_compat.md)")
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{owner}: unknown field {key!r}{hint}")

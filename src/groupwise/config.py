"""GRPOConfig: every knob of a run, TRL's names and meanings where TRL has the field.

A TRL user switches by changing an import. Every TRL 1.16 field is either a field here, with TRL's meaning (a few
are accepted without effect, marked `inert` with the reason), or listed in `TRL_NOT_SUPPORTED` (groupwise.config_trl)
with what to use instead: such a field may appear at TRL's default, any other value is an error naming it. A name
nobody has is an error with a close match. Validation runs in `__post_init__`, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os

from dataclasses import dataclass
from typing import Any

from groupwise.best import check_fields as check_best_fields
from groupwise.config_habits import TrainingArgumentsHabits
from groupwise.config_base import HUB_ID, ConfigError, load_yaml, option, warn_user
from groupwise.config_trl import TRL_NOT_SUPPORTED, TRLFields
from groupwise.core.advantages import ESTIMATORS, SCALES, STDS, STEP_ADVANTAGES
from groupwise.core.importance import IS_MODES
from groupwise.core.losses import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, OBJECTIVES
from groupwise.core.supervision import SUPERVISIONS
from groupwise.generation import BACKENDS, GENERATION_DTYPES, check_generation_fields
from groupwise.generation.vllm_fields import check_sampler_fields
from groupwise.layout import BatchLayout, fill as fill_layout
from groupwise.logging import LOG_LEVELS, transformers_verbosity
from groupwise.modeling import check_compile_backend
from groupwise.optim import OPTIMIZERS, SCHEDULERS, check_available, check_optim_args, check_schedule
from groupwise.rewards.combine import MULTI_OBJECTIVE
from groupwise.rewards.sources import ON_REWARD_ERROR
from groupwise.rewards.steps import SPLIT_MODES
from groupwise.sharding import resolve as resolve_sharding
from groupwise.trackers import TRACKERS, resolve_report_to

__all__ = ["BatchLayout", "ConfigError", "GRPOConfig", "TRL_NOT_SUPPORTED", "load_yaml"]

# GRPOConfig fields a loss objective may read, by the objective's option name (groupwise.core.losses.OBJECTIVES)
OBJECTIVE_FIELDS = ("epsilon", "epsilon_high", "delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")

# fields read only when their switch is on: switch → (fields, a value off the default is an error (True) or a
# warning saying why (TRL's ModelConfig LoRA fields, which TRL configs carry either way, groupwise.adapters; fields
# TRL accepts and ignores without their switch))
SWITCHED_FIELDS = {
    "use_adaptive_entropy": (("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"), True),
    "sync_ref_model": (("ref_model_mixup_alpha", "ref_model_sync_steps"), True),
    "log_completions": (("log_completions_hub_repo",), True),
    "use_peft": (("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                  "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora"),
                 "the full model trains, or peft_config's adapter: set use_peft=True to train LoRA adapters with them"),
    "gradient_checkpointing": (("gradient_checkpointing_kwargs",), "activations are kept, not recomputed: set "
                                                                   "gradient_checkpointing=True to use them"),
    "use_vllm": (("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
                  "vllm_max_model_length", "vllm_model_impl"), "they configure the vLLM engine, and generation_backend "
                                                               "samples: set use_vllm=True to generate with vLLM")}

# GRPOConfig fields an advantage estimator may take, by the estimator's option name (groupwise.core.advantages)
ESTIMATOR_OPTIONS = {"scale": "scale_rewards", "std": "reward_std", "eps": "advantage_eps"}

@dataclass
class GRPOConfig(TRLFields, TrainingArgumentsHabits):
    """Configuration of a GRPO run (DeepSeekMath §4.1; arXiv 2402.03300). Field names follow TRL's GRPOConfig."""

    # ---- output, logging, checkpoints -------------------------------------------------------------------------
    output_dir: str = option("Folder for metrics.jsonl, checkpoint-N/ folders and the final model.", default="outputs/groupwise")
    run_name: str | None = option("Name of the run in the trackers (the wandb / trackio run name), as in TRL / transformers.", default=None)
    logging_first_step: bool = option("Also log the first optimizer step (TRL / transformers).", default=False)
    disable_tqdm: bool | None = option("Hide the progress bar and print each log line instead (None: True when transformers' logging is quieter than warnings when the config is built, as in transformers).", default=None)
    logging_strategy: str = option("When to log metrics: 'steps' (every logging_steps), 'epoch' (at the end of each pass over the prompts) or 'no' (no step lines, but step 1 with logging_first_step: evaluation and end-of-training lines only).", default="steps", choices=("steps", "epoch", "no"))
    logging_steps: float = option("Log metrics (progress bar, metrics.jsonl, trackers) every this many optimizer steps (< 1: that fraction of max_steps, rounded up, as transformers).", default=10, ge=0)
    logging_nan_inf_filter: bool = option("Leave non-finite loss values out of the logged averages (transformers' meaning; a skipped step is still counted in train/skipped_steps).", default=True)
    log_level: str = option("transformers / groupwise log level on the main process ('passive': leave it as it is).", default="passive", choices=LOG_LEVELS)
    log_level_replica: str = option("Log level on the other processes.", default="warning", choices=LOG_LEVELS)
    log_on_each_node: bool = option("In multi-node runs, log (progress bar, warnings) on the main process of each node, not only the first (transformers).", default=True)
    log_unique_prompts: bool = option("The completions table sent to wandb / trackio has one row per prompt (its first completion) instead of every completion (TRL).", default=False)
    save_strategy: str = option("When to write checkpoint-N/: 'steps' (every save_steps, and at the end), 'epoch' (at the end of each pass over the prompts, and at the end), 'best' (after each evaluation that gives metric_for_best_model a new best value; transformers) or 'no' (never; save_model() still works).", default="steps", choices=("steps", "epoch", "best", "no"))
    save_steps: float = option("Write checkpoint-N/ every this many optimizer steps (0: only at the end; < 1: that fraction of max_steps, rounded up, as transformers).", default=500, ge=0)
    save_only_model: bool = option("Checkpoints hold the model only: no optimizer, scheduler or RNG state (smaller, but a run cannot resume from them).", default=False)
    save_total_limit: int | None = option("Keep at most this many checkpoint-N/ folders of the run (oldest deleted first), the best one (metric_for_best_model) counted and never deleted; 1 with a best checkpoint older than the last: both kept, the last deleted at the end (transformers); null, 0 or less: no limit (transformers).", default=None)
    report_to: str = option("Extra trackers besides metrics.jsonl: 'none', 'tensorboard', 'wandb', 'trackio', a list, or 'all' (those installed).", default="none", choices=("none", "all", *TRACKERS), accepts="list[str]")
    project: str = option("The trackio project the run logs to (report_to 'trackio'; transformers).", default="huggingface")
    trackio_space_id: str | None = option("The Hugging Face Space ('user/name' or 'name') that report_to 'trackio' logs to, live (None: this machine only; transformers).", default=None)
    trackio_bucket_id: str | None = option("The Hugging Face Bucket of that Space's logs (None: trackio picks one; transformers).", default=None)
    log_completions: bool = option("Every logging step: print completions with their rewards, write output_dir/completions/completions_<step>.parquet and wandb's / trackio's `completions` table (TRL).", default=False)
    log_completions_hub_repo: str | None = option("A Hugging Face dataset repository ('user/name' or 'name') that log_completions' parquet files are uploaded to, every 2 minutes and when training ends (TRL; private as hub_private_repo).", default=None)
    num_completions_to_print: int | None = option("Completions printed when log_completions is on, drawn at random (None: all).", default=None, ge=0)
    overwrite_output_dir: bool = option("Let a new (not resumed) run delete the checkpoints, metrics and final model (weights or adapter, configs) another run left in output_dir; without it such a run refuses to start.", default=False)
    save_on_interrupt: bool = option("On SIGINT / SIGTERM, write a checkpoint of the step reached before stopping (exit code 130 / 143).", default=True)
    max_consecutive_skipped_steps: int = option("Stop the run (exit ≠ 0, last good checkpoint kept) after this many optimizer steps in a row were skipped for a non-finite loss or gradient.", default=5, ge=1)
    resume_from_checkpoint: str | None = option("A checkpoint-N/ folder to resume from exactly, or true for the newest one in output_dir (transformers' meaning); false or unset: a new run.", default=None, accepts="bool")
    restore_callback_states_from_checkpoint: bool = option("On resume, restore the callbacks' states a checkpoint holds (transformers' ExportableState callbacks, e.g. EarlyStoppingCallback's patience counter, and the TrainerControl flags); they are saved at every checkpoint either way.", default=False)
    push_to_hub: bool = option("Upload the model folder (output_dir) to the hub: at every save (hub_strategy) and at the end, and on trainer.push_to_hub() and trainer.save_model() (needs hub_model_id and a token).", default=False)
    hub_model_id: str | None = option("Hub repository ('name' or 'org/name') push_to_hub uploads to (default: the output_dir's folder name).", default=None)
    hub_token: str | None = option("Hub token for push_to_hub (default: HF_TOKEN or the cached login). Never written to metrics.jsonl.", default=None)
    hub_private_repo: bool | None = option("Create the hub repository as private (None: the account's default).", default=None)
    hub_strategy: str = option("What push_to_hub uploads (transformers): 'every_save' (each checkpoint's model, and the end), 'checkpoint' (also the whole latest checkpoint, to the repository's last-checkpoint/ folder, for resuming), 'all_checkpoints' (also every checkpoint, each to its checkpoint-N/ folder) or 'end' (the end only).", default="every_save", choices=("every_save", "checkpoint", "all_checkpoints", "end"))
    hub_revision: str | None = option("Branch of the hub repository to push to.", default=None)
    hub_always_push: bool = option("Kept for TRL configs.", default=False, inert="uploads are synchronous, so a push is never skipped")
    data_seed: int | None = option("Seed of the prompt order alone (None: seed), as in TRL / transformers.", default=None, ge=0, le=2**32 - 1)
    seed: int = option("Seed of the data order, sampling and anything random in the run.", default=42, ge=0, le=2**32 - 1)

    # ---- optimisation -----------------------------------------------------------------------------------------
    learning_rate: float = option("AdamW learning rate.", default=1e-6, ge=0)
    weight_decay: float = option("AdamW weight decay.", default=0.0, ge=0)
    adam_beta1: float = option("AdamW β1.", default=0.9, ge=0, lt=1)
    adam_beta2: float = option("AdamW β2.", default=0.999, ge=0, lt=1)
    adam_epsilon: float = option("AdamW ε.", default=1e-8, gt=0)
    max_grad_norm: float = option("Clip the global gradient norm to this value (≤ 0: no clipping, as transformers).", default=1.0)
    optim: str = option("Optimizer (groupwise.optim.OPTIMIZERS; transformers' names): torch's AdamW (fused or not), Adafactor, SGD, Adagrad, RMSprop, and bitsandbytes' 8-bit ones when bitsandbytes is installed.", default="adamw_torch_fused", choices=OPTIMIZERS)
    optim_args: str | None = option("Extra optimizer arguments as 'key=value,key=value' (transformers' format), e.g. 'momentum=0.9' for sgd.", default=None)
    lr_scheduler_type: str = option("transformers scheduler name (groupwise.optim.SCHEDULERS; reduce_lr_on_plateau and greedy step on an evaluation metric and are not offered).", default="linear", choices=SCHEDULERS)
    lr_scheduler_kwargs: dict | str | None = option("Extra arguments of the scheduler (transformers' scheduler_specific_kwargs), e.g. {'num_cycles': 2}.", default=None, json_text=True)
    warmup_steps: float = option("Linear warm-up: this many optimizer steps when ≥ 1, that fraction of max_steps (rounded up) when < 1 — transformers 5's meaning; 0: use warmup_ratio.", default=0.0, ge=0)
    warmup_ratio: float = option("Fraction of max_steps used for linear warm-up (rounded up, as transformers 4).", default=0.0, ge=0, le=1)
    max_steps: int = option("Optimizer steps to train; -1 (or 0, as transformers): derive from num_train_epochs.", default=-1, ge=-1)
    num_train_epochs: float = option("Passes over the prompt dataset when max_steps is -1.", default=3.0, ge=0)
    per_device_train_batch_size: int = option("Completions (not prompts) per micro-batch on each process (TRL meaning).", default=8, ge=1)
    gradient_accumulation_steps: int = option("Micro-batches accumulated into one optimizer step.", default=1, ge=1)
    fsdp: str | None = option("Shard the policy with FSDP2 over all processes: true (transformers 5's form, tuned by fsdp_config), or transformers' words 'full_shard' (weights gathered per layer for each forward, then freed) / 'shard_grad_op' (kept until the backward), optionally with 'offload' (shards, gradients and optimizer state in host memory, FSDP2's CPUOffloadPolicy; the optimizer step on the CPU; one process is then sharded too) and 'auto_wrap' (groupwise.sharding). An accelerate launch with an FSDP2 config does the same.", default=None, accepts="bool | list[str]")
    fsdp_config: dict | str | None = option("transformers' FSDP options with fsdp (a mapping, or a JSON file's path; an 'fsdp_' prefix on keys is dropped): reshard_after_forward (default true), transformer_layer_cls_to_wrap (default the model's decoder layer classes), version (2), auto_wrap_policy (TRANSFORMER_BASED_WRAP), cpu_offload / offload_params (as the 'offload' word); activation_checkpointing / xla* must stay false; state_dict_type, cpu_ram_efficient_loading, sync_module_states, use_orig_params, *_prefetch, limit_all_gathers, min_num_params have no effect.", default=None)
    ddp_timeout: float = option("Seconds a collective operation may wait for the other processes (TRL / transformers' name): a process that dies makes the others stop within this time. Also bounds each request to a vLLM server (vllm_mode='server').", default=1800.0, gt=0)
    bf16: bool = option("Train in bfloat16 mixed precision (through accelerate).", default=False)
    fp16: bool = option("Train in float16 mixed precision, for GPUs without bfloat16 (T4, V100): float32 master weights, the forward under float16 autocast, the loss multiplied by a dynamic scale whose overflowing steps are skipped (transformers' meaning; logged as train/loss_scale, train/overflow); with fsdp an overflow in any process's shard skips the step everywhere. Not with bf16.", default=False)
    gradient_checkpointing: bool = option("Recompute activations in the backward pass to save memory.", default=False)
    gradient_checkpointing_kwargs: dict | str | None = option("Arguments of the model's activation checkpointing (transformers': 'use_reentrant', …, and transformers 5's 'every_n_layers', 'offload').", default=None, json_text=True)
    activation_checkpointing: bool | None = option("transformers 5's name for gradient_checkpointing: when set, it wins (and the two mirror each other).", default=None)
    activation_checkpointing_kwargs: dict | str | None = option("transformers 5's name for gradient_checkpointing_kwargs: when set, it wins.", default=None, json_text=True)
    tf32: bool | None = option("Allow TF32 matmuls on Ampere+ GPUs (True/False sets torch's flags; None leaves them).", default=None)
    cast_lm_head_to_fp32: bool = option("Keep the output head in float32 (policy, reference, and the generation_dtype sampler; needs an untied head) (TRL, ScaleRL).", default=False)
    full_determinism: bool = option("Deterministic algorithms everywhere (transformers' enable_full_determinism): slower, bitwise reproducible across runs.", default=False)
    torch_empty_cache_steps: int | None = option("Release cached accelerator memory every this many optimizer steps (None: never).", default=None, ge=1)
    average_tokens_across_devices: bool = option("Normalise token-count losses by the tokens of all processes (always the case for loss_type 'dapo' / 'cispo'; transformers' meaning).", default=True)
    ddp_find_unused_parameters: bool | None = option(
        "DDP find_unused_parameters (None: False; true for a model that leaves trainable parameters without a "
        "gradient; TRL's None: True without gradient checkpointing).", default=None)
    ddp_bucket_cap_mb: int | None = option("DDP gradient bucket size in MiB (None: torch's default).", default=None, ge=1)
    ddp_broadcast_buffers: bool | None = option("DDP broadcast_buffers (None: torch's default).", default=None)
    ddp_static_graph: bool | None = option("DDP static_graph (None: torch's default).", default=None)
    ddp_backend: str | None = option("torch.distributed backend (None: nccl on GPUs, gloo on CPU).", default=None, choices=(None, "nccl", "gloo", "mpi", "ccl", "hccl", "cncl", "mccl"))
    dataloader_num_workers: int = option("Kept for TRL configs.", default=0, ge=0, inert="prompt rows are read by index in the main process (one round needs a few rows); there is no DataLoader")
    dataloader_pin_memory: bool = option("Kept for TRL configs.", default=True, inert="there is no DataLoader; prompts are tokenized into device tensors directly")
    dataloader_persistent_workers: bool = option("Kept for TRL configs.", default=False, inert="there is no DataLoader")
    dataloader_prefetch_factor: int | None = option("Kept for TRL configs.", default=None, inert="there is no DataLoader")
    dataloader_drop_last: bool = option("Kept for TRL configs.", default=False, inert="every round is a full batch of prompts (epochs wrap around)")
    dataloader_in_order: bool = option("Kept for TRL configs.", default=True, inert="there is no DataLoader")
    dataloader_multiprocessing_context: str | None = option("Kept for TRL configs.", default=None, inert="there is no DataLoader")
    use_cache: bool = option("Kept for TRL configs.", default=False, inert="generation always uses a KV cache and training forwards never do")
    skip_memory_metrics: bool = option("Kept for TRL configs.", default=True, inert="memory metrics are not collected")
    log_multimodal: bool = option("Kept for TRL configs.", default=True, inert="groupwise trains text-only models")
    do_train: bool = option("Not read by the trainer, as in transformers (for your scripts).", default=False)
    do_eval: bool = option("Not read by the trainer, as in transformers (for your scripts).", default=False)
    do_predict: bool = option("Not read by the trainer, as in transformers (for your scripts).", default=False)
    local_rank: int = option("Set by launchers; the process rank is read from the environment (transformers).", default=-1)
    shuffle_dataset: bool = option("Shuffle the prompts each epoch (seeded).", default=True)
    disable_dropout: bool = option("Set dropout to 0 in the policy and reference model (RL needs log-probs without noise).", default=True)
    model_init_kwargs: dict | str | None = option("kwargs for AutoModelForCausalLM.from_pretrained when the model is a path.", default=None, json_text=True)
    vllm_structured_outputs_regex: str | None = option("vLLM's structured outputs: every completion is constrained to match this regular expression (use_vllm; vLLM's regex dialect), as TRL.", default=None)
    torch_compile: bool = option("Compile the policy's forward that computes log-probs (training, π_θold) with torch.compile, as transformers compiles the model it trains; generation is compiled separately (generation_compile). Set by torch_compile_backend or torch_compile_mode.", default=False)
    torch_compile_backend: str | None = option("torch.compile backend (one of torch._dynamo.list_backends(), e.g. 'inductor', the default once torch_compile is on, or 'aot_eager'); setting it turns torch_compile on (transformers).", default=None)
    torch_compile_mode: str | None = option("torch.compile mode; setting it turns torch_compile on (transformers).", default=None, choices=(None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    logprob_chunk_tokens: int = option("Completion tokens whose logits exist at once when computing log-probs (the output head runs in checkpointed chunks; the (N, T, V) logits never exist).", default=1024, ge=1)
    trust_remote_code: bool = option("Allow model repositories to run their own code. Off unless you ask for it.", default=False)

    # ---- LoRA (TRL's ModelConfig names; groupwise.adapters) ----------------------------------------------------
    use_peft: bool = option("Train LoRA adapters instead of the full model (TRL's ModelConfig field; GRPOTrainer(peft_config=…) does the same from Python). Needs peft.", default=False, parsed=False)
    lora_r: int = option("LoRA rank.", default=16, ge=1, parsed=False)
    lora_alpha: int = option("LoRA α (the update is scaled by α / r).", default=32, ge=1, parsed=False)
    lora_dropout: float = option("Dropout on the LoRA path (set to 0 by disable_dropout, as every dropout).", default=0.05, ge=0, lt=1, parsed=False)
    lora_target_modules: list[str] | str | None = option("Modules that get adapters (None: peft's default for the architecture; 'all-linear').", default=None, parsed=False)
    lora_target_parameters: list[str] | None = option("Parameters (not modules) that get adapters, e.g. MoE experts (peft ≥ 0.17).", default=None, parsed=False)
    lora_modules_to_save: list[str] | None = option("Modules trained in full and saved with the adapter.", default=None, parsed=False)
    lora_task_type: str = option("peft task type.", default="CAUSAL_LM", parsed=False)
    use_rslora: bool = option("Rank-stabilised LoRA (scale α / √r).", default=False, parsed=False)
    use_dora: bool = option("Weight-decomposed LoRA (DoRA).", default=False, parsed=False)

    # ---- generation -------------------------------------------------------------------------------------------
    num_generations: int = option("G: completions sampled per prompt (the group of DeepSeekMath §4.1).", default=8, ge=2)
    remove_unused_columns: bool = option("Pass only the prompt column to reward functions (TRL); False passes every dataset column as a keyword.", default=False)
    steps_per_generation: int | None = option("Micro-batches per process that one generation round feeds (default: gradient_accumulation_steps).", default=None, ge=1)
    generation_batch_size: int | None = option("Completions per generation round over all processes (alternative to steps_per_generation).", default=None, ge=1)
    max_prompt_length: int | None = option("Keep only the last this many prompt tokens (None, the default: no truncation, as TRL 1.16, which dropped the field).", default=None, ge=1)
    truncate_prompt: str = option("Prompts longer than max_prompt_length: 'left' keeps their last max_prompt_length tokens (TRL's behaviour; counted in a warning when the dataset is checked), 'error' stops before the model loads, naming the first such row (with tools, whose schemas the dataset check does not count, at that prompt's rollout).", default="left", choices=("left", "error"))
    pad_to_multiple_of: int | str | None = option("Pad prompt and completion tensors to a multiple of this many tokens ('auto': no padding here, 128 on Neuron in TRL).", default="auto")
    max_completion_length: int = option("Maximum completion tokens; longer completions are truncated (and known as such).", default=512, ge=1)
    temperature: float = option("Sampling temperature; log-probs are computed at the same temperature.", default=1.0, gt=0)
    top_p: float = option("Nucleus sampling mass.", default=1.0, gt=0, le=1)
    top_k: int = option("Keep the k most likely tokens (0: off).", default=0, ge=0)
    min_p: float | None = option("Drop tokens below min_p × the top probability (None: off).", default=None, ge=0, le=1)
    repetition_penalty: float = option("transformers' repetition penalty (1.0: off).", default=1.0, gt=0)
    generation_kwargs: dict | str | None = option("Extra sampling fields: transformers GenerationConfig fields (generation_backend='transformers') or vLLM SamplingParams fields (use_vllm). They override the fields groupwise sets, as in TRL; keys that change the completions' shape (max_new_tokens, max_tokens, max_length, n, num_return_sequences) are refused.", default=None, json_text=True)
    use_vllm: bool = option("Generate with vLLM (TRL's name): vllm_mode='colocate' runs an engine in each process (groupwise.generation.vllm), 'server' asks a separate vLLM server (groupwise.generation.vllm_server); needs vLLM installed (`pip install vllm`, the build for your CUDA and torch: docs/vllm.md). Sets generation_backend='vllm'.", default=False)
    vllm_mode: str = option("'colocate' (an in-process engine sharing the GPU) or 'server' (a vLLM server started apart, e.g. on other GPUs, with `vllm serve` / `trl vllm-serve`: docs/vllm.md; with several training processes the main one talks to it, as in TRL).", default="colocate", choices=("colocate", "server"))
    vllm_server_base_url: str | None = option("vllm_mode='server': base URL of the vLLM server, e.g. 'http://localhost:8000' (TRL); when set, vllm_server_host and vllm_server_port are not read.", default=None)
    vllm_server_host: str = option("vllm_mode='server': host of the vLLM server, when vllm_server_base_url is not set (TRL).", default="0.0.0.0")
    vllm_server_port: int = option("vllm_mode='server': port of the vLLM server, when vllm_server_base_url is not set (TRL).", default=8000, ge=1, le=65535)
    vllm_server_timeout: float = option("vllm_mode='server': seconds to wait for the server to answer GET /health before stopping with an error that names its URL (TRL).", default=240.0, ge=0)
    vllm_group_port: int = option("vllm_mode='server': port this process opens for the weight-transfer group the server joins to receive the weights (TRL); change it only when it is taken.", default=51216, ge=1, le=65535)
    vllm_gpu_memory_utilization: float = option("Share of GPU memory the colocated engine may take (TRL).", default=0.3, gt=0, le=1)
    vllm_tensor_parallel_size: int = option("Tensor-parallel size of the colocated engine (TRL): each engine spans this many consecutive processes; it must divide their number.", default=1, ge=1)
    vllm_enable_sleep_mode: bool = option("Let the engine sleep (weights and KV cache offloaded) during the optimizer step (TRL).", default=False)
    vllm_max_model_length: int | None = option("max_model_len of the engine (TRL).", default=None, ge=1)
    vllm_model_impl: str = option("vLLM's model implementation: 'vllm' or 'transformers' (TRL's help), or vLLM's other values 'auto' / 'terratorch', which TRL passes on too.", default="vllm", choices=("vllm", "transformers", "auto", "terratorch"))
    generation_dtype: str | None = option("Sample from a copy of the policy in this dtype ('bfloat16', 'float16', 'float32'), refreshed after every optimizer step (None: sample from the policy itself). The sampler's numerics then differ from the trainer's, so the loss is importance-corrected (vllm_importance_sampling_*).", default=None, choices=(None, *GENERATION_DTYPES))
    vllm_importance_sampling_correction: bool = option("Correct the loss for a sampler whose numerics differ from the trainer's (TRL's name and default; it applies when the sampler differs: generation_dtype set). groupwise.core.importance.", default=True)
    vllm_importance_sampling_mode: str = option("'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask' (TRL): weights per token or per completion, clipped (truncate) or zeroed (mask) outside [clip_min, clip_max].", default="sequence_mask", choices=IS_MODES)
    vllm_importance_sampling_clip_max: float | None = option("Upper bound C of the importance weight (TRL).", default=3.0, gt=0)
    vllm_importance_sampling_clip_min: float | None = option("Lower bound of the importance weight (None: none) (TRL).", default=None, ge=0)
    vllm_importance_sampling_cap: float | None = option("TRL's deprecated name for vllm_importance_sampling_clip_max; when set, it wins.", default=None, gt=0)
    generation_backend: str = option("Generation backend (groupwise.generation); 'fast' prefills each prompt once per group and drops finished rows, with generate()'s processors.", default="fast", choices=BACKENDS)
    generation_compile: bool | None = option("The fast backend's static decode loop: a preallocated KV cache and a decode step compiled with torch.compile (CUDA graphs on a GPU); finished rows stay in the batch. None: on when generating on CUDA, for the models it serves (sliding-window, recurrent, ALiBi or non-sdpa models decode with the eager loop, named in a warning); True: on, or an error naming why not. Each new (rows, prompt width rounded to 64) shape compiles once (seconds to a minute).", default=None)
    generation_fuse_projections: bool = option("In the static decode loop, compute each layer's q/k/v and gate/up projections as one matrix product each, from copies of the concatenated weights refreshed at every generation call (fewer, larger products; costs the memory of those weights). Plain nn.Linear layers only (not PEFT or sharded ones).", default=False)
    chat_template_kwargs: dict | str | None = option("Extra kwargs for tokenizer.apply_chat_template on conversational prompts.", default=None, json_text=True)

    # ---- tools and environments (GRPOTrainer(tools=…, environment_factory=…); groupwise.agents, docs/agents.md) ---
    max_tool_calling_iterations: int | None = option("Maximum number of tool-calling turns when training an agent. If `None`, there is no limit and generation stops when the model generates a response turn with no tool calls or when the total response length reaches `max_model_length` (TRL; max_completion_length bounds the whole multi-turn completion, tool tokens included).", default=None, ge=0)
    tool_timeout: float | None = option("Seconds one tool call may take (groupwise's addition; None: no limit). An overrun becomes the tool message {'error': \"tool 'name' timed out after T s\"}, counted in tools/failure_frequency and tools/timeout_frequency; the call is abandoned in a daemon thread (tools are trusted code; model-generated code must go through groupwise.agents.sandbox.run_python).", default=30.0, gt=0)

    # ---- GRPO objective ---------------------------------------------------------------------------------------
    beta: float = option("β: weight of the k3 KL penalty to the reference model (DeepSeekMath eq. 3–4). 0: no reference model.", default=0.0, ge=0)
    epsilon: float = option("ε_low: lower clip of the importance ratio, clip(ρ, 1−ε, 1+ε_high) (PPO/GRPO); ≥ 1 leaves the ratio unclipped from below, as TRL allows.", default=0.2, gt=0)
    epsilon_high: float | None = option("ε_high: upper clip (DAPO 'clip-higher'); defaults to epsilon.", default=None, gt=0)
    delta: float | None = option("δ: cap on the unclipped ratio, two-sided clipping (INTELLECT-2); > 1 + ε_high.", default=None)
    importance_sampling_level: str = option("'token' ratio per token (GRPO) or 'sequence' (GSPO, exp of the mean log-ratio).", default="token", choices=IMPORTANCE_SAMPLING_LEVELS)
    num_iterations: int = option("μ: policy updates per generation batch (DeepSeekMath Alg. 1).", default=1, ge=1)
    loss_type: str = option("The per-token objective and what its masked sum is divided by (groupwise.core.losses.LOSS_TYPES, TRL's names).", default="dapo", choices=LOSS_TYPES)
    sapo_temperature_pos: float = option("τ_pos of loss_type='sapo': the gate's temperature on tokens with positive advantage (TRL).", default=1.0, gt=0)
    sapo_temperature_neg: float = option("τ_neg of loss_type='sapo': the gate's temperature on tokens with advantage ≤ 0 (TRL).", default=1.05, gt=0)
    vespo_k_pos: float = option("k of loss_type='vespo' for Â ≥ 0: the power in φ(w) = e^λ w^k e^(−λw), how hard sequences with ratio w < 1 are down-weighted (TRL).", default=2.0, ge=0)
    vespo_lambda_pos: float = option("λ of loss_type='vespo' for Â ≥ 0: the decay in φ(w), how hard sequences with ratio w > 1 are down-weighted (TRL).", default=3.0, ge=0)
    vespo_k_neg: float = option("k of loss_type='vespo' for Â < 0 (TRL).", default=3.0, ge=0)
    vespo_lambda_neg: float = option("λ of loss_type='vespo' for Â < 0 (TRL).", default=2.0, ge=0)
    off_policy_mask_threshold: float | None = option("δ of the off-policy sequence mask (DeepSeek-V3.2 eq. 9, TRL): a completion whose mean KL from the sampling policy, mean_t (log π_sampler − log π_θ), exceeds δ has its policy term dropped where its advantage is negative (e.g. 0.5). π_sampler is the sampler's own log-probs when it differs from the trainer (use_vllm, generation_dtype), else π_θold. None: off.", default=None, ge=0)
    use_bias_correction_kl: bool = option("Multiply the k3 KL term by the importance ratio ρ (TRL's default True): its value is unchanged on-policy but its gradient gains k3·∇log π. False (groupwise's default) is DeepSeekMath eq. 3 as written.", default=False)
    entropy_coef: float = option("c in L − c·H̄: an entropy bonus, H̄ the mean token entropy of each micro-batch (over the tokens the policy term acts on), the same for every loss_type (TRL). With use_adaptive_entropy, the initial c. 0: off.", default=0.0)
    router_aux_loss_coef: float | None = option("Weight of a Mixture-of-Experts model's router load-balancing loss (the model's own aux_loss) added to the GRPO loss, logged as aux_loss (TRL). None: the model config's router_aux_loss_coef (0.0 when it declares none); 0.0: off. Setting it for a dense model is an error.", default=None, ge=0)
    use_adaptive_entropy: bool = option("Adapt entropy_coef after every optimizer step (Skywork-OR1's adaptive entropy control, TRL; groupwise.core.entropy): +entropy_coef_delta while the step's mean token entropy is ≤ entropy_target, −entropy_coef_delta otherwise, within [entropy_coef_min, entropy_coef_max]; the bonus applies only while entropy is ≤ entropy_target. Its state is kept in checkpoints.", default=False)
    entropy_coef_min: float = option("Lower bound of the adapted entropy_coef (use_adaptive_entropy, TRL).", default=0.0, ge=0)
    entropy_coef_max: float = option("Upper bound of the adapted entropy_coef (use_adaptive_entropy, TRL).", default=1.0, ge=0)
    entropy_coef_delta: float = option("Step of the adapted entropy_coef per optimizer step (use_adaptive_entropy, TRL).", default=0.005, ge=0)
    entropy_target: float = option("Target mean token entropy in nats (use_adaptive_entropy, TRL), over the tokens the policy term acts on. Language models sit at 2–10 nats, so the default 0.2 acts only on a near-collapse: set it near the entropy you want to keep.", default=0.2, ge=0)
    scale_rewards: str = option("Advantage scaling: 'group' (DeepSeekMath), 'batch', 'none' (Dr. GRPO); True='group', False='none'.", default="group", accepts="bool")
    advantage_estimator: str = option("How rewards become advantages, for outcome and step rewards alike (groupwise.core.advantages; the default is DeepSeekMath §4.1.2/§4.1.3). Each estimator reads only the options it takes among scale_rewards, reward_std and advantage_eps; setting another is an error.", default="grpo", choices=ESTIMATORS)
    reward_std: str = option("Std in the normalisation: 'population' (1/G, DeepSeekMath's std) or 'unbiased' (Bessel, TRL).", default="population", choices=STDS)
    advantage_eps: float = option("Added to the std before dividing, so near-equal rewards do not become ±1 advantages.", default=1e-4, ge=0)
    reward_weights: list[float] | None = option("One weight per reward function (default: all 1).", default=None)
    multi_objective_aggregation: str = option("'sum_then_normalize' (weighted sum, then normalise as scale_rewards says) or 'normalize_then_sum' (z-score each function in its group, weighted sum, then normalise over the batch, as TRL). Combines reward_funcs only: step rewards are summed with process_reward_weights.", default="sum_then_normalize", choices=MULTI_OBJECTIVE)
    reward_timeout: float | None = option("Seconds one reward-function call may take (None, the default: no limit). With a limit the call runs in a daemon thread: an overrun scores that call's rows NaN (unscored, counted in rewards/<func>/errors), the run goes on and the stuck call cannot keep the process alive. Reward code that relies on signal.alarm (math_verify's default timeout) only works without a limit.", default=None, gt=0)
    on_reward_error: str = option("An exception in a reward function: 'raise' (stop, naming the function and row) or 'nan' (score NaN, counted in rewards/<func>/errors).", default="raise", choices=ON_REWARD_ERROR)
    mask_truncated_completions: bool = option("Leave completions that hit max_completion_length out of the loss (DAPO).", default=False)
    top_entropy_quantile: float = option("Train only on this top fraction of tokens by entropy (1.0: all tokens; 0: only the highest-entropy ones, as TRL); the threshold is over the micro-batch of every process, as TRL.", default=1.0, ge=0, le=1)
    sync_ref_model: bool = option("Move the reference model toward the policy every ref_model_sync_steps (TR-DPO).", default=False)
    ref_model_mixup_alpha: float = option("TR-DPO α: ref ← α·policy + (1−α)·ref.", default=0.6, ge=0, le=1)
    ref_model_sync_steps: int = option("Optimizer steps between TR-DPO reference syncs.", default=512, ge=1)

    # ---- process supervision (DeepSeekMath §4.1.3) ------------------------------------------------------------
    supervision: str = option("'outcome' (§4.1.2, one advantage per completion), 'process' (§4.1.3, token t gets the sum of the normalised rewards of the steps ending at or after t) or 'both' (w_o·outcome + w_p·process) (groupwise.core.supervision).", default="outcome", choices=SUPERVISIONS)
    step_split: str = option("How completions split into steps: 'delimiter' (step_delimiter), 'regex' (each step_pattern match ends a step), 'tag' (step_tag after each step) or 'turn' (each assistant turn of a multi-turn rollout with tools is a step; step rewards from process_reward_funcs or the environment's get_step_rewards()).", default="delimiter", choices=SPLIT_MODES)
    step_advantage: str = option("How step rewards become token advantages: 'suffix_sum' (DeepSeekMath §4.1.3: sum of the group-normalised rewards of this and later steps) or 'step_return' (the return-to-go from each step, normalised among the group's completions at the same step index: no baseline that grows with the completion's own number of steps, for turns or steps whose number the model chooses; groupwise.core.advantages._step_return).", default="suffix_sum", choices=STEP_ADVANTAGES)
    step_delimiter: str = option("Text that ends a step when step_split='delimiter'.", default="\n")
    step_pattern: str | None = option("Regex whose matches end steps when step_split='regex'; special tokens whose text it matches stay in the text it searches (as a special step delimiter or tag does).", default=None)
    step_tag: str | None = option("Step tag after each step when step_split='tag' (Math-Shepherd 'ки', Qwen2.5-Math-PRM '<extra_0>').", default=None)
    score_truncated_step: bool = option("Score the last step of a completion cut by max_completion_length (False: leave it out; its tokens get process advantage 0, and under supervision='both' still w_o·Â_outcome).", default=False)
    process_reward_weights: list[float] | None = option("One weight per process reward function (default: all 1).", default=None)
    outcome_advantage_weight: float = option("w_o in supervision='both': Â = w_o·Â_outcome + w_p·Â_process.", default=1.0)
    process_advantage_weight: float = option("w_p in supervision='both'.", default=1.0)

    # ---- dynamic sampling (DAPO, Yu et al. 2025) ---------------------------------------------------------------
    dynamic_sampling: bool = option("Drop groups that carry no signal (all rewards equal; for process supervision all step rewards equal) and refill the batch from further prompts (DAPO). Needs whole groups per process.", default=False)
    max_dynamic_sampling_rounds: int = option("Extra generation rounds at most per batch when refilling; groups still missing are taken from the dropped ones (counted in dynamic/unfilled_groups).", default=4, ge=0)

    # ---- evaluation -------------------------------------------------------------------------------------------
    eval_strategy: str = option("When to evaluate on eval_dataset during training: 'no' (TRL's default; trainer.evaluate() still works), 'steps' (every eval_steps, and at the end) or 'epoch'.", default="no", choices=("no", "steps", "epoch"))
    eval_steps: float | None = option("Evaluate every this many optimizer steps with eval_strategy='steps' (None: logging_steps; < 1: that fraction of max_steps, rounded up; 0 under eval_strategy='steps': logging_steps; as transformers).", default=None, ge=0)
    eval_on_start: bool = option("Also evaluate before the first optimizer step (a sanity check, transformers).", default=False)
    metric_for_best_model: str | None = option("Evaluation metric that decides the best checkpoint (with or without 'eval_'; e.g. 'reward'): state.best_metric / best_model_checkpoint, read by load_best_model_at_end and EarlyStoppingCallback (transformers; groupwise.best).", default=None)
    greater_is_better: bool | None = option("Is a larger metric_for_best_model better? (None: True unless its name ends with 'loss'; transformers).", default=None)
    load_best_model_at_end: bool = option("Load the best checkpoint's weights when training ends (transformers; push_to_hub then uploads them): needs metric_for_best_model, and save_strategy 'best' or eval_strategy = save_strategy with save_steps a multiple of eval_steps (a new best between two saves is saved then, so that it can be loaded); save_total_limit never deletes the best checkpoint.", default=False)
    eval_delay: float = option("Do not evaluate (eval_strategy 'steps' / 'epoch') before this many optimizer steps / epochs.", default=0, ge=0)
    num_generations_eval: int | None = option("Completions sampled per eval prompt (None: greedy, one per prompt). With k ≥ 1 evaluation samples at the training temperature and logs mean@k and pass@k per reward function.", default=None, ge=1)
    per_device_eval_batch_size: int = option("Prompts per generation batch during evaluation.", default=16, ge=1)

    UNSUPPORTED = TRL_NOT_SUPPORTED

    def __post_init__(self) -> None:
        # transformers 5 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs): the new name
        # wins when set, then both names hold the same value (as TrainingArguments resolves them)
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if isinstance(getattr(self, new), str) and getattr(self, new).strip().lower() in ("none", "null"):
                setattr(self, new, None)  # `--activation_checkpointing None`: unset, as transformers' parser reads it
            if getattr(self, new) is not None:
                setattr(self, old, getattr(self, new))
            setattr(self, new, getattr(self, old))
        # transformers' spellings (None, "none", "all", a name, a list) as the trackers to open; the trainer resolves
        # it again, as it may be set after the config is built
        self.report_to = resolve_report_to(self.report_to)
        super().__post_init__()  # types, finiteness and the constraints declared on each field, then validate()
        if self.disable_tqdm is None:  # transformers: hidden when its logging is quieter than warnings
            self.disable_tqdm = transformers_verbosity() > LOG_LEVELS["warning"]

    def validate(self) -> None:
        """Rules that span several fields (single-field rules are declared on the fields)."""
        self.output_dir = os.path.expanduser(self.output_dir)  # transformers: `~/runs/x` is under the home folder
        if self.bf16 and self.fp16:  # transformers' rule
            raise ConfigError("bf16=True and fp16=True: choose one mixed precision (bf16 where the GPU has it)")
        if isinstance(self.scale_rewards, bool):  # TRL's boolean spellings (after coercion: 'True' is one too)
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.scale_rewards not in SCALES:
            raise ConfigError(f"scale_rewards={self.scale_rewards!r} is not one of {list(SCALES)} (or True / False)")
        taken = ESTIMATORS[self.advantage_estimator].options
        aggregation = MULTI_OBJECTIVE[self.multi_objective_aggregation]
        read = set(taken) | set(aggregation.options)
        for opt, name in ESTIMATOR_OPTIONS.items():
            if opt not in read and getattr(self, name) != _default(name):
                raise ConfigError(f"{name}={getattr(self, name)!r} has no effect with advantage_estimator="
                                  f"{self.advantage_estimator!r} (it reads {[ESTIMATOR_OPTIONS[o] for o in taken] or 'none of them'}); "
                                  f"remove {name} or choose advantage_estimator='grpo'")
        if self.multi_objective_aggregation != _default("multi_objective_aggregation") \
                and not SUPERVISIONS[self.supervision].outcome:
            raise ConfigError(f"multi_objective_aggregation={self.multi_objective_aggregation!r} combines the outcome "
                              f"rewards (reward_funcs), which supervision={self.supervision!r} only logs: its step "
                              "rewards are summed with process_reward_weights. Drop it, or set supervision='both'")
        # the aggregation fixes the outcome rewards' scale only: step rewards (process, both) still read scale_rewards
        if aggregation.scale is not None and "scale" in taken and not SUPERVISIONS[self.supervision].process and \
                self.scale_rewards not in (_default("scale_rewards"), aggregation.scale):
            raise ConfigError(f"scale_rewards={self.scale_rewards!r} has no effect with multi_objective_aggregation="
                              f"{self.multi_objective_aggregation!r}, whose summed z-scores are normalised over the "
                              f"batch (scale {aggregation.scale!r}, as in TRL): remove scale_rewards")
        objective = LOSS_TYPES[self.loss_type].objective
        for name in OBJECTIVE_FIELDS:
            if name not in OBJECTIVES[objective].options and getattr(self, name) != _default(name):
                readers = sorted(t for t, lt in LOSS_TYPES.items() if name in OBJECTIVES[lt.objective].options)
                raise ConfigError(f"{name}={getattr(self, name)!r} has no effect with loss_type={self.loss_type!r}; "
                                  f"remove it, or choose a loss_type that reads it: {readers}")
        if OBJECTIVES[objective].sequence_weight and self.corrects_sampling \
                and not self.vllm_importance_sampling_mode.startswith("token"):
            raise ConfigError(f"loss_type={self.loss_type!r} folds the sampler correction into its sequence weight "
                              "token by token: set vllm_importance_sampling_mode to 'token_truncate' or 'token_mask' "
                              f"(not {self.vllm_importance_sampling_mode!r})")
        if OBJECTIVES[objective].sequence_weight and self.importance_sampling_level != "token":
            warn_user(f"loss_type={self.loss_type!r} computes its sequence weight itself: importance_sampling_level="
                      f"{self.importance_sampling_level!r} has no effect on its loss; leave it 'token' (TRL warns "
                      "alike)")
        for switch, (fields, rule) in SWITCHED_FIELDS.items():  # TRL ignores them silently
            changed = [] if getattr(self, switch) else [n for n in fields if getattr(self, n) != _default(n)]
            if changed:
                names = ", ".join(f"{n}={getattr(self, n)!r}" for n in changed)
                if rule is True:  # refused
                    raise ConfigError(f"{names} has no effect without {switch}=True: remove it, or set {switch}=True")
                warn_user(f"{names}: no effect without {switch}=True ({rule}, or remove them)")  # rule: why
        loss_type = LOSS_TYPES[self.loss_type]  # TRL's two warnings on the importance-sampling level
        if loss_type.paper_level is not None and self.importance_sampling_level != loss_type.paper_level:
            warn_user(f"loss_type={self.loss_type!r} is set up with importance_sampling_level="
                      f"{loss_type.paper_level!r} in its paper (this run: {self.importance_sampling_level!r}; "
                      "TRL warns alike)")
        if self.importance_sampling_level == "sequence" and loss_type.length_weighted:
            warn_user(f"importance_sampling_level='sequence' with loss_type={self.loss_type!r}: the loss sums "
                      "per-token terms, so each sequence weighs by its length instead of the per-sequence "
                      "objective of GSPO; set loss_type='grpo' for GSPO's setup (TRL warns alike)")
        if self.dynamic_sampling and self.max_steps <= 0:
            warn_user(f"dynamic_sampling=True with num_train_epochs={self.num_train_epochs:g} and no max_steps: the "
                      "refills read more prompts per step than planned, so the epochs end the run before the steps "
                      f"planned from them (lr_scheduler_type={self.lr_scheduler_type!r} stops short of its end, the "
                      "progress bar's total is too large); set max_steps to train a fixed number of steps")
        if self.use_adaptive_entropy and self.entropy_coef_min > self.entropy_coef_max:
            raise ConfigError(f"entropy_coef_min ({self.entropy_coef_min}) must not exceed entropy_coef_max "
                              f"({self.entropy_coef_max})")
        if objective == "cispo" and self.epsilon_high is None:
            raise ConfigError("loss_type='cispo' caps the importance weight at epsilon_high (ε_max; 5.0 is the value "
                              "recommended with CISPO): set epsilon_high")
        if not self.average_tokens_across_devices:
            raise ConfigError("average_tokens_across_devices=False is not supported: loss types that count tokens "
                              "(dapo, cispo) always count them over all processes; use loss_type='bnpo' for a "
                              "per-process token mean")
        check_sampler_fields(self, _default)  # use_vllm, vllm_mode, the importance-sampling correction
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:  # transformers' rules
            self.torch_compile = True
        if self.torch_compile:
            self.torch_compile_backend = self.torch_compile_backend or "inductor"
            check_compile_backend(self.torch_compile_backend)
        check_available(self.optim)
        sharded = resolve_sharding(self.fsdp, self.fsdp_config) is not None  # a bad value fails here, before loading
        if sharded and not OPTIMIZERS[self.optim].shards:
            raise ConfigError(f"optim={self.optim!r} cannot step FSDP2's sharded parameters: with fsdp use one of "
                              f"{[k for k, o in OPTIMIZERS.items() if o.shards]}, or drop fsdp")
        check_optim_args(self.optim, self.optim_args)  # a bad item, or a key a field sets
        check_schedule(self.lr_scheduler_type, self.lr_scheduler_kwargs)  # before the model loads, not at build
        if isinstance(self.pad_to_multiple_of, str):
            text = self.pad_to_multiple_of.strip().lower()
            if text in ("auto", "none", "null"):
                self.pad_to_multiple_of = None  # "auto" pads on Neuron devices only, which groupwise does not run on
            elif text.isdigit() and int(text) > 0:
                self.pad_to_multiple_of = int(text)
            else:
                raise ConfigError(f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be a positive integer, "
                                  "'auto' or None")
        elif self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of must be ≥ 1, got {self.pad_to_multiple_of}")
        if self.push_to_hub and self.hub_model_id is not None and not HUB_ID.match(self.hub_model_id):
            raise ConfigError(f"hub_model_id={self.hub_model_id!r} is not a hub repository id ('name' or 'org/name')")
        for name in ("logging_steps", "save_steps", "eval_steps"):  # transformers: under its strategy 'steps' only
            value, strategy = getattr(self, name), getattr(self, name.replace("_steps", "_strategy"))
            if value is not None and value > 1 and value != int(value) and strategy == "steps":
                raise ConfigError(f"{name}={value} must be a whole number of steps, or a fraction of max_steps below 1")
            if value is not None and value >= 1:
                setattr(self, name, int(value))
        if self.eval_strategy == "steps" and not self.eval_steps:  # transformers: defaults to logging_steps there
            self.eval_steps = self.logging_steps or None
        if self.eval_strategy == "steps" and self.eval_steps is None:  # transformers refuses it alike
            raise ConfigError("eval_strategy='steps' needs eval_steps, which defaults to logging_steps (0 here): set "
                              "eval_steps or logging_steps > 0")
        if self.logging_strategy == "steps" and self.logging_steps == 0:  # transformers' rule
            raise ConfigError("logging_strategy='steps' needs logging_steps > 0 (every that many steps, or a fraction "
                              "of max_steps below 1): set logging_steps, or logging_strategy='no'")
        check_generation_fields(self)  # generation_kwargs and the fast backend's switches
        SPLIT_MODES[self.step_split].check(step_delimiter=self.step_delimiter, step_pattern=self.step_pattern,
                                           step_tag=self.step_tag)
        try:
            SUPERVISIONS[self.supervision].check_fields(
                self.supervision, outcome_weight=self.outcome_advantage_weight,
                process_weight=self.process_advantage_weight, score_truncated_step=self.score_truncated_step)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not self.output_dir or "\x00" in self.output_dir:
            raise ConfigError(f"output_dir={self.output_dir!r} is not a usable folder name")
        if os.path.isfile(self.output_dir):
            raise ConfigError(f"output_dir={self.output_dir!r} is a file; give a folder")
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and self.delta <= 1 + eps_high:
            raise ConfigError(f"delta must be > 1 + epsilon_high = {1 + eps_high}, got {self.delta}")
        if self.sync_ref_model and self.beta == 0:
            raise ConfigError("sync_ref_model=True needs beta > 0: with beta = 0 there is no reference model to sync")
        if self.max_steps <= 0 and self.num_train_epochs == 0:  # transformers: max_steps ≤ 0 reads the epochs
            raise ConfigError("num_train_epochs=0 with max_steps ≤ 0: nothing to train; set num_train_epochs > 0 or "
                              "max_steps ≥ 1")
        for name in ("reward_weights", "process_reward_weights"):
            weights = getattr(self, name)
            if weights is not None and not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                               and math.isfinite(w) for w in weights):
                raise ConfigError(f"{name} must be a list of finite numbers, got {weights!r}")
        # torchrun / accelerate export WORLD_SIZE; the trainer checks again with the real process count
        check_best_fields(self, sharded=sharded)  # best-model rules (transformers'); greater_is_better filled in
        self.layout(world_size=int(os.environ.get("WORLD_SIZE", "1")))

    def __repr__(self) -> str:  # the dataclass repr would print hub_token
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def to_dict(self) -> dict[str, Any]:
        """The fields, as logged (metrics.jsonl, trackers): the hub token is hidden."""
        values = super().to_dict()
        if values.get("hub_token"):
            values["hub_token"] = "<hidden>"
        return values

    @property
    def compile_kwargs(self) -> dict[str, Any] | None:
        """torch.compile's arguments for the policy's log-prob forward (torch_compile), else None."""
        return {"backend": self.torch_compile_backend, "mode": self.torch_compile_mode} if self.torch_compile else None

    @property
    def samples_apart(self) -> bool:
        """Do the sampler's numerics differ from the trainer's (vLLM, or a copy in generation_dtype)?"""
        return self.use_vllm or self.generation_dtype is not None

    @property
    def corrects_sampling(self) -> bool:
        """Is the loss importance-corrected for the sampler? When asked for and the sampler's numerics differ."""
        return self.vllm_importance_sampling_correction and self.samples_apart

    @property
    def keeps_sampling_logps(self) -> bool:
        """Does the update read the sampler's own log-probs? For the importance correction, and for the off-policy
        mask when the sampler differs (its KL is then measured from the policy that really sampled, as TRL)."""
        return self.corrects_sampling or (self.off_policy_mask_threshold is not None and self.samples_apart)

    def estimator_options(self, *, outcome: bool = False) -> dict[str, Any]:
        """`estimator=` and the options the chosen advantage estimator takes, read from their fields. `outcome`:
        for the combined outcome reward, whose scale the multi_objective_aggregation may fix."""
        taken = ESTIMATORS[self.advantage_estimator].options
        options = {"estimator": self.advantage_estimator, **{o: getattr(self, ESTIMATOR_OPTIONS[o]) for o in taken}}
        fixed = MULTI_OBJECTIVE[self.multi_objective_aggregation].scale
        if outcome and fixed is not None and "scale" in options:
            options["scale"] = fixed
        return options

    def layout(self, world_size: int) -> BatchLayout:
        """Resolve the batch arithmetic for `world_size` processes, filling in `steps_per_generation` /
        `generation_batch_size` as TRL does (groupwise.layout); raises ConfigError naming the fields."""
        return fill_layout(self, world_size)


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(GRPOConfig) if f.name == name)

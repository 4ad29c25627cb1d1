"""TRL 1.16 GRPOConfig / TrainingArguments fields that groupwise does not implement, each with what to do instead.

A config may still carry such a field at TRL's default (or a value TRL's to_dict() writes for it): a TRL config
dumped whole loads, since it asks for nothing groupwise lacks. Any other value is a ConfigError naming the field and the alternative. Every other TRL field is a GRPOConfig field
(docs/trl_compat.md lists the ones accepted without effect and why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, make_dataclass
from typing import Any


@dataclass(frozen=True)
class NotSupported:
    default: Any  # TRL's default: a config may carry this value
    reason: str  # what to do instead
    also: Callable[[Any, dict], bool] | None = None  # other values that ask for nothing (what TRL's to_dict() writes)

    def accepts(self, value: Any, values: dict[str, Any]) -> bool:
        """May a config carry this value? Yes at TRL's default (or a value `also` accepts)."""
        if self.also is not None and self.also(value, values):
            return True
        return value == self.default or (value is None and self.default in (None, False, "", []))


# TrainingArguments.accelerator_config as TRL 1.16's to_dict() writes it when left alone
ACCELERATOR_CONFIG_DEFAULTS = {"dispatch_batches": None, "even_batches": True, "gradient_accumulation_kwargs": None,
                               "non_blocking": False, "split_batches": False, "use_seedable_sampler": True}

_EVAL_LOOP = ("GRPO evaluation generates and scores completions (trainer.evaluate()); there is no prediction loop or "
              "compute_metrics to configure")


TRL_NOT_SUPPORTED: dict[str, NotSupported] = {
    # generation engines
    "use_transformers_paged": NotSupported(False, "use generation_backend='fast' (prefill shared per group)"),
    "use_transformers_continuous_batching": NotSupported(False, "use generation_backend='fast' (prefill shared per "
                                                                "group, finished rows leave the batch)"),
    "transformers_continuous_batching_config": NotSupported(None, "continuous batching is not implemented; use "
                                                                  "generation_backend='fast'"),
    "cache_implementation": NotSupported(None, "generation uses the model's default KV cache"),
    # kernels and compilation
    # not a TRL 1.16 field: older TRL's (default False), which configs dumped by it still hold
    "use_liger_loss": NotSupported(False, "log-probs never build the full logits: the output head runs in "
                                         "checkpointed chunks (logprob_chunk_tokens)"),
    "use_liger_kernel": NotSupported(False, "Liger kernels are not used; log-probs run the output head in chunks "
                                            "(logprob_chunk_tokens)"),
    "liger_kernel_config": NotSupported(None, "Liger kernels are not used"),
    # precision and devices
    "bf16_full_eval": NotSupported(False, "evaluation runs in the training precision; set bf16=True"),
    "fp16_full_eval": NotSupported(False, "evaluation runs in the training precision; set fp16=True"),
    "use_cpu": NotSupported(False, "set ACCELERATE_USE_CPU=1 or CUDA_VISIBLE_DEVICES='' instead"),
    # sharding and launchers
    "deepspeed": NotSupported(None, "DeepSpeed is not supported: shard with FSDP2 instead (fsdp: full_shard, or "
                                    "accelerate launch --config_file examples/accelerate/fsdp2.yaml)"),
    "ds3_gather_for_generation": NotSupported(True, "DeepSpeed ZeRO-3 is not supported: drop the field; to shard "
                                                    "the weights use FSDP2 (fsdp: full_shard), which gathers them for "
                                                    "generation"),
    "accelerator_config": NotSupported(None, "configure accelerate with `accelerate launch --config_file …`",
                                       also=lambda value, values: value == ACCELERATOR_CONFIG_DEFAULTS),
    "parallelism_config": NotSupported(None, "context / tensor parallelism is not supported; use data parallelism"),
    "save_on_each_node": NotSupported(False, "checkpoints are written by the main process to a folder every node "
                                             "must see (a shared file system)"),
    # objective variants not implemented
    "neftune_noise_alpha": NotSupported(None, "NEFTune is for supervised fine-tuning, not GRPO"),
    "label_smoothing_factor": NotSupported(0.0, "GRPO has no labels to smooth"),
    "label_names": NotSupported(None, "GRPO has no labels"),
    "optim_target_modules": NotSupported(None, "GaLore / APOLLO optimizers are not supported; use optim "
                                               "'adamw_torch_fused', 'adamw_torch', 'adafactor', 'sgd', 'adagrad' "
                                               "or 'rmsprop'"),
    # batching and data order
    "auto_find_batch_size": NotSupported(False, "a generation batch must hold whole groups; lower "
                                                "per_device_train_batch_size instead (as in TRL)"),
    "train_sampling_strategy": NotSupported("random", "use shuffle_dataset (True: a seeded permutation each epoch, "
                                                      "False: dataset order)"),
    "length_column_name": NotSupported("length", "group_by_length sampling is not supported"),
    "ignore_data_skip": NotSupported(False, "resume always continues from the exact data position of the checkpoint"),
    "include_num_input_tokens_seen": NotSupported(
        "no", "the count is always kept, as TRL's GRPOTrainer keeps it: state.num_input_tokens_seen (prompt + "
              "completion tokens), logged as num_tokens",
        also=lambda value, _: value in (True, False, "all", "non_padding", "no")),  # TRL's GRPO counts whatever it says
    # evaluation loop of transformers' Trainer
    **{name: NotSupported(default, _EVAL_LOOP) for name, default in {
        "prediction_loss_only": False, "eval_do_concat_batches": True, "eval_use_gather_object": False,
        "eval_accumulation_steps": None, "include_for_metrics": [], "batch_eval_metrics": False}.items()},
    # checkpoints and logging
    "enable_jit_checkpoint": NotSupported(False, "groupwise checkpoints on SIGTERM / SIGINT already "
                                                 "(save_on_interrupt, on by default)"),
    "debug": NotSupported("", "transformers' debug modes are not supported", also=lambda value, values: value == []),
    "trackio_static_space_id": NotSupported(None, "report_to 'trackio' makes no static Space after training or on "
                                                  "push (as False does): freeze the Space with trackio yourself",
                                            also=lambda value, _: value is False),
}

# TRL 1.16's annotations of those fields, in a form TRL's parser reads (TrlParser / HfArgumentParser): each is a
# GRPOConfig field (TRLFields), so that a TRL script's config file or command line that sets one is refused by name
# instead of being dropped as an unknown argument; at TRL's default it is kept and does nothing
PARSER_TYPES = {
    "use_transformers_paged": "bool", "use_transformers_continuous_batching": "bool",
    "transformers_continuous_batching_config": "dict | str | None", "cache_implementation": "str | None",
    "use_liger_kernel": "bool", "liger_kernel_config": "dict | str | None", "bf16_full_eval": "bool",
    "fp16_full_eval": "bool", "use_cpu": "bool", "deepspeed": "dict | str | None", "ds3_gather_for_generation": "bool",
    "accelerator_config": "dict | str | None", "parallelism_config": "str | None", "save_on_each_node": "bool",
    "neftune_noise_alpha": "float | None", "label_smoothing_factor": "float", "label_names": "list[str] | None",
    "optim_target_modules": "str | None", "auto_find_batch_size": "bool", "train_sampling_strategy": "str",
    "length_column_name": "str", "ignore_data_skip": "bool", "include_num_input_tokens_seen": "bool",
    "prediction_loss_only": "bool", "eval_do_concat_batches": "bool", "eval_use_gather_object": "bool",
    "eval_accumulation_steps": "int | None", "include_for_metrics": "list[str]", "batch_eval_metrics": "bool",
    "enable_jit_checkpoint": "bool", "debug": "str", "trackio_static_space_id": "str | None",
}
# the other values TRL writes or accepts for some of them (option's `accepts`: read, then checked by NotSupported)
PARSER_ACCEPTS = {"debug": "list[str]", "include_num_input_tokens_seen": "str", "optim_target_modules": "list[str]",
                  "trackio_static_space_id": "bool", "parallelism_config": "dict"}


def _field(name: str, entry: NotSupported):
    from groupwise.config_base import option

    default = {"default_factory": list} if entry.default == [] else {"default": entry.default}
    return name, PARSER_TYPES[name], option(f"TRL's field, not supported by groupwise: {entry.reason}.",
                                            accepts=PARSER_ACCEPTS.get(name), unsupported=entry, **default)


def _trl_fields():
    """The base dataclass of GRPOConfig holding TRL_NOT_SUPPORTED's TRL 1.16 fields (use_liger_loss, older TRL's,
    stays a constructor keyword only); StrictConfig refuses a value other than TRL's (NotSupported.accepts)."""
    from groupwise.config_base import StrictConfig

    return make_dataclass("TRLFields", [_field(name, entry) for name, entry in TRL_NOT_SUPPORTED.items()
                                        if name in PARSER_TYPES], bases=(StrictConfig,), kw_only=True,
                          namespace={"__module__": __name__})  # keyword-only: GRPOConfig("out") is output_dir


TRLFields = _trl_fields()

"""Optimizers by transformers' `optim` names (GRPOConfig.optim), each built from the run's config.

Every entry takes parameter groups and the config, and reads `learning_rate`, the Adam fields where they apply, and
`optim_args` ("key=value,key=value", transformers' format) for anything else. `weight_decay` applies as in
transformers' Trainer: to every trainable parameter except biases and normalisation weights (`param_groups`).
bitsandbytes' optimizers are offered under transformers' names and need `pip install bitsandbytes`; the config
checks that before any model loads; the 8-bit ones keep nn.Embedding weights' state in 32 bits, as transformers'.
An optim_args key that a field sets (lr, weight_decay; betas, eps for the Adam ones) is refused, naming the field.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from groupwise.config_base import ConfigError

if TYPE_CHECKING:
    from groupwise.adapters import Reference
    from groupwise.distributed import Distributed
    from groupwise.config import GRPOConfig


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """'momentum=0.9,nesterov=True' → {'momentum': 0.9, 'nesterov': True} (values read as Python literals)."""
    out: dict[str, Any] = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"optim_args item {item!r} is not key=value (e.g. optim_args='momentum=0.9')")
        if value.lower() in _WORDS:  # transformers reads nesterov / centered as true|1|yes: 'false' must be False
            out[key] = _WORDS[value.lower()]
            continue
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


_WORDS = {"true": True, "yes": True, "false": False, "no": False}
# optim_args keys that a GRPOConfig field sets (transformers ignores them in optim_args): name them instead
_FIELD_KEYS = {"lr": "learning_rate", "weight_decay": "weight_decay"}
_ADAM_KEYS = {"betas": "adam_beta1 / adam_beta2", "eps": "adam_epsilon"}


def check_optim_args(optim: str, text: str | None) -> dict[str, Any]:
    """optim_args parsed, refusing a key that a config field already sets for this optimizer (checked with the
    config)."""
    out = parse_optim_args(text)
    fields = {**_FIELD_KEYS, **(_ADAM_KEYS if OPTIMIZERS[optim].adam else {})}
    for key in out:
        if key in fields:
            raise ConfigError(f"optim_args sets {key!r}, which optim={optim!r} takes from {fields[key]}: set "
                              f"{fields[key]} instead and drop {key} from optim_args")
    return out


def _adam(args: GRPOConfig) -> dict[str, Any]:
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay}


def _adamw_torch(params, args, fused: bool = False):
    return torch.optim.AdamW(params, **_adam(args), **({"fused": True} if fused else {}),
                             **parse_optim_args(args.optim_args))


def _adamw_torch_fused(params, args):
    return _adamw_torch(params, args, fused=True)


def _adafactor(params, args):
    from transformers.optimization import Adafactor

    kwargs = {"scale_parameter": False, "relative_step": False, **parse_optim_args(args.optim_args)}
    return Adafactor(params, lr=args.learning_rate, weight_decay=args.weight_decay, **kwargs)


def _torch(cls_name: str):
    def build(params, args):
        return getattr(torch.optim, cls_name)(params, lr=args.learning_rate, weight_decay=args.weight_decay,
                                              **parse_optim_args(args.optim_args))
    return build


def _bnb(cls_name: str, **fixed):
    def build(params, args):
        import bitsandbytes

        return getattr(bitsandbytes.optim, cls_name)(params, **_adam(args), **fixed, **parse_optim_args(args.optim_args))
    return build


@dataclass(frozen=True)
class Optimizer:
    build: Callable[..., torch.optim.Optimizer]  # (params, args) → optimizer
    summary: str
    requires: str | None = None  # a package the optimizer needs
    adam: bool = False  # takes adam_beta1 / adam_beta2 / adam_epsilon
    eight_bit: bool = False  # nn.Embedding weights keep 32-bit state (transformers' Trainer)
    # steps FSDP2's sharded parameters (DTensors) and saves / resumes their state per shard: Adafactor's factored
    # state is not shaped like its parameter (and its update mixes DTensors with tensors); bitsandbytes' kernels
    # take plain CUDA tensors
    shards: bool = True


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw_torch_fused": Optimizer(_adamw_torch_fused, "torch AdamW, fused kernel (TRL's default)", adam=True),
    "adamw_torch": Optimizer(_adamw_torch, "torch AdamW, for-each kernel", adam=True),
    "adafactor": Optimizer(_adafactor, "transformers' Adafactor with a fixed learning rate", shards=False),
    "sgd": Optimizer(_torch("SGD"), "torch SGD (optim_args: momentum, nesterov, …)"),
    "adagrad": Optimizer(_torch("Adagrad"), "torch Adagrad"),
    "rmsprop": Optimizer(_torch("RMSprop"), "torch RMSprop"),
    "adamw_8bit": Optimizer(_bnb("AdamW8bit"), "bitsandbytes 8-bit AdamW", "bitsandbytes", adam=True,
                            eight_bit=True, shards=False),
    "adamw_bnb_8bit": Optimizer(_bnb("AdamW8bit"), "bitsandbytes 8-bit AdamW", "bitsandbytes", adam=True,
                                eight_bit=True, shards=False),
    "paged_adamw_8bit": Optimizer(_bnb("PagedAdamW8bit"), "bitsandbytes paged 8-bit AdamW", "bitsandbytes",
                                  adam=True, eight_bit=True, shards=False),
    "paged_adamw_32bit": Optimizer(_bnb("PagedAdamW32bit"), "bitsandbytes paged AdamW", "bitsandbytes", adam=True,
                                   shards=False),
}


def check_available(name: str) -> None:
    """A ConfigError when the optimizer's package is not installed (checked with the config)."""
    needed = OPTIMIZERS[name].requires
    if needed and importlib.util.find_spec(needed) is None:
        raise ConfigError(f"optim={name!r} needs the {needed} package: `pip install {needed}`, or use "
                          "optim='adamw_torch_fused'")


# transformers' Trainer.get_decay_parameter_names: parameters whose name matches one of these get no weight decay
NO_DECAY_PATTERNS = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in transformers' two groups: with weight decay, and without (biases, norms, and
    anything inside a torch LayerNorm)."""
    in_layernorm = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exempt = id(p) in in_layernorm or any(pattern.search(name.lower()) for pattern in NO_DECAY_PATTERNS)
        (no_decay if exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, args: GRPOConfig) -> torch.optim.Optimizer:
    """The `optim` optimizer over `model`'s trainable parameters, in transformers' weight-decay groups."""
    entry = OPTIMIZERS[args.optim]
    try:
        optimizer = entry.build(param_groups(model, args.weight_decay), args)
    except TypeError as e:  # an optim_args key the optimizer does not take
        raise ConfigError(f"optim={args.optim!r} with optim_args={args.optim_args!r}: {e}") from None
    if entry.eight_bit:  # as transformers' Trainer: embeddings' optimizer state in 32 bits (8-bit ones are unstable)
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


# transformers' lr_scheduler_type names (get_scheduler) that step once per optimizer step; reduce_lr_on_plateau and
# greedy step on an evaluation metric, which a GRPO step does not have
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")


# schedules whose arguments have no defaults: min_lr or min_lr_rate; num_decay_steps
NEEDS_SCHEDULER_KWARGS = ("cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")


def check_schedule(name: str, kwargs: dict | None) -> None:
    """lr_scheduler_kwargs checked with the config, by building the schedule over a stand-in parameter (an unknown
    or missing argument, or a bad combination such as cosine_with_min_lr without min_lr / min_lr_rate, would fail
    after the model loads). transformers' constant schedules take no arguments and drop them: refused here."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"lr_scheduler_kwargs={kwargs!r} must be a mapping, e.g. {{'num_cycles': 2}}")
    if not kwargs and name not in NEEDS_SCHEDULER_KWARGS:
        return  # nothing to check (and a config stays free of importing transformers)
    from transformers import get_scheduler

    if name in ("constant", "constant_with_warmup") and kwargs:
        raise ConfigError(f"lr_scheduler_type={name!r} takes no lr_scheduler_kwargs (transformers would drop "
                          f"{sorted(kwargs)}): remove them, or choose a schedule that takes them")
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        get_scheduler(name, stand_in, num_warmup_steps=1, num_training_steps=100, scheduler_specific_kwargs=kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"lr_scheduler_kwargs={kwargs!r} do not fit lr_scheduler_type={name!r}: "
                          f"{' '.join(str(e).split())}") from None


def build_schedule(optimizer: torch.optim.Optimizer, args: GRPOConfig, max_steps: int, given=None):
    """The learning-rate schedule: `given` (TRL's optimizers[1], whose state must fit a checkpoint when one can be
    written), or lr_scheduler_type over max_steps with its warm-up and lr_scheduler_kwargs."""
    if given is not None:
        if not args.save_only_model and (args.save_strategy != "no" or args.save_on_interrupt):
            from groupwise.checkpoint_files import check_json_state

            check_json_state(given.state_dict(), f"optimizers[1] ({type(given).__name__})")
        return given
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup(max_steps),
                         num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)


def build_training(policy: torch.nn.Module, args: GRPOConfig, dist: Distributed, *, optimizers=(None, None),
                   reference: Reference | None = None, max_steps: int):
    """What trains and how: (trained, optimizer, scheduler, replica). `trained` is the policy wrapped in
    PolicyForLogps (log-probs without full logits), sharded with FSDP2 or prepared for data parallelism; the
    optimizer is `optim` (or TRL's optimizers[0], built by the user over the model's parameters); `replica` is what
    generation samples from when it is not the policy itself (a generation_dtype copy, or with fsdp the unsharded
    model), else None."""
    import copy

    from groupwise.generation import GENERATION_DTYPES
    from groupwise.modeling import PolicyForLogps

    optimizer, scheduler = optimizers
    if dist.precision == "fp16":  # GradScaler refuses float16 gradients; bfloat16 ones would not need it
        low = sorted({str(p.dtype) for p in policy.parameters() if p.requires_grad and p.dtype != torch.float32})
        if low:
            raise ConfigError(f"fp16 trains float32 weights under float16 autocast, but the policy's trainable weights "
                              f"are {', '.join(low)}: load the model in float32 (model.float(), or dtype float32)")
    replica = None
    if args.generation_dtype is not None:  # sampling in another dtype: a cast copy, refreshed after every step
        replica = copy.deepcopy(policy).to(dist.device, GENERATION_DTYPES[args.generation_dtype])
        if args.cast_lm_head_to_fp32:  # the sampler's head in float32 too (TRL's low-precision sampler keeps it so)
            replica.get_output_embeddings().float()
        replica.eval().requires_grad_(False)
    if dist.sharding is not None:  # FSDP2: shard, then build the optimizer over the shards
        if args.cast_lm_head_to_fp32:  # the head must be the Float32Head that becomes a float32 unit
            from groupwise.loading import check_head_cast

            check_head_cast(policy)
        if replica is None:  # QLoRA: the packed base weights (frozen, never sharded) shared, not copied
            from groupwise.sharding import QUANTIZED_PARAMETERS

            shared = {id(p): p for p in policy.parameters() if type(p).__name__ in QUANTIZED_PARAMETERS}
            replica = copy.deepcopy(policy, memo=shared).to(dist.device).eval().requires_grad_(False)
        trained = dist.fully_shard(PolicyForLogps(policy, args.logprob_chunk_tokens, args.compile_kwargs), policy)
        if reference is not None and reference.copy is not None:  # sharded alike: π_θ's numerics, 1 / world
            reference.shard(dist, args.logprob_chunk_tokens)
        elif reference is not None:  # LoRA: π_ref is the sharded policy itself, adapters off or at their start
            reference.use_sharded(trained)
        optimizer = build_optimizer(policy, args)
        return trained, optimizer, build_schedule(optimizer, args, max_steps), replica
    if optimizer is None:
        optimizer = build_optimizer(policy, args)
    else:
        given = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not given <= {id(p) for p in policy.parameters()}:
            raise ConfigError("optimizers[0] holds parameters that are not the model's: build it over "
                              "model.parameters() of the model passed to GRPOTrainer")
        left_out = [n for n, p in policy.named_parameters() if p.requires_grad and id(p) not in given]
        if left_out:  # e.g. built before peft_config wrapped the model: the adapters would never move
            raise ConfigError(f"optimizers[0] leaves out {len(left_out)} trainable parameters ({', '.join(left_out[:3])}"
                              f"{' …' if len(left_out) > 3 else ''}), which would never train: build it over the "
                              "trainable parameters of the model as trained (with peft_config, after get_peft_model: "
                              "pass the PeftModel and its parameters), or let optim build it")
        if not args.save_only_model and (args.save_strategy != "no" or args.save_on_interrupt):
            from groupwise.checkpoint_files import check_json_state

            check_json_state({"param_groups": optimizer.state_dict()["param_groups"]}, "optimizers[0]")
    scheduler = build_schedule(optimizer, args, max_steps, given=scheduler)
    trained, optimizer = dist.prepare(PolicyForLogps(policy, args.logprob_chunk_tokens, args.compile_kwargs), optimizer)
    return trained, optimizer, scheduler, replica

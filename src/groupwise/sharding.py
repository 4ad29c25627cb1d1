"""FSDP2 sharding (torch's `fully_shard`): the one place groupwise shards a model.

Asked for by the config (`fsdp: full_shard`, TRL / transformers' field) or by `accelerate launch --config_file`
with an FSDP2 config (accelerate exports ACCELERATE_USE_FSDP / FSDP_VERSION=2 / FSDP_RESHARD_AFTER_FORWARD). groupwise
applies `fully_shard` itself, the same way on GPUs and on CPU (gloo), where accelerate would fall back to DDP:

- every decoder layer (the model's `_no_split_modules` classes) is one FSDP unit; the root unit is the log-prob
  wrapper (`PolicyForLogps`), so the embeddings, final norm and output head are gathered around every forward that
  computes log-probs: training and π_θold go through it; the reference model (β > 0) is a frozen copy sharded the
  same way, with the same mixed precision, so π_ref's forward has π_θ's numerics and costs 1 / world of its weights;
  with `cast_lm_head_to_fp32` the output head is a unit of its own, gathered in float32 whatever the mixed precision;
- generation runs on a full, unsharded replica of the policy on each process, refreshed from the shards after every
  optimizer step (one all-gather of the weights per step): sampling then needs no collective, and processes may
  finish their rows at different times. Memory: the replica costs one full copy of the weights per process, while
  gradients and optimizer state stay sharded (TRL's `ds3_gather_for_generation=True` trade-off);
- checkpoints hold each process's shards of the weights and of the optimizer state as safetensors
  (`model_shard_<rank>.safetensors`, `optimizer_<rank>.*`; resume needs the same number of processes, as it does
  for the RNG streams), plus the consolidated model (`model.safetensors`, loadable with `from_pretrained`).
  torch.distributed.checkpoint's own format pickles its metadata, which groupwise checkpoints never do.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from groupwise.config_base import ConfigError

logger = logging.getLogger(__name__)

# transformers' `fsdp` strings groupwise takes (the FSDP1 option names, mapped onto FSDP2 as transformers 5 maps
# them: a strategy → reshard_after_forward, "offload" → fsdp_config cpu_offload, "auto_wrap" → nothing)
FSDP_OPTIONS = {"full_shard": True, "shard_grad_op": False, "auto_wrap": None, "offload": None}


@dataclass(frozen=True)
class Sharding:
    reshard_after_forward: bool  # full_shard: free gathered weights after each forward; shard_grad_op: keep them
    layer_classes: tuple[str, ...] = ()  # fsdp_transformer_layer_cls_to_wrap; (): the model's _no_split_modules
    offload: bool = False  # cpu_offload: shards, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy)
    # where layer_classes was set (errors name it); not part of what the sharding is
    classes_from: str = field(default="fsdp_config's transformer_layer_cls_to_wrap", compare=False)


# FSDP_RESHARD_AFTER_FORWARD as `accelerate launch` exports fsdp_reshard_after_forward: a boolean for FSDP2, in
# accelerate's spellings (its str_to_bool; accelerate itself fails on any other value)
RESHARD_VALUES = {**dict.fromkeys(("y", "yes", "t", "true", "on", "1"), True),
                  **dict.fromkeys(("n", "no", "f", "false", "off", "0"), False)}


# transformers' fsdp_config keys (the "fsdp_" prefix stripped, as TrainingArguments does), by what groupwise does
FSDP_CONFIG_APPLIED = ("version", "reshard_after_forward", "transformer_layer_cls_to_wrap", "auto_wrap_policy",
                       "cpu_offload", "offload_params")  # the last two: transformers' and accelerate's name of one switch
FSDP_CONFIG_REFUSED = {  # accepted while false: what groupwise's FSDP2 does not do
    "activation_checkpointing": "set gradient_checkpointing: true instead",
    "xla": "XLA is not supported", "xla_fsdp_v2": "XLA is not supported", "xla_fsdp_grad_ckpt": "XLA is not supported"}
FSDP_CONFIG_INERT = (  # accepted, no effect: checkpoints are always per-process shards plus a consolidated model,
    # every process reads the whole checkpoint (nothing to broadcast), FSDP2 has no FSDP1 prefetch / flat-param knobs,
    # and min_num_params only applies to size-based wrapping (refused)
    "state_dict_type", "cpu_ram_efficient_loading", "sync_module_states", "use_orig_params", "forward_prefetch",
    "backward_prefetch", "limit_all_gathers", "min_num_params", "xla_fsdp_settings")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _flag(key: str, value) -> bool:
    text = str(value).strip().lower()
    if text not in _TRUE + _FALSE:
        raise ConfigError(f"fsdp_config[{key!r}]={value!r} is not a boolean: set true or false")
    return text in _TRUE


def fsdp_options(fsdp_config: dict | str | None) -> dict:
    """transformers' fsdp_config: a dict, JSON text or a JSON file's path, with the "fsdp_" prefix of its keys
    stripped; an unknown key is a ConfigError listing the known ones."""
    if fsdp_config is None or fsdp_config == "":
        return {}
    if isinstance(fsdp_config, str):
        import json

        text = fsdp_config if fsdp_config.lstrip().startswith("{") else None
        if text is None:
            try:
                text = Path(fsdp_config).read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"fsdp_config={fsdp_config!r}: cannot read it ({e.strerror}): give a JSON file's "
                                  "path or a mapping") from None
        try:
            fsdp_config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"fsdp_config={fsdp_config!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(fsdp_config, dict):
        raise ConfigError(f"fsdp_config must be a mapping (or a JSON file's path), got {type(fsdp_config).__name__}")
    options = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in fsdp_config.items()}
    known = (*FSDP_CONFIG_APPLIED, *FSDP_CONFIG_REFUSED, *FSDP_CONFIG_INERT)
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ConfigError(f"fsdp_config has {unknown}, which are not transformers' FSDP options: use {sorted(known)}")
    return options


def _from_config(options: dict, reshard_words: list[bool], offload_word: bool = False) -> Sharding:
    """The Sharding of an `fsdp` request and its fsdp_config options (transformers 5's reading: the config's
    reshard_after_forward wins over the strategy word; the version defaults to 2)."""
    version = str(options.get("version", 2))
    if version != "2":
        raise ConfigError(f"fsdp_config version {version}: groupwise shards with FSDP2; set version: 2 (transformers' "
                          "default) or leave it out")
    for key, why in FSDP_CONFIG_REFUSED.items():
        if key in options and _flag(key, options[key]):
            raise ConfigError(f"fsdp_config sets {key}: true, which groupwise's FSDP2 does not apply ({why}): set it "
                              "to false or leave it out")
    wrap = str(options.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"))
    if wrap.upper() != "TRANSFORMER_BASED_WRAP":
        raise ConfigError(f"fsdp_config auto_wrap_policy={wrap!r}: groupwise shards decoder layer by decoder layer; "
                          "set TRANSFORMER_BASED_WRAP or leave it out")
    if "reshard_after_forward" in options:
        reshard = _flag("reshard_after_forward", options["reshard_after_forward"])
    else:
        reshard = reshard_words[0] if reshard_words else True
    classes = options.get("transformer_layer_cls_to_wrap") or []
    classes = [classes] if isinstance(classes, str) else classes
    if not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise ConfigError(f"fsdp_config transformer_layer_cls_to_wrap={classes!r} must be a class name or a list of "
                          "them (e.g. ['Qwen2DecoderLayer'])")
    offload = offload_word or any(_flag(key, options[key]) for key in ("cpu_offload", "offload_params") if key in options)
    return Sharding(reshard_after_forward=reshard, layer_classes=tuple(c.strip() for c in classes if c.strip()),
                    offload=offload)


def resolve(fsdp: bool | str | list | None, fsdp_config: dict | str | None = None) -> Sharding | None:
    """The sharding asked for by the `fsdp` field (True, or transformers' words 'full_shard' / 'shard_grad_op' /
    'auto_wrap') with its `fsdp_config`, or by an accelerate FSDP launch, or None (replicas / DDP)."""
    options = fsdp_options(fsdp_config)
    if fsdp:
        words = [] if fsdp is True else fsdp.replace(",", " ").split() if isinstance(fsdp, str) else list(fsdp)
        unknown = [w for w in words if w not in FSDP_OPTIONS]
        if unknown:
            raise ConfigError(f"fsdp={fsdp!r}: {unknown} not supported; use true, 'full_shard' or 'shard_grad_op' "
                              "(optionally with 'offload', and 'auto_wrap': decoder layers are always the units)")
        return _from_config(options, [FSDP_OPTIONS[w] for w in words if FSDP_OPTIONS[w] is not None],
                            offload_word="offload" in words)
    # transformers ignores it then; a forgotten `fsdp` would train unsharded (what older transformers' to_dict()
    # wrote for every run, its defaults, asks for nothing)
    dumped = {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}
    if any(k not in dumped or v != dumped[k] for k, v in options.items()):
        raise ConfigError("fsdp_config is set but fsdp is not: set fsdp: true to shard with it, or drop fsdp_config")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        raise ConfigError("the accelerate config asks for DeepSpeed, which groupwise does not support: shard with FSDP2 "
                          "instead (accelerate launch --config_file examples/accelerate/fsdp2.yaml, or fsdp: full_shard)")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ConfigError(f"the accelerate config asks for FSDP version {version}: groupwise shards with FSDP2; "
                              "set fsdp_version: 2 in the accelerate config file")
        if os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() in ("1", "true"):
            raise ConfigError("the accelerate config sets fsdp_activation_checkpointing: true, which groupwise's FSDP2 "
                              "does not apply (set gradient_checkpointing: true in the groupwise config instead): set "
                              "fsdp_activation_checkpointing: false in the accelerate config file")
        wrap = os.environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")  # left out: layer by layer too
        if wrap.upper() != "TRANSFORMER_BASED_WRAP":
            raise ConfigError(f"the accelerate config sets fsdp_auto_wrap_policy: {wrap}, which groupwise's FSDP2 "
                              "does not apply (it shards decoder layer by decoder layer): set fsdp_auto_wrap_policy: "
                              "TRANSFORMER_BASED_WRAP in the accelerate config file")
        reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true")
        if reshard.lower() not in RESHARD_VALUES:  # e.g. FULL_SHARD, FSDP1's sharding strategy
            raise ConfigError(f"the accelerate config sets fsdp_reshard_after_forward: {reshard}, which FSDP2 does not "
                              "read: set it to true (FULL_SHARD) or false (SHARD_GRAD_OP) in the accelerate config "
                              "file")
        classes = tuple(c.strip() for c in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip())
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() in ("1", "true")
        return Sharding(reshard_after_forward=RESHARD_VALUES[reshard.lower()], layer_classes=classes, offload=offload,
                        classes_from="the accelerate config's fsdp_transformer_layer_cls_to_wrap")
    return None


QUANTIZED_PARAMETERS = ("Params4bit",)  # bitsandbytes' 4-bit weights (8 bits with fsdp: refused, groupwise.quantization)


def shard(root: torch.nn.Module, model: torch.nn.Module, sharding: Sharding, device: torch.device,
          bf16: bool = False, frozen: bool = False) -> torch.nn.Module:
    """fully_shard every decoder layer of `model` (or the classes named by fsdp_transformer_layer_cls_to_wrap), then
    `root` (the module whose forward runs: PolicyForLogps).
    bf16: FSDP2's mixed precision (float32 sharded master weights, gathered and computed in bfloat16, gradients
    reduced in float32), as accelerate sets it up for an FSDP2 bf16 launch. frozen: a model that never runs a
    backward (the reference), resharded after every forward whatever the strategy (shard_grad_op keeps the gathered
    weights for the backward, which would then never come: a full copy would stay). sharding.offload: every unit's
    shards (and so its gradients and the optimizer state built over them) live in host memory and are copied to the
    device for each all-gather; the optimizer step runs on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    layers = decoder_layers(model, sharding)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    if bf16 and not frozen and not any(type(p).__name__ in QUANTIZED_PARAMETERS for p in model.parameters()):
        upcast_trainable(model)
    reshard = frozen or sharding.reshard_after_forward
    # QLoRA: bitsandbytes' packed weights (frozen, already 4 / 8 bits) stay whole on every process; sharding them
    # would drop their quantization state (FSDP2 gathers a Parameter subclass back as a plain tensor)
    ignored = {p for p in model.parameters() if type(p).__name__ in QUANTIZED_PARAMETERS} or None
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if sharding.offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload,
                    ignored_params=ignored)
    from groupwise.modeling import Float32Head

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, Float32Head):  # cast_lm_head_to_fp32: its own unit, gathered and reduced in float32
        fully_shard(head, mesh=mesh, reshard_after_forward=reshard, mp_policy=MixedPrecisionPolicy(),
                    offload_policy=offload)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload,
                ignored_params=ignored)
    return root


def decoder_layers(model: torch.nn.Module, sharding: Sharding) -> list[torch.nn.Module]:
    """The modules fully_shard makes units of: those of the classes sharding.layer_classes names, else of the
    model's `_no_split_modules` classes. A class named that the model lacks, or no class at all, is a ConfigError
    naming the fix."""
    declared = list(getattr(model, "_no_split_modules", None) or [])
    layer_names = set(sharding.layer_classes or declared)
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    missing = sorted(layer_names - {type(m).__name__ for m in layers}) if sharding.layer_classes else []
    if missing:  # as accelerate: every class named must be in the model
        raise ConfigError(f"{sharding.classes_from} names {missing}, which {type(model).__name__} does not contain: "
                          f"name its decoder layer class ({declared}) there, or leave the key out")
    if not layers:
        repeated = sorted({type(m).__name__ for name, m in model.named_modules()
                           if name.rsplit(".", 1)[-1].isdigit()})  # the children of a ModuleList: its layers
        hint = f" (its repeated blocks: {repeated})" if repeated else ""
        raise ConfigError(f"fsdp: {type(model).__name__} declares no decoder layer classes (_no_split_modules), so "
                          "it cannot be sharded layer by layer by default: name its decoder layer class in "
                          f"fsdp_config: {{transformer_layer_cls_to_wrap: [...]}}{hint}")
    return layers


# from_pretrained keywords that say which config to read (the others, dtype and the like, do not change the modules)
_CONFIG_KWARGS = ("revision", "subfolder", "trust_remote_code", "gguf_file", "token", "cache_dir", "local_files_only")


def check_layers_before_loading(model: str, sharding: Sharding, init_kwargs: dict) -> None:
    """decoder_layers on the model `model` (a path or hub id) would load, built from its config on the meta device
    (no weights read): a wrong transformer_layer_cls_to_wrap, or a model without _no_split_modules, is refused
    before every process loads the weights. A config that cannot be built so (custom code not allowed, a format
    from_config does not take) is left to the check after loading."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: init_kwargs[k] for k in _CONFIG_KWARGS if k in init_kwargs}
    try:
        config = AutoConfig.from_pretrained(model, **kwargs)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=kwargs.get("trust_remote_code",
                                                                                              False))
    except Exception:  # noqa: BLE001 — the same check runs on the loaded model (shard)
        return
    decoder_layers(skeleton, sharding)


def upcast_trainable(model: torch.nn.Module) -> list[str]:
    """The float32 master weights mixed precision keeps: trainable parameters loaded in a 16-bit dtype are upcast
    before they are sharded (as accelerate's FSDP2 preparation does under mixed precision, QLoRA models aside); the
    policy then steps float32 shards and is gathered in bfloat16 for its forward. Returns the names upcast."""
    names = []
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)
            names.append(name)
    if names:
        logger.info("fsdp with bf16: %d trainable parameters loaded in 16 bits are upcast to float32 master weights "
                    "(checkpoints hold float32 weights): %s", len(names), ", ".join(names[:5]) + " …" * (len(names) > 5))
    return names


def initialize(root: torch.nn.Module) -> None:
    """FSDP2's lazy initialisation of a sharded model now, as its first forward would do it (once; later calls do
    nothing). It records the reduce dtype of the parameters that require grad at that moment: a first forward with
    the trainable ones frozen (PEFT's disable_adapter() for the reference pass, β > 0) records none, and with a
    bf16 param dtype the first backward then fails (bf16 gradients assigned to float32 shards)."""
    root._get_fsdp_state()._lazy_init()


def reshard(root: torch.nn.Module) -> None:
    """Free every gathered unit of a sharded model: its parameters are this process's shards again (a later
    forward gathers them anew)."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _adapters_only(model: torch.nn.Module) -> bool:
    """A PeftModel: only its trainable tensors (the adapters) ever change; the frozen base stays as loaded."""
    from groupwise.adapters import is_peft_model

    return is_peft_model(model)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on every process (an all-gather of every shard); of a PeftModel, the trainable
    tensors only (gathering the frozen base after every step would move the whole model for nothing)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=_adapters_only(model))
    return get_model_state_dict(model, options=options)


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a sharded checkpoint keeps of the model: its state dict, or of a PeftModel the trainable tensors (the
    base is the model the run loads, unchanged: checkpoints stay adapter-sized)."""
    state = model.state_dict()
    if not _adapters_only(model):
        return state
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def local_tensors(state: dict) -> dict[str, torch.Tensor]:
    """This process's shard of each tensor of a (model) state dict."""
    # clones: tied weights (embeddings = output head) share storage, which safetensors refuses to write twice
    return {k: (v.to_local() if _is_dtensor(v) else v).detach().cpu().clone() for k, v in state.items()}


def load_local(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy this process's saved shards back into the sharded parameters and buffers (`trained_state`), exactly."""
    from groupwise.checkpoint import CheckpointError

    state = trained_state(model)
    if set(state) != set(tensors):
        missing, unexpected = sorted(set(state) - set(tensors)), sorted(set(tensors) - set(state))
        raise CheckpointError(f"{source}: the model shards do not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    with torch.no_grad():
        for name, value in state.items():
            local = value.to_local() if _is_dtensor(value) else value
            if local.shape != tensors[name].shape:
                raise CheckpointError(f"{source}: shard {name} has shape {tuple(tensors[name].shape)}, the model's "
                                      f"{tuple(local.shape)}: resume with the same model and number of processes")
            local.copy_(tensors[name])


def optimizer_local(opt_state: dict) -> dict:
    """An optimizer state dict whose DTensor states are replaced by this process's shards."""
    return {"param_groups": opt_state["param_groups"],
            "state": {i: {k: (v.to_local() if _is_dtensor(v) else v) for k, v in st.items()}
                      for i, st in opt_state["state"].items()}}


def optimizer_from_local(optimizer: torch.optim.Optimizer, local: dict) -> dict:
    """The inverse of optimizer_local: shards become DTensors laid out like their parameters."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]

    def sharded(v: torch.Tensor, p) -> torch.Tensor:
        t = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        # from_local places the shard on the mesh's device; with CPU offload the parameter's shard is in host
        # memory: back there at once, one tensor at a time (not the whole optimizer state on the GPU)
        return t if t.device == p.device else t.to(p.device)

    state = {}
    for idx, st in local["state"].items():
        p = params[int(idx)]
        state[idx] = {k: (sharded(v, p) if _is_dtensor(p) and isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                      for k, v in st.items()}
    return {"param_groups": local["param_groups"], "state": state}


def process_group_backend(backend: str | None, sharding: Sharding | None, cuda: bool) -> str | None:
    """The torch.distributed backend: `backend` (ddp_backend) or None (torch's default). With CPU offload on GPUs
    the gradient norm and the fp16 overflow check reduce CPU-held shards, which NCCL cannot: NCCL for CUDA tensors
    and gloo for CPU ones ("cuda:nccl,cpu:gloo", as accelerate sets up for fsdp_offload_params)."""
    if not (cuda and sharding is not None and sharding.offload):
        return backend
    if backend in (None, "cuda:nccl,cpu:gloo"):
        return "cuda:nccl,cpu:gloo"
    raise ConfigError(f"fsdp with CPU offload and ddp_backend={backend!r}: the offloaded shards are reduced on the CPU, "
                      "which needs gloo next to NCCL: leave ddp_backend unset, or set it to 'cuda:nccl,cpu:gloo'")


def total_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip (max_norm > 0) and return the global gradient norm of sharded parameters (a plain scalar tensor)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm and max_norm > 0 else float("inf"))
    return norm.full_tensor() if _is_dtensor(norm) else norm

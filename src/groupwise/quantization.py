"""Quantized policies (QLoRA): TRL's `GRPOTrainer(quantization_config=BitsAndBytesConfig(…))` and its script fields
`load_in_4bit` / `load_in_8bit` / `bnb_4bit_quant_type` / `use_bnb_nested_quant` / `bnb_4bit_quant_storage`.

The base weights load in 4 or 8 bits (bitsandbytes) and stay frozen; the adapters (peft_config / use_peft) train in
full precision, and the reference policy is the base with the adapters off (no copy). Under FSDP2 the packed 4-bit
weights stay whole on every process (groupwise.sharding). Everything is checked before the weights load.

GGUF files are the other kind transformers reads: dequantized on load, so their policies train as float models
(forget_gguf, gguf_base)."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from groupwise.config_base import ConfigError, coerce

if TYPE_CHECKING:
    from groupwise.config import GRPOConfig

QUANT_TYPES = ("fp4", "nf4")  # TRL ModelConfig's choices
QUANT_STORAGES = ("float16", "float32", "int8", "uint8", "float64", "bfloat16")  # what BitsAndBytesConfig takes
# TRL ModelConfig's bitsandbytes fields (run fields of `groupwise train`): name: (annotation, default, help)
QUANTIZATION_FIELDS: dict[str, tuple[str, Any, str]] = {
    "load_in_8bit": ("bool", False, "Load the policy's base weights in 8 bits (bitsandbytes; train LoRA adapters on them) (TRL ModelConfig)."),
    "load_in_4bit": ("bool", False, "Load the policy's base weights in 4 bits (QLoRA; the 4-bit compute dtype is dtype) (TRL ModelConfig)."),
    "bnb_4bit_quant_type": ("str", "nf4", "4-bit quantization type: 'fp4' or 'nf4' (with load_in_4bit) (TRL ModelConfig)."),
    "use_bnb_nested_quant": ("bool", False, "Nested (double) 4-bit quantization (with load_in_4bit) (TRL ModelConfig)."),
    "bnb_4bit_quant_storage": ("str | None", None, f"Storage dtype of the 4-bit weights, one of {list(QUANT_STORAGES)} (with load_in_4bit) (TRL ModelConfig)."),
}
QUANTIZATION = {name: default for name, (_, default, _) in QUANTIZATION_FIELDS.items()}  # name: TRL's default


# transformers' quantization methods whose weights are full-precision once loaded: GGUF files are dequantized on load
DEQUANTIZED_ON_LOAD = ("gguf",)


def is_quantized(model) -> bool:
    """A model loaded in 4 or 8 bits by bitsandbytes, or quantized by any other transformers method (its
    `hf_quantizer`, unless that method leaves full-precision weights; a PeftModel answers for its base)."""
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        return True
    quantizer = getattr(model, "hf_quantizer", None)
    return quantizer is not None and not _dequantized(getattr(quantizer, "quantization_config", None))


def gguf_quantizer(model):
    """The GGUF quantizer transformers left on a model read from a GGUF file (a PeftModel: on its base), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantizer = getattr(base, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    return quantizer if quantizer is not None and str(getattr(method, "value", method)) == "gguf" else None


def forget_gguf(model) -> None:
    """A policy read from a GGUF file holds plain weights (transformers dequantizes them on load), but transformers
    keeps its GGUF quantizer, which makes save_pretrained refuse the model ("quantized with gguf and is not
    serializable") and would write a config that points back to the .gguf file. Drop it (transformers' own
    remove_quantization_config, and the `_is_quantized` mark on the configs), so checkpoints and exports are plain
    safetensors models. Weights transformers left packed in GGUF blocks (its GgufLinear layers, for architectures
    with a GGUF kernel on the device) cannot train: a ConfigError."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantizer = gguf_quantizer(base)
    if quantizer is None:
        return
    packed = getattr(quantizer, "packed_modules", None) or {}
    if packed:
        raise ConfigError(f"the policy keeps {len(packed)} weights packed in GGUF blocks (e.g. {next(iter(packed))}), "
                          "which cannot train: load it dequantized, with model_init_kwargs={'gguf_file': …, "
                          "'quantization_config': transformers.GgufConfig(dequantize=True)} (or pass a model loaded "
                          "so)")
    quantizer.remove_quantization_config(base)
    for module in base.modules():  # transformers reads the mark's presence, not its value
        config = getattr(module, "config", None)
        if config is not None and "_is_quantized" in vars(config):
            del config._is_quantized


def gguf_base(path: str) -> tuple[str, dict]:
    """A base model named by path, as from_pretrained reads it: a .gguf file → (its folder, {"gguf_file": name}); a
    local folder without config.json holding one .gguf file (what a LoRA run over a GGUF policy records as its
    adapter's base) → (the folder, that file); anything else (a hub id: its GGUF file is not looked for) as given.
    Several .gguf files: a ConfigError naming them."""
    local = os.path.expanduser(path)
    if os.path.isfile(local) and local.endswith(".gguf"):
        return os.path.dirname(local) or ".", {"gguf_file": os.path.basename(local)}
    if os.path.isdir(local) and not os.path.exists(os.path.join(local, "config.json")):
        files = sorted(n for n in os.listdir(local) if n.endswith(".gguf"))
        if len(files) > 1:
            raise ConfigError(f"base model {path!r} holds several GGUF files ({', '.join(files)}) and no config.json: "
                              f"name one, e.g. {os.path.join(path, files[0])!r}")
        if files:
            return local, {"gguf_file": files[0]}
    return path, {}


def _dequantized(config) -> bool:
    """Does this quantization config leave full-precision weights (dequantize=True, e.g. transformers' advice for
    training gpt-oss with Mxfp4Config(dequantize=True); a GGUF file)?"""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    method = values.get("quant_method")
    dequantize = getattr(config, "dequantize", None) if not isinstance(config, dict) else None  # not in to_dict()
    return bool(dequantize or values.get("dequantize")) or str(getattr(method, "value", method)) in DEQUANTIZED_ON_LOAD


def saved_quantization(model: str, args: GRPOConfig) -> dict | None:
    """The `quantization_config` a checkpoint's config.json holds (a model saved in 4 / 8 bits, e.g. the hub's
    *-bnb-4bit models, which from_pretrained loads quantized without being asked), or None; read without the
    weights. A folder or hub id that cannot be read is left to the loading, which names it."""
    from transformers import PretrainedConfig

    revision = (args.model_init_kwargs or {}).get("revision")
    try:
        config, _ = PretrainedConfig.get_config_dict(model, **({"revision": revision} if revision else {}))
    except (OSError, ValueError):
        return None
    return config.get("quantization_config") or None


def from_script_fields(values: dict[str, Any], dtype: str | None):
    """TRL's get_quantization_config: a BitsAndBytesConfig from the script fields, each checked against its type
    (the 4-bit compute dtype is the model's `dtype`, so 'auto' with load_in_4bit is an error, where TRL's
    BitsAndBytesConfig fails), or None when neither load_in_4bit nor load_in_8bit is set; both set is an error, as
    TRL's ModelConfig raises."""
    fields = {name: coerce(name, ann, values.get(name, default)) for name, (ann, default, _) in QUANTIZATION_FIELDS.items()}
    if fields["load_in_4bit"] and fields["load_in_8bit"]:  # TRL's ModelConfig raises too
        raise ConfigError("load_in_4bit=True and load_in_8bit=True: 8-bit and 4-bit precision cannot be used at the "
                          "same time (as in TRL); set one of them")
    for name, allowed in (("bnb_4bit_quant_type", QUANT_TYPES), ("bnb_4bit_quant_storage", QUANT_STORAGES)):
        if fields[name] is not None and fields[name] not in allowed:
            raise ConfigError(f"{name}={fields[name]!r} is not one of {list(allowed)}")
    if not fields["load_in_4bit"]:
        for name in ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"):
            if fields[name] not in (QUANTIZATION[name], None):
                raise ConfigError(f"{name}={fields[name]!r} has no effect without load_in_4bit=True: set "
                                  "load_in_4bit, or remove it")
    if not (fields["load_in_4bit"] or fields["load_in_8bit"]):
        return None
    _need_bitsandbytes("load_in_4bit" if fields["load_in_4bit"] else "load_in_8bit")
    from transformers import BitsAndBytesConfig

    if fields["load_in_4bit"]:
        if dtype == "auto":  # TRL passes it on too, and BitsAndBytesConfig fails on getattr(torch, "auto")
            raise ConfigError("load_in_4bit=True with dtype='auto': the 4-bit compute dtype is dtype (TRL's "
                              "get_quantization_config), which 'auto' does not name: set dtype to 'bfloat16', "
                              "'float16' or 'float32'")
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype,
                                  bnb_4bit_quant_type=fields["bnb_4bit_quant_type"],
                                  bnb_4bit_use_double_quant=fields["use_bnb_nested_quant"],
                                  bnb_4bit_quant_storage=fields["bnb_4bit_quant_storage"])
    return BitsAndBytesConfig(load_in_8bit=True)


def check_quantization(args: GRPOConfig, model, quantization_config, *, lora: bool, sharded: bool) -> None:
    """Before any weights load: what a quantized policy needs (bitsandbytes, adapters to train, a path to load the
    model from) and the features that do not work with one yet."""
    in_kwargs = (args.model_init_kwargs or {}).get("quantization_config")
    if quantization_config is not None and in_kwargs is not None:
        raise ConfigError("quantization_config is set both as a GRPOTrainer argument and in model_init_kwargs: "
                          "set it in one place, preferably as the trainer argument (TRL's rule)")
    quantization_config = quantization_config if quantization_config is not None else in_kwargs
    if quantization_config is not None and not isinstance(model, str):
        raise ConfigError("quantization_config applies when the model is loaded from a path: the model passed is "
                          "already loaded; pass its path, or load it with from_pretrained(…, "
                          "quantization_config=…) yourself")
    if quantization_config is not None and _dequantized(quantization_config):
        return  # full-precision weights once loaded (dequantize=True): trained as any model
    saved = saved_quantization(model, args) if isinstance(model, str) and quantization_config is None else None
    saved = None if saved is not None and _dequantized(saved) else saved
    quantized = quantization_config is not None or saved is not None or (
        not isinstance(model, str) and is_quantized(model))
    if not quantized:
        return
    what = ("quantization_config" if quantization_config is not None else
            f"{model!r}, saved quantized (its config.json's quantization_config)" if saved is not None else
            "a model loaded in 4 / 8 bits")
    given = quantization_config if quantization_config is not None else saved
    config = given.to_dict() if hasattr(given, "to_dict") else dict(given or {})
    if given is not None:
        method = config.get("quant_method", "bitsandbytes")
    else:  # a model object: its transformers quantizer's method (bitsandbytes' flags alone: bitsandbytes)
        quantizer_config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
        method = getattr(quantizer_config, "quant_method", "bitsandbytes")
    method = str(getattr(method, "value", method))  # transformers' QuantizationMethod enum
    if method != "bitsandbytes":  # what the checks below and groupwise.sharding are written for
        raise ConfigError(f"{what}: quant_method {method!r} is not supported; groupwise trains adapters on "
                          "bitsandbytes 4 / 8-bit bases (QLoRA): load the unquantized model with load_in_4bit / "
                          "quantization_config=BitsAndBytesConfig(…), or dequantize it as it loads (a quantization "
                          "config with dequantize=True, e.g. Mxfp4Config(dequantize=True))")
    if given is not None:
        _need_bitsandbytes(what)
    if not lora:
        raise ConfigError(f"{what}: quantized weights cannot be trained; train adapters on them (QLoRA): pass "
                          "peft_config=LoraConfig(…) or set use_peft=True")
    for on, field in ((args.generation_dtype is not None, "generation_dtype"),
                      (args.use_vllm, "use_vllm")):
        if on:
            raise ConfigError(f"{what} with {field} is not supported yet: drop {field}, or load the model unquantized")
    four_bit = config.get("load_in_4bit", False) if given is not None else getattr(model, "is_loaded_in_4bit", False)
    if sharded and not four_bit:  # only bitsandbytes' 4-bit weights are left out of the sharding (groupwise.sharding)
        raise ConfigError(f"{what} with fsdp is supported in 4 bits only (bitsandbytes' load_in_4bit, QLoRA; 8-bit "
                          "weights keep scales FSDP2 cannot gather): load the base with load_in_4bit, or drop fsdp")


def _need_bitsandbytes(field: str) -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{field} loads the model with bitsandbytes, which is not installed: `pip install "
                          "bitsandbytes`")

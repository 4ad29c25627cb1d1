"""`groupwise export CHECKPOINT --merge OUT`: a checkpoint as a standalone model, a LoRA adapter merged into its base,
and how much of the adapter's update that merge rounds away in the base's dtype."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch

from groupwise.adapters import ADAPTER_CONFIG, _peft, adapted_tied_embeddings, check_base, saved_tokenizer
from groupwise.config_base import ConfigError, warn_user
from groupwise.quantization import forget_gguf, gguf_base, is_quantized


# an export whose rounding to the saved dtype loses more of the adapter's update than this (as a norm) warns
ROUNDING_WARN = 0.05


def export_merged(checkpoint: str, out: str, base: str | None = None, trust_remote_code: bool = False,
                  dtype: str = "auto") -> str:
    """Base model + the checkpoint's adapter, merged (merge_and_unload), saved to `out` with the tokenizer.
    `base` defaults to the adapter's base_model_name_or_path. A full fine-tune checkpoint is copied as a model.
    `out` must be new or empty. `dtype`: the merged weights' dtype, 'auto' = the base's stored one (as PEFT's
    merge_and_unload after from_pretrained). Merged into 16-bit weights, an update smaller than their precision
    rounds away (W + ΔW rounds to W where |ΔW| < half of W's spacing, 2⁻⁸·|W| in bfloat16), though the run trained
    with it (its base in float32 by default, the adapter applied apart): a warning says how much of the update
    was lost (‖round(W + ΔW) − (W + ΔW)‖ / ‖ΔW‖ over the adapted layers) when that exceeds ROUNDING_WARN,
    naming dtype float32."""
    from transformers import AutoModelForCausalLM

    from groupwise.config_base import check_location, check_model_location
    from groupwise.loading import MODEL_DTYPES

    if dtype != "auto" and dtype not in MODEL_DTYPES:
        raise ConfigError(f"export: --dtype {dtype} is not one of {['auto', *MODEL_DTYPES]}")
    torch_dtype = MODEL_DTYPES.get(dtype, "auto")

    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ConfigError(f"export: {checkpoint!r} is not a checkpoint folder")
    target = Path(out)
    if target.is_file() or (target.is_dir() and any(target.iterdir())):  # the base, the run, an earlier export
        raise ConfigError(f"export: --merge {out} is not an empty folder: give a new one (an export never writes "
                          "over a model, the adapter's base model or a run's folder)")
    if (folder / ADAPTER_CONFIG).exists():
        peft = _peft()
        config = peft.PeftConfig.from_pretrained(str(folder))
        given, base = base, base or config.base_model_name_or_path
        if not base:
            raise ConfigError(f"export: {checkpoint} does not name its base model (the policy was built in memory): "
                              "give it with --base PATH")
        base, gguf = gguf_base(base)  # a GGUF file (or the folder holding one): read dequantized, saved plain
        try:
            check_location(base, "--base" if given else f"{checkpoint}'s base_model_name_or_path")
        except ConfigError as e:
            raise ConfigError(f"export: {e}" + ("" if given else "; give the base model with --base PATH")) from None
        tokenizer = saved_tokenizer([(folder, {}), (base, gguf)], trust_remote_code, "export")  # before any write
        check_base(base, checkpoint, {"trust_remote_code": trust_remote_code, **gguf},
                   "check --base" if given else "give it with --base PATH", given=given is not None)
        model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=trust_remote_code, **gguf,
                                                     **({"dtype": torch_dtype} if torch_dtype != "auto" else {}))
        forget_gguf(model)
        quantized = is_quantized(model)
        if quantized:  # a base saved in 4 / 8 bits: merged into the weights it computes with, unquantized
            model = model.dequantize()
            if torch_dtype != "auto":
                model = model.to(torch_dtype)
        model = peft.PeftModel.from_pretrained(model, str(folder))
        if where := adapted_tied_embeddings(model):
            raise ConfigError(f"export: {checkpoint}'s adapter changes the {where} of a model whose input embeddings "
                              "and output head are one tensor (tie_word_embeddings): merged, the model could not keep "
                              "both as trained. Use the checkpoint as an adapter (PeftModel.from_pretrained), or train "
                              "without LoRA on embed_tokens / lm_head (modules_to_save with "
                              "LoraConfig(ensure_weight_tying=True) merges correctly)")
        lost = rounding_loss(model, saved_adapter_tensors(folder))
        model = model.merge_and_unload()
        if lost > ROUNDING_WARN:
            written = next(model.parameters()).dtype
            warn_user(f"export: merged into {str(written).removeprefix('torch.')} weights, which round away "
                      f"{lost:.0%} of the adapter's update (‖rounding‖ / ‖update‖ over the adapted layers): the "
                      "merged model computes differently from the trained one. --dtype float32 keeps it (twice the "
                      "size), or use the checkpoint as an adapter")
        if quantized:  # saved as a model built afresh: the loaded one would write its weights back as 4-bit ones
            state, dtype = model.state_dict(), next(model.parameters()).dtype
            model = AutoModelForCausalLM.from_config(model.config, dtype=dtype, trust_remote_code=trust_remote_code)
            model.load_state_dict(state)
    else:
        if base is not None:
            raise ConfigError(f"export: {checkpoint} holds a full model, not an adapter: --base has nothing to merge "
                              "into; drop --base")
        check_model_location(str(folder), "export CHECKPOINT")  # a folder without config.json: named, one line
        tokenizer = saved_tokenizer([(folder, {})], trust_remote_code, "export")
        model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                     **({"dtype": torch_dtype} if torch_dtype != "auto" else {}))
    # written beside OUT, then renamed to it: a run killed while writing leaves no half model at OUT (a later export
    # deletes such a leftover .tmp folder)
    staging = target.parent / f".tmp-export-{target.name}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if target.is_dir():
        target.rmdir()  # the empty folder given as OUT
    os.replace(staging, target)
    return out


def saved_adapter_tensors(folder: Path):
    """An adapter folder's tensors as saved (read one at a time, when asked for): loading modules_to_save copies and
    trainable tokens' rows into a 16-bit base rounds them, which rounding_loss counts from these. Read from
    adapter_model.safetensors, else from adapter_model.bin (PEFT's safe_serialization=False; loaded weights_only,
    memory-mapped); {} without either."""
    from collections.abc import Mapping

    from safetensors import safe_open

    path = Path(folder) / "adapter_model.safetensors"
    if not path.exists():
        pickled = Path(folder) / "adapter_model.bin"
        return torch.load(pickled, map_location="cpu", weights_only=True, mmap=True) if pickled.exists() else {}

    class Saved(Mapping):
        def __init__(self):
            self.file = safe_open(str(path), "pt")
            self.names = set(self.file.keys())

        def __getitem__(self, name):
            if name not in self.names:
                raise KeyError(name)
            return self.file.get_tensor(name)

        def __iter__(self):
            return iter(self.names)

        def __len__(self):
            return len(self.names)

    return Saved()


# rounding_loss reads a weight this many elements at a time (whole rows): its temporaries stay a few hundred MiB
# (64 MiB per float32 block, 128 MiB per float64 one) whatever the layer, beside the layer's own float32 copy (an
# lm_head of 150k × 4096: 2.3 GiB; its temporaries whole would need several GiB more)
CHUNK = 1 << 24


def rounding_sums(trained: torch.Tensor, original: torch.Tensor, chunk: int = CHUNK) -> tuple[float, float]:
    """(‖round(W′) − W′‖², ‖W′ − W‖²) for W′ = `trained` (any dtype, read as float32) rounded to `original`'s dtype,
    W = `original`: summed over row blocks of about `chunk` elements, in float64."""
    rows = max(1, chunk // max(1, trained[0].numel())) if trained.dim() > 1 else max(1, chunk)
    lost = update = 0.0
    for new, old in zip(trained.split(rows), original.split(rows), strict=True):
        new = new.float()
        lost += (new.to(original.dtype).float() - new).double().square().sum().item()
        update += (new - old.float()).double().square().sum().item()
    return lost, update


def rounding_loss(model, saved: dict[str, torch.Tensor] | None = None) -> float:
    """How much of a PeftModel's update merging would round away in its base weights' dtype:
    ‖round(W′) − W′‖ / ‖W′ − W‖ over every adapted layer, W′ the layer's merged weight computed in float32 by the
    layer's own merge (on a float32 copy of the layer, one layer at a time: LoRA's W + ΔW, DoRA's rescaled one, an
    embedding's). 0 for float32 bases and for an update of zero. `saved`: the adapter file's tensors as trained,
    for what loading into the base's dtype has already rounded (modules_to_save copies, trainable tokens' rows),
    counted alike against the original weights. Memory: one layer's float32 copy at a time, its sums read in row
    blocks (rounding_sums). Not measured: target-parameter adapters."""
    lost = update = 0.0

    def count(trained: torch.Tensor, original: torch.Tensor) -> None:  # W′ as trained, W as in the base
        nonlocal lost, update
        more = rounding_sums(trained, original)
        lost, update = lost + more[0], update + more[1]

    with torch.no_grad():
        for name, module in model.named_modules() if saved else ():
            if hasattr(module, "original_module") and hasattr(module, "modules_to_save"):  # a whole trained copy
                for param, original in module.original_module.named_parameters():
                    if f"{name}.{param}" in saved and original.dtype != torch.float32:
                        count(saved[f"{name}.{param}"], original)
            token = getattr(module, "token_adapter", None)  # trainable tokens: new rows of an embedding
            rows = saved.get(f"{name}.token_adapter.trainable_tokens_delta")
            if token is not None and rows is not None and token.get_base_layer().weight.dtype != torch.float32:
                indices = token.token_indices[token.active_adapters[0]]
                count(rows, token.get_base_layer().weight[indices])
        for module in model.modules():
            base = getattr(module, "base_layer", None)
            weight = getattr(base, "weight", None)
            if not hasattr(module, "get_delta_weight") or weight is None or weight.dtype == torch.float32 \
                    or not any(n in getattr(module, "lora_A", {}) or n in getattr(module, "lora_embedding_A", {})
                               for n in module.active_adapters):
                continue
            layer = copy.deepcopy(module).float()
            layer.merge(adapter_names=list(module.active_adapters))
            count(layer.get_base_layer().weight.detach(), weight)
            del layer
    return (lost / update) ** 0.5 if update > 0 else 0.0

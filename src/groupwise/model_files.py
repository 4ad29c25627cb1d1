"""What a saved model's folder holds besides its config: its weight files, each safetensors file whole
(config_base.check_model_location calls check_weights before anything loads), and a tokenizer's files."""

from __future__ import annotations

import json
import os
import re

from groupwise.config_base import ConfigError

# model.safetensors, its shards and index, pytorch_model.bin, adapter_model.*, and save_pretrained(variant=…)'s names
# (model.fp16.safetensors, model.fp16-00001-of-00002.safetensors, model.safetensors.index.fp16.json)
WEIGHT_FILES = re.compile(r"(model|adapter_model|pytorch_model)([.-].+)?\.(safetensors|bin)$|"
                          r"(model|adapter_model|pytorch_model)\.(safetensors|bin)\.index(\..+)?\.json$")


def check_weights(value: str, field: str, folder: str, names: set[str]) -> None:
    """A model folder (config.json, or an adapter's adapter_config.json) holds weights, and each safetensors file's
    header reads: an incomplete or torn copy is named here, before anything loads, not by a traceback from the
    loading after the other models have loaded."""
    if not ({"config.json", "adapter_config.json"} & names) or any(n.endswith(".gguf") for n in names):
        return  # a GGUF file (with or without a config.json beside it: model_init_kwargs' gguf_file)
    weights = sorted(n for n in names if WEIGHT_FILES.match(n))
    if not weights:
        kind = "adapter_model.safetensors" if "config.json" not in names else "model.safetensors (or its shards)"
        raise ConfigError(f"{field}={value!r} has a config but no weights ({kind}): an incomplete copy? give the "
                          "folder save_pretrained wrote, or a checkpoint folder of a run")
    for name in weights:
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    if size <= 0 or size > os.path.getsize(path) - 8:
                        raise ValueError("header length past the file's end")
                    header = json.loads(f.read(size))
                end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                if 8 + size + end > os.path.getsize(path):
                    raise ValueError(f"{os.path.getsize(path)} bytes, where its tensors end at byte {8 + size + end}")
            except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
                raise ConfigError(f"{field}={value!r}: {name} is damaged ({e}): a torn copy or download; copy "
                                  "it again") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model")


def holds_tokenizer(names: set[str]) -> bool:
    """Does a folder with these file names hold a tokenizer's files (whether or not they load)?"""
    return bool(names & set(TOKENIZER_FILES))

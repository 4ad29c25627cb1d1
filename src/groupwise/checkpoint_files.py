"""What a checkpoint folder holds besides the model, and how, as safetensors + JSON (no pickle): the optimizer's
state (optimizer<suffix>.safetensors: its tensors; optimizer<suffix>.json: the rest), each process's random streams
(rng_state_<rank>.safetensors + .json: torch CPU / CUDA, numpy, python), JSON files (and the check that a state is
JSON before a run starts) and their sha256, and the fsyncs that put a folder on disk. Shared by
GRPO's checkpoints (groupwise.checkpoint, checkpoint_load) and `prm train`'s (groupwise.prm_checkpoint)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from groupwise.config_base import ConfigError


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2))


def write_optimizer(opt_state: dict, folder: Path, suffix: str = "") -> None:
    """optimizer.state_dict() as optimizer<suffix>.safetensors (its tensors) + optimizer<suffix>.json (the rest). A
    parameter's tensors are `state.<i>.<key>`; a tensor inside a dict of its state (bitsandbytes' 8-bit optimizers
    keep theirs under `__bnb_optimizer_quant_state__`) is `nested.<i>.<key>.<n>`, which the JSON names in its place.
    A tensor several entries hold (bitsandbytes' quantile maps) is written once and named in the others' places, so
    it loads shared again (safetensors refuses to write one twice)."""
    tensors, rest = {}, {"param_groups": opt_state["param_groups"], "state": {}}
    stored: dict[tuple, str] = {}

    def put(value: torch.Tensor, name: str) -> str:
        """The name `value` is written under: `name`, or the one it was written under already."""
        same = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()))
        if same not in stored:
            stored[same] = name
            tensors[name] = value.detach().cpu().contiguous()
        return stored[same]

    def nested(value, prefix: str, counter):
        if isinstance(value, torch.Tensor):
            return {_TENSOR: put(value, f"{prefix}{next(counter)}")}
        return {k: nested(v, prefix, counter) for k, v in value.items()} if isinstance(value, dict) else value

    for idx, st in opt_state["state"].items():
        rest["state"][str(idx)] = {}
        for key, value in st.items():
            if not isinstance(value, torch.Tensor):
                rest["state"][str(idx)][key] = nested(value, f"nested.{idx}.{key}.", itertools.count())
            elif (name := put(value, f"state.{idx}.{key}")) != f"state.{idx}.{key}":  # held by an earlier entry
                rest["state"][str(idx)][key] = {_TENSOR: name}
    save_file(tensors, str(folder / f"optimizer{suffix}.safetensors"))
    write_json(folder / f"optimizer{suffix}.json", rest)


_TENSOR = "__safetensors__"  # in optimizer.json: the tensor of that name in optimizer.safetensors


def read_optimizer(folder: Path, suffix: str = "") -> dict:
    """The state dict write_optimizer wrote."""
    rest = json.loads((folder / f"optimizer{suffix}.json").read_text())
    tensors = load_file(str(folder / f"optimizer{suffix}.safetensors"))

    def nested(value):
        if isinstance(value, dict):
            return tensors[value[_TENSOR]] if set(value) == {_TENSOR} else {k: nested(v) for k, v in value.items()}
        return value

    state: dict[int, dict] = {int(i): {k: nested(v) for k, v in st.items()} for i, st in rest["state"].items()}
    for name, tensor in tensors.items():
        if name.startswith("state."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = tensor
    return {"state": state, "param_groups": rest["param_groups"]}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    py = random.getstate()
    return tensors, {"numpy": [kind, int(pos), int(has_gauss), float(cached)], "python": [py[0], list(py[1]), py[2]]}


def _set_rng_state(tensors: dict[str, torch.Tensor], rest: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    kind, pos, has_gauss, cached = rest["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    v, state, gauss = rest["python"]
    random.setstate((v, tuple(state), gauss))


def rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_state_{rank}.safetensors"


def write_rng(folder: Path, rank: int) -> None:
    """This process's random streams as rng_state_<rank>.safetensors + .json."""
    tensors, rest = _rng_state()
    save_file(tensors, str(rng_file(folder, rank)))
    write_json(folder / f"rng_state_{rank}.json", rest)


def read_rng(folder: Path, rank: int) -> None:
    """Set this process's random streams to those write_rng wrote."""
    _set_rng_state(load_file(str(rng_file(folder, rank))),
                   json.loads((folder / f"rng_state_{rank}.json").read_text()))


@contextlib.contextmanager
def rng_untouched():
    """Run a block without moving any random stream a checkpoint records (torch CPU / CUDA, numpy, python)."""
    tensors, rest = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(tensors, rest)


def check_json_state(state: Any, what: str) -> None:
    """A state that checkpoints write as JSON (no pickles) must be JSON: a ConfigError naming the first value that
    is not, so that a run learns it before training rather than at its first save."""
    def first_bad(x: Any, where: str) -> tuple[str, Any] | None:
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else None
        if items is None:
            return None if x is None or isinstance(x, (str, int, float, bool)) else (where, x)
        for k, v in items:
            if isinstance(x, dict) and not isinstance(k, str):
                return f"{where} key {k!r}", k
            if bad := first_bad(v, f"{where}.{k}" if isinstance(x, dict) else f"{where}[{k}]"):
                return bad
        return None

    bad = first_bad(state, "state_dict()")
    if bad is not None:
        raise ConfigError(f"{what}: {bad[0]} is a {type(bad[1]).__name__}, which a checkpoint (JSON, no pickles) "
                          "cannot hold: keep only numbers, strings and lists in it (a float lr, not a tensor; a "
                          "plain function as a scheduler's lr_lambda, not an object holding one), or set "
                          "save_only_model=True / "
                          "save_strategy='no' with save_on_interrupt=False")


def sync_files(folder: Path) -> None:
    """fsync every file under `folder`, then the folders themselves (a crash after the save keeps it whole)."""
    for p in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    sync_dir(folder)


def sync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

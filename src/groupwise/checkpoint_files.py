"""What a checkpoint folder holds besides the model, and how, as safetensors + JSON (no pickle): the optimizer's
state (optimizer<suffix>.safetensors: its tensors; optimizer<suffix>.json: the rest), each process's random streams
(rng_state_<rank>.safetensors + .json: torch CPU / CUDA, numpy, python), JSON files and their sha256. Shared by
GRPO's checkpoints (groupwise.checkpoint, checkpoint_load) and `prm train`'s (groupwise.prm_checkpoint)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2))


def write_optimizer(opt_state: dict, folder: Path, suffix: str = "") -> None:
    """optimizer.state_dict() as optimizer<suffix>.safetensors (its tensors) + optimizer<suffix>.json (the rest)."""
    tensors, rest = {}, {"param_groups": opt_state["param_groups"], "state": {}}
    for idx, st in opt_state["state"].items():
        rest["state"][str(idx)] = {}
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                rest["state"][str(idx)][key] = value
    save_file(tensors, str(folder / f"optimizer{suffix}.safetensors"))
    write_json(folder / f"optimizer{suffix}.json", rest)


def read_optimizer(folder: Path, suffix: str = "") -> dict:
    """The state dict write_optimizer wrote."""
    rest = json.loads((folder / f"optimizer{suffix}.json").read_text())
    state: dict[int, dict] = {int(i): dict(v) for i, v in rest["state"].items()}
    for name, tensor in load_file(str(folder / f"optimizer{suffix}.safetensors")).items():
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

"""Checkpoints: safetensors + JSON only (no pickle), written atomically, resumed exactly.

checkpoint-N/
  model.safetensors, config.json, tokenizer files   loadable with AutoModelForCausalLM.from_pretrained
  (LoRA: adapter_model.safetensors + adapter_config.json instead, loadable with PeftModel.from_pretrained)
  optimizer.safetensors + optimizer.json            tensors / the rest of optimizer.state_dict()
  scheduler.json, trainer_state.json                schedule position, step, data cursor, counters
  rng_state_<rank>.safetensors + .json              torch (CPU, CUDA), numpy and python RNG of each process
  rollout_<rank>.safetensors                        the generation batch, when N falls inside a round
  ref_model.safetensors                             the reference model, when TR-DPO moves it
  model_shard_<rank>.safetensors, optimizer_<rank>.*  each process's shards, when the run is sharded (FSDP2); the
                                                    optimizer.* files are then absent and model.safetensors is the
                                                    consolidated model; ref_model_shard_<rank>.safetensors
                                                    replaces ref_model.safetensors
  checksums.json                                    sha256 of every other file, written last
The folder is built as .tmp-checkpoint-N and renamed once complete: a crash never leaves a half checkpoint under a
checkpoint-N name, and resume refuses a folder whose files do not match checksums.json (missing, truncated,
bit-flipped or edited), naming the file. trainer_state.json records the run id; `save_total_limit` rotation only
ever deletes checkpoints of the same run, a save refuses to replace another run's checkpoint of the same step, and
a new run refuses an output_dir that holds another run's outputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from groupwise.config_base import ConfigError
from groupwise.layout import ROUND_FIELDS

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
SET_ASIDE_RE = re.compile(r"^checkpoint-(\d+)\.abandoned(-\d+)?$")  # see set_aside_later
MANIFEST = "checksums.json"


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed from, or an output folder would be overwritten; the message names the file
    (an input error: exit 2 on the command line)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    """checksums.json: the sha256 of every file under the folder (subfolders too, by relative path)."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    _write_json(folder / MANIFEST, {name: _sha256(folder / name) for name in files})


def verify_checkpoint(folder: str | Path) -> None:
    """Raise CheckpointError unless every file listed in checksums.json is there with its recorded sha256."""
    path = Path(folder)
    if not (path / MANIFEST).exists() and _run_id_of(path) is None and (path / "trainer_state.json").exists():
        warnings.warn(f"{path} predates checksums (no {MANIFEST}): resumed without verifying its files",
                      RuntimeWarning, stacklevel=2)
        return
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a complete groupwise checkpoint (a save that "
                              "did not finish, or another tool's folder); resume from an earlier checkpoint")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / MANIFEST} is corrupted ({e}); resume from an earlier checkpoint") from None
    for name, digest in manifest.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f} is missing (listed in {MANIFEST}); resume from an earlier checkpoint")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f} does not match its checksum: the file was changed or corrupted after the "
                                  "save; resume from an earlier checkpoint")


def run_outputs(output_dir: str | Path) -> list[Path]:
    """What a previous run left in output_dir: checkpoint-N folders (set aside ones too), metrics.jsonl,
    completions.jsonl and the completions/ tables."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if CHECKPOINT_RE.match(p.name) or SET_ASIDE_RE.match(p.name)
                  or p.name in ("metrics.jsonl", "completions.jsonl", "completions"))


def latest_checkpoint(output_dir: str | Path) -> str:
    """The checkpoint-N folder with the largest N in output_dir (resume_from_checkpoint=True)."""
    root = Path(output_dir)
    found = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir())
    if not found:
        raise CheckpointError(f"resume_from_checkpoint=True: no checkpoint-N folder in output_dir {output_dir}")
    return str(found[-1][1])


def resume_folder(value: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint folder resume_from_checkpoint names (True: the newest in output_dir), or None for a new run.
    A folder that is not there or holds no trainer_state.json is a CheckpointError (cheap: nothing is verified
    or loaded here)."""
    if not value:
        return None
    folder = latest_checkpoint(output_dir) if value is True else str(value)
    if not (Path(folder) / "trainer_state.json").is_file():
        why = "does not exist" if not Path(folder).exists() else "holds no trainer_state.json"
        raise CheckpointError(f"resume_from_checkpoint={folder!r} {why}: not a checkpoint written by groupwise; "
                              "give a checkpoint-N folder of a run, or true for the newest one in output_dir")
    return folder


def set_aside_later(output_dir: str | Path, step: int, run_id: str | None) -> list[Path]:
    """Resuming run `run_id` at `step`: its checkpoints of later steps in output_dir belong to the branch the resume
    abandons. Left in place, resume_from_checkpoint=True would pick them after a crash, and the rotation
    (save_total_limit) would keep them and delete the resumed branch's. They are renamed checkpoint-N.abandoned
    (-2, -3, … if taken), kept whole; other runs' checkpoints are left alone. Returns the new names."""
    root = Path(output_dir)
    later = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := CHECKPOINT_RE.match(p.name)) and int(m.group(1)) > step and _run_id_of(p) == run_id)
    moved = []
    for _, path in later:
        target, k = path.with_name(path.name + ".abandoned"), 1
        while target.exists():
            k += 1
            target = path.with_name(f"{path.name}.abandoned-{k}")
        path.rename(target)
        moved.append(target)
    if moved:
        _sync_dir(root)
    return moved


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
                          "cannot hold: keep only numbers, strings and lists in the scheduler's attributes (e.g. a "
                          "plain function as lr_lambda, not an object holding one), or set save_only_model=True / "
                          "save_strategy='no' with save_on_interrupt=False")


def claim_output_dir(output_dir: str | Path, overwrite: bool) -> None:
    """Before a new (non-resumed) run: refuse an output_dir holding another run's checkpoints or metrics, unless
    overwrite (TRL's overwrite_output_dir), which deletes them."""
    found = run_outputs(output_dir)
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name for p in found[:4]) + (" …" if len(found) > 4 else "")
        raise CheckpointError(f"output_dir {output_dir} already holds a run ({names}): resume it with "
                              "resume_from_checkpoint, choose another output_dir, or set overwrite_output_dir=True "
                              "to delete those outputs")
    for p in found:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2))


def _optimizer_to_files(opt_state: dict, folder: Path, suffix: str = "") -> None:
    tensors, rest = {}, {"param_groups": opt_state["param_groups"], "state": {}}
    for idx, st in opt_state["state"].items():
        rest["state"][str(idx)] = {}
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                rest["state"][str(idx)][key] = value
    save_file(tensors, str(folder / f"optimizer{suffix}.safetensors"))
    _write_json(folder / f"optimizer{suffix}.json", rest)


def _optimizer_from_files(folder: Path, suffix: str = "") -> dict:
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


@contextlib.contextmanager
def rng_untouched():
    """Run a block without moving any random stream the checkpoint records (torch CPU / CUDA, numpy, python)."""
    tensors, rest = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(tensors, rest)


def _set_rng_state(tensors: dict[str, torch.Tensor], rest: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    kind, pos, has_gauss, cached = rest["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    v, state, gauss = rest["python"]
    random.setstate((v, tuple(state), gauss))


def save_checkpoint(output_dir: str, step: int, *, dist, model, tokenizer, optimizer, scheduler, state: dict,
                    pending: dict[str, torch.Tensor] | None = None, ref_model=None,
                    save_total_limit: int | None = None, model_only: bool = False,
                    sharded_model: torch.nn.Module | None = None) -> Path:
    """checkpoint-<step>/: the model (safetensors, from_pretrained-loadable), tokenizer, optimizer, scheduler, each
    process's RNG state, the trainer state and an unfinished round; written to a temporary folder, checksummed,
    then renamed. `model_only` (save_only_model) writes the model, tokenizer and trainer state only: such a
    checkpoint cannot be resumed. `sharded_model` (FSDP2): every process also writes its shards of the weights and
    of the optimizer state; `model` is then the consolidated (unsharded) copy written for from_pretrained."""
    root = Path(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    owner = _run_id_of(final) if final.is_dir() else None  # every process reads it: all refuse together
    if owner is not None and owner != state.get("run_id"):
        raise CheckpointError(f"{final} belongs to another run (run_id {owner}, this run's is {state.get('run_id')}): "
                              "it is left as it is; resume into another output_dir, or move that checkpoint away")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    if not model_only:
        tensors, rest = _rng_state()
        save_file(tensors, str(tmp / f"rng_state_{dist.rank}.safetensors"))
        _write_json(tmp / f"rng_state_{dist.rank}.json", rest)
        if pending:
            save_file({k: v.detach().cpu().contiguous() for k, v in pending.items()},
                      str(tmp / f"rollout_{dist.rank}.safetensors"))
    # every process builds the optimizer state dict (collective under some backends); the main one writes
    opt_state = None if model_only else optimizer.state_dict()
    if sharded_model is not None and not model_only:
        from groupwise.sharding import local_tensors, optimizer_local

        save_file(local_tensors(sharded_model.state_dict()), str(tmp / f"model_shard_{dist.rank}.safetensors"))
        _optimizer_to_files(optimizer_local(opt_state), tmp, suffix=f"_{dist.rank}")
        if ref_model is not None:  # sharded alike (adapters.Reference.shard): each process its shards
            save_file(local_tensors(ref_model.state_dict()), str(tmp / f"ref_model_shard_{dist.rank}.safetensors"))
    if dist.is_main:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _write_json(tmp / "trainer_state.json", {**state, "model_only": model_only})
        if not model_only:
            if sharded_model is None:  # sharded runs wrote optimizer_<rank>.* above
                _optimizer_to_files(opt_state, tmp)
            _write_json(tmp / "scheduler.json", scheduler.state_dict())
        if ref_model is not None and not model_only and sharded_model is None:
            save_file({k: v.detach().cpu().clone() for k, v in ref_model.state_dict().items()},  # tied: copies
                      str(tmp / "ref_model.safetensors"))
    dist.barrier()
    if dist.is_main:
        _write_manifest(tmp)  # last: a folder without it (or with files that do not match it) is never resumed
        _sync(tmp)  # on disk before the rename, and the rename on disk before older checkpoints are deleted
        old = root / f".old-checkpoint-{step}"  # this run's earlier save of the same step: set aside, then dropped
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _sync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        _rotate(root, save_total_limit, state.get("run_id"), keep=final)
    dist.barrier()
    return final


def _sync(folder: Path) -> None:
    """fsync every file under `folder`, then the folders themselves (a crash after the save keeps it whole)."""
    for p in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _sync_dir(folder)


def _sync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _run_id_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / "trainer_state.json").read_text()).get("run_id")
    except (OSError, json.JSONDecodeError):
        return None


def _rotate(root: Path, limit: int | None, run_id: str | None, keep: Path) -> None:
    """Keep the newest `limit` checkpoints of this run (never the one just written); other runs' are not touched."""
    if not limit:
        return
    mine = sorted((int(m.group(1)), p) for p in root.iterdir()
                  if (m := CHECKPOINT_RE.match(p.name)) and _run_id_of(p) == run_id)
    for _, path in mine[:-limit]:
        if path != keep:
            shutil.rmtree(path)


def _model_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    # model.safetensors or transformers' model-00001-of-0000N.safetensors shards (not model_shard_<rank>: fsdp's)
    for path in sorted(p for p in folder.glob("model*.safetensors") if not p.name.startswith("model_shard_")):
        weights.update(load_file(str(path)))
    if not weights:
        raise FileNotFoundError(f"{folder}: no model*.safetensors weights")
    return weights


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes differ
        first = str(e).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{source}: checkpoint does not match the model ({first}): resume with the model it "
                              "was saved from") from None
    current = model.state_dict()
    loaded = {current[n].data_ptr() for n in weights if n in current}
    untied = [n for n in missing if current[n].data_ptr() not in loaded]  # save_pretrained drops tied copies
    if unexpected or untied:
        raise CheckpointError(f"{source}: checkpoint does not match the model (missing {untied[:5]}, "
                              f"unexpected {unexpected[:5]}): resume with the model it was saved from")


def load_checkpoint(folder: str, *, dist, model, optimizer, scheduler, ref_model=None,
                    sharded_model: torch.nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """Restore everything saved by save_checkpoint into the given objects (call `read_state` first: it verifies
    the files); returns the pending rollout tensors, or None."""
    path = Path(folder)
    rng_file = path / f"rng_state_{dist.rank}.safetensors"
    if not rng_file.exists():
        raise FileNotFoundError(f"{folder} has no RNG state for process {dist.rank}: was it saved with "
                                f"{dist.world_size} processes?")
    from groupwise.adapters import ADAPTER_WEIGHTS, is_peft_model, load_adapter

    if sharded_model is not None:  # FSDP2: this process's shards, exactly (the consolidated copy is for users)
        from groupwise.sharding import load_local, optimizer_from_local

        shard_file = path / f"model_shard_{dist.rank}.safetensors"
        if not shard_file.exists():
            raise CheckpointError(f"{folder} holds no shards for process {dist.rank}: it was not saved by a sharded "
                                  f"run of {dist.world_size} processes (fsdp); resume it the way it was saved")
        load_local(sharded_model, load_file(str(shard_file)), folder)
        optimizer.load_state_dict(optimizer_from_local(optimizer, _optimizer_from_files(path, f"_{dist.rank}")))
    elif is_peft_model(model):  # a LoRA run: the checkpoint holds the adapter (the base never changes)
        load_adapter(model, path, folder)
        optimizer.load_state_dict(_optimizer_from_files(path))
    else:
        if (path / "model_shard_0.safetensors").exists():
            raise CheckpointError(f"{folder} was saved by a sharded run (fsdp): resume it with fsdp and "
                                  f"{len(list(path.glob('model_shard_*.safetensors')))} processes")
        if (path / ADAPTER_WEIGHTS).exists():
            raise CheckpointError(f"{folder} holds a LoRA adapter ({ADAPTER_WEIGHTS}), not the model: resume it "
                                  "with the run's peft_config / use_peft")
        load_model_weights(model, _model_weights(path), folder)
        optimizer.load_state_dict(_optimizer_from_files(path))
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    if ref_model is not None and (path / f"ref_model_shard_{dist.rank}.safetensors").exists():
        from groupwise.sharding import load_local

        load_local(ref_model, load_file(str(path / f"ref_model_shard_{dist.rank}.safetensors")), folder)
    elif ref_model is not None and (path / "ref_model.safetensors").exists():
        ref_model.load_state_dict(load_file(str(path / "ref_model.safetensors")))
    _set_rng_state(load_file(str(rng_file)), json.loads((path / f"rng_state_{dist.rank}.json").read_text()))
    pending_file = path / f"rollout_{dist.rank}.safetensors"
    pending = load_file(str(pending_file)) if pending_file.exists() else None
    return pending


# GRPOConfig fields a resumed run must keep, and why
RESUME_FIELDS = {
    **dict.fromkeys(("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                     "steps_per_generation", "generation_batch_size", "seed", "data_seed", "shuffle_dataset",
                     "dynamic_sampling"), "the data order and batch layout depend on it"),
    **dict.fromkeys(("optim", "optim_args"), "the saved optimizer state is this optimizer's"),
}


def check_resume(path: str, state: dict, args, *, world_size: int, max_steps: int, data: str | None = None) -> None:
    """Refuse, naming the reason, a checkpoint this run cannot continue exactly (before anything loads); warn when
    the train dataset is not the one the checkpoint was trained on (`data`: PromptData.fingerprint)."""
    if state.get("model_only"):
        raise CheckpointError(f"{path} was written with save_only_model=True: it holds the model only (no "
                              "optimizer, scheduler or RNG state), so the run cannot resume from it; start a new "
                              "run with it as the model")
    if state["world_size"] != world_size:
        raise CheckpointError(f"{path} was saved by {state['world_size']} processes; resume with the same number "
                              f"(now {world_size}) so the data split and RNG streams match")
    if state["global_step"] >= max_steps:
        raise CheckpointError(f"{path} is at step {state['global_step']}, which is not before max_steps={max_steps}: "
                              "raise max_steps to train further")
    for name, saved in state.get("config", {}).items():
        if saved is None and name in ROUND_FIELDS:
            continue  # saved before the layout was filled in: derived from fields compared here too
        if getattr(args, name) != saved:
            raise CheckpointError(f"resume: {name} is {saved!r} in {path} but {getattr(args, name)!r} now; resume "
                                  f"with the same value ({RESUME_FIELDS.get(name, 'the run depends on it')})")
    if data is not None and state.get("data") not in (None, data):
        warnings.warn(f"resume: train_dataset is not the one {path} was trained on (its rows differ): the run "
                      "continues its prompt order over these rows; resume with the same dataset to continue exactly",
                      UserWarning, stacklevel=3)


def check_pending(path: str, pending: dict[str, torch.Tensor], args) -> None:
    """The generation batch saved inside a round was built for the loss settings of its run: refuse settings it
    lacks the tensors for (reference log-probs for beta ≠ 0, importance weights for the sampling correction)."""
    for field, key, needed in (("beta", "ref_logps", args.beta != 0),
                               ("the importance-sampling correction", "is_weights", args.corrects_sampling)):
        if needed != (key in pending):
            raise CheckpointError(f"{path} stopped inside a generation round built {'without' if needed else 'with'} "
                                  f"{key} ({field} changed since): resume with the run's settings, or from a "
                                  "checkpoint at a round boundary")


def read_state(folder: str | Path) -> dict:
    """trainer_state.json of a verified checkpoint (cheap to call before any weights load)."""
    path = Path(folder)
    if not (path / "trainer_state.json").exists():
        raise FileNotFoundError(f"{folder} is not a groupwise checkpoint (no trainer_state.json)")
    verify_checkpoint(path)
    return json.loads((path / "trainer_state.json").read_text())

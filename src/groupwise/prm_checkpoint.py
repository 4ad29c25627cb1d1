"""Checkpoints of `groupwise prm train`, written as GRPO's are (groupwise.checkpoint: a temporary folder,
checksums.json, renamed into place; save_total_limit deletes only this run's oldest) and resumed exactly: a run
resumed from checkpoint-N ends with the weights an uninterrupted run ends with.

checkpoint-N/
  model.safetensors, config.json, tokenizer files   the PRM after N optimizer steps (AutoModelForTokenClassification)
  groupwise_prm.json                                as in the final folder: load_prm scores a checkpoint directly
  optimizer.safetensors + optimizer.json            AdamW's state (tensors / the rest)
  scheduler.json                                    the schedule's position
  rng_state_0.safetensors + .json                   torch, numpy and python RNG (dropout continues where it was)
  trainer_state.json                                command "prm train", step, run_id, the fields that fix the run
                                                    (RUN_FIELDS), train_file's sha256 and the held-out metrics
                                                    before training
  checksums.json                                    sha256 of every other file, written last

The data order needs no state: the split and each epoch's shuffle come from `seed`, so a resume replays them and
skips the batches already trained on.
"""

from __future__ import annotations

import hashlib
import json
import uuid
import warnings
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from groupwise.checkpoint import (
    CheckpointError, _fresh_folder, _optimizer_from_files, _optimizer_to_files, _publish, _rng_state, _set_rng_state,
    _write_json, claim_output_dir, read_state, resume_folder, set_aside_later,
)
from groupwise.rewards.prm import PRM_CONFIG

COMMAND = "prm train"
# the fields a resume must repeat: each changes the data, the split, the order, the inputs or the schedule
RUN_FIELDS = ("model_name_or_path", "eval_file", "eval_fraction", "separator", "prompt_separator", "learning_rate",
              "weight_decay", "lr_scheduler_type", "warmup_steps", "max_grad_norm", "num_train_epochs",
              "per_device_train_batch_size", "max_length", "seed")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def start(cfg) -> tuple[str | None, dict[str, Any]]:
    """Before the model loads: (the checkpoint folder to resume from, its trainer_state.json), or (None, a new run's
    state) after claiming output_dir as GRPO does (another run's checkpoints there are an error unless
    overwrite_output_dir). A checkpoint of another command, or one whose run differs in a RUN_FIELDS value or in
    train_file's content, is a CheckpointError naming the difference and the fix."""
    folder = resume_folder(cfg.resume_from_checkpoint, cfg.output_dir, command=COMMAND)
    if folder is None:
        claim_output_dir(cfg.output_dir, cfg.overwrite_output_dir)
        return None, {"command": COMMAND, "run_id": uuid.uuid4().hex, "step": 0,
                      "config": {k: getattr(cfg, k) for k in RUN_FIELDS},
                      "train_file_sha256": file_sha256(cfg.train_file)}
    state = read_state(folder)  # verifies every file against checksums.json
    for name in RUN_FIELDS:
        was, now = state["config"][name], getattr(cfg, name)
        if was != now:
            raise CheckpointError(f"resume_from_checkpoint={folder!r} was trained with {name}={was!r}, this config "
                                  f"has {name}={now!r}: resume with {name}: {json.dumps(was)}, or start a new run "
                                  "(another output_dir)")
    if file_sha256(cfg.train_file) != state["train_file_sha256"]:
        raise CheckpointError(f"train_file {cfg.train_file!r} is not the file {folder!r} was trained on (its content "
                              "changed): resume with that file, or start a new run (another output_dir)")
    # the later checkpoints of the branch this resume gives up: kept, renamed, out of the way of resume=True
    if moved := set_aside_later(cfg.output_dir, state["step"], state["run_id"]):
        warnings.warn(f"resumed at step {state['step']}: the later checkpoints in output_dir were set aside, not "
                      f"deleted: {', '.join(p.name for p in moved)}", UserWarning, stacklevel=3)
    print(f"prm train: resuming from {folder} (step {state['step']})")
    return folder, state


def save(cfg, step: int, *, model, tokenizer, optimizer, scheduler, state: dict[str, Any],
         prm_record: dict[str, Any]) -> Path:
    """checkpoint-<step>/ in output_dir (see the module docstring); the rotation keeps save_total_limit of them."""
    root = Path(cfg.output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    _fresh_folder(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    _write_json(tmp / PRM_CONFIG, prm_record)
    _optimizer_to_files(optimizer.state_dict(), tmp)
    _write_json(tmp / "scheduler.json", scheduler.state_dict())
    tensors, rest = _rng_state()
    save_file(tensors, str(tmp / "rng_state_0.safetensors"))
    _write_json(tmp / "rng_state_0.json", rest)
    _write_json(tmp / "trainer_state.json", {**state, "step": step})
    _publish(tmp, final, root, step, cfg.save_total_limit, state["run_id"])
    return final


def restore(folder: str, *, optimizer, scheduler) -> None:
    """The optimizer, the schedule and the RNG as checkpoint `folder` saved them (the weights are loaded from it with
    from_pretrained)."""
    path = Path(folder)
    optimizer.load_state_dict(_optimizer_from_files(path))
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    _set_rng_state(load_file(str(path / "rng_state_0.safetensors")),
                   json.loads((path / "rng_state_0.json").read_text()))

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

import json
import os
import uuid
from pathlib import Path
from typing import Any

from groupwise.checkpoint import (CheckpointError, claim_output_dir, fresh_folder, publish, read_state, resume_folder,
                                  set_aside_later)
from groupwise.checkpoint_files import read_optimizer, read_rng, sha256_of, write_json, write_optimizer, write_rng
from groupwise.rewards.prm import PRM_CONFIG

COMMAND = "prm train"
# the fields a resume must repeat: each changes the data, the split, the order, the inputs or the schedule
RUN_FIELDS = ("model_name_or_path", "eval_file", "eval_fraction", "separator", "prompt_separator", "learning_rate",
              "weight_decay", "lr_scheduler_type", "warmup_steps", "max_grad_norm", "num_train_epochs",
              "per_device_train_batch_size", "max_length", "seed", "disable_dropout")
# what a checkpoint written before a field existed was trained with
RUN_FIELD_BEFORE = {"disable_dropout": False}
# run fields that name a file or folder: the same one under another spelling (./base, an absolute path) is the same
PATH_FIELDS = ("model_name_or_path", "eval_file")


def _location(value: Any) -> Any:
    """A local file or folder's real path (a hub id, or nothing: the value itself)."""
    return os.path.realpath(value) if isinstance(value, str) and value and os.path.exists(value) else value


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
                      "locations": {k: _location(getattr(cfg, k)) for k in PATH_FIELDS},
                      "train_file_sha256": sha256_of(cfg.train_file)}
    state = read_state(folder)  # verifies every file against checksums.json
    for name in RUN_FIELDS:
        was, now = state["config"].get(name, RUN_FIELD_BEFORE.get(name)), getattr(cfg, name)
        if name in PATH_FIELDS and was != now:  # (a checkpoint without locations: read from this directory)
            if state.get("locations", {}).get(name, _location(was)) == _location(now):
                continue
        if was != now:
            raise CheckpointError(f"resume_from_checkpoint={folder!r} was trained with {name}={was!r}, this config "
                                  f"has {name}={now!r}: resume with {name}: {json.dumps(was)}, or start a new run "
                                  "(another output_dir)")
    if sha256_of(cfg.train_file) != state["train_file_sha256"]:
        raise CheckpointError(f"train_file {cfg.train_file!r} is not the file {folder!r} was trained on (its content "
                              "changed): resume with that file, or start a new run (another output_dir)")
    set_aside_later(cfg.output_dir, state["step"], state["run_id"])  # the branch this resume gives up
    print(f"prm train: resuming from {folder} (step {state['step']})")
    return folder, state


def save(cfg, step: int, *, model, tokenizer, optimizer, scheduler, state: dict[str, Any],
         prm_record: dict[str, Any]) -> Path:
    """checkpoint-<step>/ in output_dir (see the module docstring); the rotation keeps save_total_limit of them."""
    root = Path(cfg.output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    fresh_folder(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    write_json(tmp / PRM_CONFIG, prm_record)
    write_optimizer(optimizer.state_dict(), tmp)
    write_json(tmp / "scheduler.json", scheduler.state_dict())
    write_rng(tmp, 0)
    write_json(tmp / "trainer_state.json", {**state, "step": step})
    publish(tmp, final, root, step, cfg.save_total_limit, state["run_id"])
    return final


def restore(folder: str, *, optimizer, scheduler) -> None:
    """The optimizer, the schedule and the RNG as checkpoint `folder` saved them (the weights are loaded from it with
    from_pretrained)."""
    path = Path(folder)
    optimizer.load_state_dict(read_optimizer(path))
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    read_rng(path, 0)

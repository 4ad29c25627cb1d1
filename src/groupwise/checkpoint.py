"""Checkpoints: safetensors + JSON only (no pickle), written atomically, resumed exactly.

checkpoint-N/
  model.safetensors, config.json, tokenizer files   loadable with AutoModelForCausalLM.from_pretrained
  (LoRA: adapter_model.safetensors + adapter_config.json instead, loadable with PeftModel.from_pretrained)
  optimizer.safetensors + optimizer.json            tensors / the rest of optimizer.state_dict()
  scheduler.json, trainer_state.json                schedule position, step, data cursor, counters
  rng_state_<rank>.safetensors + .json              torch (CPU, CUDA), numpy and python RNG of each process
  rollout_<rank>.safetensors                        the generation batch, when N falls inside a round
  ref_model.safetensors                             the reference model, when TR-DPO moves it
  model_shard_<rank>.safetensors, optimizer_<rank>.*  each process's shards, when the run is sharded (FSDP2; with
                                                    LoRA of the adapters only); the
                                                    optimizer.* files are then absent and model.safetensors is the
                                                    consolidated model; ref_model_shard_<rank>.safetensors
                                                    replaces ref_model.safetensors (a sharded run resumes
                                                    either: older ones wrote the whole reference)
  checksums.json                                    sha256 of every other file, written last
The folder is built as .tmp-checkpoint-N and renamed once complete: a crash never leaves a half checkpoint under a
checkpoint-N name (the .tmp folder it leaves is removed by the next save or resume), and resume refuses a folder
whose files do not match checksums.json (missing, truncated, bit-flipped or edited), naming the file. A save of a step that has a checkpoint moves it to .old-checkpoint-N
first: a crash before the new folder takes its name leaves the step there, and resume (or the next save) puts it
back (put_back_replaced). trainer_state.json records the run id; `save_total_limit` rotation only ever deletes
checkpoints of the same run, a save refuses to replace another run's checkpoint of the same step, and a new run
refuses an output_dir that holds another run's outputs. A checkpoint the rotation deletes is renamed
.old-checkpoint-N.deleted first (a kill during the deletion never leaves a half checkpoint-N; the leftover is
removed by the next save or resume). A folder whose trainer_state.json is transformers' TrainerState (a transformers
/ TRL checkpoint) is never resumed. Loading is groupwise.checkpoint_load's; the optimizer / RNG / JSON file formats
and the fsyncs are groupwise.checkpoint_files'.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from groupwise.checkpoint_files import sha256_of, sync_dir, sync_files, write_json, write_optimizer, write_rng
from groupwise.config_base import ConfigError

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
SET_ASIDE_RE = re.compile(r"^checkpoint-(\d+)\.abandoned(-\d+)?$")  # see set_aside_later
REPLACED_RE = re.compile(r"^\.old-checkpoint-(\d+)$")  # see publish, put_back_replaced
DELETED_RE = re.compile(r"^\.old-checkpoint-(\d+)\.deleted$")  # see _delete
# what a run leaves at output_dir's top besides its checkpoints, deleted with them by overwrite_output_dir: the state
# and results it writes there (save_state, save_metrics: all_results.json would merge the new run's into the old's),
# and, when its weights are there, its final model (save_model: weights or an adapter, and what loads with them:
# configs, tokenizer files and chat templates, a card), which would load with the new run's model (a full model
# left beside a new adapter, or the reverse, or an old chat template beside a new tokenizer). Without weights the
# model files stay (a project folder's README)
RUN_FILES_RE = re.compile(r"^(trainer_state\.json|(train|eval|all)_results\.json|eval_completions\.jsonl)$")
_WEIGHTS = r"model(-\d+-of-\d+)?\.safetensors|pytorch_model.*\.bin|adapter_model\.(safetensors|bin)"
WEIGHTS_RE = re.compile(rf"^({_WEIGHTS})$")
FINAL_RE = re.compile(rf"^({_WEIGHTS}|model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json|"
                      r"adapter_config\.json|config\.json|generation_config\.json|README\.md|"
                      r"tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json|"
                      r"chat_template\.(jinja|json)|additional_chat_templates|vocab\.(json|txt)|merges\.txt|"
                      r"tokenizer\.model)$")
SETTING_ASIDE = ".setting-aside.json"  # set_aside_later's intent, until its renames are all done
UNFINISHED_RE = re.compile(r"^\.tmp-checkpoint-(\d+)$")  # a save in progress (save_checkpoint), or a crash's
MANIFEST = "checksums.json"


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed from, or an output folder would be overwritten; the message names the file
    (an input error: exit 2 on the command line)."""


def _write_manifest(folder: Path) -> None:
    """checksums.json: the sha256 of every file under the folder (subfolders too, by relative path)."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    write_json(folder / MANIFEST, {name: sha256_of(folder / name) for name in files})


def is_transformers_state(state: dict) -> bool:
    """Is this trainer_state.json transformers' TrainerState (a checkpoint of transformers' / TRL's Trainer, or an
    output_dir after trainer.save_state()) rather than groupwise's resume state? TrainerState.save_to_json writes
    its process and hyper-parameter-search flags, which groupwise's never holds; groupwise's holds the sampler."""
    return "sampler" not in state and any(k in state for k in ("is_world_process_zero", "is_hyper_param_search",
                                                                "trial_name"))


def foreign_message(folder: str | Path) -> str:
    """A transformers / TRL checkpoint given to resume: how to start a new run from its weights, an adapter's (a
    LoRA run's checkpoint holds only the adapter) loaded trainable over its base."""
    adapter = Path(folder) / "adapter_config.json"
    if adapter.is_file():
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path") or "<its base>"
        except (OSError, json.JSONDecodeError, AttributeError):
            base = "<its base>"
        start = (f"model=PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {str(folder)!r}, "
                 f"is_trainable=True) (a LoRA checkpoint: it holds the adapter only), or from a config, "
                 f"`groupwise export {folder} --merge OUT`, then model_name_or_path: OUT")
    else:
        start = f"model={str(folder)!r}"
    return (f"resume_from_checkpoint={str(folder)!r} is a transformers / TRL checkpoint (its trainer_state.json is "
            "transformers' TrainerState), not groupwise's: it holds no groupwise resume state; start a new run "
            f"from its weights with {start}")


def _state_of(folder: Path) -> dict | None:
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) else None


def verify_checkpoint(folder: str | Path) -> None:
    """Raise CheckpointError unless every file listed in checksums.json is there with its recorded sha256."""
    path = Path(folder)
    if is_transformers_state(_state_of(path) or {}):
        raise CheckpointError(foreign_message(path))
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
        if sha256_of(f) != digest:
            raise CheckpointError(f"{f} does not match its checksum: the file was changed or corrupted after the "
                                  "save; resume from an earlier checkpoint")


def run_outputs(output_dir: str | Path) -> list[Path]:
    """What a previous run left in output_dir: checkpoint-N folders (set aside ones too, and .old-checkpoint-N: see
    put_back_replaced), metrics.jsonl, completions.jsonl and the completions/ tables; a `prm train` run's log,
    metrics and PRM record (a finished PRM usually has no checkpoint: save_steps is 500)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if CHECKPOINT_RE.match(p.name) or SET_ASIDE_RE.match(p.name)
                  or REPLACED_RE.match(p.name) or DELETED_RE.match(p.name)
                  or p.name in ("metrics.jsonl", "completions.jsonl", "completions", "train_log.jsonl",
                                "eval_metrics.json", "groupwise_prm.json"))


def put_back_replaced(output_dir: str | Path, writing: Path | None = None, ours: bool = True) -> list[Path]:
    """A save of a step that has a checkpoint (this run's) moves checkpoint-N to .old-checkpoint-N, renames the new
    folder checkpoint-N, then deletes .old-checkpoint-N (publish). A crash between the two renames leaves the step
    only in .old-checkpoint-N, where resume does not look: it is renamed checkpoint-N again (that save is lost, not
    the step; resume verifies its checksums as any checkpoint's). One whose checkpoint-N is there is what the crash
    kept from being deleted: it is deleted, unless it holds another run's id. A .old-checkpoint-N.deleted folder is
    what a kill left of a deletion (_delete): it is removed. In this run's output_dir (`ours`), so is a
    .tmp-checkpoint-N other than `writing` (the save in progress): what a crash left of a save, as large as a
    checkpoint, never resumed from (another folder's may be another run's save in progress). Safe on every process
    at once (a rename another process made first is skipped). Returns the checkpoint-N folders put back."""
    root = Path(output_dir)
    try:
        names = list(root.iterdir())
    except OSError:  # no such folder (yet), or not readable: nothing of ours to put back
        return []
    if ours and (root / SETTING_ASIDE) in names:  # a set-aside that a kill interrupted: finished first
        try:
            pending = json.loads((root / SETTING_ASIDE).read_text())
            set_aside_later(root, int(pending["step"]), pending["run_id"])
        except (OSError, ValueError, KeyError, TypeError):  # gone (another process finished it), or unreadable
            pass
        names = list(root.iterdir())
    for leftover in (p for p in names if DELETED_RE.match(p.name) or (
            ours and UNFINISHED_RE.match(p.name) and p != writing)):
        shutil.rmtree(leftover, ignore_errors=True)
    replaced = sorted(p for p in names if REPLACED_RE.match(p.name))
    restored = []
    for old in replaced:
        final = root / old.name.removeprefix(".old-")
        if final.exists():
            if _run_id_of(old) in (None, _run_id_of(final)):
                shutil.rmtree(old, ignore_errors=True)
            continue
        try:
            old.rename(final)
        except FileNotFoundError:  # another process put it back
            continue
        restored.append(final)
        warnings.warn(f"{final.name} put back from {old.name} (a save replacing it was interrupted) in {root}",
                      RuntimeWarning, stacklevel=2)
    if restored:
        sync_dir(root)
    return restored


def _incomplete(folder: Path) -> str | None:
    """Why a checkpoint-N folder cannot be resumed from, or None; cheap (the files' presence, not their checksums,
    which read_state verifies)."""
    state = _state_of(folder)
    if state is None:
        return "no readable trainer_state.json"
    if is_transformers_state(state):
        return "a transformers / TRL checkpoint, not groupwise's"
    if state.get("model_only"):
        return "saved with save_only_model=True"
    if not (folder / MANIFEST).exists():
        return None if state.get("run_id") is None else f"no {MANIFEST}"  # (no run id: predates checksums)
    try:
        listed = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return f"an unreadable {MANIFEST}"
    gone = [name for name in listed if not (folder / name).is_file()]
    return f"{gone[0]} missing" if gone else None


def latest_checkpoint(output_dir: str | Path) -> str:
    """The resumable checkpoint-N folder with the largest N in output_dir (resume_from_checkpoint=True); newer
    folders that are not complete checkpoints (files missing, written with save_only_model) are passed over with a
    warning naming them."""
    root = Path(output_dir)
    found = sorted(((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                    if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()), reverse=True)
    if not found:
        raise CheckpointError(f"resume_from_checkpoint=True: no checkpoint-N folder in output_dir {output_dir}: drop "
                              "resume_from_checkpoint to start a new run, or set output_dir to the run to continue")
    skipped = []
    for _, path in found:
        why = _incomplete(path)
        if why is None:
            if skipped:
                warnings.warn(f"resume_from_checkpoint=True: resuming from {path.name}; newer folders are not "
                              f"complete checkpoints: {'; '.join(skipped)}", RuntimeWarning, stacklevel=3)
            return str(path)
        skipped.append(f"{path.name} ({why})")
    listed = "; ".join(skipped[:3]) + (" …" if len(skipped) > 3 else "")
    raise CheckpointError(f"resume_from_checkpoint=True: no complete checkpoint in output_dir {output_dir} "
                          f"({listed}); start a new run (a save_only_model or transformers checkpoint can be its "
                          "model)")


def resume_folder(value: str | bool | None, output_dir: str | Path, command: str = "train") -> str | None:
    """The checkpoint folder resume_from_checkpoint names (True: the newest in output_dir), or None for a new run.
    A folder that is not there, holds no trainer_state.json, holds transformers' (a transformers / TRL checkpoint)
    or was written by another groupwise command (`groupwise train`'s state has no "command"; `prm train`'s says so)
    is a CheckpointError (cheap: nothing is verified or loaded here)."""
    if not value:
        return None
    for root in {Path(output_dir), *([] if value is True else [Path(value).parent])}:
        # before anything looks for checkpoints, or sets the later ones aside
        put_back_replaced(root, ours=root.resolve() == Path(output_dir).resolve())
    folder = latest_checkpoint(output_dir) if value is True else str(value)
    if not (Path(folder) / "trainer_state.json").is_file():
        why = "does not exist" if not Path(folder).exists() else \
            "holds no trainer_state.json: not a checkpoint written by groupwise"
        raise CheckpointError(f"resume_from_checkpoint={folder!r} {why}; give a checkpoint-N folder of a run, or "
                              "true for the newest one in output_dir")
    state = _state_of(Path(folder)) or {}
    if is_transformers_state(state):
        raise CheckpointError(foreign_message(folder))
    if (written_by := state.get("command", "train")) != command:
        raise CheckpointError(f"resume_from_checkpoint={folder!r} is a checkpoint of `groupwise {written_by}`, not "
                              f"of `groupwise {command}`: resume it with `groupwise {written_by}`, or give a "
                              f"checkpoint of a `groupwise {command}` run")
    return folder


def set_aside_later(output_dir: str | Path, step: int, run_id: str | None) -> list[Path]:
    """Resuming run `run_id` at `step`: its checkpoints of later steps in output_dir belong to the branch the resume
    abandons. Left in place, resume_from_checkpoint=True would pick them after a crash, and the rotation
    (save_total_limit) would keep them and delete the resumed branch's. They are renamed checkpoint-N.abandoned
    (-2, -3, … if taken), kept whole, with a warning naming them; other runs' checkpoints are left alone. The intent
    is written first (SETTING_ASIDE): a kill between the renames is finished by the next put_back_replaced, so a
    resume never picks a checkpoint of the abandoned branch. Returns the new names."""
    root = Path(output_dir)
    later = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := CHECKPOINT_RE.match(p.name)) and int(m.group(1)) > step and _run_id_of(p) == run_id)
    marker = root / SETTING_ASIDE
    if later:  # the intent first: a kill between the renames leaves it, and put_back_replaced finishes the job
        tmp = root / (SETTING_ASIDE + ".tmp")
        tmp.write_text(json.dumps({"step": step, "run_id": run_id}))
        os.replace(tmp, marker)
        sync_dir(root)
    moved = []
    for _, path in later:
        target, k = path.with_name(path.name + ".abandoned"), 1
        while target.exists():
            k += 1
            target = path.with_name(f"{path.name}.abandoned-{k}")
        try:
            path.rename(target)
        except FileNotFoundError:  # another process finishing the same set-aside moved it
            continue
        moved.append(target)
    if later:
        sync_dir(root)
        marker.unlink(missing_ok=True)
        warnings.warn(f"resumed at step {step}: the later checkpoints in output_dir were set aside, not deleted: "
                      f"{', '.join(p.name for p in moved)}", UserWarning, stacklevel=3)
    return moved


def check_writable(output_dir: str | Path) -> None:
    """output_dir can be created and written, probed with a temporary folder (removed) in it or in its nearest
    existing parent, before the model loads: a folder under a file, or a read-only or forbidden place, failed only
    when the trackers opened, after the data and the model, with a traceback."""
    probe = Path(output_dir).absolute()
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if probe.is_symlink() and not probe.exists():
        raise ConfigError(f"output_dir={str(output_dir)!r}: {str(probe)!r} is a symbolic link to a missing target: "
                          "create the target, or choose another output_dir")
    if probe == Path(output_dir).absolute() and not probe.is_dir():
        raise ConfigError(f"output_dir={str(output_dir)!r} is a file, not a folder: choose another output_dir")
    if not probe.is_dir():
        raise ConfigError(f"output_dir={str(output_dir)!r} lies under {str(probe)!r}, which is a file, not a folder: "
                          "choose another output_dir")
    import tempfile

    try:
        tempfile.TemporaryDirectory(dir=probe, prefix=".groupwise-probe-").cleanup()
    except OSError as e:
        raise ConfigError(f"output_dir={str(output_dir)!r} cannot be written ({type(e).__name__} in "
                          f"{str(probe)!r}: {e.strerror or e}): choose a writable folder") from None


def claim_output_dir(output_dir: str | Path, overwrite: bool, model_folder: str | None = None) -> None:
    """Before a new (non-resumed) run: refuse an output_dir holding another run's checkpoints or metrics, unless
    overwrite (TRL's overwrite_output_dir), which deletes them, RUN_FILES_RE and that run's final model (FINAL_RE,
    when weights are there), unless output_dir is `model_folder`, the folder the policy was loaded from (training
    in place: those files are the model). A folder holding no run is left as it is."""
    found = run_outputs(output_dir)
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name for p in found[:4]) + (" …" if len(found) > 4 else "")
        resumable = any(CHECKPOINT_RE.match(p.name) or REPLACED_RE.match(p.name) for p in found)
        resume = "resume it with resume_from_checkpoint, " if resumable else ""  # (save_strategy 'no': nothing to)
        raise CheckpointError(f"output_dir {output_dir} already holds a run ({names}): {resume}choose another "
                              "output_dir, or set overwrite_output_dir=True to delete those outputs")
    top = list(Path(output_dir).iterdir())
    found += [p for p in top if p.is_file() and RUN_FILES_RE.match(p.name)]
    in_place = model_folder is not None and os.path.isdir(model_folder) and os.path.samefile(model_folder, output_dir)
    if any(WEIGHTS_RE.match(p.name) for p in top) and not in_place:  # the run's final model
        found += [p for p in top if FINAL_RE.match(p.name)]
    for p in found:  # (a PRM's groupwise_prm.json is among run_outputs)
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def save_checkpoint(output_dir: str, step: int, *, dist, model, tokenizer, optimizer, scheduler, state: dict,
                    pending: dict[str, torch.Tensor] | None = None, ref_model=None,
                    save_total_limit: int | None = None, model_only: bool = False,
                    sharded_model: torch.nn.Module | None = None, keep: str | None = None,
                    model_state: dict[str, torch.Tensor] | None = None) -> Path:
    """checkpoint-<step>/: the model (safetensors, from_pretrained-loadable), tokenizer, optimizer, scheduler, each
    process's RNG state, the trainer state and an unfinished round; written to a temporary folder, checksummed,
    then renamed. `model_only` (save_only_model) writes the model, tokenizer and trainer state only: such a
    checkpoint cannot be resumed. `sharded_model` (FSDP2): every process also writes its shards of the weights and
    of the optimizer state; `model` is then the consolidated (unsharded) copy written for from_pretrained, or the
    model whose `model_state` (the gathered weights) is written.
    `keep`: a checkpoint the save_total_limit rotation leaves alone (state.best_model_checkpoint)."""
    root = Path(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    owner = _run_id_of(final) if final.is_dir() else None  # every process reads it: all refuse together
    if owner is not None and owner != state.get("run_id"):
        raise CheckpointError(f"{final} belongs to another run (run_id {owner}, this run's is {state.get('run_id')}): "
                              "it is left as it is; resume into another output_dir, or move that checkpoint away")
    # each phase runs under run_together: a failure on one process (a full disk) stops every process with its
    # message at once, instead of leaving the others in a barrier until ddp_timeout
    dist.run_together(lambda: dist.is_main and fresh_folder(tmp), f"preparing checkpoint-{step}")

    def write() -> None:
        # every process builds the optimizer state dict (collective under some backends); the main one writes
        opt_state = None if model_only else optimizer.state_dict()
        if not model_only:
            write_rng(tmp, dist.rank)
            if pending:
                save_file({k: v.detach().cpu().contiguous() for k, v in pending.items()},
                          str(tmp / f"rollout_{dist.rank}.safetensors"))
        if sharded_model is not None and not model_only:
            from groupwise.sharding import local_tensors, optimizer_local, trained_state

            save_file(local_tensors(trained_state(sharded_model)), str(tmp / f"model_shard_{dist.rank}.safetensors"))
            write_optimizer(optimizer_local(opt_state), tmp, suffix=f"_{dist.rank}")
            if ref_model is not None:  # sharded alike (adapters.Reference.shard): each process its shards
                save_file(local_tensors(ref_model.state_dict()), str(tmp / f"ref_model_shard_{dist.rank}.safetensors"))
        if dist.is_main:
            model.save_pretrained(str(tmp), safe_serialization=True, state_dict=model_state)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            write_json(tmp / "trainer_state.json", {**state, "model_only": model_only})
            if not model_only:
                if sharded_model is None:  # sharded runs wrote optimizer_<rank>.* above
                    write_optimizer(opt_state, tmp)
                write_json(tmp / "scheduler.json", scheduler.state_dict())
            if ref_model is not None and not model_only and sharded_model is None:
                save_file({k: v.detach().cpu().clone() for k, v in ref_model.state_dict().items()},  # tied: copies
                          str(tmp / "ref_model.safetensors"))

    dist.run_together(write, f"writing checkpoint-{step}")
    dist.run_together(lambda: dist.is_main and publish(tmp, final, root, step, save_total_limit, state.get("run_id"),
                                                         keep), f"publishing checkpoint-{step}")
    return final


def fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def publish(tmp: Path, final: Path, root: Path, step: int, save_total_limit: int | None, run_id: str | None,
             keep: str | None = None) -> None:
    """Checksums, then the complete folder renamed into place, then the rotation (the main process). A checkpoint
    of this step is moved aside first and deleted last: a crash between the renames leaves it as .old-checkpoint-N,
    which the next resume or save puts back (put_back_replaced; here before the rotation counts the checkpoints)."""
    put_back_replaced(root, writing=tmp)
    _write_manifest(tmp)  # last: a folder without it (or with files that do not match it) is never resumed
    sync_files(tmp)  # on disk before the rename, and the rename on disk before older checkpoints are deleted
    old = root / f".old-checkpoint-{step}"  # this run's earlier save of the same step: set aside, then dropped
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    sync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    _rotate(root, save_total_limit, run_id, keep={final, *([Path(keep)] if keep else [])})


def _run_id_of(folder: Path) -> str | None:
    return (_state_of(folder) or {}).get("run_id")


def _mine(root: Path, run_id: str | None) -> list[Path]:
    """This run's checkpoint-N folders in `root`, oldest (smallest N) first."""
    mine = sorted((int(m.group(1)), p) for p in root.iterdir()
                  if (m := CHECKPOINT_RE.match(p.name)) and _run_id_of(p) == run_id)
    return [p for _, p in mine]


def _delete(path: Path) -> None:
    """Delete a checkpoint folder: renamed .old-checkpoint-N.deleted first (atomic), then removed, so a kill during
    the removal leaves no half checkpoint-N for resume to find (put_back_replaced removes the leftover; hub uploads
    ignore .old-*)."""
    trash = path.with_name(f".old-{path.name}.deleted")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash)


def _rotate(root: Path, limit: int | None, run_id: str | None, keep: set[Path]) -> None:
    """transformers' rotate_checkpoints over this run's checkpoints (other runs' are not touched): with more than
    `limit`, the oldest are deleted until max(limit, the number protected) remain, never a protected one (`keep`:
    the one just written and the best). So save_total_limit counts the best checkpoint; at 1 the best and the
    newest are kept (and the end of training deletes the newest: keep_only_best)."""
    if limit is None or limit <= 0:  # transformers: no limit
        return
    mine = _mine(root, run_id)
    kept = {k.resolve() for k in keep}  # the best as recorded may be spelt otherwise (relative, another path)
    protected = {p for p in mine if p.resolve() in kept}
    remaining = len(mine)
    for path in mine:
        if remaining <= max(limit, len(protected)):
            break
        if path not in protected:
            _delete(path)
            remaining -= 1


def keep_only_best(output_dir: str | Path, run_id: str | None, best: str | Path) -> None:
    """transformers' end of training with save_total_limit=1 and a best checkpoint: this run's other checkpoints
    (the newest, which the rotation kept beside the best) are deleted."""
    for path in _mine(Path(output_dir), run_id):
        if path.resolve() != Path(best).resolve():
            _delete(path)


def read_state(folder: str | Path) -> dict:
    """trainer_state.json of a verified checkpoint (cheap to call before any weights load)."""
    path = Path(folder)
    if not (path / "trainer_state.json").exists():
        raise CheckpointError(f"{folder} is not a groupwise checkpoint (no trainer_state.json)")
    verify_checkpoint(path)
    return json.loads((path / "trainer_state.json").read_text())

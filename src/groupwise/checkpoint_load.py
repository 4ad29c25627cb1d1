"""Resuming from a checkpoint (groupwise.checkpoint writes them): what a run must keep to continue exactly
(check_resume, check_pending), and loading every saved state back into the model, its optimizer and scheduler, the
reference model, the RNG streams (load_checkpoint). Imports groupwise.checkpoint inside functions (it re-exports
these names)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from groupwise.checkpoint_files import read_optimizer, read_rng, rng_file
from groupwise.layout import ROUND_FIELDS


def _error(message: str) -> Exception:
    from groupwise.checkpoint import CheckpointError

    return CheckpointError(message)


def _model_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    # model.safetensors or transformers' model-00001-of-0000N.safetensors shards (not model_shard_<rank>: fsdp's)
    for path in sorted(p for p in folder.glob("model*.safetensors") if not p.name.startswith("model_shard_")):
        weights.update(load_file(str(path)))
    if not weights:
        raise _error(f"{folder}: no model*.safetensors weights")
    return weights


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes differ
        first = str(e).strip().splitlines()[-1].strip()
        raise _error(f"{source}: checkpoint does not match the model ({first}): resume with the model it "
                     "was saved from") from None
    current = model.state_dict()
    loaded = {current[n].data_ptr() for n in weights if n in current}
    untied = [n for n in missing if current[n].data_ptr() not in loaded]  # save_pretrained drops tied copies
    if unexpected or untied:
        raise _error(f"{source}: checkpoint does not match the model (missing {untied[:5]}, "
                     f"unexpected {unexpected[:5]}): resume with the model it was saved from")


def load_model_from(folder: str, *, dist, model, sharded_model: torch.nn.Module | None = None) -> None:
    """The weights of a checkpoint written by save_checkpoint into the model: with fsdp this process's shards,
    exactly (the consolidated copy is for users); with LoRA the adapter (the base never changes); else the model."""
    from groupwise.adapters import ADAPTER_WEIGHTS, is_peft_model, load_adapter

    path = Path(folder)
    if not path.is_dir():
        raise _error(f"checkpoint {folder} does not exist (deleted or moved since it was saved): nothing to load")
    if sharded_model is not None:
        from groupwise.sharding import load_local

        shard_file = path / f"model_shard_{dist.rank}.safetensors"
        if not shard_file.exists():
            raise _error(f"{folder} holds no shards for process {dist.rank}: it was not saved by a sharded "
                         f"run of {dist.world_size} processes (fsdp); resume it the way it was saved")
        load_local(sharded_model, load_file(str(shard_file)), folder)
        return
    if (path / "model_shard_0.safetensors").exists():  # its optimizer state is in shards too (LoRA's as well)
        raise _error(f"{folder} was saved by a sharded run (fsdp): resume it with fsdp and "
                     f"{len(list(path.glob('model_shard_*.safetensors')))} processes")
    if is_peft_model(model):
        load_adapter(model, path, folder)
    else:
        if (path / ADAPTER_WEIGHTS).exists():
            raise _error(f"{folder} holds a LoRA adapter ({ADAPTER_WEIGHTS}), not the model: resume it "
                         "with the run's peft_config / use_peft")
        load_model_weights(model, _model_weights(path), folder)


def load_checkpoint(folder: str, *, dist, model, optimizer, scheduler, ref_model=None,
                    sharded_model: torch.nn.Module | None = None) -> dict[str, torch.Tensor] | None:
    """Restore everything saved by save_checkpoint into the given objects (call `read_state` first: it verifies
    the files); returns the pending rollout tensors, or None."""
    path = Path(folder)
    if not rng_file(path, dist.rank).exists():
        raise _error(f"{folder} has no RNG state for process {dist.rank}: was it saved with {dist.world_size} "
                     "processes?")

    load_model_from(folder, dist=dist, model=model, sharded_model=sharded_model)
    if sharded_model is not None:  # FSDP2: this process's shards of the optimizer state
        from groupwise.sharding import optimizer_from_local

        optimizer.load_state_dict(optimizer_from_local(optimizer, read_optimizer(path, f"_{dist.rank}")))
    else:
        optimizer.load_state_dict(read_optimizer(path))
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        # the rate of the next step from this run's schedule, as every later step's is: the optimizer's saved rate
        # came from the checkpoint's (one step of the old schedule when max_steps or the scheduler changed)
        rates = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        scheduler._last_lr = rates
    if ref_model is not None:
        load_reference(ref_model, path, dist.rank, sharded=sharded_model is not None)
    read_rng(path, dist.rank)
    pending_file = path / f"rollout_{dist.rank}.safetensors"
    pending = load_file(str(pending_file)) if pending_file.exists() else None
    return pending


def load_reference(ref_model: torch.nn.Module, path: Path, rank: int, sharded: bool) -> None:
    """The reference model TR-DPO moved (sync_ref_model), when the checkpoint holds it: this process's shards
    (ref_model_shard_<rank>), or the whole model (ref_model.safetensors), which a sharded run — whose reference is
    sharded — takes its shards of (checkpoints of sharded runs written before the reference was sharded)."""
    shard_file, full_file = path / f"ref_model_shard_{rank}.safetensors", path / "ref_model.safetensors"
    if shard_file.exists():
        from groupwise.sharding import load_local

        load_local(ref_model, load_file(str(shard_file)), f"{path} (ref_model_shard_{rank})")
    elif full_file.exists():
        weights = load_file(str(full_file))
        if sharded:
            load_full_into_shards(ref_model, weights, f"{path} (ref_model.safetensors)")
        else:
            load_model_weights(ref_model, weights, f"{path} (ref_model.safetensors)")


def load_full_into_shards(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy a full (unsharded) state dict into a model sharded with FSDP2: each process copies its own slice of
    every tensor, as its DTensor's placements lay it out (no collective: every process reads the same file).
    Exactly the keys of the model (a tied copy may be absent), each of the model's full shape."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    state = model.state_dict()
    ids = {n: id(t) for n, t in [*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)]}  # tied names share one tensor
    given = {ids[n] for n in tensors if n in ids}
    missing = sorted(n for n in set(state) - set(tensors) if n not in ids or ids[n] not in given)
    unexpected = sorted(set(tensors) - set(state))
    if missing or unexpected:
        raise _error(f"{source}: checkpoint does not match the model (missing {missing[:5]}, unexpected "
                     f"{unexpected[:5]}): resume with the model it was saved from")
    with torch.no_grad():
        for name, value in state.items():
            if name not in tensors:
                continue  # a tied copy of a tensor loaded under another name
            full = tensors[name]
            if tuple(full.shape) != tuple(value.shape):
                raise _error(f"{source}: {name} has shape {tuple(full.shape)}, the model's {tuple(value.shape)}: "
                             "resume with the model it was saved from")
            full = full.to(device=value.device, dtype=value.dtype)
            if isinstance(value, DTensor):  # src_data_rank=None: this process's slice of its own copy
                full = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None).to_local()
            local(value).copy_(full)


# GRPOConfig fields a resumed run must keep, and why
RESUME_FIELDS = {
    **dict.fromkeys(("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                     "steps_per_generation", "generation_batch_size", "seed", "data_seed", "shuffle_dataset",
                     "dynamic_sampling"), "the data order and batch layout depend on it"),
    **dict.fromkeys(("optim", "optim_args"), "the saved optimizer state is this optimizer's"),
}

# how to start a new run from a checkpoint's weights, full or adapter
NEW_RUN_FROM = ("model_name_or_path: {path}; for a LoRA checkpoint, its merge: `groupwise export {path} --merge OUT`, "
                "then model_name_or_path: OUT")

# GRPOConfig fields the optimizer's saved state holds (its param groups: lr as the schedule's base, weight decay,
# betas, eps): changed on resume they have no effect, as in transformers, which says nothing; groupwise warns
SAVED_OPTIMIZER_FIELDS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")


def check_resume(path: str, state: dict, args, *, world_size: int, max_steps: int, data: str | None = None,
                 epoch_steps_before: int | None = None, rows: int | None = None) -> None:
    """Refuse, naming the reason, a checkpoint this run cannot continue exactly (before anything loads); warn when
    the train dataset is not the one the checkpoint was trained on (`data`: PromptData.fingerprint, None for a
    stream; `rows`: its length, None for a stream): a stream where it had a dataset of rows (or the reverse), or
    another number of rows, is refused (the prompt order depends on them).
    `epoch_steps_before`: the max_steps num_train_epochs gave before the epoch count was exact (session 24's fix:
    ceil(E × rounds per epoch × steps per round)); a checkpoint planned by it is named, not silently re-planned."""
    if state.get("model_only"):
        raise _error(f"{path} was written with save_only_model=True: it holds the model only (no "
                     "optimizer, scheduler or RNG state), so the run cannot resume from it; start a new "
                     "run with it as the model")
    lacking = [k for k in ("global_step", "world_size") if k not in state]
    if lacking:  # (a transformers / TRL checkpoint is named earlier: checkpoint.resume_folder)
        raise _error(f"{path}: its trainer_state.json has no {lacking[0]!r}: not a checkpoint groupwise wrote; resume "
                     "from a checkpoint-N folder of a groupwise run, or start a new run with its weights as the model")
    if state["world_size"] != world_size:
        raise _error(f"{path} was saved by {state['world_size']} processes; resume with the same number "
                     f"(now {world_size}) so the data split and RNG streams match, or start a new run from its "
                     f"weights ({NEW_RUN_FROM.format(path=path)})")
    planned = state.get("max_steps")  # a checkpoint from before the exact count has no "epoch_plan"
    if "epoch_plan" not in state and args.max_steps <= 0 and planned not in (None, max_steps) \
            and planned == epoch_steps_before:
        raise _error(f"{path} was planned for max_steps={planned} by num_train_epochs={args.num_train_epochs} as an "
                     f"earlier groupwise counted epochs (now {max_steps} steps: rounds wrap around the epochs); "
                     f"resume with max_steps={planned} to finish it as planned")
    if state["global_step"] >= max_steps:  # == : a finished run (killed in its final save, or after it)
        finished = (f"; it holds that run's trained model (from_pretrained({str(path)!r}), or `groupwise export "
                    f"{path} --merge OUT` for an adapter)") if state["global_step"] == max_steps else ""
        raise _error(f"{path} is at step {state['global_step']}, which is not before max_steps={max_steps}: "
                     f"raise max_steps to train further{finished}")
    for name, saved in state.get("config", {}).items():
        if saved is None and name in ROUND_FIELDS:
            continue  # saved before the layout was filled in: derived from fields compared here too
        if getattr(args, name) != saved:
            raise _error(f"resume: {name} is {saved!r} in {path} but {getattr(args, name)!r} now; resume "
                         f"with the same value ({RESUME_FIELDS.get(name, 'the run depends on it')})")
    changed = [f"{name}={getattr(args, name)!r} (saved: {saved!r})"
               for name, saved in state.get("optimizer_fields", {}).items() if getattr(args, name) != saved]
    if changed:
        warnings.warn(f"resume: {', '.join(changed)} differs from {path}, whose optimizer state and learning-rate "
                      "schedule resume as saved: the new value has no effect (as in transformers); to train with "
                      f"it, start a new run from its weights ({NEW_RUN_FROM.format(path=path)})", UserWarning,
                      stacklevel=3)
    if "data" in state and (state["data"] is None) != (data is None):  # (older checkpoints did not record it)
        saved, now = ("a stream", "a dataset of rows") if state["data"] is None else ("a dataset of rows", "a stream")
        raise _error(f"resume: {path} was trained on {saved} as train_dataset, this run gives {now}: resume with "
                     "the same kind (a stream's position and an epoch's order are not the same cursor)")
    saved_rows = state.get("sampler", {}).get("size")
    if rows is not None and saved_rows is not None and saved_rows != rows:
        raise _error(f"resume: the checkpoint's train_dataset had {saved_rows} rows, this one has {rows}: resume "
                     "with the same dataset (the order of the prompts depends on it)")
    if data is not None and state.get("data") not in (None, data):
        warnings.warn(f"resume: train_dataset is not the one {path} was trained on (its rows differ): the run "
                      "continues its prompt order over these rows; resume with the same dataset to continue exactly",
                      UserWarning, stacklevel=3)


def check_pending(path: str, pending: dict[str, torch.Tensor], args, custom_rollout: bool = False) -> None:
    """The generation batch saved inside a round was built for the loss settings of its run: refuse settings it
    lacks the tensors for (reference log-probs for beta ≠ 0, importance weights for the sampling correction, the
    sampler's log-probs for the off-policy mask; a rollout_func's log-probs may be there without use_vllm, and may
    be missing with it: the mask then measures from π_θold, as TRL)."""
    mask = args.off_policy_mask_threshold is not None
    for field, key, needed, allowed in (("beta", "ref_logps", args.beta != 0, args.beta != 0),
                                        ("the importance-sampling correction", "is_weights", args.corrects_sampling,
                                         args.corrects_sampling),
                                        ("off_policy_mask_threshold", "sampling_logps",
                                         mask and args.keeps_sampling_logps and not custom_rollout, mask)):
        if (key in pending) != needed and (key not in pending or not allowed):
            raise _error(f"{path} stopped inside a generation round built {'without' if needed else 'with'} "
                         f"{key} ({field} changed since): resume with the run's settings, or from a "
                         "checkpoint at a round boundary")



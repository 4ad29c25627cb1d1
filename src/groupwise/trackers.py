"""The trackers a run reports to besides metrics.jsonl (GRPOConfig.report_to): TensorBoard, wandb and trackio, each
as transformers' callback for it writes (names, config, summary values), and report_to's spellings."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

from groupwise.config_base import ConfigError


class Opened(NamedTuple):
    """A tracker opened for a run."""
    log: Callable  # (step, metrics)
    close: Callable  # (failed: bool): the run ended on an error
    table: Callable | None = None  # (DataFrame): TRL's `completions` table, for trackers that show tables


class Tracker(NamedTuple):
    open: Callable[..., Opened]  # (output_dir, config, model, logging_steps)
    modules: tuple[str, ...]  # what it needs installed: one of these


def tracker_names(metrics: dict) -> dict:
    """The names transformers' tracker callbacks give a log line: `eval_x` → `eval/x`, `test_x` → `test/x`, any
    other `x` → `train/x` (groupwise's own `train/…` metrics, e.g. train/skipped_steps, keep their name, where
    transformers' rewrite would make it train/train/…)."""
    def name(k: str) -> str:
        if k.startswith("train/"):
            return k
        for prefix in ("eval", "test"):
            if k.startswith(prefix + "_"):
                return f"{prefix}/{k[len(prefix) + 1:]}"
        return "train/" + k
    return {name(k): v for k, v in metrics.items()}


# the end-of-training values that wandb keeps in the run's summary rather than as a series (transformers)
SUMMARY_ONLY = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")


def _tensorboard(output_dir: str, config: dict, model=None, logging_steps: int = 0):
    """transformers' TensorBoardCallback: a folder per run, output_dir/runs/<date>_<host> (or $TENSORBOARD_LOGGING_DIR),
    the config as text `args` and the model's as `model_config`, scalars (bools too) under tracker_names, text
    values as text; torch's SummaryWriter, else tensorboardX's."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError("report_to=['tensorboard'] needs `pip install groupwise[tensorboard]`") from e
    import socket
    from datetime import datetime

    folder = os.getenv("TENSORBOARD_LOGGING_DIR") or str(
        Path(output_dir) / "runs" / f"{datetime.now().strftime('%b%d_%H-%M-%S')}_{socket.gethostname()}")
    writer = SummaryWriter(log_dir=os.path.expanduser(folder))
    writer.add_text("args", json.dumps(config, indent=2, default=str))
    if getattr(model, "config", None) is not None and hasattr(model.config, "to_json_string"):
        writer.add_text("model_config", model.config.to_json_string())

    def log(step, metrics):
        for k, v in tracker_names(metrics).items():
            if isinstance(v, (int, float)):
                writer.add_scalar(k, v, step)
            elif isinstance(v, str):
                writer.add_text(k, v, step)
        writer.flush()
    return Opened(log, lambda failed: writer.close())


def wandb_config(config: dict, model=None) -> dict:
    """What transformers' WandbCallback sets as the run's config: the model's config under the training arguments,
    the PEFT config (`peft_config`) and `model/num_parameters`."""
    combined = dict(config)
    if getattr(model, "config", None) is not None:
        model_config = model.config if isinstance(model.config, dict) else model.config.to_dict()
        combined = {**model_config, **combined}
    peft = getattr(model, "peft_config", None)
    if peft is not None:
        peft = {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in peft.items()} if isinstance(peft, dict) \
            else peft
        combined = {"peft_config": peft, **combined}
    try:
        combined["model/num_parameters"] = model.num_parameters()
    except AttributeError:  # no model, or not a transformers model (transformers leaves it out too)
        pass
    return combined


def _wandb(output_dir: str, config: dict, model=None, logging_steps: int = 0):
    """transformers' WandbCallback: a run in $WANDB_PROJECT (default "huggingface"), or the run the user already
    started (wandb.run: its config updated, and left open at the end: it is the user's); the config of wandb_config;
    series under tracker_names against `train/global_step`; the end-of-training values (SUMMARY_ONLY) in the run's
    summary; $WANDB_WATCH as transformers reads it. A run this tracker started is finished at the end of train(),
    with exit code 1 when training failed. $WANDB_LOG_MODEL (model artifacts) is not supported: a warning."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("report_to=['wandb'] needs `pip install groupwise[wandb]`") from e
    if os.getenv("WANDB_LOG_MODEL", "false").lower() in ("end", "checkpoint"):
        warnings.warn(f"WANDB_LOG_MODEL={os.environ['WANDB_LOG_MODEL']} is not supported by groupwise: no model "
                      "artifact is uploaded to wandb (upload output_dir's model yourself, or use push_to_hub)",
                      RuntimeWarning, stacklevel=2)
    combined = wandb_config(config, model)
    mine = wandb.run is None
    if mine:  # WANDB_RESUME, when set, decides; else a run id that exists ($WANDB_RUN_ID) is resumed
        run = wandb.init(project=os.getenv("WANDB_PROJECT", "huggingface"), config=combined,
                         name=config.get("run_name"), resume=os.getenv("WANDB_RESUME") or "allow")
    else:
        run = wandb.run
        run.config.update(combined, allow_val_change=True)
    if getattr(run, "define_metric", None):
        run.define_metric("train/global_step")
        run.define_metric("*", step_metric="train/global_step", step_sync=True)
    watch = os.getenv("WANDB_WATCH", "false")
    if watch in ("all", "parameters", "gradients") and model is not None:
        wandb.watch(model, log=watch, log_freq=max(100, logging_steps))  # transformers': state.logging_steps

    def log(step, metrics):
        for k in SUMMARY_ONLY:
            if k in metrics:
                run.summary[k] = metrics[k]
        run.log({**tracker_names({k: v for k, v in metrics.items() if k not in SUMMARY_ONLY}),
                 "train/global_step": step})
    def close(failed: bool) -> None:
        if mine:
            run.finish(exit_code=1 if failed else 0)

    return Opened(log, close, lambda frame: run.log({"completions": wandb.Table(dataframe=frame)}))


def _trackio(output_dir: str, config: dict, model=None, logging_steps: int = 0):
    """transformers' TrackioCallback: a run named run_name in the project `project` (default "huggingface"), resumed
    when it exists; stored on this machine ($TRACKIO_DIR, default ~/.cache/huggingface/trackio: `trackio show`), or
    in the Space trackio_space_id (its bucket trackio_bucket_id, private as hub_private_repo); the config of
    wandb_config; series under tracker_names with `train/global_step`, the end-of-training values (SUMMARY_ONLY)
    left out as transformers leaves them out; TRL's completions table as a trackio.Table. No static Space is made
    after training or on push (transformers' trackio_static_space_id)."""
    try:
        import trackio
    except ImportError as e:
        raise ImportError("report_to=['trackio'] needs `pip install groupwise[trackio]`") from e
    run = trackio.init(project=config.get("project") or "huggingface", name=config.get("run_name"),
                       space_id=config.get("trackio_space_id"), bucket_id=config.get("trackio_bucket_id"),
                       private=config.get("hub_private_repo"), resume="allow")
    # after init, as transformers: init refuses keys starting with "_", which a model's config has (_name_or_path)
    run.config.update(wandb_config(config, model))

    def log(step, metrics):
        trackio.log({**tracker_names({k: v for k, v in metrics.items() if k not in SUMMARY_ONLY}),
                     "train/global_step": step})

    return Opened(log, lambda failed: trackio.finish(),
                  lambda frame: trackio.log({"completions": trackio.Table(dataframe=frame)}))


# GRPOConfig.report_to: trackers besides metrics.jsonl (always written); TensorBoard with tensorboard or tensorboardX,
# as transformers
TRACKERS = {"tensorboard": Tracker(_tensorboard, ("tensorboard", "tensorboardX")), "wandb": Tracker(_wandb, ("wandb",)),
            "trackio": Tracker(_trackio, ("trackio",))}

# transformers' other report_to integrations: not trackers here (an error saying so)
OTHER_INTEGRATIONS = ("azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "mlflow",
                      "neptune", "swanlab", "kubeflow")


def is_installed(name: str) -> bool:
    import importlib.util

    return any(m in sys.modules or importlib.util.find_spec(m) is not None for m in TRACKERS[name].modules)


def installed_trackers() -> list[str]:
    """report_to="all": the TRACKERS whose package is installed."""
    return [name for name in TRACKERS if is_installed(name)]


def resolve_report_to(value) -> list[str]:
    """report_to as the trackers to open, with transformers' spellings: None or "none" → none, "all" → the installed
    TRACKERS, one name or a list ("none" entries dropped); each known and installed, else a ConfigError."""
    if value == "all" or value == ["all"]:
        return installed_trackers()
    if not (value is None or isinstance(value, (str, list, tuple))):
        raise ConfigError(f"report_to={value!r} must be a tracker name or a list of them (or 'none' / 'all')")
    given = [value] if isinstance(value, str) or value is None else list(value)
    names = [name for name in given if name not in ("none", None)]
    for name in names:
        if name in OTHER_INTEGRATIONS:
            raise ConfigError(f"report_to={name!r}: groupwise reports to {list(TRACKERS)} only (and always writes "
                              f"output_dir/metrics.jsonl); drop {name!r} from report_to")
        if name not in TRACKERS:
            raise ConfigError(f"report_to={name!r} is not one of {['none', 'all', *TRACKERS]}")
    check_trackers(names)
    return names


def check_trackers(report_to: list[str]) -> None:
    """Before anything loads: every tracker asked for is installed."""
    for name in report_to:
        if not is_installed(name):
            raise ConfigError(f"report_to={name!r} needs `pip install groupwise[{name}]` (or drop it from report_to)")

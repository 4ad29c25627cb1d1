"""`groupwise train [CONFIG.yaml] [--field value …]` — fields as in GRPOConfig plus the run fields below.

Run fields: model_name_or_path, dataset_name (a .jsonl/.json/.csv/.parquet file, a saved dataset folder,
`builtin:<task>` or a hub name), dataset_split, eval_dataset_name, eval_split, reward_funcs (list of
`package.module:function` paths or reward-model paths), process_reward_funcs (step-reward functions). With no config and no model, `groupwise train` runs the
built-in demo; `groupwise train builtin:<task> [--field value …]` runs that built-in task's demo
(groupwise.demo.DEMOS: arithmetic, calculator).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

import yaml

from groupwise.checkpoint import CheckpointError, claim_output_dir, resume_folder
from groupwise.config import ConfigError, GRPOConfig, load_yaml
from groupwise.config_base import check_location, check_model_location, reject_unknown
from groupwise.rewards.process import resolve_process_spec
from groupwise.rewards.sources import resolve_spec

RUN_FIELDS = {
    "model_name_or_path": "Policy: a local folder or hub id loadable with AutoModelForCausalLM.",
    "dataset_name": "Prompts: .jsonl/.json/.csv/.parquet file, a save_to_disk folder, builtin:<task> or a hub name.",
    "dataset_split": "Split of dataset_name (default 'train').",
    "eval_dataset_name": "Evaluation prompts, same forms as dataset_name.",
    "eval_split": "Split of eval_dataset_name (default 'test': for a built-in task with splits its held-out problems; builtin:toy has none).",
    "reward_funcs": "List of 'package.module:function' paths or reward-model paths (builtin tasks bring theirs).",
    "process_reward_funcs": "List of step-reward sources (supervision process / both): 'package.module:function' paths, PRM folders written by `groupwise prm train`, or {path: …, kind: …} mappings.",
}


def parse_overrides(tokens: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, bare `--flag` (= true); values parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}: fields are given as --name value")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value, i = tokens[i + 1], i + 1
            else:
                value = "true"
        try:
            out[key.replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError:  # not a YAML scalar or list (e.g. a control character): the plain string
            out[key.replace("-", "_")] = value
        i += 1
    return out


def builtin_task(name: str):
    """The task module of `builtin:<task>` (groupwise.tasks.TASKS), or None for any other dataset name."""
    if not name.startswith("builtin:"):
        return None
    from groupwise.tasks import TASKS

    task = name.split(":", 1)[1]
    if task not in TASKS:
        raise ConfigError(f"dataset_name={name!r}: unknown built-in task; choose from {sorted(TASKS)}")
    return TASKS[task]


def run_builtin_demo(name: str, values: dict[str, Any]) -> int:
    """`groupwise train builtin:<task> [--field value …]`: the demo of a built-in task (groupwise.demo.DEMOS), with
    any GRPOConfig field overridden; run fields (model, dataset, rewards) belong to the demo."""
    from groupwise.demo import DEMOS, run_demo

    task = name.split(":", 1)[1]
    if task not in DEMOS:
        raise ConfigError(f"{name!r}: no built-in demo of that name; choose from "
                          f"{['builtin:' + t for t in sorted(DEMOS)]}, or give a config with dataset_name: {name}")
    given = sorted(set(values) & set(RUN_FIELDS))
    if given:
        raise ConfigError(f"{given[0]} cannot be set for {name!r}, which brings its own policy, data and rewards; "
                          f"write a config with dataset_name: {name} and model_name_or_path instead")
    return run_demo(values, task)


def load_dataset_spec(name: str, split: str | None, *, default: str = "train"):
    """The rows of dataset_name / eval_dataset_name: `split` as given, or `default` (train for training, test for
    evaluation) where the dataset has splits."""
    task = builtin_task(name)
    if task is not None:  # arithmetic and calculator have train/test splits (by a hash of the problem); toy has none
        if "split" not in inspect.signature(task.dataset).parameters:
            if split is not None:
                raise ConfigError(f"{name!r} has no train/test split: leave dataset_split / eval_split unset "
                                  "(its rows are the same either way)")
            return task.dataset()
        split = split or default
        if split not in ("train", "test"):
            raise ConfigError(f"split {split!r} of {name!r}: built-in tasks have the splits 'train' and 'test'")
        return task.dataset(split=split)
    import datasets

    path = Path(name)
    if path.is_dir():
        data = datasets.load_from_disk(str(path))
        return data[split or default] if isinstance(data, datasets.DatasetDict) else data
    if path.is_file():
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise ConfigError(f"dataset_name={name!r}: unsupported file type {path.suffix!r}")
        if path.stat().st_size == 0:
            raise ConfigError(f"dataset {name!r} is empty: give a file with at least one row")
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    return datasets.load_dataset(name, split=split or default)


def build_run(values: dict[str, Any]):
    """Split a flat mapping into run fields and a GRPOConfig (validated before anything loads)."""
    known = set(RUN_FIELDS) | {f.name for f in dataclasses.fields(GRPOConfig)}
    reject_unknown(values, known | set(GRPOConfig.UNSUPPORTED), owner="groupwise train")
    run = {k: values[k] for k in RUN_FIELDS if k in values}
    for key in ("reward_funcs", "process_reward_funcs"):  # one spec given as a string is a list of one
        if isinstance(run.get(key), str):
            run[key] = [run[key]]
        elif run.get(key) is not None and not isinstance(run[key], list):
            raise ConfigError(f"{key}={run[key]!r}: give a list of 'package.module:function' paths or reward-model "
                              "paths (or one as a string)")
    args = GRPOConfig(**{k: v for k, v in values.items() if k not in RUN_FIELDS})
    return run, args


def cmd_train(argv: list[str]) -> int:
    if argv and argv[0].startswith("builtin:"):  # a built-in task's demo: its shipped policy, data and rewards
        return run_builtin_demo(argv[0], parse_overrides(argv[1:]))
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    values = load_yaml(config_path) if config_path else {}
    values.update(parse_overrides(argv[1:] if config_path else argv))
    if "model_name_or_path" not in values:
        given = sorted(set(values) & set(RUN_FIELDS))
        if given:
            raise ConfigError(f"{given[0]} is set but model_name_or_path is not: give the policy as "
                              "model_name_or_path (without one, `groupwise train` runs the built-in demo)")
        from groupwise.demo import run_demo

        return run_demo(values)
    run, args = build_run(values)
    # everything that names a file is checked before anything loads
    check_model_location(run["model_name_or_path"], "model_name_or_path")
    dataset_name = run.get("dataset_name")
    if not dataset_name:
        raise ConfigError("dataset_name is required (a prompt file, a dataset folder, builtin:<task> or a hub name)")
    for field in ("dataset_name", "eval_dataset_name"):
        if run.get(field) and builtin_task(run[field]) is None:
            check_location(run[field], field)
    for i, spec in enumerate(run.get("reward_funcs") or []):
        resolve_spec(spec, f"reward_funcs[{i}]")
    for i, spec in enumerate(run.get("process_reward_funcs") or []):
        resolve_process_spec(spec, f"process_reward_funcs[{i}]")
    if not args.resume_from_checkpoint and not args.overwrite_output_dir:
        claim_output_dir(args.output_dir, overwrite=False)  # refuses only; deleting is the trainer's, on one process
    resume_folder(args.resume_from_checkpoint, args.output_dir)  # a checkpoint that is not there, named now
    train_data = load_dataset_spec(dataset_name, run.get("dataset_split"))
    eval_data = None
    if run.get("eval_dataset_name"):
        eval_data = load_dataset_spec(run["eval_dataset_name"], run.get("eval_split"), default="test")
    task = builtin_task(dataset_name)  # a built-in task brings its reward (and step-reward) functions
    reward_funcs = run.get("reward_funcs") or (task.REWARD_FUNCS if task else None)
    process_funcs = run.get("process_reward_funcs") or None
    if not process_funcs and task is not None and args.supervision != "outcome":
        process_funcs = getattr(task, "PROCESS_REWARD_FUNCS", None)
    # a task whose environment owns its rewards (get_reward, get_step_rewards) brings it: TRL's environment_factory
    environment_factory = getattr(task, "ENVIRONMENT_FACTORY", None)
    if not reward_funcs and args.supervision != "process" and environment_factory is None:
        raise ConfigError("reward_funcs is required: a list of 'package.module:function' paths or reward-model paths")
    from groupwise.trainer import GRPOTrainer

    trainer = GRPOTrainer(run["model_name_or_path"], reward_funcs or [], args=args, train_dataset=train_data,
                          eval_dataset=eval_data, process_reward_funcs=process_funcs,
                          environment_factory=environment_factory)
    trainer.train()
    return 0


def cmd_prm_train(argv: list[str]) -> int:
    from groupwise.prm_train import PRMTrainConfig, train_prm

    if any(a in ("-h", "--help") for a in argv):  # the fields, as `groupwise fields` lists GRPOConfig's
        print("usage: groupwise prm train [CONFIG.yaml] [--field value …]; fields (PRMTrainConfig):")
        for name, help_text, default, _ in PRMTrainConfig.describe():
            print(f"{name:32s} {help_text} (default {default!r})")
        return 0
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    values = load_yaml(config_path) if config_path else {}
    values.update(parse_overrides(argv[1:] if config_path else argv))
    train_prm(PRMTrainConfig(**values))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a configuration or input error (one line naming the field or file; --debug for the
    traceback); 1 the run stopped on an error of its own (a reward function, non-finite steps, another process);
    130 / 143 stopped by SIGINT / SIGTERM (after writing a checkpoint when save_on_interrupt)."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return _main(argv)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        if debug:
            raise
        print(f"groupwise: configuration error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 — a stopped run: one line, the traceback with --debug
        from groupwise.distributed import ProcessFailed
        from groupwise.rewards import RewardFunctionError
        from groupwise.trainer import TrainingInterrupted, TrainingStopped

        if isinstance(e, TrainingInterrupted) and not debug:
            print(f"groupwise: {e}", file=sys.stderr)
            return 128 + int(e.signum)
        if debug or not isinstance(e, (RewardFunctionError, TrainingStopped, ProcessFailed)):
            raise
        print(f"groupwise: run stopped: {e}", file=sys.stderr)
        return 1


def cmd_export(argv: list[str]) -> int:
    """`groupwise export CHECKPOINT --merge OUT [--base BASE]`: the checkpoint's model, from_pretrained-loadable, in
    OUT: a LoRA checkpoint is merged into its base model (the one the adapter names, or --base)."""
    parser = argparse.ArgumentParser(prog="groupwise export")
    parser.add_argument("checkpoint", help="a checkpoint-N folder")
    parser.add_argument("--merge", required=True, metavar="OUT", help="folder to write the merged model to")
    parser.add_argument("--base", default=None, help="base model of a LoRA checkpoint (default: the adapter's)")
    parser.add_argument("--trust_remote_code", action="store_true")
    ns = parser.parse_args(argv)
    from groupwise.adapters import export_merged

    out = export_merged(ns.checkpoint, ns.merge, base=ns.base, trust_remote_code=ns.trust_remote_code)
    print(f"groupwise: wrote {out}")
    return 0


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="groupwise", description="GRPO with outcome and process supervision")
    parser.add_argument("command", choices=["train", "prm", "export", "fields"],
                        help="train: run GRPO; prm train: train a process reward model; export CHECKPOINT --merge OUT: "
                             "a checkpoint as a standalone model (LoRA merged into its base); fields: list config fields")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return cmd_train(rest)
    if command == "prm":
        if not rest or rest[0] != "train":
            parser.error("usage: groupwise prm train CONFIG.yaml [--field value …]")
        return cmd_prm_train(rest[1:])
    if command == "export":
        return cmd_export(rest)
    if command == "fields":
        for k, v in RUN_FIELDS.items():
            print(f"{k:32s} {v}")
        for name, help_text, default, choices in GRPOConfig.describe():
            print(f"{name:32s} {help_text} (default {default!r})")
            for choice in choices:
                print(f"{'':34s}- {choice}")
        return 0
    parser.error(f"unknown command {command!r}")
    return 2

if __name__ == "__main__":
    raise SystemExit(main())

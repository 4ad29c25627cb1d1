"""`groupwise train [CONFIG.yaml] [--field value …]` — the role of `trl grpo --config CONFIG.yaml`: GRPOConfig's
fields plus the run fields of groupwise.script_args (TRL's ScriptArguments / ModelConfig / DatasetMixtureConfig names:
model_name_or_path, dataset_name, reward_funcs, …). With no config and no model, `groupwise train` runs the
built-in demo; `groupwise train builtin:<task> [--field value …]` runs that built-in task's demo
(groupwise.demo.DEMOS: arithmetic, calculator).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import sys
from typing import Any

from groupwise.checkpoint import CheckpointError, claim_output_dir, resume_folder
from groupwise.cli_args import parse_overrides, read_config
from groupwise.config import ConfigError, GRPOConfig
from groupwise.config_base import check_location, check_model_location, reject_unknown
from groupwise.core.supervision import SUPERVISIONS
from groupwise.logging import EVAL_COMPLETIONS
from groupwise.rewards.process import resolve_process_spec
from groupwise.rewards.sources import resolve_spec
from groupwise.quantization import QUANTIZATION, QUANTIZATION_FIELDS, from_script_fields
from groupwise.script_args import (ALIASES, RUN_FIELDS, builtin_task, check_run_fields, load_dataset_spec,
                                   eval_rows_named, load_run_datasets, model_init_kwargs, reward_specs)

__all__ = ["RUN_FIELDS", "build_run", "builtin_task", "load_dataset_spec", "main", "parse_overrides"]

TRAIN_USAGE = """usage: groupwise train [CONFIG.yaml | --config CONFIG.yaml] [--field value …] [--debug]
       groupwise train builtin:<task> [--field value …]      (a built-in task's demo: arithmetic, calculator)
       groupwise train [--field value …]                     (no model_name_or_path: the built-in demo)

Fields: every GRPOConfig field (`groupwise fields` lists them with help and defaults) and the run fields below,
from CONFIG.yaml (YAML values; its env: mapping sets environment variables first, as TRL) and the command line
(which wins; each value read by its field's type, as TRL's parser: text stays text, booleans true/false, yes/no,
t/f, y/n, 1/0): --field value, --field=value, --flag (true), --no_flag (false), --field a b c (a list).
Exit codes: 0 done, 2 a configuration or input error, 1 the run stopped on an error."""

def run_builtin_demo(name: str, values: dict[str, Any]) -> int:
    """`groupwise train builtin:<task> [--field value …]`: the demo of a built-in task (groupwise.demo.DEMOS), with
    any GRPOConfig field overridden; run fields (model, dataset, rewards) belong to the demo."""
    from groupwise.demo import DEMOS, run_demo

    task = name.split(":", 1)[1]
    if task not in DEMOS:
        from groupwise.tasks import TASKS

        hint = (f", or give a config with dataset_name: {name} (a built-in task without a demo)"
                if task in TASKS else "")
        raise ConfigError(f"{name!r}: no built-in demo of that name; choose from "
                          f"{['builtin:' + t for t in sorted(DEMOS)]}{hint}")
    given = sorted(set(values) & (set(RUN_FIELDS) | set(QUANTIZATION)))
    if given:
        raise ConfigError(f"{given[0]} cannot be set for {name!r}, which brings its own policy, data and rewards; "
                          f"write a config with dataset_name: {name} and model_name_or_path instead")
    return run_demo(values, task)


# GRPOTrainer's Python arguments a config file cannot give (they are objects), and what to do instead
_IN_PYTHON = "pass it to GRPOTrainer(...) in a Python script (docs/agents.md)"
TRAINER_ARGUMENTS = {
    "tools": f"tools are Python functions: {_IN_PYTHON}, or use a built-in task that brings its own "
             "(dataset_name: builtin:calculator)",
    "environment_factory": f"an environment is a Python class: {_IN_PYTHON}, or use a built-in task that brings "
                           "its own (dataset_name: builtin:calculator)",
    "rollout_func": "a rollout function is Python code: pass it to GRPOTrainer(rollout_func=...) in a script",
    "callbacks": "callbacks are Python objects: pass them to GRPOTrainer(callbacks=[...]) in a script",
    "peft_config": "give LoRA as use_peft: true with lora_r / lora_alpha / lora_target_modules (TRL's fields)",
}
# keys of the `trl` command's launcher (TRL's CLI turns them into an accelerate launch); groupwise train runs in the
# process it is started in
LAUNCH_KEYS = ("accelerate_config", "num_processes")


def build_run(values: dict[str, Any], owner: str = "groupwise train"):
    """Split a flat mapping into the run fields (checked, TRL's defaults filled in) and a GRPOConfig (validated before
    anything loads), whose model_init_kwargs gain model_revision / attn_implementation / dtype (TRL's grpo script)."""
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    for name in values:
        if name in TRAINER_ARGUMENTS:
            raise ConfigError(f"{name} is an argument of GRPOTrainer, not a config field: {TRAINER_ARGUMENTS[name]}")
        if name in LAUNCH_KEYS:
            raise ConfigError(f"{name} is a key of the trl command's launcher, not a config field: launch with "
                              "accelerate: accelerate launch --num_processes N [--config_file accelerate.yaml] -m "
                              "groupwise train config.yaml (README, Multi-process)")
    reject_unknown(values, set(RUN_FIELDS) | set(QUANTIZATION) | fields | set(GRPOConfig.UNSUPPORTED), owner=owner)
    run = check_run_fields({k: values[k] for k in RUN_FIELDS if k in values})
    run["quantization_config"] = from_script_fields(values, run["dtype"])  # TRL's get_quantization_config
    args = GRPOConfig(**{k: v for k, v in values.items() if k not in RUN_FIELDS and k not in QUANTIZATION})
    args.model_init_kwargs = model_init_kwargs(run, args.model_init_kwargs)
    return run, args


def cmd_train(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        return print_lines([TRAIN_USAGE + "\n\nrun fields:"] + [
            f"  {name:28s} {help_text}" + (f" (default {default!r})" if default is not None else "")
            for name, (_, default, help_text) in {**RUN_FIELDS, **QUANTIZATION_FIELDS}.items()])
    if argv and argv[0].startswith("builtin:"):  # a built-in task's demo: its shipped policy, data and rewards
        return run_builtin_demo(argv[0], parse_overrides(argv[1:]))
    values = read_values(argv)
    if "model_name_or_path" not in values:
        given = sorted(set(values) & (set(RUN_FIELDS) | set(QUANTIZATION)))
        if given:
            raise ConfigError(f"{given[0]} is set but model_name_or_path is not: give the policy as "
                              "model_name_or_path (without one, `groupwise train` runs the built-in demo)")
        from groupwise.demo import run_demo

        return run_demo(values)
    trainer, args = build_trainer(values)
    with running("training"):
        trainer.train()
    if not args.push_to_hub:  # with it, train() ended by saving the final model to output_dir and uploading it
        trainer.save_model(args.output_dir)  # the trained model in output_dir, as TRL's grpo script leaves it
    return 0


class FileMissingInRun(RuntimeError):
    """A file went missing while the run ran (its inputs were checked before it began): the run stopped (exit 1),
    not a configuration error (exit 2)."""


@contextlib.contextmanager
def running(what: str):
    """Errors raised once `what` has begun are the run's: a FileNotFoundError there is not a configuration error."""
    try:
        yield
    except FileNotFoundError as e:
        missing = FileMissingInRun(f"{e} (during {what}: a file the run uses went missing)")
        if getattr(e, "groupwise_shared", False):  # raised on every process (groupwise.distributed.shared)
            missing.groupwise_shared = True
        raise missing from e


def read_values(argv: list[str]) -> dict[str, Any]:
    """The config file's values under the command line's (which win; both names of an aliased field included)."""
    values, overrides = read_config(argv)
    for pair in ALIASES:  # one field's two names (dtype / torch_dtype): the command line wins over the file too
        if any(name in overrides for name in pair):
            values = {k: v for k, v in values.items() if k not in pair}
    return {**values, **overrides}


def importable_here() -> None:
    """Reward and step-reward modules of the working directory import ('mymodule:fn'), as in TRL (and `python -m`)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def build_trainer(values: dict[str, Any], *, evaluation: bool = False):
    """The GRPOTrainer a run's fields describe, everything they name checked before anything loads: its model,
    datasets (TRL's grpo script's choice of train and evaluation rows), reward and step-reward functions. With
    `evaluation` (groupwise eval): the evaluation rows are required, and output_dir is not claimed (nothing trains)."""
    run, args = build_run(values, owner="groupwise eval" if evaluation else "groupwise train")
    # everything that names a file is checked before anything loads
    model, processing_class = run["model_name_or_path"], None
    adapter = evaluation and os.path.isfile(os.path.join(os.path.expanduser(model), "adapter_config.json"))
    check_model_location(model, "model_name_or_path", policy=not adapter)  # eval reads an adapter over its base
    dataset_name = run["dataset_name"]
    if not dataset_name and not run["datasets"] and not (evaluation and run["eval_dataset_name"]):
        raise ConfigError("dataset_name is required (a prompt file, a dataset folder, builtin:<task> or a hub name), "
                          "or TRL's datasets: mixture")
    unread = {"dataset_name"} if run["datasets"] or evaluation and eval_rows_named(run) else set()
    for field in ("dataset_name", "eval_dataset_name"):  # a mixture wins: dataset_name is ignored (TRL warns)
        if run[field] and field not in unread and builtin_task(run[field]) is None:
            check_location(run[field], field)
    importable_here()
    specs = reward_specs(run)
    shift = 1 if run["reward_model_name_or_path"] else 0  # the reward model comes first among the specs
    for i, spec in enumerate(specs):
        where = "reward_model_name_or_path" if i < shift else f"reward_funcs[{i - shift}]"
        resolve_spec(spec, where)
    for i, spec in enumerate(run["process_reward_funcs"] or []):
        resolve_process_spec(spec, f"process_reward_funcs[{i}]")
    if evaluation:
        args.push_to_hub = False  # a training config's uploads are not an evaluation's (nor its token check)
        args.log_completions_hub_repo = None
    else:
        if not args.resume_from_checkpoint and not args.overwrite_output_dir:
            claim_output_dir(args.output_dir, overwrite=False)  # refuses only; the trainer deletes, on one process
        resume_folder(args.resume_from_checkpoint, args.output_dir)  # a checkpoint that is not there, named now
    train_data, eval_data = load_run_datasets(run, args, evaluation=evaluation)
    # the task whose rewards train (and evaluate); `groupwise eval` without dataset_name: its eval rows' task
    named = dataset_name or (run["eval_dataset_name"] if evaluation else None)
    task = builtin_task(named) if named and not run["datasets"] else None
    reward_funcs = specs or (task.REWARD_FUNCS if task else None)  # a built-in task brings its reward functions
    process_funcs = run["process_reward_funcs"] or None
    if not process_funcs and task is not None and SUPERVISIONS[args.supervision].process:
        process_funcs = getattr(task, "PROCESS_REWARD_FUNCS", None)
    # a task whose environment owns its rewards (get_reward, get_step_rewards) brings it: TRL's environment_factory
    environment_factory = getattr(task, "ENVIRONMENT_FACTORY", None)
    if environment_factory is None:  # the files named, not the trainer's train_dataset / eval_dataset arguments
        source = "datasets (the mixture)" if run["datasets"] else f"dataset_name={dataset_name!r}"
        named_rows = [(eval_data, f"eval_dataset_name={run['eval_dataset_name']!r}" if run["eval_dataset_name"]
                       else f"{source}'s evaluation rows")]
        for data, where in ([] if evaluation else [(train_data, source)]) + named_rows:
            columns = getattr(data, "column_names", None)
            if columns is not None and "prompt" not in columns:
                raise ConfigError(f"{where} has no 'prompt' column (columns: {columns}): rename the column holding "
                                  "the prompts to 'prompt'")
    if not reward_funcs and SUPERVISIONS[args.supervision].outcome and environment_factory is None:
        raise ConfigError("reward_funcs is required: a list of 'package.module:function' paths or reward-model paths")
    from groupwise.trainer import GRPOTrainer

    if adapter:
        from groupwise.adapters import load_adapter_checkpoint

        model, processing_class = load_adapter_checkpoint(os.path.expanduser(model), args, run["quantization_config"])
        args.model_init_kwargs, args.use_peft = None, False  # read by the loading above: the adapter is the run's
    trainer = GRPOTrainer(model, reward_funcs or [], args=args, train_dataset=train_data, eval_dataset=eval_data,
                          processing_class=processing_class, process_reward_funcs=process_funcs,
                          environment_factory=environment_factory,
                          quantization_config=None if adapter else run["quantization_config"])  # adapter: loaded
    if dataset_name and not run["datasets"] and task is None and not os.path.exists(os.path.expanduser(dataset_name)):
        trainer._card_defaults = {"dataset_name": dataset_name}  # a hub dataset: its card names it, as TRL's script's
    return trainer, args


EVAL_USAGE = """usage: groupwise eval [CONFIG.yaml | --config CONFIG.yaml] [--field value …]

Evaluates model_name_or_path (a trained output_dir, a checkpoint-N folder, a LoRA run's adapter folder over its
base, a hub id) as training's evaluation does (trainer.evaluate()): the run's reward and step-reward functions over
its evaluation rows — eval_dataset_name (eval_split), else dataset_name's dataset_test_split — greedy and one
completion per prompt, or num_generations_eval sampled ones (rewards/<func>/mean@k, pass@k). The same config and
fields as `groupwise train` (training-only fields are read and not used; nothing is pushed). Prints the eval_*
metrics and writes them to output_dir/eval_results.json (and all_results.json, as transformers' save_metrics), and
every completion to output_dir/eval_completions.jsonl (index, sample, prompt, completion, each reward function's
value, reward, step rewards; appended to, one run id per call).
Exit codes: 0 done, 2 a configuration or input error, 1 an error while evaluating."""


def cmd_eval(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        return print_lines([EVAL_USAGE])
    values = read_values(argv)
    if "model_name_or_path" not in values:
        raise ConfigError("groupwise eval needs model_name_or_path: the model to evaluate (a trained output_dir, a "
                          "checkpoint-N folder or a hub id)")
    trainer, args = build_trainer(values, evaluation=True)
    with running("evaluation"):
        metrics = trainer.evaluate()
    trainer.save_metrics("eval", metrics)  # eval_results.json (and all_results.json), as transformers' Trainer
    if trainer.dist.is_main:
        path = os.path.join(args.output_dir, "eval_results.json")
        print_lines([f"{k:40s} {v:.6g}" if isinstance(v, float) else f"{k:40s} {v}" for k, v in sorted(metrics.items())]
                    + [f"groupwise: wrote {path} and {os.path.join(args.output_dir, EVAL_COMPLETIONS)}"])
    return 0


def cmd_prm(sub: str, argv: list[str]) -> int:
    """groupwise prm train | eval: a config of PRMTrainConfig's / PRMEvalConfig's fields."""
    from groupwise.prm_eval import PRMEvalConfig, evaluate_scorer
    from groupwise.prm_train import PRMTrainConfig, train_prm

    config = PRMTrainConfig if sub == "train" else PRMEvalConfig
    if any(a in ("-h", "--help") for a in argv):  # the fields, as `groupwise fields` lists GRPOConfig's
        return print_lines([f"usage: groupwise prm {sub} [CONFIG.yaml | --config CONFIG.yaml] [--field value …]; "
                            "the config's env: mapping sets environment variables first (as in groupwise train); "
                            f"fields ({config.__name__}):"] + [f"{name:32s} {help_text} (default {default!r})"
                                                               for name, help_text, default, _ in config.describe()])
    values, overrides = read_config(argv, config.field_types())
    cfg = config(**{**values, **overrides})
    importable_here()
    if sub == "train":
        train_prm(cfg)
        return 0
    with running("PRM evaluation"):
        metrics = evaluate_scorer(cfg)
    return print_lines([f"{k:32s} {v:.6g}" for k, v in sorted(metrics.items())]
                       + ([f"groupwise: wrote {cfg.output_file}"] if cfg.output_file else []))


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a configuration or input error (one line naming the field or file; --debug for the
    traceback); 1 the run stopped on an error of its own (a reward function, non-finite steps, another process);
    130 / 143 stopped by SIGINT / SIGTERM (after writing a checkpoint when save_on_interrupt)."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    after = argv[argv.index("--debug") + 1] if debug and argv.index("--debug") + 1 < len(argv) else None
    argv = [a for a in argv if a != "--debug"]
    try:
        if after is not None and set(after.split()) <= DEBUG_MODES:  # TRL's --debug field with a value
            raise ConfigError(f"--debug {after!r}: --debug takes no value here (it shows the traceback of an error); "
                              "TRL's debug field (transformers' debug modes) is not supported by groupwise")
        return _main(argv)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        from groupwise.distributed import mark_failed

        mark_failed(e)  # an error of this process alone: its exit does not wait for the others (they may be elsewhere)
        if debug:  # the traceback, and the same exit code
            import traceback

            traceback.print_exc()
        print(f"groupwise: configuration error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 — a stopped run: one line, the traceback with --debug
        from groupwise.distributed import ProcessFailed, mark_failed
        from groupwise.rewards import RewardFunctionError
        from groupwise.signals import TrainingInterrupted
        from groupwise.trainer import TrainingStopped

        if isinstance(e, TrainingInterrupted) and not debug:
            print(f"groupwise: {e}", file=sys.stderr)
            return 128 + int(e.signum)
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if debug or not (full or isinstance(e, (RewardFunctionError, TrainingStopped, ProcessFailed,
                                                FileMissingInRun))):
            raise  # the interpreter reports it (and teardown reads it at exit)
        mark_failed(e)
        if full:  # a save stopped by a full disk: checkpoints are written aside and renamed, the last one is whole
            print(f"groupwise: run stopped: {e}: free space there, then resume with resume_from_checkpoint=True "
                  "(the last complete checkpoint-N is intact; a .tmp-checkpoint-N folder the failed save left is "
                  "removed then)", file=sys.stderr)
            return 1
        print(f"groupwise: run stopped: {e}", file=sys.stderr)
        return 1


DEBUG_MODES = {"underflow_overflow", "tpu_metrics_debug"}  # transformers' DebugOption values (TRL's debug field)


def print_lines(lines: list[str]) -> int:
    """Print a listing; `groupwise fields | head`: the reader left, no traceback. Returns 0."""
    try:
        print("\n".join(lines))
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_export(argv: list[str]) -> int:
    """`groupwise export CHECKPOINT --merge OUT [--base BASE]`: the checkpoint's model, from_pretrained-loadable, in
    OUT: a LoRA checkpoint is merged into its base model (the one the adapter names, or --base)."""
    parser = argparse.ArgumentParser(prog="groupwise export")
    parser.add_argument("checkpoint", help="a checkpoint-N folder")
    parser.add_argument("--merge", required=True, metavar="OUT", help="folder to write the merged model to")
    parser.add_argument("--base", default=None,
                        help="base model of a LoRA checkpoint (default: the adapter's): a folder, hub id or local .gguf file")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the merged weights' dtype (default auto: the base's stored one; a LoRA update smaller "
                             "than 16-bit weights' precision rounds away in them, and a warning says how much)")
    parser.add_argument("--trust_remote_code", action="store_true")
    ns = parser.parse_args(argv)
    from groupwise.export import export_merged

    out = export_merged(ns.checkpoint, ns.merge, base=ns.base, trust_remote_code=ns.trust_remote_code, dtype=ns.dtype)
    print(f"groupwise: wrote {out}")
    return 0


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="groupwise", description="GRPO with outcome and process supervision")
    parser.add_argument("command", choices=["train", "eval", "prm", "export", "fields"],
                        help="train: run GRPO; eval: evaluate a model as training's evaluation does (groupwise eval "
                             "--help); prm train / prm eval: train a process reward model, or score one against step "
                             "labels; export CHECKPOINT --merge OUT: a checkpoint as a standalone model (LoRA merged "
                             "into its base); fields: list config fields")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":  # the demo is `groupwise train` without a model
        parser.error("the demo is `groupwise train` (no config: the built-in arithmetic demo; `groupwise train "
                     "builtin:calculator` for the tool-calling one), or `make demo`")
    if command == "train":
        return cmd_train(rest)
    if command == "prm":
        usage = ("usage: groupwise prm train|eval [CONFIG.yaml | --config CONFIG.yaml] [--field value …] (train: a "
                 "process reward model; eval: a PRM or step-reward function against step labels; groupwise prm "
                 "train --help / prm eval --help: the fields)")
        if rest and rest[0] in ("-h", "--help"):
            print(usage)
            return 0
        if not rest or rest[0] not in ("train", "eval"):
            parser.error(usage)
        return cmd_prm(rest[0], rest[1:])
    if command == "eval":
        return cmd_eval(rest)
    if command == "export":
        return cmd_export(rest)
    if command == "fields":
        if rest and rest[0] in ("-h", "--help"):
            print("usage: groupwise fields: every field of `groupwise train` (run fields, then GRPOConfig's) with "
                  "its help and default")
            return 0
        if rest:
            parser.error(f"groupwise fields takes no arguments, got {rest}")
        lines = [f"{name:32s} {help_text} (default {default!r})"
                 for name, (_, default, help_text) in {**RUN_FIELDS, **QUANTIZATION_FIELDS}.items()]
        for name, help_text, default, choices in GRPOConfig.describe():
            lines += [f"{name:32s} {help_text} (default {default!r})"] + [f"{'':34s}- {c}" for c in choices]
        return print_lines(lines)
    import difflib

    commands = ("train", "demo", "eval", "export", "prm", "fields")
    near = difflib.get_close_matches(command, commands, n=1)
    hint = ("; TRL's `trl grpo --config X` is `groupwise train X`" if command == "grpo" else
            f"; did you mean {near[0]!r}?" if near else f" (commands: {', '.join(commands)})")
    parser.error(f"unknown command {command!r}{hint}")
    return 2

if __name__ == "__main__":
    raise SystemExit(main())

"""`groupwise train`'s run fields besides GRPOConfig, and the datasets they name.

TRL's `trl grpo` reads four dataclasses: ScriptArguments (dataset_name, dataset_config, dataset_train_split,
dataset_test_split, dataset_streaming), ModelConfig (model_name_or_path, model_revision, dtype, attn_implementation,
the LoRA fields — GRPOConfig fields here — and the bitsandbytes ones), DatasetMixtureConfig (datasets, streaming,
test_split_size) and GRPOScriptArguments (reward_funcs, reward_model_name_or_path). Each is a run field here with
TRL's name, default and meaning, beside groupwise's own (dataset_split, eval_dataset_name, eval_split,
process_reward_funcs). As in TRL: model_revision / dtype / attn_implementation become model_init_kwargs (which win
where both say), a `datasets:` mixture wins over dataset_name, and with eval_strategy ≠ 'no' the evaluation rows
are dataset_name's dataset_test_split (or the test_split_size share of the mixture) unless eval_dataset_name is set.
"""

from __future__ import annotations

import difflib
import inspect
import re
from pathlib import Path
from typing import Any

from groupwise.config_base import ConfigError, check_location, coerce, reject_unknown, warn_user
from groupwise.loading import MODEL_DTYPES

# name: (annotation, default, help); the annotation is checked as GRPOConfig checks its fields (config_base.coerce)
RUN_FIELDS: dict[str, tuple[str, Any, str]] = {
    "model_name_or_path": ("str | None", None, "Policy: a local folder or hub id loadable with AutoModelForCausalLM (TRL ModelConfig)."),
    "model_revision": ("str", "main", "Branch, tag or commit of a hub model (TRL ModelConfig; model_init_kwargs['revision'])."),
    "dtype": ("str | None", "float32", "dtype the policy loads in: 'auto' (the checkpoint's), 'bfloat16', 'float16', 'float32' (TRL ModelConfig's default; model_init_kwargs['dtype'])."),
    "torch_dtype": ("str | None", None, "transformers' former name for dtype (a groupwise alias: TRL's script does not read it)."),
    "attn_implementation": ("str | None", None, "Attention implementation, e.g. 'sdpa', 'eager', 'flash_attention_2' (TRL ModelConfig; model_init_kwargs)."),
    "dataset_name": ("str | None", None, "Prompts: .jsonl/.json/.csv/.parquet/.arrow file, a save_to_disk folder, a folder of data files, builtin:<task> or a hub name."),
    "dataset_config": ("str | None", None, "Configuration (load_dataset's name=) of dataset_name (TRL ScriptArguments)."),
    "dataset_split": ("str | None", None, "Split of dataset_name to train on (default 'train'); TRL's name: dataset_train_split."),
    "dataset_train_split": ("str", "train", "TRL's name for dataset_split."),
    "dataset_test_split": ("str", "test", "Split of dataset_name evaluated when eval_strategy ≠ 'no' and eval_dataset_name is not set (TRL ScriptArguments)."),
    "dataset_streaming": ("bool", False, "Read dataset_name as a stream (an IterableDataset; needs max_steps) (TRL ScriptArguments)."),
    "datasets": ("list | None", None, "TRL's dataset mixture: a list of {path, name, data_dir, data_files, split, columns, fraction}, concatenated (fraction: each one's share); wins over dataset_name."),
    "streaming": ("bool", False, "Read the datasets mixture as a stream (TRL DatasetMixtureConfig)."),
    "test_split_size": ("float | None", None, "Hold out this share (< 1) or number of rows of the datasets: mixture, seeded, as the evaluation rows (TRL DatasetMixtureConfig; no effect without a mixture, as in TRL)."),
    "eval_dataset_name": ("str | None", None, "Evaluation prompts, same forms as dataset_name."),
    "eval_split": ("str | None", None, "Split of eval_dataset_name (default 'test': for a built-in task with splits its held-out problems, which may be sliced as in datasets, e.g. 'test[:100]'; builtin:toy has none; a data file is read whole, its one split being 'train'); without eval_dataset_name, the split of dataset_name evaluated (default dataset_test_split)."),
    "reward_funcs": ("list | None", None, "List of 'package.module:function' (or TRL's 'package.module.function') paths, reward-model paths, or the names of TRL's built-in rewards: accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment (builtin tasks bring theirs)."),
    "reward_model_name_or_path": ("str | None", None, "A reward model scored before reward_funcs (TRL GRPOScriptArguments)."),
    "process_reward_funcs": ("list | None", None, "List of step-reward sources (supervision process / both): 'package.module:function' paths, PRM folders written by `groupwise prm train`, or {path: …, kind: …} mappings."),
    "ignore_bias_buffers": ("bool", False, "Kept for TRL configs: TRL's grpo script does not read it either."),
}

# a built-in task's split, optionally sliced in datasets' syntax by row numbers: test, test[:100], train[10:-10]
BUILTIN_SPLIT = re.compile(r"(?P<split>train|test)(?P<slice>\[(?P<start>-?\d+)?:(?P<stop>-?\d+)?\])?")
MIXTURE_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")
# TRL's reward-function registry of `trl grpo` (trl/scripts/grpo.py): the ones groupwise has, or None
TRL_REWARDS = {"accuracy_reward": "groupwise.rewards:accuracy_reward",
               "reasoning_accuracy_reward": "groupwise.rewards:reasoning_accuracy_reward",
               "think_format_reward": "groupwise.rewards:think_format_reward",
               # the script's instance: get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
               "get_soft_overlong_punishment": "groupwise.rewards.shaping:trl_grpo_soft_overlong_punishment"}
# how a data file is read (datasets' builders); a compressed file is read by the builder of its inner suffix
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
SAVED_DATASET = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes
ALIASES = (("dataset_split", "dataset_train_split"), ("dtype", "torch_dtype"))  # two names of one field


def check_run_fields(run: dict[str, Any]) -> dict[str, Any]:
    """The run fields given, typed and checked (TRL's defaults filled in); a ConfigError names the field."""
    run = dict(run)
    for key in ("reward_funcs", "process_reward_funcs"):  # one spec given as a string is a list of one
        if isinstance(run.get(key), str):
            run[key] = [run[key]]
        elif run.get(key) is not None and not isinstance(run[key], list):
            raise ConfigError(f"{key}={run[key]!r}: give a list of 'package.module:function' paths or reward-model "
                              "paths (or one as a string)")
    out = {name: coerce(name, ann, run.get(name, default)) for name, (ann, default, _) in RUN_FIELDS.items()}
    for ours, theirs in ALIASES:  # two names of one field, in one source (the command line wins over a file: cli)
        if run.get(ours) is not None and run.get(theirs) is not None and out[ours] != out[theirs]:
            raise ConfigError(f"{ours}={out[ours]!r} and {theirs}={out[theirs]!r} name the same thing: give one")
    out["dataset_split"] = out["dataset_split"] or out["dataset_train_split"]
    if out["torch_dtype"] is not None:
        out["dtype"] = out["torch_dtype"]
    if out["dtype"] is not None and out["dtype"] not in ("auto", *MODEL_DTYPES):
        raise ConfigError(f"dtype={out['dtype']!r} is not one of {['auto', *MODEL_DTYPES]}")
    if out["ignore_bias_buffers"]:
        warn_user("ignore_bias_buffers=True has no effect (TRL's grpo script does not read it either)")
    size = out["test_split_size"]
    if size is not None and not (0 < size < 1 or (size >= 1 and float(size).is_integer())):
        raise ConfigError(f"test_split_size={size} must be a share in (0, 1) or a whole number of rows")
    if size is not None and out["datasets"] is None:  # TRL applies it in get_dataset, to a mixture only
        warn_user(f"test_split_size={size} has no effect without a datasets: mixture (as in TRL): every row of "
                  "dataset_name trains; evaluation reads dataset_test_split / eval_split of dataset_name, or "
                  "eval_dataset_name")
    if out["datasets"] is not None:
        for i, entry in enumerate(out["datasets"]):
            if not isinstance(entry, dict) or "path" not in entry:
                raise ConfigError(f"datasets[{i}]={entry!r:.80}: give a mapping with path (and optionally "
                                  f"{', '.join(MIXTURE_KEYS[1:])}), as TRL's DatasetConfig")
            reject_unknown(entry, set(MIXTURE_KEYS), owner=f"datasets[{i}]")
        fractions = [e.get("fraction") for e in out["datasets"]]
        numbers = all(isinstance(f, (int, float)) and not isinstance(f, bool) and f >= 0 for f in fractions)
        if any(f is not None for f in fractions) and not (numbers and sum(fractions) > 0):
            raise ConfigError(f"datasets: fraction must be a number ≥ 0 for every dataset of the mixture or for none "
                              f"(got {fractions}), as in TRL")
    return out


def model_init_kwargs(run: dict[str, Any], given: dict | None) -> dict[str, Any]:
    """TRL's grpo script: model_revision, attn_implementation and dtype as from_pretrained kwargs, overridden by the
    config's own model_init_kwargs."""
    kwargs: dict[str, Any] = {"revision": run["model_revision"]} if run["model_revision"] != "main" else {}
    if run["attn_implementation"] is not None:
        kwargs["attn_implementation"] = run["attn_implementation"]
    given = dict(given or {})
    if "dtype" not in given and "torch_dtype" not in given:
        kwargs["dtype"] = run["dtype"]
    return {**kwargs, **given}


def reward_specs(run: dict[str, Any]) -> list:
    """reward_model_name_or_path (first, as TRL), then reward_funcs, where a name of `trl grpo`'s reward registry
    is groupwise's function of that name (not a hub id)."""
    specs = [run["reward_model_name_or_path"]] if run["reward_model_name_or_path"] else []
    for i, spec in enumerate(run["reward_funcs"] or []):
        if isinstance(spec, str) and not Path(spec).exists():
            if spec in TRL_REWARDS:
                spec = TRL_REWARDS[spec]
            elif not any(c in spec for c in "/.:") and (close := difflib.get_close_matches(spec, sorted(TRL_REWARDS),
                                                                                           n=1)):
                # a near miss of a registry name (accuracy_rewrd), not a bare hub id: named before anything loads
                raise ConfigError(f"reward_funcs[{i}]={spec!r} is not one of `trl grpo`'s reward functions "
                                  f"{sorted(TRL_REWARDS)} (did you mean {close[0]!r}?), a "
                                  "'package.module:function' path or a reward model (a folder or an org/name hub id)")
        specs.append(spec)
    return specs


def builtin_task(name: str):
    """The task module of `builtin:<task>` (groupwise.tasks.TASKS), or None for any other dataset name."""
    if not name.startswith("builtin:"):
        return None
    from groupwise.tasks import TASKS

    task = name.split(":", 1)[1]
    if task not in TASKS:
        raise ConfigError(f"dataset_name={name!r}: unknown built-in task; choose from {sorted(TASKS)}")
    return TASKS[task]


def _file_builder(path: Path, field: str) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes.pop()
    kind = FILE_BUILDERS.get(suffixes[-1] if suffixes else "")
    if kind is None:
        suffix = "".join(path.suffixes) or "without a suffix"
        raise ConfigError(f"{field}={str(path)!r}: unsupported file type {suffix!r} (use {', '.join(FILE_BUILDERS)}, "
                          "a saved dataset folder or a folder of such files)")
    return kind


def load_dataset_spec(name: str, split: str | None, *, default: str = "train", field: str = "dataset_name",
                      config: str | None = None, data_dir: str | None = None, data_files: Any = None,
                      streaming: bool = False, file_is_split: bool = True, seed: int = 0):
    """The rows of `split` (None: `default`) of a dataset as a run names it: builtin:<task>, a data file (one split,
    'train', as datasets reads it; a slice such as 'train[:100]' too), a save_to_disk folder (a saved DatasetDict's
    splits; a saved Dataset is one split, 'train', as a data file, read whole when named alone (`split` None) and
    `file_is_split`; slices of either in datasets' syntax), a folder of data files or a hub dataset (load_dataset's
    name / data_dir / data_files). Anything that fails is one ConfigError naming `field`. `seed` draws a built-in task's training
    problems, wherever they are read (its 'test' split is fixed: the same held-out problems whatever the seed)."""
    task = builtin_task(name)
    if task is not None:  # arithmetic and calculator have train/test splits (by a hash of the problem); toy has none
        if "split" not in inspect.signature(task.dataset).parameters:
            if split not in (None, "train"):  # 'train': dataset_train_split's default, its one split
                raise ConfigError(f"{name!r} has no train/test split (it has one set of rows): to evaluate on it, "
                                  f"give eval_dataset_name: {name} without eval_split; leave dataset_split unset")
            return task.dataset(seed=seed)
        split = split or default
        match = BUILTIN_SPLIT.fullmatch(split)
        if match is None:
            raise ConfigError(f"split {split!r} of {name!r}: built-in tasks have the splits 'train' and 'test' (a "
                              "slice of one in datasets' syntax works too, e.g. 'test[:100]')")
        rows = task.dataset(split=match["split"], **({"seed": seed} if match["split"] == "train" else {}))
        if match["slice"] is None:
            return rows
        start, stop = (int(x) if x else None for x in (match["start"], match["stop"]))
        return rows[start:stop]
    import datasets

    given, split = split, split or default
    path = Path(name).expanduser()
    try:
        if path.is_dir() and any((path / f).exists() for f in SAVED_DATASET):
            data = datasets.load_from_disk(str(path))
            one = not isinstance(data, datasets.DatasetDict)  # one saved Dataset: one split, 'train', as a file;
            if one and given is None and file_is_split:  # an evaluation folder named on its own is read whole
                return data.to_iterable_dataset() if streaming else data
            data = _saved_split(datasets.DatasetDict(train=data) if one else data, split,
                                f"{field}={name!r}" + (" is one saved Dataset, one split ('train'): it" if one else ""))
            return data.to_iterable_dataset() if streaming else data
        if path.is_file():
            kind = _file_builder(path, field)
            if path.stat().st_size == 0:
                raise ConfigError(f"{field}={name!r} is empty: give a file with at least one row")
            # a data file has one split, 'train' (datasets: "Unknown split … Should be one of ['train']"); an
            # evaluation file named on its own (eval_split unset) is read whole
            asked = given if given is not None else "train"
            if asked.split("[", 1)[0].strip() != "train":
                raise ConfigError(f"{field}={name!r} is one file, one split: it has no split {asked!r} (a data file's "
                                  "one split is 'train', as in datasets and TRL; a slice such as 'train[:100]' works)")
            return datasets.load_dataset(kind, data_files=str(path), split=asked, streaming=streaming)
        return datasets.load_dataset(str(path) if path.is_dir() else name, name=config, data_dir=data_dir,
                                     data_files=data_files, split=split, streaming=streaming)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — datasets' errors (bad rows, unknown split, no network) as one line
        text = " ".join(str(e).split())
        if "corresponds to no data" in text:
            raise ConfigError(f"{field}={name!r} has no rows: give a dataset with at least one row") from e
        bad = _first_bad_json_line(path) if path.is_file() and path.suffix in (".jsonl", ".ndjson") else None
        if bad is not None:  # Arrow names a 0-based row and a symptom ("Invalid encoding in string")
            raise ConfigError(f"{field}={name!r}: line {bad[0]} is not valid JSON ({bad[1]}): fix or delete it") from e
        cause = f"{type(e).__name__}: {text[:300]}" + (f"; {type(e.__cause__).__name__}: {e.__cause__}"[:200]
                                                        if e.__cause__ is not None else "")
        raise ConfigError(f"{field}={name!r} (split {split!r}) cannot be loaded: {cause}") from e


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """The first line (1-based) of a JSON-lines file that does not parse, and why; None when every line parses."""
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line.rstrip("\r\n"))
                except ValueError as e:
                    return number, str(e)
    return None


def _saved_split(data, split: str, where: str):
    """`split` of a save_to_disk folder's splits, in datasets' split syntax ('test', 'train[:100]', 'train[10%:]',
    'train+test'), as load_dataset reads it; a split the folder does not have is named with those it has."""
    import datasets

    if split in data:  # any name save_to_disk kept ('my-split' too, which the split syntax cannot spell)
        return data[split]
    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute({k: len(v) for k, v in data.items()})
    except (ValueError, AssertionError):
        raise ConfigError(f"{where} has no split {split!r} (splits: {sorted(data)}): give one of them, or a slice of "
                          f"one in datasets' syntax, e.g. '{next(iter(data))}[:100]'") from None
    rows = [data[p.splitname].select(range(p.from_, p.to)) for p in parts]
    return rows[0] if len(rows) == 1 else datasets.concatenate_datasets(rows)


def _as_dataset(data):
    """A built-in task's rows (a list of dicts) as a datasets.Dataset, to be split or concatenated."""
    if isinstance(data, list):
        import datasets

        return datasets.Dataset.from_list(data)
    return data


def load_mixture(entries: list[dict], *, streaming: bool, seed: int = 0):
    """TRL's get_dataset: each entry loaded (its columns selected), shares by fraction (the first rows of each, the
    largest mixture that oversamples none), concatenated. `seed`: a built-in task's training problems."""
    import datasets

    parts = []
    for i, entry in enumerate(entries):
        where = f"datasets[{i}].path"
        if builtin_task(entry["path"]) is None and not entry.get("data_files"):  # (with data_files: a builder name)
            check_location(entry["path"], where)
        data = load_dataset_spec(entry["path"], entry.get("split"), field=where, config=entry.get("name"),
                                 data_dir=entry.get("data_dir"), data_files=entry.get("data_files"),
                                 streaming=streaming, seed=seed)
        columns = entry.get("columns")
        if columns is not None:
            have = list(data.column_names or [])
            missing = [c for c in ([columns] if isinstance(columns, str) else columns) if have and c not in have]
            if missing:
                raise ConfigError(f"datasets[{i}].columns: {entry['path']!r} has no column {missing[0]!r} "
                                  f"(columns: {have})")
            data = data.select_columns(columns)
        parts.append(_as_dataset(data))
    fractions = [e.get("fraction") for e in entries]
    if fractions and fractions[0] is not None:
        if streaming:
            raise ConfigError("datasets: fraction does not apply to a stream (streaming: true), as in TRL")
        weights = [f / sum(fractions) for f in fractions]
        total = min(len(d) / w for d, w in zip(parts, weights) if w > 0)
        parts = [d.select(range(round(w * total))) for d, w in zip(parts, weights)]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as e:
        raise ConfigError(f"datasets: the mixture's datasets cannot be concatenated (give each the same columns, "
                          f"e.g. with columns: [prompt, …]): {' '.join(str(e).split())[:300]}") from None


def eval_rows_named(run: dict[str, Any]) -> bool:
    """Does `groupwise eval` read its rows from eval_dataset_name alone (dataset_name then unread)? Not when a
    mixture is split by test_split_size: that split gives them."""
    return bool(run["eval_dataset_name"]) and not (run["datasets"] and run["test_split_size"] is not None)


def load_run_datasets(run: dict[str, Any], args, *, evaluation: bool = False) -> tuple[Any, Any]:
    """The training rows and the evaluation rows (or None) of a run, as TRL's grpo script chooses them.
    `evaluation` (groupwise eval): the evaluation rows are wanted whatever eval_strategy says, and are the training
    rows too (the trainer is built to evaluate only), so dataset_name may be left out given eval_dataset_name."""
    if evaluation and eval_rows_named(run):
        held = load_dataset_spec(run["eval_dataset_name"], run["eval_split"], default="test", field="eval_dataset_name",
                                 seed=args.seed)
        return held, held
    if evaluation and not run["datasets"]:  # dataset_name's evaluation split only (a mixture is split first)
        if not run["dataset_name"]:
            raise ConfigError("groupwise eval needs evaluation rows: give eval_dataset_name (and eval_split), or "
                              "dataset_name, whose dataset_test_split is evaluated")
        split = run["eval_split"] or run["dataset_test_split"]
        try:
            held = load_dataset_spec(run["dataset_name"], split, config=run["dataset_config"], file_is_split=False,
                                     seed=args.seed)
        except ConfigError as e:
            fix = "" if "eval_dataset_name" in str(e) else "; give eval_split, or eval_dataset_name"
            raise ConfigError(f"groupwise eval evaluates split {split!r} of dataset_name (dataset_test_split, as "
                              f"TRL): {e}{fix}") from None
        return held, held
    train, held = _run_datasets(run, args, evaluation)
    return (held, held) if evaluation else (train, held)


def _run_datasets(run: dict[str, Any], args, evaluation: bool) -> tuple[Any, Any]:
    from groupwise.data import is_stream

    mixture = run["datasets"]
    if mixture and run["dataset_name"]:
        warn_user("both datasets and dataset_name are set: the datasets mixture is used and dataset_name is "
                  "ignored, as in TRL")
    if mixture:
        train = load_mixture(mixture, streaming=run["streaming"], seed=args.seed)
    else:
        train = load_dataset_spec(run["dataset_name"], run["dataset_split"], config=run["dataset_config"],
                                  streaming=run["dataset_streaming"], seed=args.seed)
    held_out = None
    if mixture and run["test_split_size"] is not None:  # TRL: get_dataset splits the mixture only
        if is_stream(train):
            raise ConfigError("test_split_size cannot split a stream: turn streaming off, or give eval_dataset_name")
        size = run["test_split_size"]
        train = _as_dataset(train)
        try:
            parts = train.train_test_split(test_size=int(size) if size >= 1 else size, seed=args.seed)
        except ValueError as e:
            raise ConfigError(f"test_split_size={size}: {' '.join(str(e).split())[:200]}") from None
        train, held_out = parts["train"], parts["test"]
    wants_eval = evaluation or args.eval_strategy != "no" or args.eval_on_start
    if run["eval_dataset_name"]:
        if held_out is not None:
            raise ConfigError("test_split_size and eval_dataset_name both give the evaluation rows: drop one")
        return train, load_dataset_spec(run["eval_dataset_name"], run["eval_split"], default="test",
                                        field="eval_dataset_name", seed=args.seed)
    if not wants_eval:
        return train, None
    if held_out is not None:
        return train, held_out
    asked = ("groupwise eval" if evaluation else f"eval_strategy={args.eval_strategy!r}" if args.eval_strategy != "no"
             else "eval_on_start=True")
    if mixture:
        raise ConfigError(f"{asked} needs evaluation rows: set test_split_size (a share of the mixture held out) "
                          "or eval_dataset_name")
    split = run["eval_split"] or run["dataset_test_split"]
    try:  # TRL: dataset_name's dataset_test_split
        return train, load_dataset_spec(run["dataset_name"], split, config=run["dataset_config"], file_is_split=False,
                                        seed=args.seed)
    except ConfigError as e:
        raise ConfigError(f"{asked} evaluates on split {split!r} of dataset_name (dataset_test_split, as TRL): {e}; "
                          "give eval_dataset_name, or a datasets: mixture with test_split_size") from None

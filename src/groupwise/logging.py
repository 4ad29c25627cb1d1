"""Metrics out: metrics.jsonl (always), the trackers of report_to (groupwise.trackers), console tables."""

from __future__ import annotations

import contextlib
import json
import os
import math
import random
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tqdm.auto import tqdm

from groupwise.trackers import TRACKERS, Opened

if TYPE_CHECKING:
    from groupwise.types import Round


def speed_metrics(runtime: float, steps: int, samples: float, prefix: str = "train") -> dict[str, float]:
    """transformers' speed metrics: of the end-of-training line, or of an evaluation (`prefix` = its
    metric_key_prefix), rounded as transformers rounds them."""
    out = {f"{prefix}_runtime": round(runtime, 4)}
    if runtime > 0:
        out.update({f"{prefix}_samples_per_second": round(samples / runtime, 3),
                    f"{prefix}_steps_per_second": round(steps / runtime, 3)})
    return out


# the key only the end-of-training line has: not train_runtime, which evaluate(metric_key_prefix="train") also writes
END_OF_TRAINING = "total_flos"

# GRPOConfig.log_level / log_level_replica: transformers' names; "passive" leaves the levels as they are
LOG_LEVELS = {"detail": 10, "debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50, "passive": None}


def set_log_level(level: str) -> None:
    """Apply a LOG_LEVELS name to transformers' and groupwise's loggers."""
    value = LOG_LEVELS[level]
    if value is None:
        return
    import logging

    import transformers

    transformers.logging.set_verbosity(value)
    logging.getLogger("groupwise").setLevel(value)


def transformers_verbosity() -> int:
    """transformers' logging level now, without importing transformers: its library logger's once imported, else
    the level it will start with ($TRANSFORMERS_VERBOSITY, default warning)."""
    import logging

    if "transformers" in sys.modules:
        return logging.getLogger("transformers").getEffectiveLevel()
    return LOG_LEVELS.get(os.getenv("TRANSFORMERS_VERBOSITY", "warning").lower()) or logging.WARNING


def console_line(logs: dict) -> dict:
    """A log line as transformers' ProgressCallback / PrinterCallback print it: floats to 4 significant digits,
    without total_flos."""
    return {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in logs.items() if k != "total_flos"}


class MetricsLogger:
    """metrics.jsonl: one JSON object per logged step, with the run id. On resume, lines after the resumed step are
    dropped (they are replayed exactly) and a torn last line (a crash mid-write) is skipped with a warning."""

    def __init__(self, output_dir: str, report_to: list[str], *, enabled: bool, config: dict, resume_step: int = 0,
                 run_id: str | None = None, resumed: bool = False, model=None, logging_steps: int = 0,
                 uploads: tuple[Callable[[], Opened], ...] = ()):
        self.enabled, self.run_id = enabled, run_id
        self.path = Path(output_dir) / "metrics.jsonl"
        self.completions_path = Path(output_dir) / "completions.jsonl"
        self.eval_completions_path = Path(output_dir) / EVAL_COMPLETIONS
        self.history: list[dict] = []
        self.trackers: list = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed:  # keep what this run logged up to the resumed step (trainer.state); other runs' lines stay
            self.history = trim_jsonl(self.path, resume_step, run_id)
            trim_jsonl(self.completions_path, resume_step, run_id, keep_records=False)
            trim_jsonl(self.eval_completions_path, resume_step, run_id, keep_records=False)
        # model: its config; logging_steps: the run's log interval in steps (transformers' state's); `uploads`: what
        # opens and closes as a tracker does (log_completions_hub_repo's schedule)
        for open_one in [lambda name=name: TRACKERS[name].open(output_dir, config, model, logging_steps)
                         for name in report_to] + list(uploads):
            try:
                self.trackers.append(open_one())
            except BaseException:
                self.close(failed=True)  # the ones already opened
                raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = _finite(metrics)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "run_id": self.run_id, **clean}) + "\n")
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """completions.jsonl: one line per completion of the logged step (prompt, completion, rewards, advantage)."""
        if self.enabled:
            append_rows(self.completions_path, step, self.run_id, rows)

    def log_table(self, step: int, rows: list[dict], unique_prompts: bool) -> None:
        """log_completions, as TRL: the step's completions table (step, prompt, completion, each reward function, the
        log_extra columns, advantage) to output_dir/completions/completions_<step>.parquet, and to the trackers
        that show tables (wandb's and trackio's `completions`), there one row per prompt when unique_prompts (log_unique_prompts)."""
        if not self.enabled or not rows:
            return
        import pandas as pd

        frame = pd.DataFrame(completion_table(step, rows))
        folder = self.path.parent / "completions"
        folder.mkdir(exist_ok=True)
        try:
            frame.to_parquet(folder / f"completions_{step:05d}.parquet")
        except (TypeError, ValueError) as e:  # pyarrow's errors: mixed content types inside messages
            warnings.warn(f"completions table of step {step}: {e}; its prompt and completion columns are written as "
                          "JSON text", RuntimeWarning, stacklevel=2)
            for column in ("prompt", "completion"):
                frame[column] = [v if isinstance(v, str) else json.dumps(v, default=str) for v in frame[column]]
            frame.to_parquet(folder / f"completions_{step:05d}.parquet")
        if unique_prompts:
            frame = frame[~frame["prompt"].astype(str).duplicated()]
        for tracker in self.trackers:
            if tracker.table is not None:
                tracker.table(frame)

    def close(self, failed: bool = False) -> None:
        """Close the trackers (`failed`: the run ended on an error); later lines (evaluate() after train()) go to
        metrics.jsonl only. Every tracker is closed even if one fails to: the first failure is raised after them,
        or, when the run already failed, only warned about (the run's own error is the one that matters)."""
        trackers, self.trackers, errors = self.trackers, [], []
        for tracker in trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # noqa: BLE001 — the others are closed first
                errors.append(e)
        if errors and failed:
            warnings.warn(f"closing a tracker failed: {type(errors[0]).__name__}: {errors[0]}", RuntimeWarning,
                          stacklevel=2)
        elif errors:
            raise errors[0]


# every evaluate() call's completions, one line each (groupwise.evaluation: index, sample, prompt, completion, rewards)
EVAL_COMPLETIONS = "eval_completions.jsonl"


def append_rows(path: Path, step: int, run_id: str | None, rows: list[dict], **fields) -> None:
    """completions.jsonl / eval_completions.jsonl: one JSON line per row, with the step, the run id and `fields`
    (evaluation's `dataset`: the metric prefix, eval or eval_<name>); NaN and inf written as null."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({"step": step, "run_id": run_id, **fields, **_finite(row)}, default=str) + "\n")


def _finite(record: dict) -> dict:  # JSON has no NaN / inf: write null
    def clean(v):
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
            v = v.item()  # a numpy or torch scalar (trainer.log({"x": np.float32(0.5)})), as its Python number
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return {k: clean(v) for k, v in record.items()}


def trim_jsonl(path: Path, resume_step: int, run_id: str | None, keep_records: bool = True) -> list[dict]:
    """On resume: drop the run's records of steps after resume_step (they are replayed exactly) and return the run's
    kept ones (`keep_records`; else [], for files read by nothing after, as completions); lines of other runs are left
    alone (a line without run id counts as the run's); a line that is not valid JSON (a crash mid-write) is dropped
    with a warning."""
    if not path.exists():
        return []
    records = []
    tmp = path.with_name(path.name + ".tmp")  # a crash while rewriting leaves the old file whole
    with path.open() as lines, tmp.open("w") as kept:  # line by line: an eval_completions.jsonl may be large
        for i, line in enumerate(lines):
            line = line.rstrip("\n")
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                warnings.warn(f"{path}: line {i + 1} is not valid JSON (a crash mid-write?); dropped", RuntimeWarning,
                              stacklevel=3)
                continue
            if record is None:
                continue
            mine = record.get("run_id") in (run_id, None)
            if mine and record.get("step", 0) > resume_step:
                continue
            kept.write(line + "\n")
            if mine and END_OF_TRAINING not in record and keep_records:  # an earlier train() call's end: not in
                records.append(record)  # the resumed history
    os.replace(tmp, path)
    return records


def print_completions(step: int, prompts: list[Any], completions: list[Any], rewards: list[float],
                      advantages: list[float], limit: int | None,
                      steps: list[list[tuple[str, float]]] | None = None) -> None:
    """advantages: the first token's advantage (the whole completion's under outcome supervision)."""
    lines = [f"── completions at step {step} " + "─" * 40]
    for i, (p, c, r, a) in enumerate(list(zip(prompts, completions, rewards, advantages))[:limit]):
        lines.append(f"prompt: {_short(p)}\ncompletion: {_short(c)}\nreward {r:+.3f}   advantage {a:+.3f}")
        for j, (text, sr) in enumerate(steps[i] if steps else []):
            shown = "unscored" if sr is None or sr != sr else f"{sr:+.3f}"  # NaN: no step function scored it
            lines.append(f"    step {j + 1}: {shown}  {_short(text, 120)}")
        lines.append("")
    tqdm.write("\n".join(lines))


def _message(m: dict) -> str:
    """A chat message on one line; an assistant's tool calls as name(arguments)."""
    calls = [c.get("function", c) for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    shown = "".join(f" [{c.get('name')}({c.get('arguments')})]" for c in calls if isinstance(c, dict))
    return f"{m.get('role')}: {m.get('content')}{shown}"


def _short(x: Any, n: int = 300) -> str:
    if isinstance(x, list):
        x = " | ".join(_message(m) for m in x if isinstance(m, dict))
    s = str(x).replace("\n", "⏎")
    return s if len(s) <= n else s[:n] + "…"


# metrics logged as their value at the logging step, not the window's mean (transformers' learning_rate and
# grad_norm; TRL's running num_tokens). TRL averages entropy_coef over the window, as the other metrics
LAST_VALUE = ("learning_rate", "grad_norm", "num_tokens")


def window_summary(window: dict[str, list[float]], nan_inf_filter: bool) -> dict[str, float]:
    """One log line from the metrics since the last one: the mean (the loss without non-finite values when
    logging_nan_inf_filter), or the last value for LAST_VALUE."""
    loss_mode = "finite" if nan_inf_filter else "all"
    return {k: v[-1] if k in LAST_VALUE else window_mean(v, loss_mode if k in ("loss", "policy_loss") else "measured")
            for k, v in window.items() if v}


def window_mean(values: list[float], mode: str) -> float:
    """Mean over the logging window. mode "measured": NaN marks "not measured" (a metric absent from a step) and is
    left out; "finite": NaN and ±inf left out (logging_nan_inf_filter, for the loss); "all": nothing left out."""
    def keep(v) -> bool:
        if v is None:
            return False
        if mode == "all" or not isinstance(v, float):
            return True
        return not math.isnan(v) and (mode == "measured" or not math.isinf(v))
    kept = [v for v in values if keep(v)]
    return sum(kept) / len(kept) if kept else float("nan")


# completions.jsonl's row fields; any other key of a row is a log_extra column
ROW_FIELDS = ("prompt", "completion", "reward", "advantage", "rewards", "steps")


def completion_table(step: int, rows: list[dict]) -> dict[str, list]:
    """TRL's completions table from completions.jsonl rows: step, prompt, completion, one column per reward function,
    the log_extra columns, advantage."""
    names = list(rows[0].get("rewards", {}))
    extra = [k for k in rows[0] if k not in ROW_FIELDS]
    return {"step": [step] * len(rows), "prompt": [r["prompt"] for r in rows],
            "completion": [r["completion"] for r in rows], **{n: [r["rewards"][n] for r in rows] for n in names},
            **{k: [r.get(k) for r in rows] for k in extra}, "advantage": [r["advantage"] for r in rows]}


def print_rows(step: int, rows: list[dict], limit: int | None) -> None:
    """log_completions: `limit` (num_completions_to_print; None: all) of the round's rows (all processes'), drawn at
    random as TRL draws them; from a generator seeded by the step, so printing never moves the run's random state."""
    if limit is not None and limit <= 0:
        return
    if limit is not None and limit < len(rows):
        rows = random.Random(step).sample(rows, limit)
    print_completions(step, [r["prompt"] for r in rows], [r["completion"] for r in rows],
                      [r["reward"] for r in rows], [r["advantage"] for r in rows], limit,
                      steps=None if rows and "steps" not in rows[0] else [r["steps"] for r in rows])


def completion_rows(rnd: Round, names: list[str], extra: dict[str, list]) -> list[dict]:
    """This process's rows of a logged round for completions.jsonl: prompt, completion, each reward function's value
    (`names`), TRL's reward (Σ w·r), the first token's advantage, step rewards, and the `log_extra` columns that have
    one value per row."""
    n = len(rnd.completions.prompts)
    first_token = rnd.first_token_advantages()
    extra = {k: v for k, v in extra.items() if len(v) == n}
    rows = []
    for i in range(n):
        row = {"prompt": rnd.completions.prompts[i], "completion": rnd.completions.completions[i],
               "reward": float(rnd.rewards[i]), "advantage": first_token[i]}
        if rnd.per_func is not None:
            row["rewards"] = {name: float(rnd.per_func[i, f]) for f, name in enumerate(names)}
        if rnd.steps is not None:
            row["steps"] = [[text, float(r)] for text, r in rnd.steps[i]]
        rows.append({**row, **{k: v[i] for k, v in extra.items()}})
    return rows


def above_bars(show):
    """warnings.showwarning that writes a warning on its own lines above the progress bars (tqdm clears them,
    the warning is shown by `show`, the bars are drawn again), not appended to the bar's line."""
    def shown_above_bars(*args, **kwargs):
        with tqdm.external_write_mode():
            show(*args, **kwargs)

    shown_above_bars.shows = show
    return shown_above_bars


_BARS = {"open": 0, "before": None}  # bars drawing now (every trainer's, every thread's) and the hook before them
_BARS_LOCK = threading.Lock()


def hook_warnings() -> None:
    """A bar begins: the first puts above_bars over warnings.showwarning (unhook_warnings, when the last ends, puts
    back the hook from before, whatever order they end in)."""
    with _BARS_LOCK:
        if _BARS["open"] == 0:
            _BARS["before"] = warnings.showwarning
            warnings.showwarning = above_bars(_BARS["before"])
        _BARS["open"] += 1


def unhook_warnings() -> None:
    with _BARS_LOCK:
        _BARS["open"] -= 1
        before = _BARS["before"]
        if _BARS["open"] == 0 and getattr(warnings.showwarning, "shows", None) is before:  # (else another hook was
            warnings.showwarning = before  # put over it since, and stays)


@contextlib.contextmanager
def warnings_above_bars():
    """Within: warnings are written above the progress bars (above_bars); the hook before is put back after."""
    hook_warnings()
    try:
        yield
    finally:
        unhook_warnings()

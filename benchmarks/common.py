"""Shared bits of the benchmark scripts: machine description, medians, markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores{gpu}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}; `{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`, "
            f"{time.strftime('%Y-%m-%d')}")


def median_time(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def write_table(name: str, title: str, header: list[str], rows: list[list[str]], notes: list[str],
                echo: bool = True) -> str:
    md = [f"# {title}", "", machine(), "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += [""] + notes
    text = "\n".join(md) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    if echo:
        print(text)
    return text


# ---- supervision comparisons (supervision.py, turns.py): runs of the demo trainers, read from metrics.jsonl --------
def run_metrics(trainer) -> list[dict]:
    """Train, then the run's metrics.jsonl lines."""
    import json

    trainer.train()
    return [json.loads(x) for x in (Path(trainer.args.output_dir) / "metrics.jsonl").read_text().splitlines()]


def at_step(lines: list[dict], key: str, step: int) -> float:
    return next(x[key] for x in lines if key in x and x["step"] == step)


def at_time(lines: list[dict], key: str, seconds: float) -> float:
    """The last evaluation finished within `seconds` of the run's start (nan when none)."""
    done = [x for x in lines if key in x and x["time/elapsed"] <= seconds]
    return done[-1][key] if done else float("nan")


def last(lines: list[dict], key: str) -> float:
    values = [x[key] for x in lines if key in x]
    return values[-1] if values else float("nan")


def mean_sd(values, scale: float = 100.0, digits: int = 1) -> str:
    """'mean ± std' (sample std; 0 for one value) of the non-nan values, scaled; '–' when there is none."""
    values = [v for v in values if v == v]
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * sd:.{digits}f}"


def curve_tables(runs: dict[str, list[list[dict]]], key: str, max_steps: int) -> tuple[list[int], list[str]]:
    """The evaluated steps, and markdown rows: `key` (×100) per variant at every evaluated step and at a quarter,
    half, three quarters and all of the shortest run's wall time, mean ± std over the runs (seeds)."""
    steps = sorted({x["step"] for rs in runs.values() for lines in rs for x in lines if key in x})
    total = min(x["time/elapsed"] for rs in runs.values() for lines in rs for x in lines
                if key in x and x["step"] == max_steps)
    times = [round(total * f) for f in (0.25, 0.5, 0.75, 1.0)]
    md = ["| supervision | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    md += [f"| {name} | " + " | ".join(mean_sd([at_step(r, key, s) for r in rs]) for s in steps) + " |"
           for name, rs in runs.items()]
    md += ["", "At fixed wall time (seconds since the run started, evaluations included):", "",
           "| supervision | " + " | ".join(f"{t} s" for t in times) + " |", "|---|" + "---|" * len(times)]
    md += [f"| {name} | " + " | ".join(mean_sd([at_time(r, key, t) for r in rs]) for t in times) + " |"
           for name, rs in runs.items()]
    return steps, md


def plot_curves(runs: dict[str, list[list[dict]]], key: str, steps: list[int], path: Path, title: str,
                labels: dict[str, str], colors: dict[str, str]) -> None:
    """`key` against the optimizer step, mean ± std band over the runs of each variant (needs matplotlib)."""
    import torch

    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib missing: no {path.name} (pip install groupwise[plot])")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rs in runs.items():
        curves = torch.tensor([[at_step(r, key, s) for s in steps] for r in rs])
        mean, sd = curves.mean(0), curves.std(0) if len(curves) > 1 else torch.zeros(len(steps))
        ax.plot(steps, mean, "o-", color=colors[name], label=labels[name])
        ax.fill_between(steps, mean - sd, mean + sd, color=colors[name], alpha=0.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)

"""Metrics out: metrics.jsonl (always), TensorBoard / wandb (when asked and installed), console tables."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def _tensorboard(output_dir: str, config: dict):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("report_to=['tensorboard'] needs `pip install groupwise[tensorboard]`") from e
    writer = SummaryWriter(log_dir=str(Path(output_dir) / "runs"))

    def log(step, metrics):
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                writer.add_scalar(k, v, step)
    return log, writer.close


def _wandb(output_dir: str, config: dict):
    try:
        import wandb
    except ImportError as e:
        raise ImportError("report_to=['wandb'] needs `pip install groupwise[wandb]`") from e
    run = wandb.init(config=config, resume="allow")
    return (lambda step, metrics: run.log(metrics, step=step)), run.finish


# GRPOConfig.report_to: trackers besides metrics.jsonl (always written); each opens to (log, close)
TRACKERS = {"tensorboard": _tensorboard, "wandb": _wandb}


class MetricsLogger:
    """metrics.jsonl: one JSON object per logged step, with the run id. On resume, lines after the resumed step are
    dropped (they are replayed exactly) and a torn last line (a crash mid-write) is skipped with a warning."""

    def __init__(self, output_dir: str, report_to: list[str], *, enabled: bool, config: dict, resume_step: int = 0,
                 run_id: str | None = None):
        self.enabled, self.run_id = enabled, run_id
        self.path = Path(output_dir) / "metrics.jsonl"
        self.trackers: list = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # resuming: drop lines written after the checkpoint we resume from
            keep = []
            for i, line in enumerate(self.path.read_text().splitlines()):
                try:
                    record = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:
                    warnings.warn(f"{self.path}: line {i + 1} is not valid JSON (a crash mid-write?); dropped",
                                  RuntimeWarning, stacklevel=2)
                    continue
                if record is not None and record.get("step", 0) <= resume_step:
                    keep.append(line)
            self.path.write_text("".join(line + "\n" for line in keep))
        self.trackers = [TRACKERS[name](output_dir, config) for name in report_to]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "run_id": self.run_id, **clean}) + "\n")
        for log, _ in self.trackers:
            log(step, metrics)

    def close(self) -> None:
        for _, close in self.trackers:
            close()


def print_completions(step: int, prompts: list[Any], completions: list[Any], rewards: list[float],
                      advantages: list[float], limit: int | None,
                      steps: list[list[tuple[str, float]]] | None = None) -> None:
    """advantages: the first token's advantage (the whole completion's under outcome supervision)."""
    lines = [f"── completions at step {step} " + "─" * 40]
    for i, (p, c, r, a) in enumerate(list(zip(prompts, completions, rewards, advantages))[:limit]):
        lines.append(f"prompt: {_short(p)}\ncompletion: {_short(c)}\nreward {r:+.3f}   advantage {a:+.3f}")
        for j, (text, sr) in enumerate(steps[i] if steps else []):
            lines.append(f"    step {j + 1}: {sr:+.3f}  {_short(text, 120)}")
        lines.append("")
    tqdm.write("\n".join(lines))


def _short(x: Any, n: int = 300) -> str:
    if isinstance(x, list):
        x = " | ".join(f"{m.get('role')}: {m.get('content')}" for m in x if isinstance(m, dict))
    s = str(x).replace("\n", "⏎")
    return s if len(s) <= n else s[:n] + "…"

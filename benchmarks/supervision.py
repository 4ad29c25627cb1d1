"""Outcome vs process supervision (DeepSeekMath §4.1.2 vs §4.1.3) on the embedded arithmetic demo: same base policy,
same steps, same batch, several seeds. Also checks the demo's target (held-out greedy accuracy +20 points with the
default settings, which use process supervision).

    .venv/bin/python benchmarks/supervision.py [--seeds 0 1 2] [--max_steps 200]
Writes benchmarks/results/supervision.md and supervision.png (and prints the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def run(supervision: str, seed: int, max_steps: int, eval_steps: int, out: Path) -> list[dict]:
    from groupwise.demo import demo_trainer

    trainer = demo_trainer({"supervision": supervision, "seed": seed, "max_steps": max_steps,
                            "eval_steps": eval_steps, "eval_strategy": "steps", "eval_on_start": True, "save_steps": 0, "output_dir": str(out), "logging_steps": 5})
    trainer.train()
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def at_step(lines, step):
    return next(x["eval/accuracy"] for x in lines if "eval/accuracy" in x and x["step"] == step)


def at_time(lines, seconds):
    """Accuracy of the last evaluation finished within `seconds` of the run's start."""
    done = [x for x in lines if "eval/accuracy" in x and x["time/elapsed"] <= seconds]
    return done[-1]["eval/accuracy"] if done else float("nan")


def fmt(values):
    values = [v for v in values if v == v]
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} ± {100 * sd:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max_steps", type=int, default=200)
    ap.add_argument("--eval_steps", type=int, default=25)
    ap.add_argument("--work", default="outputs/bench-supervision")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    runs: dict[str, list[list[dict]]] = {"outcome": [], "process": []}
    start = time.time()
    for seed in args.seeds:
        for sup in runs:
            runs[sup].append(run(sup, seed, args.max_steps, args.eval_steps, Path(args.work) / f"{sup}-{seed}"))
            print(f"[{time.time() - start:.0f}s] {sup} seed {seed}: "
                  f"{at_step(runs[sup][-1], 0):.3f} → {at_step(runs[sup][-1], args.max_steps):.3f}", flush=True)
    steps = list(range(0, args.max_steps + 1, args.eval_steps))
    total = min(x["time/elapsed"] for r in runs.values() for lines in r for x in lines if "eval/accuracy" in x
                and x["step"] == args.max_steps)
    times = [round(total * f) for f in (0.25, 0.5, 0.75, 1.0)]
    import transformers

    md = ["# Outcome vs process supervision — arithmetic demo\n",
          f"`{' '.join(sys.argv)}` on {platform.machine()} ({os.cpu_count()} CPU cores), torch {torch.__version__}, "
          f"transformers {transformers.__version__}; seeds {args.seeds}; same base policy (46.0% greedy), "
          f"{args.max_steps} optimizer steps of 64 completions (8 prompts × G = 8), lr 5e-5, T = 0.7.\n",
          "Held-out greedy accuracy (%, 200 problems), mean ± std over seeds.\n",
          "| supervision | " + " | ".join(f"step {s}" for s in steps) + " |",
          "|---|" + "---|" * len(steps)]
    for sup, rs in runs.items():
        md.append(f"| {sup} | " + " | ".join(fmt([at_step(r, s) for r in rs]) for s in steps) + " |")
    md += ["", "At fixed wall time (seconds since the run started, evaluations included):", "",
           "| supervision | " + " | ".join(f"{t} s" for t in times) + " |", "|---|" + "---|" * len(times)]
    for sup, rs in runs.items():
        md.append(f"| {sup} | " + " | ".join(fmt([at_time(r, t) for r in rs]) for t in times) + " |")
    gains = [at_step(r, args.max_steps) - at_step(r, 0) for r in runs["process"]]
    verdict = "met" if statistics.mean(gains) >= 0.20 else f"missed by {100 * (0.20 - statistics.mean(gains)):.1f} pt"
    md += ["", f"Demo target (default settings = process supervision): +20 points. Measured "
               f"{fmt(gains).replace(' ± ', ' ± ')} points over {len(gains)} seeds: **{verdict}**."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "supervision.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for sup, color in (("outcome", "tab:blue"), ("process", "tab:orange")):
            curves = torch.tensor([[at_step(r, s) for s in steps] for r in runs[sup]])
            mean, sd = curves.mean(0), curves.std(0) if len(curves) > 1 else torch.zeros(len(steps))
            ax.plot(steps, mean, "o-", color=color, label=f"{sup} supervision")
            ax.fill_between(steps, mean - sd, mean + sd, color=color, alpha=0.2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_title(f"arithmetic demo, {len(args.seeds)} seeds (mean ± std)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "supervision.png", dpi=100)
    except ImportError:
        print("matplotlib missing: no supervision.png (pip install groupwise[plot])")


if __name__ == "__main__":
    main()

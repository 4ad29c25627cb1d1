"""Outcome vs process supervision (DeepSeekMath §4.1.2 vs §4.1.3) on the embedded arithmetic demo: same base policy,
same steps, same batch, several seeds. Also checks the demo's target (held-out greedy accuracy +20 points with the
default settings, which use process supervision). The counterpart for tool-calling turns is benchmarks/turns.py.

    .venv/bin/python benchmarks/supervision.py [--seeds 0 1 2] [--max_steps 200] [--name supervision]
Writes benchmarks/results/supervision.md and supervision.png (and prints the table); --name changes the file names
(e.g. for a quick check that must not replace the committed results).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, at_step, curve_tables, mean_sd, plot_curves, run_metrics  # noqa: E402

KEY = "eval_rewards/accuracy/mean"


def run(supervision: str, seed: int, max_steps: int, eval_steps: int, out: Path) -> list[dict]:
    from groupwise.demo import demo_trainer

    return run_metrics(demo_trainer({"supervision": supervision, "seed": seed, "max_steps": max_steps,
                                     "eval_steps": eval_steps, "eval_strategy": "steps", "eval_on_start": True,
                                     "save_steps": 0, "output_dir": str(out), "logging_steps": 5}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max_steps", type=int, default=200)
    ap.add_argument("--eval_steps", type=int, default=25)
    ap.add_argument("--work", default="outputs/bench-supervision")
    ap.add_argument("--name", default="supervision", help="results file names: benchmarks/results/<name>.md / .png")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    runs: dict[str, list[list[dict]]] = {"outcome": [], "process": []}
    start = time.time()
    for seed in args.seeds:
        for sup in runs:
            runs[sup].append(run(sup, seed, args.max_steps, args.eval_steps, Path(args.work) / f"{sup}-{seed}"))
            print(f"[{time.time() - start:.0f}s] {sup} seed {seed}: {at_step(runs[sup][-1], KEY, 0):.3f} → "
                  f"{at_step(runs[sup][-1], KEY, args.max_steps):.3f}", flush=True)
    steps, tables = curve_tables(runs, KEY, args.max_steps)
    import transformers

    md = ["# Outcome vs process supervision — arithmetic demo\n",
          f"`{' '.join(sys.argv)}` on {platform.machine()} ({os.cpu_count()} CPU cores), torch {torch.__version__}, "
          f"transformers {transformers.__version__}; seeds {args.seeds}; same base policy (46.0% greedy), "
          f"{args.max_steps} optimizer steps of 64 completions (8 prompts × G = 8), lr 5e-5, T = 0.7.\n",
          "Held-out greedy accuracy (%, 200 problems), mean ± std over seeds.\n", *tables]
    gains = [at_step(r, KEY, args.max_steps) - at_step(r, KEY, 0) for r in runs["process"]]
    verdict = "met" if statistics.mean(gains) >= 0.20 else f"missed by {100 * (0.20 - statistics.mean(gains)):.1f} pt"
    md += ["", f"Demo target (default settings = process supervision): +20 points. Measured "
               f"{mean_sd(gains)} points over {len(gains)} seeds: **{verdict}**."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    plot_curves(runs, KEY, steps, RESULTS / f"{args.name}.png", f"arithmetic demo, {len(args.seeds)} seeds (mean ± std)",
                labels={s: f"{s} supervision" for s in runs}, colors={"outcome": "tab:blue", "process": "tab:orange"})


if __name__ == "__main__":
    main()

"""Outcome vs per-turn process supervision on the built-in calculator task (groupwise.tasks.calculator): the policy
solves arithmetic by calling a calculator tool; the outcome reward is CalculatorEnv.get_reward (the answer), the
process rewards are CalculatorEnv.get_step_rewards (one per assistant turn: was the call a correct next operation;
the answer; step_split="turn"). Same base policy, same steps, same batch, several seeds; held-out greedy accuracy
(the final answer, through the tool loop) at a few points. The counterpart of benchmarks/supervision.py (text steps).

    .venv/bin/python benchmarks/turns.py [--seeds 0 1 2] [--supervisions outcome process both] [--max_steps 60]
                                         [--set step_advantage=step_return …] [--name turns]
Writes benchmarks/results/turns.md and turns.png (and prints the table); --name changes the file names (e.g. for
a check run that must not replace the published results). One run (60 steps, evaluations at 0/20/40/60) takes
about 2–2.5 minutes on 2 idle CPU cores, so the default 3 variants × 3 seeds take ~21 minutes (the run's seconds
are in the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, at_step, curve_tables, last, mean_sd, plot_curves, run_metrics  # noqa: E402

EVAL_KEY = "eval_rewards/CalculatorEnv/mean"  # held-out greedy accuracy: the environment's get_reward on 200 held-out problems
COLORS = {"outcome": "tab:blue", "process": "tab:orange", "both": "tab:green"}
LABELS = {"outcome": "outcome only", "process": "per-turn process", "both": "outcome + per-turn"}


def run(supervision: str, seed: int, max_steps: int, eval_steps: int, out: Path, extra: dict) -> list[dict]:
    from groupwise.demo import calculator_trainer

    return run_metrics(calculator_trainer({**extra, "supervision": supervision, "seed": seed, "max_steps": max_steps,
                                           "eval_steps": eval_steps, "eval_strategy": "steps", "eval_on_start": True,
                                           "save_strategy": "no", "output_dir": str(out), "logging_steps": 5}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--supervisions", nargs="+", default=["outcome", "process", "both"],
                    choices=["outcome", "process", "both"])
    ap.add_argument("--max_steps", type=int, default=60)
    ap.add_argument("--eval_steps", type=int, default=20)
    ap.add_argument("--work", default="outputs/bench-turns")
    ap.add_argument("--name", default="turns", help="results file names: benchmarks/results/<name>.md / .png")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="GRPOConfig fields for every run, e.g. step_advantage=step_return learning_rate=1e-4")
    args = ap.parse_args()
    import yaml

    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    torch.set_num_threads(os.cpu_count() or 1)
    from groupwise.demo import CALCULATOR_DEFAULTS, CALCULATOR_POLICY_DIR

    runs: dict[str, list[list[dict]]] = {sup: [] for sup in args.supervisions}
    seconds: dict[str, list[float]] = {sup: [] for sup in args.supervisions}
    start = time.time()
    for seed in args.seeds:
        for sup in runs:
            t0 = time.time()
            runs[sup].append(run(sup, seed, args.max_steps, args.eval_steps, Path(args.work) / f"{sup}-{seed}", extra))
            seconds[sup].append(time.time() - t0)
            print(f"[{time.time() - start:.0f}s] {sup} seed {seed} ({seconds[sup][-1]:.0f} s): "
                  f"{at_step(runs[sup][-1], EVAL_KEY, 0):.3f} → {at_step(runs[sup][-1], EVAL_KEY, args.max_steps):.3f}",
                  flush=True)
    steps, tables = curve_tables(runs, EVAL_KEY, args.max_steps)
    base = json.loads((CALCULATOR_POLICY_DIR / "provenance.json").read_text())["held_out_greedy"]["accuracy"]
    d = {**CALCULATOR_DEFAULTS, **extra}
    import transformers

    md = ["# Outcome vs per-turn process supervision — calculator tool task\n",
          f"`{' '.join(sys.argv)}` on {platform.machine()} ({os.cpu_count()} CPU cores), torch {torch.__version__}, "
          f"transformers {transformers.__version__}; seeds {args.seeds}; same base policy "
          f"(`calculator_policy`, {100 * base:.1f}% greedy), {args.max_steps} optimizer steps of "
          f"{d['per_device_train_batch_size']} rollouts ({d['per_device_train_batch_size'] // d['num_generations']} "
          f"prompts × G = {d['num_generations']}), lr {d['learning_rate']}, T = {d['temperature']}, "
          f"loss {d['loss_type']}, ≤ {d['max_tool_calling_iterations']} tool rounds, "
          f"max_completion_length {d['max_completion_length']}"
          + (f"; also {', '.join(f'{k}={v}' for k, v in extra.items())}" if extra else "") + ".\n",
          "Rewards (groupwise.tasks.calculator.CalculatorEnv): outcome = the answer given with the `answer` tool is "
          "right; process (`step_split=\"turn\"`) = one reward per assistant turn: 1 when its `calculate` call is a "
          "correct next operation (or its answer is right; the closing turn gets the outcome); both = the sum of "
          "the two normalised advantages (weights 1, 1).\n",
          "Held-out greedy accuracy (%, 200 problems, final answer through the tool loop), mean ± std over seeds.\n",
          *tables]
    md += ["", "At the last logged step (training rollouts, mean ± std over seeds) and the run's wall time:", "",
           "| supervision | tools/call_frequency | tools/failure_frequency | rewards/CalculatorEnv/mean | seconds |",
           "|---|---|---|---|---|"]
    for sup, rs in runs.items():
        md.append(f"| {sup} | {mean_sd([last(r, 'tools/call_frequency') for r in rs], 1, 2)} | "
                  f"{mean_sd([last(r, 'tools/failure_frequency') for r in rs], 1, 3)} | "
                  f"{mean_sd([last(r, 'rewards/CalculatorEnv/mean') for r in rs], 1, 3)} | "
                  f"{mean_sd(seconds[sup], 1, 0)} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    plot_curves(runs, EVAL_KEY, steps, RESULTS / f"{args.name}.png",
                f"calculator tool task, {len(args.seeds)} seed(s) (mean ± std)", LABELS, COLORS)


if __name__ == "__main__":
    main()

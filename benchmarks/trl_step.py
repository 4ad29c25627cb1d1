"""Seconds per GRPO training step: groupwise vs TRL 1.16 GRPOTrainer, same model, data and configuration.

    .venv/bin/pip install -e ".[bench]"          # TRL 1.16 (optional extra)
    .venv/bin/python benchmarks/trl_step.py [--steps 12]
Model: the demo policy (0.8 M-parameter Llama) on the arithmetic task with the outcome reward; G = 8,
64 completions per step (8 prompts), max 48 completion tokens, T = 0.7, β = 0, μ = 1, loss dapo, lr 5e-5. Each trainer
runs in its own process; the median step time after the first 2 steps is reported. float32 for both (TRL's
bf16 and gradient-checkpointing defaults turned off). Target: groupwise ≥ 3× faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = dict(num_generations=8, per_device_train_batch_size=64, max_completion_length=48, temperature=0.7,
                beta=0.0, learning_rate=5e-5, loss_type="dapo", logging_steps=1, seed=0)


def data():
    from groupwise.tasks import arithmetic

    return arithmetic.dataset(2000, split="train", seed=0)


def run_trl(steps: int, out: str, matched: bool = True) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from groupwise.demo import POLICY_DIR
    from groupwise.tasks import arithmetic

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    # TRL 1.16 defaults to bf16=True and gradient_checkpointing=True. "matched" turns both off, as in groupwise,
    # so that the two trainers run the same float32 computation; the other run keeps TRL's defaults.
    extra = dict(bf16=False, gradient_checkpointing=False, disable_dropout=True) if matched else {}
    args = GRPOConfig(output_dir=out, max_steps=steps, report_to="none", save_strategy="no", use_cpu=True,
                      top_k=0, **extra, **SETTINGS)
    trainer = GRPOTrainer(AutoModelForCausalLM.from_pretrained(POLICY_DIR), arithmetic.accuracy, args=args,
                          train_dataset=Dataset.from_list(data()),
                          processing_class=AutoTokenizer.from_pretrained(POLICY_DIR), callbacks=[Clock()])
    trainer.train()
    return times


def run_groupwise(steps: int, out: str) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise import GRPOConfig, GRPOTrainer
    from groupwise.demo import POLICY_DIR
    from groupwise.tasks import arithmetic

    args = GRPOConfig(output_dir=out, max_steps=steps, save_strategy="no", max_prompt_length=None, **SETTINGS)
    trainer = GRPOTrainer(AutoModelForCausalLM.from_pretrained(POLICY_DIR), arithmetic.accuracy, args=args,
                          train_dataset=data(), processing_class=AutoTokenizer.from_pretrained(POLICY_DIR))
    trainer.train()
    return [json.loads(x)["time/step"] for x in open(f"{out}/metrics.jsonl") if "time/step" in json.loads(x)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--which")
    args = ap.parse_args()
    if args.which:
        with tempfile.TemporaryDirectory() as out:
            if args.which == "groupwise":
                times = run_groupwise(args.steps, out)
            else:
                times = run_trl(args.steps, out, matched=args.which == "trl")
            print(json.dumps(times))
        return
    from common import write_table

    medians = {}
    for which in ("trl", "trl-defaults", "groupwise"):
        proc = subprocess.run([sys.executable, __file__, "--which", which, "--steps", str(args.steps)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{which} failed:\n{proc.stderr[-3000:]}")
        times = json.loads(proc.stdout.strip().splitlines()[-1])
        medians[which] = statistics.median(times[2:])
        print(which, f"{medians[which]:.3f} s/step", flush=True)
    import trl

    speedup = medians["trl"] / medians["groupwise"]
    write_table("trl_step", "Seconds per GRPO step: groupwise vs TRL",
                ["trainer", "s/step (median)", "speedup"],
                [[f"TRL {trl.__version__} GRPOTrainer, float32 (bf16 and gradient checkpointing off)",
                  f"{medians['trl']:.3f}", "1.00×"],
                 [f"TRL {trl.__version__} GRPOTrainer, its defaults (bf16 autocast, gradient checkpointing)",
                  f"{medians['trl-defaults']:.3f}", f"{medians['trl'] / medians['trl-defaults']:.2f}×"],
                 ["groupwise GRPOTrainer (defaults: float32, fast sampler)", f"{medians['groupwise']:.3f}",
                  f"{speedup:.2f}×"]],
                [f"{args.steps} steps each, median after 2 warm-up steps; settings {SETTINGS}. Target ≥ 3× against "
                 f"the same float32 configuration: **{'met' if speedup >= 3 else f'missed by {3 - speedup:.2f}×'}**.",
                 "At 0.8 M parameters both trainers are bound by per-call framework overhead, not arithmetic: the "
                 "sampler's savings (one prefill per group, finished rows leaving the batch) grow with model size "
                 "(see generation.md)."])


if __name__ == "__main__":
    main()

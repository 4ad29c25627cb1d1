"""The default run of `groupwise train` (and `make demo`): GRPO with process supervision on the built-in
multi-step arithmetic task, from the tiny warm-started policy shipped in the package. Offline, CPU, minutes.

Evaluates held-out greedy accuracy, trains, evaluates again, prints a before/after table and writes
metrics.jsonl (eval/accuracy at step 0 and at the end), the final checkpoint and reward_accuracy.png.
Any GRPOConfig field can be overridden: `groupwise train --supervision outcome --max_steps 50`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from groupwise.config import GRPOConfig

POLICY_DIR = Path(__file__).parent / "tasks" / "data" / "arithmetic_policy"

DEMO_DEFAULTS: dict[str, Any] = dict(
    output_dir="outputs/demo", supervision="process", max_steps=200, learning_rate=5e-5, num_generations=8,
    per_device_train_batch_size=64, max_completion_length=48, max_prompt_length=None, temperature=0.7,
    logging_steps=5, save_steps=100, eval_strategy="steps", eval_steps=50, eval_on_start=True, beta=0.0,
    lr_scheduler_type="constant", seed=0,
    per_device_eval_batch_size=200, loss_type="dapo",
    overwrite_output_dir=True,  # the demo is a scratch run: `make demo` twice replaces the first one's outputs
)
NUM_EVAL_PROBLEMS = 200


def demo_trainer(overrides: dict[str, Any]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.tasks import arithmetic
    from groupwise.trainer import GRPOTrainer

    args = GRPOConfig(**{**DEMO_DEFAULTS, **overrides})
    if not (POLICY_DIR / "model.safetensors").exists():
        raise FileNotFoundError(f"the demo policy is missing from {POLICY_DIR}; regenerate it with "
                                "`python scripts/make_demo_policy.py`")
    model = AutoModelForCausalLM.from_pretrained(POLICY_DIR)
    tokenizer = AutoTokenizer.from_pretrained(POLICY_DIR)
    process = arithmetic.PROCESS_REWARD_FUNCS if args.supervision != "outcome" else None
    return GRPOTrainer(model, arithmetic.REWARD_FUNCS, args=args,
                       train_dataset=arithmetic.dataset(20_000, split="train", seed=args.seed),
                       eval_dataset=arithmetic.dataset(NUM_EVAL_PROBLEMS, split="test"),
                       processing_class=tokenizer, process_reward_funcs=process)


def run_demo(overrides: dict[str, Any]) -> int:
    start = time.perf_counter()
    trainer = demo_trainer(overrides)
    trainer.train()
    if not trainer.dist.is_main:
        return 0
    out = Path(trainer.args.output_dir)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval/accuracy" in x]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    plot = plot_metrics(out / "metrics.jsonl", out / "reward_accuracy.png")
    print("\n  held-out greedy accuracy (%d problems)\n" % NUM_EVAL_PROBLEMS
          + "  ┌──────────┬──────────┬──────────┐\n  │  before  │  after   │  change  │\n"
          + "  ├──────────┼──────────┼──────────┤\n"
          + f"  │  {before:6.1%}  │  {after:6.1%}  │ {100 * (after - before):+5.1f} pt │\n"
          + "  └──────────┴──────────┴──────────┘\n"
          + f"  supervision {trainer.args.supervision}, {trainer.global_step} steps, "
          + f"{time.perf_counter() - start:.0f} s\n  metrics {out / 'metrics.jsonl'}\n"
          + f"  model   {out / f'checkpoint-{trainer.global_step}'}\n" + (f"  plot    {plot}\n" if plot else ""))
    return 0


def plot_metrics(jsonl: Path, png: Path, train_key: str = "reward/mean", eval_key: str = "eval/accuracy"):
    """Training reward and held-out accuracy against step. Needs matplotlib (`pip install groupwise[plot]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"  (no plot: matplotlib is not installed; `pip install groupwise[plot]` for {png.name})")
        return None
    lines = [json.loads(x) for x in Path(jsonl).read_text().splitlines()]
    train = [(x["step"], x[train_key]) for x in lines if x.get(train_key) is not None]
    evals = [(x["step"], x[eval_key]) for x in lines if x.get(eval_key) is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label=f"train {train_key}", color="tab:blue")
    if evals:
        ax.plot(*zip(*evals), "o-", label=f"held-out {eval_key} (greedy)", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png

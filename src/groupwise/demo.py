"""The default run of `groupwise train` (and `make demo`): GRPO with process supervision on the built-in
multi-step arithmetic task, from the tiny warm-started policy shipped in the package. Offline, CPU, minutes.

Evaluates held-out greedy accuracy, trains, evaluates again, prints a before/after table and writes
metrics.jsonl (eval_rewards/accuracy/mean at step 0, every 50 steps and at the end), the final checkpoint and reward_accuracy.png.
Any GRPOConfig field can be overridden: `groupwise train --supervision outcome --max_steps 50`.

`groupwise train builtin:<task>` runs the demo of that built-in task (DEMOS): `builtin:arithmetic` is the default
run above; `builtin:calculator` trains the shipped calculator policy to solve arithmetic by calling a calculator
tool (groupwise.tasks.calculator, docs/calculator.md): outcome + per-turn process supervision by default
(supervision "both", step_split "turn"), `--supervision outcome` or `process` for one of the two.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupwise.config import GRPOConfig
from groupwise.core.supervision import SUPERVISIONS

POLICY_DIR = Path(__file__).parent / "tasks" / "data" / "arithmetic_policy"
CALCULATOR_POLICY_DIR = Path(__file__).parent / "tasks" / "data" / "calculator_policy"

DEMO_DEFAULTS: dict[str, Any] = dict(
    output_dir="outputs/demo", supervision="process", max_steps=200, learning_rate=5e-5, num_generations=8,
    per_device_train_batch_size=64, max_completion_length=48, max_prompt_length=None, temperature=0.7,
    logging_steps=5, save_steps=100, eval_strategy="steps", eval_steps=50, eval_on_start=True, beta=0.0,
    lr_scheduler_type="constant", seed=0,
    per_device_eval_batch_size=200, loss_type="dapo",
    overwrite_output_dir=True,  # the demo is a scratch run: `make demo` twice replaces the first one's outputs
)
NUM_EVAL_PROBLEMS = 200

# builtin:calculator — multi-turn rollouts with CalculatorEnv; every field can be overridden as above
CALCULATOR_DEFAULTS: dict[str, Any] = dict(
    output_dir="outputs/calculator", supervision="both", max_steps=60, learning_rate=5e-5, num_generations=8,
    per_device_train_batch_size=64, max_completion_length=160, max_prompt_length=None, temperature=0.7,
    max_tool_calling_iterations=5, logging_steps=5, save_steps=0, eval_strategy="steps", eval_steps=20,
    eval_on_start=True, beta=0.0, lr_scheduler_type="constant", seed=0, per_device_eval_batch_size=200,
    loss_type="dapo", generation_compile=False, overwrite_output_dir=True,
    on_reward_error="nan",  # a rollout whose rewards fail is left unscored (and counted), not fatal
)


def _check_table(values: dict[str, Any], task: str) -> None:
    """The before/after table reads the evaluation of step 0 and of the last step: refused before the policy loads
    when the settings (the demo's defaults and the overrides) leave it without one."""
    from groupwise.config_base import ConfigError

    args = GRPOConfig(**values)
    if not args.eval_on_start or args.eval_strategy == "no":
        off = "eval_on_start=False" if not args.eval_on_start else "eval_strategy='no'"
        raise ConfigError(f"{off}: the builtin:{task} demo prints held-out accuracy before and after training, from "
                          "the evaluations at step 0 and at the last step; leave eval_on_start and eval_strategy at "
                          "the demo's values (true, 'steps'), or write a config to train without evaluating")


def _load_policy(folder: Path, script: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"the demo policy is missing from {folder}; regenerate it with `python {script}`")
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def calculator_trainer(overrides: dict[str, Any]):
    """builtin:calculator: the shipped calculator policy, CalculatorEnv (its get_reward is the outcome reward, its
    get_step_rewards one reward per assistant turn), 20,000 training problems, 200 held-out ones (greedy accuracy
    = eval_rewards/CalculatorEnv/mean). supervision process / both default to step_split "turn"."""
    from groupwise.tasks import calculator
    from groupwise.trainer import GRPOTrainer

    values = {**CALCULATOR_DEFAULTS, **overrides}
    if values["supervision"] != "outcome" and "step_split" not in overrides:
        values["step_split"] = "turn"  # a reward per assistant turn, from CalculatorEnv.get_step_rewards
    args = GRPOConfig(**values)
    model, tokenizer = _load_policy(CALCULATOR_POLICY_DIR, "scripts/make_calculator_policy.py")
    return GRPOTrainer(model, args=args, train_dataset=calculator.dataset(20_000, split="train", seed=args.seed),
                       eval_dataset=calculator.dataset(NUM_EVAL_PROBLEMS, split="test"), processing_class=tokenizer,
                       environment_factory=calculator.CalculatorEnv)


def demo_trainer(overrides: dict[str, Any]):
    from groupwise.tasks import arithmetic
    from groupwise.trainer import GRPOTrainer

    from groupwise.config_base import ConfigError
    from groupwise.rewards.steps import SPLIT_MODES

    args = GRPOConfig(**{**DEMO_DEFAULTS, **overrides})
    if SPLIT_MODES[args.step_split].turns:
        raise ConfigError(f"step_split={args.step_split!r} makes each assistant turn a step, but builtin:arithmetic's "
                          "completions are one turn of text: leave step_split unset (builtin:calculator has turns)")
    model, tokenizer = _load_policy(POLICY_DIR, "scripts/make_demo_policy.py")
    process = arithmetic.PROCESS_REWARD_FUNCS if SUPERVISIONS[args.supervision].process else None
    return GRPOTrainer(model, arithmetic.REWARD_FUNCS, args=args,
                       train_dataset=arithmetic.dataset(20_000, split="train", seed=args.seed),
                       eval_dataset=arithmetic.dataset(NUM_EVAL_PROBLEMS, split="test"),
                       processing_class=tokenizer, process_reward_funcs=process)


@dataclass(frozen=True)
class Demo:
    make_trainer: Callable[[dict[str, Any]], Any]  # GRPOConfig overrides -> GRPOTrainer
    eval_key: str  # the held-out greedy accuracy metric
    title: str  # printed above the before/after table
    defaults: dict[str, Any]  # the GRPOConfig values make_trainer starts from


# builtin:<task> -> its demo
DEMOS: dict[str, Demo] = {
    "arithmetic": Demo(demo_trainer, "eval_rewards/accuracy/mean", "", DEMO_DEFAULTS),
    "calculator": Demo(calculator_trainer, "eval_rewards/CalculatorEnv/mean", "builtin:calculator, ",  # get_reward
                       CALCULATOR_DEFAULTS),
}


def run_demo(overrides: dict[str, Any], task: str = "arithmetic") -> int:
    start = time.perf_counter()
    demo = DEMOS[task]
    eval_key = demo.eval_key
    _check_table({**demo.defaults, **overrides}, task)
    trainer = demo.make_trainer(overrides)
    trainer.train()
    evals = {x["step"]: x[eval_key] for x in trainer.state.log_history if eval_key in x}  # step 0's kept on resume
    # an evaluation is collective: every process evaluates when any lacks the last step's (a process resumed from an
    # old checkpoint may hold no history)
    if trainer.dist.any(trainer.global_step not in evals):
        evals[trainer.global_step] = trainer.evaluate()[eval_key]
    if not trainer.dist.is_main:
        return 0
    before, after = evals.get(0), evals[trainer.global_step]
    out = Path(trainer.args.output_dir)
    k = trainer.args.num_generations_eval
    kind = "greedy accuracy" if k is None else f"accuracy (mean of {k} samples)"
    plot = plot_metrics(out / "metrics.jsonl", out / "reward_accuracy.png", eval_key=eval_key)
    took = f"{time.perf_counter() - start:.0f} s"
    if trainer._first_step:  # resumed: the time is this call's steps only
        took += (f" (steps {trainer._first_step + 1}-{trainer.global_step}, resumed from "
                 f"checkpoint-{trainer._first_step})")
    print(f"\n  {demo.title}held-out {kind} ({NUM_EVAL_PROBLEMS} problems)\n"
          + "  ┌──────────┬──────────┬──────────┐\n  │  before  │  after   │  change  │\n"
          + "  ├──────────┼──────────┼──────────┤\n"
          + f"  │  {_share(before)}  │  {_share(after)}  │ {_points(before, after)} │\n"
          + "  └──────────┴──────────┴──────────┘\n"
          + f"  supervision {trainer.args.supervision}, {trainer.global_step} steps, {took}\n"
          + f"  metrics {out / 'metrics.jsonl'}\n"
          + (f"  model   {ckpt}\n" if (ckpt := out / f"checkpoint-{trainer.global_step}").is_dir() else
             "  model   not saved (save_strategy / save_steps wrote no checkpoint)\n")
          + (f"  plot    {plot}\n" if plot else ""))
    return 0


def _share(value) -> str:
    """A table cell: the accuracy as a percentage, or n/a (no evaluation, or every reward failed: None / NaN)."""
    return f"{value:6.1%}" if isinstance(value, float) and math.isfinite(value) else "  n/a "


def _points(before, after) -> str:
    if any(not isinstance(v, float) or not math.isfinite(v) for v in (before, after)):
        return "   n/a  "
    return f"{100 * (after - before):+5.1f} pt"


def plot_metrics(jsonl: Path, png: Path, train_key: str = "reward", eval_key: str = "eval_rewards/accuracy/mean"):
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

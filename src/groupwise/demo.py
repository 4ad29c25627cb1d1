"""The default run of `groupwise train` / `make demo`: the built-in toy task on a tiny model built in-process.
Prints the mean reward before and after training."""

from __future__ import annotations

from typing import Any

from groupwise.config import GRPOConfig

DEMO_DEFAULTS: dict[str, Any] = dict(
    output_dir="outputs/demo", max_steps=100, learning_rate=1e-2, num_generations=8, per_device_train_batch_size=32,
    max_completion_length=12, max_prompt_length=None, logging_steps=10, save_steps=50, beta=0.0,
    lr_scheduler_type="constant", per_device_eval_batch_size=32, seed=0,
)


def run_demo(overrides: dict[str, Any]) -> int:
    from groupwise.tasks import toy
    from groupwise.trainer import GRPOTrainer

    args = GRPOConfig(**{**DEMO_DEFAULTS, **overrides})
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(tokenizer, seed=args.seed)
    trainer = GRPOTrainer(model, toy.REWARD_FUNCS, args=args, train_dataset=toy.dataset(256, seed=1),
                          eval_dataset=toy.dataset(32, seed=2), processing_class=tokenizer)
    before = trainer.evaluate()["eval/reward/mean"]
    trainer.train()
    after = trainer.evaluate()["eval/reward/mean"]
    if trainer.dist.is_main:
        print(f"\n  greedy eval reward   before {before:.3f}   after {after:.3f}\n"
              f"  metrics: {args.output_dir}/metrics.jsonl   final model: {args.output_dir}/checkpoint-{trainer.global_step}")
    return 0

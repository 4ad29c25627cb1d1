"""Outcome-supervised GRPO with a plain reward function, fully offline: a tiny model is built in-process.

    python examples/outcome_reward.py
Replace `build_model` / `build_tokenizer` with `"Qwen/Qwen2.5-0.5B-Instruct"` (or any local causal LM) for real work.
"""

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks import toy


def short_and_on_letter(completions, letter, **kwargs):
    """Reward completions made of the prompt's letter; an empty completion is worse than any attempt
    (without that, stopping at once is the easiest way to avoid the length penalty: reward hacking)."""
    return [text.count(c) / len(text) - 0.01 * len(text) if text else -0.5 for text, c in zip(completions, letter)]


def main(**overrides):
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(tokenizer, seed=0)
    args = GRPOConfig(**{"output_dir": "outputs/example-outcome", "overwrite_output_dir": True,
                         "num_generations": 8, "per_device_train_batch_size": 32, "max_completion_length": 12,
                         "max_steps": 30, "learning_rate": 1e-2, "logging_steps": 10, "lr_scheduler_type": "constant",
                         "log_completions": True, "num_completions_to_print": 2, **overrides})
    trainer = GRPOTrainer(model, short_and_on_letter, args=args, train_dataset=toy.dataset(128),
                          processing_class=tokenizer)
    metrics = trainer.train()
    print(f"final mean reward {metrics['reward']:.3f}")
    return trainer


if __name__ == "__main__":
    main()

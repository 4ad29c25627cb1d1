"""TRL's asynchronous reward functions (TRL 1.16 docs, grpo_trainer.md, "Example 5: Asynchronous reward functions"
and "Passing the reward function to the trainer"), run with groupwise: a synchronous reward and two `async def`
rewards in one list; the async ones are awaited concurrently within each step.

Differences from TRL's snippets: the import line, the model and dataset (a tiny local model and 4 prompts), and a
GRPOConfig small enough for a CPU.
"""

import asyncio

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks.toy import math_dataset, save_tiny_model


def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion[0]["content"])) for completion in completions]


async def async_reward_func1(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion[0]["content"] else 0.0 for completion in completions]


async def async_reward_func2(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(completion[0]["content"].count("1")) for completion in completions]


trainer = GRPOTrainer(
    model=save_tiny_model("tiny-chat-model"),
    reward_funcs=[reward_func, async_reward_func1, async_reward_func2],
    args=GRPOConfig(output_dir="async-reward", max_steps=2, max_completion_length=32, num_generations=4,
                    per_device_train_batch_size=8, logging_steps=1),
    train_dataset=math_dataset(4),
)
trainer.train()

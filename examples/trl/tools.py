"""TRL's tool-calling example (TRL docs, grpo_trainer.md, "Agent Training → Tools"), run with groupwise.

Differences from TRL's: the import lines (`groupwise` for `trl`), and the model: a tiny model whose tokenizer has a
tool-calling chat template, saved to a local folder, stands in for a tool-calling model such as Qwen/Qwen3-0.6B, so
the script runs offline on a CPU in seconds. Where the docs write `...` the script spells out a dataset of prompts and
a reward on the final answer (`completion[-1]["content"]`, as TRL's examples/scripts/grpo_agent.py), and a short
max_completion_length. A random tiny model seldom writes a well-formed tool call; tests/test_agents_training.py
trains with tool calls that run.
"""

from datasets import Dataset

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks.toy import save_tiny_tool_model


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def correctness_reward(completions, answer, **kwargs):
    """1 when the final message states the answer."""
    return [1.0 if str(ans) in completion[-1]["content"] else 0.0 for completion, ans in zip(completions, answer)]


dataset = Dataset.from_list([
    {"prompt": [{"role": "user", "content": f"What is {a} * {b} + {c}? Use the tools."}], "answer": a * b + c}
    for a, b, c in [(3, 4, 1), (2, 5, 3), (6, 7, 2), (9, 8, 4)]
])

trainer = GRPOTrainer(
    model=save_tiny_tool_model("tiny-tool-model"),  # TRL: a tool-calling model, e.g. "Qwen/Qwen3-0.6B"
    reward_funcs=correctness_reward,
    args=GRPOConfig(output_dir="tools", max_steps=2, max_completion_length=128, max_tool_calling_iterations=2,
                    logging_steps=1),
    train_dataset=dataset,
    tools=[multiply, async_add],
)
trainer.train()

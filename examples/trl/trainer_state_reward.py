"""A curriculum reward that reads `trainer_state`, and logs with `log_metric` / `log_extra`: the reward-function
keywords TRL 1.16 documents (grpo_trainer.md, "Using a custom reward function": `trainer_state` "can be used to
implement dynamic reward functions, such as curriculum learning, where the reward is adjusted based on the training
progress"). TRL's docs describe this protocol without a full script; this is the script, written to it.

Differences from a TRL script: the import line, and the model and dataset (a tiny local model and 4 prompts).
"""

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks.toy import math_dataset, save_tiny_model


def curriculum_reward(completions, solution, trainer_state, log_metric=None, log_extra=None, **kwargs):
    """Early on, any digit earns reward; as training progresses, only the right answer does."""
    progress = trainer_state.global_step / trainer_state.max_steps  # 0 → 1 over the run
    texts = [completion[0]["content"] for completion in completions]
    exact = [1.0 if sol in text else 0.0 for text, sol in zip(texts, solution)]
    digits = [min(sum(ch.isdigit() for ch in text), 4) / 4 for text in texts]
    rewards = [progress * e + (1 - progress) * d for e, d in zip(exact, digits)]
    if log_metric is not None:
        log_metric("curriculum/progress", progress)  # lands in metrics.jsonl
    if log_extra is not None:
        log_extra("exact", exact)  # a column of completions.jsonl
    return rewards


trainer = GRPOTrainer(
    model=save_tiny_model("tiny-chat-model"),
    reward_funcs=curriculum_reward,
    args=GRPOConfig(output_dir="curriculum", max_steps=3, max_completion_length=32, num_generations=4,
                    per_device_train_batch_size=8, logging_steps=1),
    train_dataset=math_dataset(8),
)
trainer.train()

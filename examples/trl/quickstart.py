"""TRL's GRPO quick start (TRL 1.16 docs, grpo_trainer.md, "Quick start"), run with groupwise.

Differences from TRL's script: the import lines (`groupwise` for `trl`), and the model and dataset: a tiny model
saved to a local folder and 4 math prompts stand in for Qwen/Qwen2-0.5B-Instruct and trl-lib/DeepMath-103K, so the
script runs offline on a CPU in seconds. With the real model and dataset it is TRL's script.
"""

from groupwise import GRPOTrainer
from groupwise.rewards import accuracy_reward
from groupwise.tasks.toy import math_dataset, save_tiny_model

dataset = math_dataset(4)  # TRL: load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model=save_tiny_model("tiny-chat-model"),  # TRL: "Qwen/Qwen2-0.5B-Instruct"
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()

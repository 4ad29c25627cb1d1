"""Worker of the two-process tool test (tests/test_agents_training.py): rank 0's rows call tools for two rounds, rank
1's answer at once, so rank 1 generates once per round while rank 0 generates three times."""

import dataclasses
import json
import sys
from pathlib import Path

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks import toy
from tests.agents_support import TOKENIZER, Scripted, call, multiply, user


def reply(prompt: str) -> str:
    if "<|im_start|>user\nB" in prompt:
        return "B done<|im_end|>"
    turns = [call("multiply", a=3, b=4), call("nope"), "A done"]
    return turns[prompt.count("<|im_start|>tool")] + "<|im_end|>"


class FailsOnRank1:
    """An environment whose reset raises on process 1 in the second round (an unreachable service, say)."""

    resets = 0

    def __init__(self):
        import os

        self.rank = int(os.environ.get("RANK", "0"))

    def reset(self, **row) -> None:
        type(self).resets += 1
        if self.rank == 1 and type(self).resets > 2:
            raise RuntimeError("environment service unreachable")


def fails(out: str) -> None:
    """Round 2: process 1's environment fails; both processes must stop at once with its message (not wait in the
    next collective until ddp_timeout, 120 s here)."""
    args = GRPOConfig(output_dir=out, num_generations=2, per_device_train_batch_size=2, max_completion_length=40,
                      max_steps=3, logging_steps=1, save_steps=0, seed=0, ddp_timeout=120)
    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32, num_layers=1, max_positions=1024)
    trainer = GRPOTrainer(model, lambda completions, **_: [float(len(c)) for c in completions], args=args,
                          processing_class=TOKENIZER, train_dataset=[{"prompt": user("A")}, {"prompt": user("B")}],
                          environment_factory=FailsOnRank1)
    trainer.rollout_ctx = dataclasses.replace(trainer.rollout_ctx, generator=Scripted(lambda p: "ok<|im_end|>"))
    trainer.train()


def main(out: str) -> None:
    args = GRPOConfig(output_dir=out, num_generations=2, per_device_train_batch_size=2, max_completion_length=400,
                      max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=0, seed=0, shuffle_dataset=False)
    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32, num_layers=1, max_positions=1024)
    trainer = GRPOTrainer(model, lambda completions, **_: [float(len(c)) for c in completions], args=args,
                          processing_class=TOKENIZER, train_dataset=[{"prompt": user("A")}, {"prompt": user("B")}],
                          tools=[multiply])
    gen = Scripted(reply)
    trainer.rollout_ctx = dataclasses.replace(trainer.rollout_ctx, generator=gen)
    trainer.train()
    Path(out, f"result_{trainer.dist.rank}.json").write_text(json.dumps({"calls": gen.calls}))


if __name__ == "__main__":
    (fails if sys.argv[2:] == ["fails"] else main)(sys.argv[1])

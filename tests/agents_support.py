"""Shared by the tool-calling tests: a generator backend that plays a script (the model's turns chosen by the test),
tools with TRL's docstrings, and a rollout context on the tool-capable toy tokenizer."""

from __future__ import annotations

import torch

from groupwise import GRPOConfig
from groupwise import rollout as R
from groupwise.agents import Agent, Toolbox
from groupwise.distributed import Distributed
from groupwise.generation import Generated
from groupwise.tasks import toy

TOKENIZER = toy.build_tool_tokenizer()
SAMPLING_LOGP = -0.25  # what the scripted sampler reports for each token it "drew"


def call(name: str, **arguments) -> str:
    """A tool call as the toy template's model writes it."""
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Scripted:
    """A generator backend (groupwise.generation protocol) whose completion for each row is `reply(prompt text)`,
    the prompt decoded with its special tokens. Records the rows of each call."""

    def __init__(self, reply, tokenizer=TOKENIZER):
        self.reply, self.tok, self.calls, self.prompts, self.limits = reply, tokenizer, [], [], []

    def __call__(self, model, prompt_ids, prompt_mask, *, greedy=False, logprobs=False, max_new_tokens=None):
        texts = [self.tok.decode(ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)]
        self.calls.append(len(texts))
        self.prompts.append(texts)
        self.limits.append(max_new_tokens)
        outs = [self.tok(self.reply(t), add_special_tokens=False)["input_ids"][:max_new_tokens] for t in texts]
        ids = torch.full((len(outs), max(map(len, outs))), self.tok.pad_token_id)
        for i, o in enumerate(outs):
            ids[i, :len(o)] = torch.tensor(o)
        return Generated(ids, torch.full(ids.shape, SAMPLING_LOGP) if logprobs else None)

    def update_weights(self, model):
        pass


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


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def context(reply, *, tools=(multiply, add), environment_factory=None, reward_sources=(), correct_sampling=False,
            **fields) -> tuple[R.RolloutContext, Scripted]:
    """A rollout context whose generator plays `reply`, on TOKENIZER, with these tools."""
    base = dict(num_generations=2, per_device_train_batch_size=2, max_completion_length=400)
    args = GRPOConfig(**{**base, **fields})
    gen = Scripted(reply)
    toolbox = Toolbox(list(tools), environment_factory)
    ctx = R.RolloutContext(args=args, tokenizer=TOKENIZER, generator=gen, dist=Distributed(),
                           eos_token_ids=[TOKENIZER.eos_token_id], agent=Agent.from_config(toolbox, TOKENIZER, args),
                           reward_sources=list(reward_sources) + toolbox.reward_sources,
                           correct_sampling=correct_sampling)
    return ctx, gen


def spans(ids: list[int], mask: list[int], tokenizer=TOKENIZER) -> list[tuple[int, str]]:
    """(mask value, decoded text) of each run of equal mask values: the trace format of the TRL report."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            out.append((mask[start], tokenizer.decode(ids[start:k])))
            start = k
    return out


def two_calls(prompt: str) -> str:
    """The model's turns: multiply(3, 4), then add(12, 1), then the answer; 'no tools' in the prompt: the answer."""
    if "no tools" in prompt:
        return "no tools here<|im_end|>"
    return ["Let me compute." + call("multiply", a=3, b=4) + "<|im_end|>", call("add", a=12, b=1) + "<|im_end|>",
            "The answer is 13.<|im_end|>"][prompt.count("<|im_start|>tool")]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Opening:
    """A generator whose first turn is scripted (`opening(prompt text)`, e.g. a tool call a random tiny model would
    never write) and whose later turns are the real backend's: for end-to-end training with tools."""

    def __init__(self, real, opening, tokenizer=TOKENIZER):
        self.real, self.script = real, Scripted(opening, tokenizer)
        self.calls: list[tuple[str, int]] = []

    def __call__(self, model, prompt_ids, prompt_mask, *, greedy=False, logprobs=False, max_new_tokens=None):
        texts = [self.script.tok.decode(ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)]
        first = all("<|im_start|>tool" not in t for t in texts)
        self.calls.append(("script" if first else "model", len(texts)))
        backend = self.script if first else self.real
        return backend(model, prompt_ids, prompt_mask, greedy=greedy, logprobs=logprobs,
                       max_new_tokens=max_new_tokens)

    def update_weights(self, model):
        self.real.update_weights(model)

"""Generation with transformers' `model.generate` (the reference backend)."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

from groupwise.generation import Generated
from groupwise.modeling import eval_mode


class TransformersGenerator:
    @classmethod
    def from_config(cls, args, *, pad_token_id: int, eos_token_ids: list[int], dist=None) -> "TransformersGenerator":
        return cls(max_completion_length=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, generation_kwargs=args.generation_kwargs)

    def __init__(self, *, max_completion_length: int, temperature: float, top_p: float, top_k: int,
                 min_p: float | None, repetition_penalty: float, pad_token_id: int, eos_token_ids: list[int],
                 generation_kwargs: dict | None = None):
        common = dict(max_new_tokens=max_completion_length, pad_token_id=pad_token_id, eos_token_id=eos_token_ids,
                      repetition_penalty=repetition_penalty)
        sample = dict(common, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        # generation_kwargs override the fields above (TRL); the log-probs stay at the configured temperature (TRL).
        # The outputs' form is set in the configs (generate() deprecates output arguments next to a config).
        self.temperature = temperature
        out = dict(return_dict_in_generate=True, output_logits=False)
        self.sample_config = GenerationConfig(**{**sample, **(generation_kwargs or {}), **out})
        self.greedy_config = GenerationConfig(**{**common, **(generation_kwargs or {}), **out, "do_sample": False})
        self.configs = {}  # (greedy, logprobs) → config
        for greedy, config in ((False, self.sample_config), (True, self.greedy_config)):
            self.configs[greedy, False] = config
            self.configs[greedy, True] = copy.deepcopy(config)
            self.configs[greedy, True].output_logits = True

    def update_weights(self, model) -> None:
        """Samples from the policy module itself: new weights are already there."""

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False) -> Generated:
        with eval_mode(model):
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                 generation_config=self.configs[greedy, logprobs])
        ids = out.sequences[:, prompt_ids.size(1):]  # (N, T)
        if not logprobs:
            return Generated(ids)
        # raw logits of each step (before any processor), at the sampling temperature: log π_θold of the token
        logits = torch.stack(out.logits, dim=1).float() / self.temperature  # (N, T, V)
        return Generated(ids, torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1))

"""Generation with transformers' `model.generate` (the reference backend)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig


class TransformersGenerator:
    def __init__(self, *, max_completion_length: int, temperature: float, top_p: float, top_k: int,
                 min_p: float | None, repetition_penalty: float, pad_token_id: int, eos_token_ids: list[int],
                 generation_kwargs: dict | None = None):
        common = dict(max_new_tokens=max_completion_length, pad_token_id=pad_token_id, eos_token_id=eos_token_ids,
                      repetition_penalty=repetition_penalty, **(generation_kwargs or {}))
        self.sample_config = GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                                              min_p=min_p, **common)
        self.greedy_config = GenerationConfig(do_sample=False, **common)

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False) -> torch.Tensor:
        was_training = model.training
        model.eval()
        try:
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                 generation_config=self.greedy_config if greedy else self.sample_config)
        finally:
            model.train(was_training)
        return out[:, prompt_ids.size(1):]  # (N, T)

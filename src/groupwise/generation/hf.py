"""Generation with transformers' `model.generate` (the reference backend)."""

from __future__ import annotations

import contextlib

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
        # TRL's fields, disable_compile=True included (generate() would compile a model whose generation config
        # asks for a static cache on CUDA; TRL turns that off); num_beams=1: a model's generation_config asking for
        # beams would otherwise make generate() beam-sample (TRL does), and beams are not samples of the policy
        common = dict(max_new_tokens=max_completion_length, pad_token_id=pad_token_id, eos_token_id=eos_token_ids,
                      repetition_penalty=repetition_penalty, disable_compile=True, num_beams=1)
        sample = dict(common, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        # generation_kwargs override the fields above (TRL); the log-probs stay at the configured temperature (TRL).
        # The outputs' form is set in the configs (generate() deprecates output arguments next to a config); the
        # sampled tokens' log-probs are read step by step (_StepLogprobs), not from output_logits, which keeps every
        # step's (N, V) logits until generate() returns (N · T · V floats: 74 GiB at 128 × 1024 × 152k)
        self.temperature = temperature
        out = dict(return_dict_in_generate=True, output_logits=False)
        self.configs = {False: GenerationConfig(**{**sample, **(generation_kwargs or {}), **out}),
                        True: GenerationConfig(**{**common, **(generation_kwargs or {}), **out, "do_sample": False})}

    def update_weights(self, model) -> None:
        """Samples from the policy module itself: new weights are already there."""

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False,
                 max_new_tokens: int | None = None) -> Generated:
        steps = _StepLogprobs(self.temperature) if logprobs else None
        limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}  # a later tool turn's
        with eval_mode(model), (steps.watching(model) if steps else contextlib.nullcontext()):
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                 generation_config=self.configs[greedy], **limit)
        ids = out.sequences[:, prompt_ids.size(1):]  # (N, T)
        return Generated(ids, steps.values(ids) if steps else None)


class _StepLogprobs:
    """The log-prob of each sampled token under the raw logits of its step (before any processor), at the sampling
    temperature: log softmax(z_t / τ)[y_t], log π_θold of the token as the trainer computes it. A forward hook on the
    model generate() runs keeps one step's log-softmax, (N, V), until the next forward shows which token was chosen
    from it (the last token of that forward's input_ids); the last step's is gathered from the sequences."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.last: torch.Tensor | None = None  # (N, V): the latest step's log-softmax, its token not yet seen
        self.taken: list[torch.Tensor] = []  # (N,) per step whose token was seen

    @contextlib.contextmanager
    def watching(self, model):
        get_base = getattr(model, "get_base_model", None)  # a PEFT model's generate() runs its base model's forward
        handle = (get_base() if callable(get_base) else model).register_forward_hook(self._hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _hook(self, module, args, kwargs, output) -> None:
        if self.last is not None:
            ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
            self.taken.append(self.last.gather(-1, ids[:, -1:]).squeeze(-1))
        logits = output.logits if hasattr(output, "logits") else output[0]
        self.last = torch.log_softmax(logits[:, -1].float() / self.temperature, -1)

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, T) for the completion ids generate() returned."""
        if self.last is None or len(self.taken) + 1 != ids.size(1):
            raise RuntimeError(f"the transformers backend saw {len(self.taken) + (self.last is not None)} forward "
                               f"passes for {ids.size(1)} generated tokens: its log-probs cannot be matched to the "
                               "tokens (a generation mode other than sampling or greedy in generation_kwargs?)")
        last = self.last.gather(-1, ids[:, -1:]).squeeze(-1)
        return torch.stack([*self.taken, last], dim=1)

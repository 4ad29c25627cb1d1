"""A fast sampler for transformers causal LMs, built for GRPO's shape of work: B prompts × G completions.

- The prompt of each group is encoded once (one prefill of B rows, not B·G); its KV cache is then repeated for the
  G completions (prompt compute is shared; the cached tensors are copied, not aliased).
- All rows decode in one batch; rows that finish leave it (the cache is compacted once a tenth of the batch
  has finished, so the copy is amortised).
- The KV cache grows by doubling a preallocated buffer and writing into it, instead of concatenating a new tensor
  at every step (transformers' DynamicLayer).
- Logits are processed by transformers' own processors, in generate()'s order (repetition penalty, temperature,
  top-k, top-p, min-p), and sampled with torch.multinomial as generate() does; greedy equals generate() token for
  token (tested).
- With logprobs=True it also returns log softmax(logits / temperature) of each sampled token: the quantity the
  trainer computes as log π_θold, from the sampler's own forward (what an importance-sampling correction compares;
  not used by the trainer yet).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from groupwise.generation import Generated
from groupwise.modeling import accepts_kwarg, eval_mode, position_ids_from_mask


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a buffer with spare capacity: appending writes into the buffer
    (amortised O(1) per token) and `keys`/`values` are views of its filled part."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._length = 0
            self._k = self._v = None
        n = key_states.shape[-2]
        need = self._length + n
        if self._k is None or need > self._k.shape[-2]:
            cap = max(need, 2 * (self._k.shape[-2] if self._k is not None else n), 16)
            shape = (*key_states.shape[:-2], cap, key_states.shape[-1])
            k = key_states.new_empty(shape)
            v = value_states.new_empty(shape[:-1] + (value_states.shape[-1],))
            if self._length:
                k[..., :self._length, :] = self._k[..., :self._length, :]
                v[..., :self._length, :] = self._v[..., :self._length, :]
            self._k, self._v = k, v
        self._k[..., self._length:need, :] = key_states
        self._v[..., self._length:need, :] = value_states
        self._length = need
        self.keys, self.values = self._k[..., :need, :], self._v[..., :need, :]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self._length:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self.keys, self.values = self._k[..., :self._length, :], self._v[..., :self._length, :]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self._length:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[..., :self._length, :], self._v[..., :self._length, :]


def _growing_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if not cache.layers:  # a config without layer types: one layer per decoder layer
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        cache.layers = [DynamicLayer() for _ in range(n)]
    # plain full-attention layers grow in place; other layer kinds (sliding window, …) keep their own logic
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class FastGenerator:
    """Generator backend (see groupwise.generation). Rows with identical prompts must be contiguous in groups of
    `group_size` for the prompt to be shared; otherwise each row is its own group."""

    @classmethod
    def from_config(cls, args, *, pad_token_id: int, eos_token_ids: list[int]) -> "FastGenerator":
        return cls(max_completion_length=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, group_size=args.num_generations)

    def __init__(self, *, max_completion_length: int, temperature: float, top_p: float, top_k: int,
                 min_p: float | None, repetition_penalty: float, pad_token_id: int, eos_token_ids: list[int],
                 group_size: int = 1, compact_fraction: float = 0.1):
        self.max_new = max_completion_length
        self.pad_token_id, self.eos = pad_token_id, torch.tensor(eos_token_ids)
        self.group_size, self.compact_fraction = group_size, compact_fraction
        self.temperature = temperature
        penalty = [RepetitionPenaltyLogitsProcessor(repetition_penalty)] if repetition_penalty != 1.0 else []
        warpers = []  # generate()'s order and conditions
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p))
        if min_p is not None:
            warpers.append(MinPLogitsWarper(min_p=min_p))
        self.sample_processors = LogitsProcessorList(penalty + warpers)
        self.greedy_processors = LogitsProcessorList(penalty)

    def _groups(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
        G = self.group_size
        N = prompt_ids.size(0)
        if G <= 1 or N % G:
            return 1
        ids = prompt_ids.view(N // G, G, -1)
        mask = prompt_mask.view(N // G, G, -1)
        same = (ids == ids[:, :1]).all() and (mask == mask[:, :1]).all()
        return G if bool(same) else 1

    def update_weights(self, model) -> None:
        """Samples from the policy module itself: new weights are already there."""

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False) -> Generated:
        with eval_mode(model):
            return self._generate(model, prompt_ids, prompt_mask, greedy, logprobs)

    def _generate(self, model, prompt_ids, prompt_mask, greedy, want_logprobs):
        device = prompt_ids.device
        N, P = prompt_ids.shape
        G = self._groups(prompt_ids, prompt_mask)
        eos = self.eos.to(device)
        processors = self.greedy_processors if greedy else self.sample_processors
        cache = _growing_cache(model)
        # prefill: one row per group
        u_ids, u_mask = prompt_ids[::G], prompt_mask[::G]
        extra = {"logits_to_keep": 1} if accepts_kwarg(model, "logits_to_keep") else {}
        if not accepts_kwarg(model, "position_ids"):
            raise ValueError(f"{type(model).__name__}.forward takes no position_ids: use generation_backend="
                             "'transformers' for this model")
        out = model(input_ids=u_ids, attention_mask=u_mask, position_ids=position_ids_from_mask(u_mask),
                    past_key_values=cache, use_cache=True, **extra)
        logits = out.logits[:, -1, :].float()  # (B, V)
        if G > 1:
            cache.batch_repeat_interleave(G)
            logits = logits.repeat_interleave(G, dim=0)  # (N, V)
        tokens = torch.full((N, self.max_new), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros((N, self.max_new), device=device) if want_logprobs else None
        # full ids of the active rows, kept only when a processor reads them (the repetition penalty)
        seq = prompt_ids.clone() if len(self.greedy_processors) else prompt_ids[:, :0]
        # attention mask preallocated for every step: each step passes a view, nothing is concatenated
        mask = torch.cat([prompt_mask, torch.ones(N, self.max_new, dtype=prompt_mask.dtype, device=device)], 1)
        rows = torch.arange(N, device=device)  # original row of each active row
        finished = torch.zeros(N, dtype=torch.bool, device=device)  # per active row
        next_pos = position_ids_from_mask(prompt_mask)[:, -1] + 1  # (n,)
        steps = 0
        for t in range(self.max_new):
            steps = t + 1
            scores = processors(seq, logits)
            if greedy:
                nxt = scores.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            nxt = torch.where(finished, torch.full_like(nxt, self.pad_token_id), nxt)
            tokens[rows, t] = nxt
            if logps is not None:
                logps[rows, t] = torch.log_softmax(logits / self.temperature, -1).gather(-1, nxt[:, None]).squeeze(1)
            finished = finished | torch.isin(nxt, eos)
            if bool(finished.all()) or t == self.max_new - 1:
                break
            if finished.float().mean() >= self.compact_fraction:  # drop finished rows from the batch
                keep = (~finished).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, seq, mask, nxt, next_pos = rows[keep], seq[keep], mask[keep], nxt[keep], next_pos[keep]
                finished = finished[keep]
            if seq.size(1):
                seq = torch.cat([seq, nxt[:, None]], dim=1)
            out = model(input_ids=nxt[:, None], attention_mask=mask[:, :P + t + 1], position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        # as generate(): as many columns as decoding steps (pad may equal EOS)
        return Generated(tokens[:, :steps], None if logps is None else logps[:, :steps])

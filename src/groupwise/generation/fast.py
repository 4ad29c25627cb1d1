"""A fast sampler for transformers causal LMs, built for GRPO's shape of work: B prompts × G completions.

- The prompt of each group is encoded once (one prefill of B rows, not B·G); its KV cache is then repeated for the
  G completions (prompt compute is shared; the cached tensors are copied, not aliased).
- All rows decode in one batch; rows that finish leave it (the cache is compacted once a tenth of the batch
  has finished, so the copy is amortised).
- The KV cache grows by doubling a preallocated buffer and writing into it, instead of concatenating a new tensor
  at every step (transformers' DynamicLayer). Other cache layers keep their own logic: sliding-window layers, and
  the convolution / recurrent states of hybrid models (Qwen3.5, LFM2, Falcon-H1, …), which are shared and dropped
  with their rows (select_rows). A model keeping such state in its modules (RecurrentGemma) is refused.
- Logits are processed by transformers' own processors, in generate()'s order (repetition penalty, temperature,
  top-k, top-p, min-p), and sampled with torch.multinomial as generate() does; greedy equals generate() token for
  token (tested).
- With logprobs=True it also returns log softmax(logits / temperature) of each sampled token: the quantity the
  trainer computes as log π_θold, from the sampler's own forward (what the importance-sampling correction compares).

Two decode loops share the prefill and the sampling code:
- eager (the default off CUDA): the cache grows in place and finished rows leave the batch;
- static (`compile=True`; the default on CUDA for the models it serves, see static.static_refusal; GRPOConfig.
  generation_compile): every shape is fixed for the whole
  completion, as gpt-fast and transformers' static cache do — the KV cache is one preallocated (N, H, L, D) buffer
  per layer written at a position held in a tensor, the attention mask is a preallocated 4-D mask with one column
  opened per step, and the inputs are buffers updated in place. The decode step (one forward of N tokens) is then
  compiled with torch.compile(mode="reduce-overhead"), which on CUDA captures it in a CUDA graph: a step is one
  graph replay instead of hundreds of kernel launches from Python. When only a temperature shapes the sampling, the
  whole step runs in the graph (fused_step: forward, a two-level exponential race that draws V / 512 + 512 random
  numbers per row instead of V, the token and log-prob written into the output buffers, the finished flags), and
  the host only checks every 8 steps whether all rows have finished; with top-k / top-p / min-p / a repetition
  penalty the step returns logits and transformers' processors run outside the graph. On CUDA, sdpa models attend
  with decode_attention's Triton kernel, which reads each row's keys and values only over its filled slots and
  computes the query heads of a KV head together. Finished rows stay in the batch (they emit pad). L is the prompt
  width rounded up to a multiple of 64, plus max_completion_length, so batches of similar prompt lengths reuse one
  compiled graph. Batches whose rows are not groups of one prompt (the later turns of a tool loop, evaluation)
  change shape from call to call: their step is compiled once with dynamic shapes.
"""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from groupwise.generation import Generated, repeats
from groupwise.generation.fused_linear import FusedProjections
from groupwise.generation.static import StaticState, advance, fused_pick, open_slot, static_refusal
from groupwise.modeling import accepts_kwarg, cache_keyword, eval_mode, position_ids_from_mask

try:  # the recurrent / convolution states of hybrid models (Qwen3.5, LFM2, Jamba, …)
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # an older transformers: no such layers
    LinearAttentionCacheLayerMixin = ()


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


def _state_outside_cache(model, cache: DynamicCache) -> bool:
    """After a prefill: does a layer keep its recurrent state in the model's modules (RecurrentGemma)? Its cache layer
    is then empty: a linear-attention layer without states, or (transformers < 5.23 gives RecurrentGemma's recurrent
    blocks sliding-window layers) a layer of a 'recurrent' block never written."""
    text = model.config.get_text_config(decoder=True)
    kinds = list(getattr(text, "layers_block_type", None) or ())
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if not any(layer.is_conv_states_initialized.values()) and not any(
                    layer.is_recurrent_states_initialized.values()):
                return True
        elif i < len(kinds) and kinds[i] == "recurrent" and not getattr(layer, "is_initialized", True):
            return True
    return False


def select_rows(cache: DynamicCache, indices: torch.Tensor) -> None:
    """Keep the cache rows `indices` (in that order, repeats allowed). A layer holding recurrent or convolution states
    (a hybrid model's linear-attention layers, alone or with attention keys/values) has no batch_select_indices that
    reaches those states: its reorder_cache selects every state it holds, keys and values included."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.reorder_cache(indices)
        else:
            layer.batch_select_indices(indices)


def penalty_ids(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """The prompt ids the repetition penalty reads, as generate() reads them: a row's left padding does not count
    (generate() passes prompt_ignore_length = the padding's length). The penalty only asks which tokens occur, so
    the padding is overwritten with the row's first real token (a row without one is left as it is, as in
    generate())."""
    first = (prompt_mask != 0).int().argmax(1, keepdim=True)  # (N, 1): the padding's length
    before = torch.arange(prompt_ids.size(1), device=prompt_ids.device)[None] < first
    return torch.where(before, prompt_ids.gather(1, first), prompt_ids)


class FastGenerator:
    """Generator backend (see groupwise.generation). Rows with identical prompts must be contiguous in groups of
    `group_size` (training's num_generations) or `eval_group_size` (num_generations_eval), or all in runs as long as
    the first, for the prompt to be shared; otherwise each row is its own group."""

    @classmethod
    def from_config(cls, args, *, pad_token_id: int, eos_token_ids: list[int], dist=None) -> "FastGenerator":
        return cls(max_completion_length=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, group_size=args.num_generations,
                   eval_group_size=args.num_generations_eval,
                   compile=args.generation_compile, fuse_projections=args.generation_fuse_projections)

    def __init__(self, *, max_completion_length: int, temperature: float, top_p: float, top_k: int,
                 min_p: float | None, repetition_penalty: float, pad_token_id: int, eos_token_ids: list[int],
                 group_size: int = 1, eval_group_size: int | None = None,
                 compact_fraction: float = 0.1, compile: bool | None = None,
                 compile_mode: dict | None = None, attention_kernel: bool | None = None,
                 fuse_projections: bool = False):
        """compile: decode with the static loop (None: on CUDA only); compile_mode: torch.compile's arguments for
        its step (default mode="reduce-overhead", which captures CUDA graphs; {} would be plain inductor), or the
        string "eager" to run the static loop without compiling (tests); attention_kernel: the static loop's
        attention by decode_attention's Triton kernel (None: wherever it can run, CUDA with sdpa models; False: by
        sdpa, static.grouped_decode_attention); fuse_projections: the static loop computes q/k/v and gate/up as
        one product each, from copies of the concatenated weights refreshed at every call (memory: the size of
        those weights; see fused_linear)."""
        self.max_new = max_completion_length
        self.compile, self.attention_kernel = compile, attention_kernel
        self.fuse_projections = fuse_projections
        self._projections: tuple[int, FusedProjections] | None = None  # (id(model), its projections): the latest
        self.compile_mode = (dict(mode="reduce-overhead", dynamic=False) if compile_mode is None else
                             None if compile_mode == "eager" else compile_mode)
        # static-loop buffers by shape, least recently used first; two shapes: training's and evaluation's batch
        self._static: dict[tuple, StaticState] = {}
        self._warned: set[int] = set()  # models named in the warning that the static loop cannot serve them
        self.keep_shapes = 2
        self.pad_token_id, self.eos = pad_token_id, torch.tensor(eos_token_ids)
        self.group_sizes, self.compact_fraction = (group_size, eval_group_size), compact_fraction
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
        """The number of consecutive rows that share one prompt, whose prefill is computed once for them all: the
        rule of `repeats` (num_generations, then num_generations_eval, then the first run of identical rows)."""
        if prompt_ids.size(0) <= 1:
            return 1
        rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
        ids = torch.unique(rows, dim=0, return_inverse=True)[1].tolist()  # one id per distinct (prompt, mask) row
        return repeats(ids, self.group_sizes)

    def update_weights(self, model) -> None:
        """Samples from the policy module itself: new weights are already there (updated in place, so a captured
        decode graph reads them too)."""

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False,
                 max_new_tokens: int | None = None) -> Generated:
        # this call's steps (a later tool turn asks for fewer); the buffers keep max_completion_length columns
        limit = self.max_new if max_new_tokens is None else max(1, min(self.max_new, max_new_tokens))
        static = self._use_static(model, prompt_ids.device)
        if self.fuse_projections and not static:
            raise ValueError(f"fuse_projections needs the static decode loop, which is off here (generation_compile "
                             f"{self.compile}, device {prompt_ids.device.type}, {type(model).__name__}): set "
                             "generation_compile=True, or drop generation_fuse_projections")
        with eval_mode(model):
            G, cache, logits = self._prefill(model, prompt_ids, prompt_mask)
            decode = self._decode_static if static else self._decode_eager
            return decode(model, prompt_ids, prompt_mask, G, cache, logits, greedy, logprobs, limit)

    def _use_static(self, model, device: torch.device) -> bool:
        """compile True: the static loop, or the error saying why this model cannot use it; None (the default): the
        static loop on CUDA for the models it serves, the eager loop for the others (named in a warning, once)."""
        if self.compile is False or (self.compile is None and device.type != "cuda"):
            return False
        refusal = static_refusal(model, _growing_cache(model).layers)
        if refusal is None:
            return True
        if self.compile:
            raise ValueError(refusal)
        if id(model) not in self._warned:
            self._warned.add(id(model))
            warnings.warn(f"{refusal.split(': set generation_compile=False')[0]}; generation_compile is unset, so "
                          "the eager decode loop samples (set generation_compile=False to say so)", UserWarning,
                          stacklevel=3)
        return False

    def _prefill(self, model, prompt_ids, prompt_mask):
        """One forward over one row per group; returns (G, the cache of the B unique rows, logits (N, V))."""
        G = self._groups(prompt_ids, prompt_mask)
        cache = _growing_cache(model)
        u_ids, u_mask = prompt_ids[::G], prompt_mask[::G]
        extra = {"logits_to_keep": 1} if accepts_kwarg(model, "logits_to_keep") else {}
        if not accepts_kwarg(model, "position_ids"):
            raise ValueError(f"{type(model).__name__}.forward takes no position_ids: use generation_backend="
                             "'transformers' for this model")
        out = model(input_ids=u_ids, attention_mask=u_mask, position_ids=position_ids_from_mask(u_mask),
                    **{cache_keyword(model): cache}, use_cache=True, **extra)
        if _state_outside_cache(model, cache):
            # (RecurrentGemma): the rows' states live in the model's modules, out of reach of sharing and dropping rows
            raise ValueError(f"{type(model).__name__} keeps its recurrent state outside the cache, which the fast "
                             "sampler cannot share or reorder: use generation_backend='transformers' for this model")
        if not any(getattr(layer, "is_initialized", True) for layer in cache.layers):
            # (openai-gpt): the cache was ignored, so a decode step would see its one new token alone
            raise ValueError(f"{type(model).__name__} keeps no KV cache (its forward ignores "
                             f"{cache_keyword(model)}=), which the fast sampler decodes with: use "
                             "generation_backend='transformers' for this model")
        logits = out.logits[:, -1, :].float()  # (B, V)
        return G, cache, logits.repeat_interleave(G, dim=0) if G > 1 else logits

    def _sample(self, processors, seq, logits, finished, greedy, logps_out, rows, t):
        """The next token of every active row (pad for finished rows), recording its log-prob when asked."""
        scores = logits
        for processor in processors:  # LogitsProcessorList's call without its inspect.signature per processor per token
            scores = processor(seq, scores)
        if greedy:
            nxt = scores.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        nxt = torch.where(finished, torch.full_like(nxt, self.pad_token_id), nxt)
        if logps_out is not None:
            logps_out[rows, t] = torch.log_softmax(logits / self.temperature, -1).gather(-1, nxt[:, None]).squeeze(1)
        return nxt

    def _outputs(self, N, device, want_logprobs):
        tokens = torch.full((N, self.max_new), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros((N, self.max_new), device=device) if want_logprobs else None
        return tokens, logps

    def _decode_eager(self, model, prompt_ids, prompt_mask, G, cache, logits, greedy, want_logprobs, limit):
        device = prompt_ids.device
        N, P = prompt_ids.shape
        eos = self.eos.to(device)
        processors = self.greedy_processors if greedy else self.sample_processors
        if G > 1:
            select_rows(cache, torch.arange(N // G, device=device).repeat_interleave(G))
        tokens, logps = self._outputs(N, device, want_logprobs)
        # full ids of the active rows, kept only when a processor reads them (the repetition penalty)
        seq = penalty_ids(prompt_ids, prompt_mask) if len(self.greedy_processors) else prompt_ids[:, :0]
        # attention mask preallocated for every step: each step passes a view, nothing is concatenated
        mask = torch.cat([prompt_mask, torch.ones(N, limit, dtype=prompt_mask.dtype, device=device)], 1)
        rows = torch.arange(N, device=device)  # original row of each active row
        finished = torch.zeros(N, dtype=torch.bool, device=device)  # per active row
        next_pos = position_ids_from_mask(prompt_mask)[:, -1] + 1  # (n,)
        cache_kw = cache_keyword(model)
        steps = 0
        for t in range(limit):
            steps = t + 1
            nxt = self._sample(processors, seq, logits, finished, greedy, logps, rows, t)
            tokens[rows, t] = nxt
            finished = finished | torch.isin(nxt, eos)
            done = int(finished.sum())  # one device sync per token
            if done == finished.numel() or t == limit - 1:
                break
            if done / finished.numel() >= self.compact_fraction:  # drop finished rows from the batch
                keep = (~finished).nonzero().squeeze(1)
                select_rows(cache, keep)
                rows, seq, mask, nxt, next_pos = rows[keep], seq[keep], mask[keep], nxt[keep], next_pos[keep]
                finished = finished[keep]
            if seq.size(1):
                seq = torch.cat([seq, nxt[:, None]], dim=1)
            out = model(input_ids=nxt[:, None], attention_mask=mask[:, :P + t + 1], position_ids=next_pos[:, None],
                        **{cache_kw: cache}, use_cache=True)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        # as generate(): as many columns as decoding steps (pad may equal EOS)
        return Generated(tokens[:, :steps], None if logps is None else logps[:, :steps])

    def _decode_static(self, model, prompt_ids, prompt_mask, G, prefill, logits, greedy, want_logprobs, limit):
        device = prompt_ids.device
        N, P = prompt_ids.shape
        eos = self.eos.to(device)
        processors = self.greedy_processors if greedy else self.sample_processors
        # with no processor beyond the temperature, sampling runs inside the compiled step (fused_pick): the step
        # returns N tokens instead of N × V logits
        fused = len(processors) == 0 or (len(processors) == 1 and isinstance(processors[0], TemperatureLogitsWarper))
        width = -(-P // 64) * 64  # the prompt region, rounded up so that similar batches share a compiled graph
        st = self._static_state(model, prefill, N, width + self.max_new, device, grouped=G > 1)
        # the prompt's keys/values, right-aligned in the prompt region; the rest of the buffers is masked
        for layer, src in zip(st.cache.layers, prefill.layers):
            for buf, x in ((layer.keys, src.keys), (layer.values, src.values)):
                buf.zero_()
                buf[:, :, width - P:width] = x.repeat_interleave(G, 0) if G > 1 else x
        st.b.open.zero_()
        st.b.open[:, width - P:width] = prompt_mask.bool()
        st.b.pos.fill_(width)
        st.b.pos_ids.copy_(position_ids_from_mask(prompt_mask)[:, -1:] + 1)
        del prefill
        if fused:
            return self._decode_fused(model, st, logits, greedy, want_logprobs, limit)
        tokens, logps = self._outputs(N, device, want_logprobs)
        seq = penalty_ids(prompt_ids, prompt_mask) if len(self.greedy_processors) else prompt_ids[:, :0]
        rows = torch.arange(N, device=device)
        finished = torch.zeros(N, dtype=torch.bool, device=device)
        ran = torch.zeros(self.max_new, dtype=torch.bool, device=device)  # did step t have an unfinished row
        with st.active(model):
            for t in range(limit):
                ran[t] = ~finished.all()
                nxt = self._sample(processors, seq, logits, finished, greedy, logps, rows, t)
                tokens[:, t] = nxt
                finished = finished | torch.isin(nxt, eos)
                if t == limit - 1 or (t % 8 == 7 and bool(finished.all())):
                    break
                if seq.size(1):
                    seq = torch.cat([seq, nxt[:, None]], dim=1)
                st.b.ids.copy_(nxt[:, None])
                open_slot(st.b)
                logits = st.step(model)
                advance(st.b)
        steps = int(ran.sum())  # as generate(): as many columns as decoding steps
        return Generated(tokens[:, :steps], None if logps is None else logps[:, :steps])

    def _decode_fused(self, model, st, logits, greedy, want_logprobs, limit):
        """The static loop when sampling needs no processor beyond the temperature: the whole step (open the slot,
        forward, pick, record the token and its log-prob, update `finished`) runs inside the compiled graph on
        st's buffers, so a step is one graph replay and the host only checks every 8 steps whether all rows have
        finished. The first token comes from the prefill's logits, picked the same way."""
        b = st.b
        nxt, logp = fused_pick(logits, self.temperature, greedy)
        b.tokens.fill_(self.pad_token_id)
        b.logps.zero_()
        b.tokens[:, 0], b.logps[:, 0] = nxt, logp
        b.finished.copy_(torch.isin(nxt, b.eos))
        b.ran.zero_()
        b.ran[0] = True
        b.t.fill_(1)
        b.ids.copy_(nxt[:, None])
        with st.active(model):
            for t in range(1, limit):
                st.fused_step(model, self.temperature, greedy, self.pad_token_id)
                if t % 8 == 7 and bool(b.finished.all()):
                    break
        steps = int(b.ran.sum())  # as generate(): as many columns as decoding steps
        return Generated(b.tokens[:, :steps].clone(), b.logps[:, :steps].clone() if want_logprobs else None)

    def _static_state(self, model, prefill, N: int, L: int, device, grouped: bool = True) -> "StaticState":
        """The buffers and compiled step for (model, N, L), kept between calls (the two most recent shapes): a CUDA
        graph replays on the same addresses, so the buffers live as long as the shape is in use."""
        if self._projections is not None and self._projections[0] == id(model) and not self._projections[1].current():
            # the model's projections were replaced (an adapter injected, a layer swapped): its fused projections,
            # and the states built on them, are stale
            self._projections = None
            self._static = {k: v for k, v in self._static.items() if k[0] != id(model)}
        first = prefill.layers[0] if prefill.layers else None
        # (the attention implementation decides the mask's kind: boolean for sdpa, additive for eager)
        key = (id(model), N, L, str(device), None if first is None else first.keys.dtype, grouped,
               model.config._attn_implementation)
        if key in self._static:
            self._static[key] = self._static.pop(key)  # most recently used last
            return self._static[key]
        while len(self._static) >= self.keep_shapes:  # free the least recently used shape's buffers first
            self._static.pop(next(iter(self._static)))
        mode = self.compile_mode
        if mode is not None and not grouped:
            # rows that are not groups of one prompt (the later turns of a tool loop, evaluation): their number
            # and widths change from call to call, so their step is compiled once with dynamic shapes
            mode = {**mode, "dynamic": True}
        projections = None
        if self.fuse_projections:
            if self._projections is not None and self._projections[0] == id(model):
                projections = self._projections[1]
            else:  # kept for the latest model only (they hold its layers)
                projections = FusedProjections(model)
                self._projections = (id(model), projections)
                if not len(projections):
                    raise ValueError(f"fuse_projections: {type(model).__name__} has no plain nn.Linear q/k/v or "
                                     "gate/up projections to fuse (PEFT and sharded layers are not fused): leave "
                                     "fuse_projections off for this model")
        self._static[key] = StaticState(model, prefill, N, L, self.max_new, self.eos, device,
                                        model.config._attn_implementation, mode, self.attention_kernel, projections)
        return self._static[key]

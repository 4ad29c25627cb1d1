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
  trainer computes as log π_θold, from the sampler's own forward (what the importance-sampling correction compares).

Two decode loops share the prefill and the sampling code:
- eager (the default off CUDA): the cache grows in place and finished rows leave the batch;
- static (`compile=True`, the default on CUDA; GRPOConfig.generation_compile): every shape is fixed for the whole
  completion, as gpt-fast and transformers' static cache do — the KV cache is one preallocated (N, H, L, D) buffer
  per layer written at a position held in a tensor, the attention mask is a preallocated 4-D mask with one column
  opened per step, and the inputs are buffers updated in place. The decode step (one forward of N tokens) is then
  compiled with torch.compile(mode="reduce-overhead"), which on CUDA captures it in a CUDA graph: a step is one
  graph replay instead of hundreds of kernel launches from Python. Finished rows stay in the batch (they emit pad);
  the loop checks every 8 steps whether all rows have finished. L is the prompt width rounded up to a multiple of
  64, plus max_completion_length, so batches of similar prompt lengths reuse one compiled graph. Batches whose rows
  are not groups of one prompt (the later turns of a tool loop, evaluation) change shape from call to call: their
  step is compiled once with dynamic shapes.
"""

from __future__ import annotations

import contextlib

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


class StaticLayer(DynamicLayer):
    """Keys/values in a buffer of fixed shape (N, H, L, D): a decode step writes its one token at `pos` (a 1-element
    tensor shared by every layer, advanced in place) and attention reads the whole buffer under a mask that hides
    the slots not written yet. Fixed shapes and addresses are what a compiled, graph-captured step needs."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.pos = keys, values, pos
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.pos, key_states)
        self.values.index_copy_(2, self.pos, value_states)
        return self.keys, self.values


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
                   pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, group_size=args.num_generations,
                   compile=args.generation_compile)

    def __init__(self, *, max_completion_length: int, temperature: float, top_p: float, top_k: int,
                 min_p: float | None, repetition_penalty: float, pad_token_id: int, eos_token_ids: list[int],
                 group_size: int = 1, compact_fraction: float = 0.1, compile: bool | None = None,
                 compile_mode: dict | None = None):
        """compile: decode with the static loop (None: on CUDA only); compile_mode: torch.compile's arguments for
        its step (default mode="reduce-overhead", which captures CUDA graphs; {} would be plain inductor), or the
        string "eager" to run the static loop without compiling (tests)."""
        self.max_new = max_completion_length
        self.compile = compile
        self.compile_mode = (dict(mode="reduce-overhead", dynamic=False) if compile_mode is None else
                             None if compile_mode == "eager" else compile_mode)
        # static-loop buffers by shape, least recently used first; two shapes: training's and evaluation's batch
        self._static: dict[tuple, _StaticState] = {}
        self.keep_shapes = 2
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
        """Samples from the policy module itself: new weights are already there (updated in place, so a captured
        decode graph reads them too)."""

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False) -> Generated:
        static = self._use_static(prompt_ids.device)
        if static:
            impl = getattr(model.config, "_attn_implementation", None)
            if impl not in ("sdpa", "eager"):
                raise ValueError(f"generation_compile needs attn_implementation 'sdpa' or 'eager' (the model uses "
                                 f"{impl!r}): set generation_compile=False, or load the model with "
                                 "attn_implementation='sdpa'")
        with eval_mode(model):
            G, cache, logits = self._prefill(model, prompt_ids, prompt_mask)
            decode = self._decode_static if static else self._decode_eager
            return decode(model, prompt_ids, prompt_mask, G, cache, logits, greedy, logprobs)

    def _use_static(self, device: torch.device) -> bool:
        return self.compile if self.compile is not None else device.type == "cuda"

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
                    past_key_values=cache, use_cache=True, **extra)
        logits = out.logits[:, -1, :].float()  # (B, V)
        return G, cache, logits.repeat_interleave(G, dim=0) if G > 1 else logits

    def _sample(self, processors, seq, logits, finished, greedy, logps_out, rows, t):
        """The next token of every active row (pad for finished rows), recording its log-prob when asked."""
        scores = processors(seq, logits)
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

    def _decode_eager(self, model, prompt_ids, prompt_mask, G, cache, logits, greedy, want_logprobs):
        device = prompt_ids.device
        N, P = prompt_ids.shape
        eos = self.eos.to(device)
        processors = self.greedy_processors if greedy else self.sample_processors
        if G > 1:
            cache.batch_repeat_interleave(G)
        tokens, logps = self._outputs(N, device, want_logprobs)
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
            nxt = self._sample(processors, seq, logits, finished, greedy, logps, rows, t)
            tokens[rows, t] = nxt
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

    def _decode_static(self, model, prompt_ids, prompt_mask, G, prefill, logits, greedy, want_logprobs):
        device = prompt_ids.device
        N, P = prompt_ids.shape
        eos = self.eos.to(device)
        processors = self.greedy_processors if greedy else self.sample_processors
        # with no processor beyond the temperature, sampling runs inside the compiled step (_fused_pick): the step
        # returns N tokens instead of N × V logits
        fused = len(processors) == 0 or (len(processors) == 1 and isinstance(processors[0], TemperatureLogitsWarper))
        width = -(-P // 64) * 64  # the prompt region, rounded up so that similar batches share a compiled graph
        st = self._static_state(model, prefill, N, width + self.max_new, device, grouped=G > 1)
        # the prompt's keys/values, right-aligned in the prompt region; the rest of the buffers is masked
        for layer, src in zip(st.cache.layers, prefill.layers):
            for buf, x in ((layer.keys, src.keys), (layer.values, src.values)):
                buf.zero_()
                buf[:, :, width - P:width] = x.repeat_interleave(G, 0) if G > 1 else x
        st.open.zero_()
        st.open[:, width - P:width] = prompt_mask.bool()
        st.pos.fill_(width)
        st.pos_ids.copy_(position_ids_from_mask(prompt_mask)[:, -1:] + 1)
        del prefill
        tokens, logps = self._outputs(N, device, want_logprobs)
        seq = prompt_ids.clone() if len(self.greedy_processors) else prompt_ids[:, :0]
        rows = torch.arange(N, device=device)
        finished = torch.zeros(N, dtype=torch.bool, device=device)
        ran = torch.zeros(self.max_new, dtype=torch.bool, device=device)  # did step t have an unfinished row
        pick = None  # (tokens, log-probs) of the fused step
        with st.attention(model):
            for t in range(self.max_new):
                ran[t] = ~finished.all()
                if pick is None:
                    nxt = self._sample(processors, seq, logits, finished, greedy, logps, rows, t)
                else:
                    nxt = torch.where(finished, torch.full_like(pick[0], self.pad_token_id), pick[0])
                    if logps is not None:
                        logps[:, t] = pick[1]
                tokens[:, t] = nxt
                finished = finished | torch.isin(nxt, eos)
                if t == self.max_new - 1 or (t % 8 == 7 and bool(finished.all())):
                    break
                if seq.size(1):
                    seq = torch.cat([seq, nxt[:, None]], dim=1)
                st.ids.copy_(nxt[:, None])
                st.open.index_fill_(1, st.pos, True)
                st.mask.copy_(st.open_as_mask())
                if fused:
                    pick = tuple(x.clone() for x in st.step(model, st.cache, st.ids, st.pos_ids, st.mask,
                                                           temperature=self.temperature, greedy=greedy))
                else:
                    logits = st.step(model, st.cache, st.ids, st.pos_ids, st.mask).clone()
                st.pos.add_(1)
                st.pos_ids.add_(1)
        steps = int(ran.sum())  # as generate(): as many columns as decoding steps
        return Generated(tokens[:, :steps], None if logps is None else logps[:, :steps])

    def _static_state(self, model, prefill, N: int, L: int, device, grouped: bool = True) -> "_StaticState":
        """The buffers and compiled step for (model, N, L), kept between calls (the two most recent shapes): a CUDA
        graph replays on the same addresses, so the buffers live as long as the shape is in use."""
        first = prefill.layers[0] if prefill.layers else None
        key = (id(model), N, L, str(device), None if first is None else first.keys.dtype, grouped)
        if key in self._static:
            self._static[key] = self._static.pop(key)  # most recently used last
            return self._static[key]
        while len(self._static) >= self.keep_shapes:  # free the least recently used shape's buffers first
            self._static.pop(next(iter(self._static)))
        if not all(type(layer) is GrowingLayer for layer in prefill.layers):
            raise ValueError(f"{type(model).__name__} has cache layers other than full attention (sliding window "
                             "or recurrent): set generation_compile=False for this model")
        mode = self.compile_mode
        if mode is not None and not grouped:
            # rows that are not groups of one prompt (the later turns of a tool loop, evaluation): their number
            # and widths change from call to call, so their step is compiled once with dynamic shapes
            mode = {**mode, "dynamic": True}
        self._static[key] = _StaticState(key, model, prefill, N, L, device, model.config._attn_implementation, mode)
        return self._static[key]


class _StaticState:
    """Fixed-shape buffers of the static decode loop and its (compiled) step."""

    def __init__(self, key, model, prefill, N, L, device, impl, compile_mode):
        self.key = key
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        layers = []
        for src in prefill.layers:
            k, v = src.keys, src.values
            keys = k.new_zeros((N, k.shape[1], L, k.shape[3]))
            values = v.new_zeros((N, v.shape[1], L, v.shape[3]))
            layers.append(StaticLayer(keys, values, self.pos))
        self.cache = DynamicCache(config=model.config)
        self.cache.layers = layers
        self.ids = torch.zeros(N, 1, dtype=torch.long, device=device)
        self.pos_ids = torch.zeros(N, 1, dtype=torch.long, device=device)
        self.open = torch.zeros(N, L, dtype=torch.bool, device=device)
        dtype = prefill.layers[0].keys.dtype
        # the 4-D mask attention reads: boolean for sdpa (True: attend), additive for eager attention
        self.bool_mask = impl == "sdpa"
        self.mask = torch.zeros(N, 1, 1, L, dtype=torch.bool if self.bool_mask else dtype, device=device)
        self.min = torch.finfo(dtype).min
        step = _decode_step
        if compile_mode is not None:
            for t in (self.pos, self.ids, self.pos_ids, self.mask, *(x for layer in layers
                                                                      for x in (layer.keys, layer.values))):
                torch._dynamo.mark_static_address(t)
            step = torch.compile(_decode_step, **compile_mode)
        self._step, self._graphs = step, device.type == "cuda" and compile_mode is not None
        text = model.config.get_text_config(decoder=True)
        self.grouped = (impl == "sdpa" and getattr(text, "attn_logit_softcapping", None) is None
                        and _register_grouped_attention())

    @contextlib.contextmanager
    def attention(self, model):
        """During the decode loop, sdpa models attend with grouped_decode_attention (each KV head read once for its
        query heads, where transformers' sdpa path copies the KV cache per query head whenever a mask is given)."""
        config = model.config
        before = config._attn_implementation
        swap = self.grouped and before == "sdpa"
        if swap:
            config._attn_implementation = GROUPED_ATTENTION
        try:
            yield
        finally:
            if swap:
                config._attn_implementation = before

    def open_as_mask(self) -> torch.Tensor:
        m = self.open[:, None, None, :]
        return m if self.bool_mask else torch.where(m, 0.0, self.min).to(self.mask.dtype)

    def step(self, *args, **kwargs):
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self._step(*args, **kwargs)


def _decode_step(model, cache, ids, pos_ids, mask, temperature=None, greedy=False):
    """One decode step of N rows: the forward whose shapes never change (what torch.compile captures). Returns the
    logits (N, V) in float32, or with `temperature` given the picked tokens and their log-probs (_fused_pick)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos_ids, past_key_values=cache, use_cache=True)
    logits = out.logits[:, -1, :].float()
    return logits if temperature is None else _fused_pick(logits, temperature, greedy)


def _fused_pick(logits: torch.Tensor, temperature: float, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens (N,) and log softmax(logits / T) at them (N,). Sampling uses the exponential race: with
    E_v ~ Exp(1) independent, argmax_v p_v / E_v is distributed as p (P(v wins) = p_v / Σ p = p_v), so
    argmax_v (log p_v − log E_v) samples softmax(logits / T) exactly — the Gumbel-max trick, −log E being Gumbel —
    without torch.multinomial's cumulative sum over the vocabulary; greedy takes argmax of the logits."""
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    if greedy:
        nxt = logits.argmax(-1)
    else:
        race = torch.empty_like(logp).exponential_()
        nxt = (logp - race.log()).argmax(-1)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(1)


GROUPED_ATTENTION = "groupwise_grouped_decode"


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for a decode step over a static cache, in transformers' attention-function signature: query
    (N, Hq, S, D), key/value (N, Hkv, L, D), attention_mask (N, 1, S, L) boolean (True: attend) or additive.
    Query heads h·r … h·r + r − 1 share KV head h (r = Hq / Hkv, transformers' repeat_kv order), so the queries are
    viewed as (N, Hkv, r·S, D) and attend to the KV cache as stored: one read of each KV head instead of r copies.
    Only for S = 1 (one new token per row), where the mask is the same for the r·S query rows."""
    N, Hq, S, D = query.shape
    Hkv = key.shape[1]
    if S != 1 or kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("grouped_decode_attention serves single-token decode steps without softcap or sliding "
                         "window only: set generation_compile=False for this model")
    q = query.reshape(N, Hkv, (Hq // Hkv) * S, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(N, Hq, S, D).transpose(1, 2).contiguous(), None


def _register_grouped_attention() -> bool:
    """Make grouped_decode_attention known to transformers (AttentionInterface); False where that API is missing."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(GROUPED_ATTENTION, grouped_decode_attention)
    return True

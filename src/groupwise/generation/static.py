"""The static decode loop's pieces (used by FastGenerator's static loop, see groupwise.generation.fast): the KV
cache layer of fixed shape, the loop's buffers and compiled steps, the fused two-level sampler, and the decode
attentions (grouped sdpa; the Triton kernel of decode_attention on CUDA)."""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from groupwise.generation import decode_attention
from groupwise.modeling import cache_keyword


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


class LoopBuffers(NamedTuple):
    """The static loop's state, in buffers of fixed shape and address (what a captured graph reads and writes)."""
    ids: torch.Tensor  # (N, 1) the token fed at this step
    pos: torch.Tensor  # (1,) its slot in the cache buffers (shared by all rows and layers)
    pos_ids: torch.Tensor  # (N, 1) its position id
    open: torch.Tensor  # (N, L) bool: slots that may be attended to
    mask: torch.Tensor  # (N, 1, 1, L) the 4-D mask attention reads: boolean (sdpa) or additive (eager)
    tokens: torch.Tensor  # (N, max_new) the completions (fused loop)
    logps: torch.Tensor  # (N, max_new) their log-probs (fused loop)
    finished: torch.Tensor  # (N,) bool: the row has emitted EOS
    ran: torch.Tensor  # (max_new,) bool: column t had a row still running
    t: torch.Tensor  # (1,) the column being picked
    eos: torch.Tensor  # (k,) the EOS ids


class StaticState:
    """Fixed-shape buffers of the static decode loop and its (compiled) steps."""

    def __init__(self, model, prefill, N, L, max_new, eos, device, impl, compile_mode, attention_kernel=None,
                 projections=None):
        pos = torch.zeros(1, dtype=torch.long, device=device)
        layers = []
        for src in prefill.layers:
            k, v = src.keys, src.values
            keys = k.new_zeros((N, k.shape[1], L, k.shape[3]))
            values = v.new_zeros((N, v.shape[1], L, v.shape[3]))
            layers.append(StaticLayer(keys, values, pos))
        self.cache = DynamicCache(config=model.config)
        self.cache.layers = layers
        self.cache_kw = cache_keyword(model)
        dtype = prefill.layers[0].keys.dtype
        mask_dtype = torch.bool if impl == "sdpa" else dtype  # boolean for sdpa, additive for eager attention
        zeros = functools.partial(torch.zeros, device=device)
        self.b = LoopBuffers(
            ids=zeros(N, 1, dtype=torch.long), pos=pos, pos_ids=zeros(N, 1, dtype=torch.long),
            open=zeros(N, L, dtype=torch.bool), mask=zeros(N, 1, 1, L, dtype=mask_dtype),
            tokens=zeros(N, max_new, dtype=torch.long), logps=zeros(N, max_new), finished=zeros(N, dtype=torch.bool),
            ran=zeros(max_new, dtype=torch.bool), t=zeros(1, dtype=torch.long), eos=eos.to(device))
        self._step, self._fused = decode_step, fused_step
        self.projections = projections  # fused_linear.FusedProjections, or None
        if compile_mode is not None:
            fused_weights = projections.tensors() if projections is not None else []
            for t in (*self.b, *(x for layer in layers for x in (layer.keys, layer.values)), *fused_weights):
                torch._dynamo.mark_static_address(t)
            own = not compile_mode.get("dynamic")  # fixed shapes: the graphs of (N, L) kept with their own code
            # floats (the temperature, the model's norm eps and attention scale) constants of the graph: with dynamic
            # shapes dynamo would make them 0-d CPU tensor inputs, which a CUDA graph cannot take as it takes buffers
            constant_floats = torch._dynamo.config.patch(specialize_float=True)
            self._step = constant_floats(torch.compile(_own_code(decode_step, (N, L)) if own else decode_step,
                                                       **compile_mode))
            self._fused = constant_floats(torch.compile(_own_code(fused_step, (N, L)) if own else fused_step,
                                                        **compile_mode))
        self._graphs = device.type == "cuda" and compile_mode is not None
        text = model.config.get_text_config(decoder=True)
        self.grouped = (impl == "sdpa" and getattr(text, "attn_logit_softcapping", None) is None
                        and dispatches_attention(model) and _register_grouped_attention())
        # the Triton decode kernel (boolean mask: sdpa models) where it can run, unless turned off; it reads keys and
        # values of one head size (not MLA models, whose value heads are smaller)
        same_size = prefill.layers[0].keys.shape[-1] == prefill.layers[0].values.shape[-1]
        self.kernel = self.grouped and same_size and attention_kernel is not False and decode_attention.prepare(device)
        if attention_kernel and not self.kernel:
            raise ValueError("attention_kernel=True needs a CUDA device, Triton and an sdpa model without softcap "
                             "whose key and value heads have one size (not MLA): leave attention_kernel unset to use "
                             "it where it can run")
        self.attention_name = GROUPED_ATTENTION
        if self.kernel:  # a dynamic-shape step takes one split, whatever its batch (see choose_splits)
            dynamic = bool(compile_mode and compile_mode.get("dynamic"))
            kv_heads = prefill.layers[0].keys.shape[1]
            self.attention_name = kernel_attention(1 if dynamic else decode_attention.choose_splits(N * kv_heads, L))

    @contextlib.contextmanager
    def active(self, model):
        """The decode loop's settings, for the duration of the block: sdpa models attend with the Triton kernel or
        grouped_decode_attention (each KV head read once for its query heads, where transformers' sdpa path copies
        the KV cache per query head whenever a mask is given), and fused projections are in place when asked."""
        config = model.config
        before = config._attn_implementation
        swap = self.grouped and before == "sdpa"
        if swap:
            config._attn_implementation = self.attention_name
        try:
            with self.projections.active() if self.projections is not None else contextlib.nullcontext():
                yield
        finally:
            if swap:
                config._attn_implementation = before

    def step(self, model) -> torch.Tensor:
        """One step of the logits loop: the logits (N, V) of the token in `ids` (a copy: the graph's output buffer
        is reused by the next replay)."""
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self._step(model, self.cache, self.b.ids, self.b.pos_ids, self.b.mask, self.cache_kw).clone()

    def fused_step(self, model, temperature: float, greedy: bool, pad: int) -> None:
        """One step of the fused loop (fused_step), on the buffers."""
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        self._fused(model, self.cache, self.b, temperature, greedy, pad, self.cache_kw)


def static_refusal(model, cache_layers: list | None = None) -> str | None:
    """Why the static loop cannot decode `model` (one line naming the fix), or None: its attention must read the
    loop's 4-D mask over the whole buffer (sdpa or eager), take its positions from position_ids, and have no window
    of its own; its cache (`cache_layers`, a prefill's or an empty cache's) must hold full-attention layers only."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return (f"generation_compile needs attn_implementation 'sdpa' or 'eager' (the model uses {impl!r}): set "
                "generation_compile=False, or load the model with attn_implementation='sdpa'")
    text = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(text, "alibi", False):  # Falcon with ALiBi builds its bias from a 2-D attention mask
        return (f"generation_compile: {name} uses ALiBi position biases, which the static decode loop does not "
                "build: set generation_compile=False for this model")
    if "local" in (getattr(text, "attention_layers", None) or ()):  # GPT-Neo: a window cut from the key length
        return (f"generation_compile: {name} has local (windowed) attention layers, which the static decode loop "
                "does not mask: set generation_compile=False for this model")
    from transformers.cache_utils import DynamicLayer

    from groupwise.generation.fast import GrowingLayer

    other = sorted({type(layer).__name__ for layer in cache_layers or ()
                    if type(layer) not in (GrowingLayer, DynamicLayer)})
    if other:
        return (f"generation_compile: {name} has cache layers other than full attention ({', '.join(other)}: "
                "sliding window or recurrent): set generation_compile=False for this model")
    return None


def dispatches_attention(model) -> bool:
    """Does every attention module of the model call the function transformers' AttentionInterface registers under
    config._attn_implementation? Models that test `_attn_implementation == "sdpa"` themselves (Falcon) would read
    the grouped attention's name as eager attention and add the boolean mask to their scores."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = False
    for module in base.modules():
        cls = type(module)
        if cls.__name__.endswith("Attention") and cls.__module__.startswith("transformers"):
            found = True
            if not hasattr(sys.modules.get(cls.__module__), "ALL_ATTENTION_FUNCTIONS"):
                return False
    return found


@functools.cache
def _own_code(fn, shape: tuple):
    """fn with a code object of its own for the buffers' `shape`. Dynamo keeps compiled graphs per code object and,
    past torch._dynamo.config.recompile_limit (8) of them, runs the function uncompiled from then on (a logged
    warning only): with one shared decode_step, the ninth shape of a process (prompt widths in steps of 64,
    evaluation's batch) would decode without compilation or CUDA graph. One copy per shape, kept for the process,
    holds that shape's few graphs (greedy or sampled, per model), reused when a dropped state's shape returns."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def decode_step(model, cache, ids, pos_ids, mask, cache_kw):
    """One decode step of N rows: the forward whose shapes never change (what torch.compile captures), the cache
    passed by `cache_kw` (modeling.cache_keyword). Returns the logits (N, V) in float32."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos_ids, **{cache_kw: cache}, use_cache=True)
    return out.logits[:, -1, :].float()


def fused_step(model, cache, b: LoopBuffers, temperature, greedy, pad, cache_kw):
    """One step of the fused loop, all of it on the buffers: feed b.ids at slot b.pos (opened in the mask), pick
    token t = b.t (fused_pick), write it (pad for rows already finished) and its log-prob at column t, note whether
    any row was still running (b.ran[t]), mark rows that emitted EOS finished, advance pos, position ids and t."""
    open_slot(b)
    out = model(input_ids=b.ids, attention_mask=b.mask, position_ids=b.pos_ids, **{cache_kw: cache}, use_cache=True)
    nxt, logp = fused_pick(out.logits[:, -1, :], temperature, greedy)
    b.ran.index_copy_(0, b.t, (~b.finished.all())[None])
    nxt = torch.where(b.finished, torch.full_like(nxt, pad), nxt)
    b.tokens.index_copy_(1, b.t, nxt[:, None])
    b.logps.index_copy_(1, b.t, logp[:, None])
    b.finished.logical_or_(torch.isin(nxt, b.eos))
    b.ids.copy_(nxt[:, None])
    advance(b)
    b.t.add_(1)


def open_slot(b: LoopBuffers) -> None:
    """Let attention see slot b.pos, where this step's token is written."""
    b.open.index_fill_(1, b.pos, True)
    b.mask.copy_(as_mask(b.open, b.mask.dtype))


def advance(b: LoopBuffers) -> None:
    """The next token's slot and position id."""
    b.pos.add_(1)
    b.pos_ids.add_(1)


def as_mask(open_: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (N, L) open slots as the 4-D mask attention reads: boolean (True: attend) or additive (0 / dtype's min)."""
    m = open_[:, None, None, :]
    return m if dtype == torch.bool else torch.where(m, 0.0, torch.finfo(dtype).min).to(dtype)


SAMPLE_CHUNK = 512  # vocabulary entries per chunk of fused_pick's two-level race


def fused_pick(logits: torch.Tensor, temperature: float, greedy: bool,
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens (N,) and log softmax(logits / T) at them (N,); greedy takes argmax of the logits.

    Sampling is an exponential race in two levels. With E_i ~ Exp(1) independent and masses w_i ≥ 0,
    argmax_i w_i / E_i is i with probability w_i / Σ w (the Gumbel-max trick: −log E is Gumbel). Level 1 races the
    vocabulary's chunks of `chunk` entries with masses s_c = Σ_{v∈c} e^(x_v − m) (x = logits / T, m = max x), so chunk
    c wins with probability s_c / Z, Z = Σ_c s_c; level 2 races the entries of the winning chunk with masses
    e^(x_v − m), so v wins with probability e^(x_v − m) / s_c. Together P(v) = s_c / Z · e^(x_v − m) / s_c =
    softmax(x)_v exactly, from V / chunk + chunk random numbers per row instead of V (a race over the whole
    vocabulary); tokens of probability 0 never win. log p_v = x_v − m − log Z."""
    chunk = chunk or SAMPLE_CHUNK
    x = logits.float() / temperature
    N, V = x.shape
    m = x.amax(-1, keepdim=True)
    if greedy:
        nxt = logits.argmax(-1)
        z = torch.exp(x - m).sum(-1)
    else:
        n_chunks = -(-V // chunk)
        xc = torch.nn.functional.pad(x, (0, n_chunks * chunk - V), value=float("-inf")).view(N, n_chunks, chunk)
        mass = torch.exp(xc - m[..., None]).sum(-1)  # (N, chunks)
        z = mass.sum(-1)
        tiny = torch.finfo(torch.float32).tiny  # an Exp(1) draw of exactly 0 would let any entry win
        c = (mass.log() - torch.empty_like(mass).exponential_().clamp_min(tiny).log()).argmax(-1)
        xw = xc.gather(1, c[:, None, None].expand(N, 1, chunk)).squeeze(1)  # (N, chunk): the winning chunk
        v = (xw - torch.empty_like(xw).exponential_().clamp_min(tiny).log()).argmax(-1)
        nxt = c * chunk + v
    return nxt, x.gather(-1, nxt[:, None]).squeeze(1) - m.squeeze(1) - z.log()


GROUPED_ATTENTION = "groupwise_grouped_decode"
KERNEL_ATTENTION = "groupwise_decode_kernel"


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for a decode step over a static cache, in transformers' attention-function signature: query
    (N, Hq, S, D), key/value (N, Hkv, L, D), attention_mask (N, 1, S, L) boolean (True: attend) or additive.
    Query heads h·r … h·r + r − 1 share KV head h (r = Hq / Hkv, transformers' repeat_kv order), so the queries are
    viewed as (N, Hkv, r·S, D) and attend to the KV cache as stored: one read of each KV head instead of r copies.
    Only for S = 1 (one new token per row), where the mask is the same for the r·S query rows."""
    N, Hq, S, D = _check_decode(query, kwargs)
    Hkv = key.shape[1]
    q = query.reshape(N, Hkv, (Hq // Hkv) * S, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    # the value head size (MLA models: DeepSeek-V2/V3, MiniCPM3, … have one smaller than the query / key head size)
    return out.reshape(N, Hq, S, value.shape[-1]).transpose(1, 2).contiguous(), None


def kernel_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, splits: int,
                            **kwargs):
    """grouped_decode_attention's contract on CUDA with a boolean mask, computed by decode_attention's Triton kernel:
    it reads each row's keys and values only over its open slots (the filled part of the static buffer)."""
    N, Hq, S, D = _check_decode(query, kwargs)
    scale = scaling if scaling is not None else D ** -0.5
    return decode_attention.decode_attention(query, key, value, attention_mask[:, 0, 0, :], scale, splits), None


def kernel_attention(splits: int) -> str:
    """The name under which kernel_decode_attention with `splits` splits is registered with transformers (one name
    per split count, bound outside the compiled step)."""
    from transformers import AttentionInterface

    name = f"{KERNEL_ATTENTION}_{splits}"
    AttentionInterface.register(name, functools.partial(kernel_decode_attention, splits=splits))
    return name


def _check_decode(query, kwargs):
    if query.shape[2] != 1 or kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("the static decode loop's attention serves single-token decode steps without softcap or "
                         "sliding window only: set generation_compile=False for this model")
    return query.shape


def _register_grouped_attention() -> bool:
    """Make the decode attentions known to transformers (AttentionInterface); False where that API is missing."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(GROUPED_ATTENTION, grouped_decode_attention)
    return True

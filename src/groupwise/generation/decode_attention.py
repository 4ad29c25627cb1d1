"""Decode attention on CUDA for the static decode loop: one query token per row over a static KV cache, in one
Triton kernel (flash decoding).

Why not sdpa: in a decode step of a grouped-query model each KV head serves r = Hq / Hkv query heads (7 for the
Qwen2.5 family). sdpa's kernels tile 64 or 128 query rows, so 7 rows fill a tenth of each tile, and they attend over
the whole static buffer (prompt region + max_completion_length) whatever has been written. This kernel gives each
(row, KV head) one program that
- reads the row's mask to find its first and last open slot, and reads keys and values only between them (the
  filled part of the buffer: at step t of a completion, the prompt and t tokens);
- computes the r query heads of that KV head together (one read of each key and value);
- keeps the softmax online (running max m, running sum l, rescaled accumulator), in float32:
      m' = max(m, max_j s_j),  l' = l·e^(m − m') + Σ_j e^(s_j − m'),  acc' = acc·e^(m − m') + Σ_j e^(s_j − m') v_j,
      output = acc / l,  with s_j = q·k_j · scale for open slots and −∞ for masked ones;
- when rows × KV heads are too few to fill the GPU, splits a row's slots into S parts whose partial (m, l, acc) are
  merged afterwards: M = max_s m_s, output = Σ_s e^(m_s − M) acc_s / Σ_s e^(m_s − M) l_s.
Float32 inputs use IEEE products (no TF32), so a float32 model decodes as sdpa does up to summation order.
Registered as a torch.library.triton_op so that torch.compile places the kernel inside the captured decode graph.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

SPLIT_SLOTS = 64  # a split covers at least this many slots
BLOCK_M = 128  # mask slots per iteration of the scan for a row's open range (a constant: L may be symbolic)


def _block_n(block_d: int) -> int:
    """Key/value slots per iteration: 32 for head dims up to 64, 16 above. Register use grows with slots × head dim
    (Triton 3.6 for sm_90, 4 warps, bf16: 96 registers at head dim 64 × 32 slots and 148 at 128 × 16, against 231
    and 255 with a spill at 64 slots; scripts/decode_kernel_registers.py), and fewer registers let more programs
    share a multiprocessor."""
    return 32 if block_d <= 64 else 16


_SMS = 0  # streaming multiprocessors of the GPU in use (set by prepare(), outside any compiled region)


def prepare(device: torch.device) -> bool:
    """True where the kernel can run on `device` (CUDA, Triton installed, torch.library.triton_op present); records
    the GPU's size for the choice of splits."""
    global _SMS
    if device.type != "cuda":
        return False
    if importlib.util.find_spec("triton") is None or not hasattr(torch.library, "triton_op"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    _SMS = torch.cuda.get_device_properties(index).multi_processor_count
    _build()  # registers the op here, outside any compiled region
    return True


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
                     scale: float, splits: int = 1) -> torch.Tensor:
    """query (N, Hq, 1, D), key/value (N, Hkv, L, D), keep (N, L) boolean (True: the slot may be attended to).
    Returns (N, 1, Hq, D) in the query's dtype: transformers' attention-output layout. Query head h uses KV head
    h // (Hq / Hkv) (transformers' repeat_kv order). splits: slot splits per (row, KV head), a plain int chosen
    outside any compiled region (choose_splits). prepare(device) must have returned True first."""
    return torch.ops.groupwise.decode_attention(query, key, value, keep, float(scale), splits)


def choose_splits(programs: int, L: int) -> int:
    """Splits per (row, KV head) for `programs` = rows × KV heads over L slots: enough programs for 4 per streaming
    multiprocessor, at most one split per SPLIT_SLOTS slots. Called on the host with plain ints: inside a compiled
    region a symbolic size would fix the split count with guards on the batch size (a recompile per shape)."""
    want = 4 * _SMS
    if programs >= want:
        return 1
    return max(1, min(-(-L // SPLIT_SLOTS), -(-want // programs)))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


@functools.cache
def _kernel():
    """The Triton kernel (jit-compiled on first launch; an interpreted one when TRITON_INTERPRET=1 is set)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, Keep, Out, Part, Stats,
               sq_n, sq_h, sq_d, sk_n, sk_h, sk_l, sk_d, sv_n, sv_h, sv_l, sv_d, sm_n, sm_l, so_n, so_h, so_d,
               L, scale_log2e,
               R: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a layer's buffers may exceed 2^31 elements
        h = tl.program_id(1).to(tl.int64)
        s = tl.program_id(2)
        # the row's open slots lie in [lo, hi): its first and last open slot, from its mask
        lo = tl.full([], L, tl.int32)
        hi = tl.zeros([], tl.int32)
        for start in range(0, L, BLOCK_M):
            offs = start + tl.arange(0, BLOCK_M)
            is_open = tl.load(Keep + n * sm_n + offs * sm_l, mask=offs < L, other=0) != 0
            lo = tl.minimum(lo, tl.min(tl.where(is_open, offs, L), 0))
            hi = tl.maximum(hi, tl.max(tl.where(is_open, offs + 1, 0), 0))
        lo = (lo // BLOCK_N) * BLOCK_N
        per = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), SPLITS), BLOCK_N) * BLOCK_N
        first = lo + s * per
        last = tl.minimum(first + per, hi)

        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        rd_mask = (offs_r[:, None] < R) & (offs_d[None, :] < D)
        q = tl.load(Q + n * sq_n + (h * R + offs_r)[:, None] * sq_h + offs_d[None, :] * sq_d, mask=rd_mask,
                    other=0.0)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for start in range(first, last, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_range = offs_n < last
            is_open = tl.load(Keep + n * sm_n + offs_n * sm_l, mask=in_range, other=0) != 0
            nd_mask = in_range[:, None] & (offs_d[None, :] < D)
            k = tl.load(K + n * sk_n + h * sk_h + offs_n[:, None] * sk_l + offs_d[None, :] * sk_d, mask=nd_mask,
                        other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(is_open[None, :], scores * scale_log2e, float("-inf"))  # log2 units
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + n * sv_n + h * sv_h + offs_n[:, None] * sv_l + offs_d[None, :] * sv_d, mask=nd_mask,
                        other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(Out + n * so_n + (h * R + offs_r)[:, None] * so_h + offs_d[None, :] * so_d,
                     out.to(Out.dtype.element_ty), mask=rd_mask)
        else:
            base = ((n * tl.num_programs(1) + h) * SPLITS + s) * BLOCK_R
            tl.store(Part + (base + offs_r)[:, None] * BLOCK_D + offs_d[None, :], acc)
            tl.store(Stats + (base + offs_r) * 2, m_i)
            tl.store(Stats + (base + offs_r) * 2 + 1, l_i)

    return kernel


def _run(kernel, query, key, value, keep, scale: float, splits: int) -> torch.Tensor:
    """The op's body: launch `kernel` on (N, Hkv, splits) programs, then merge the splits' partial softmaxes."""
    N, Hq, _, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    R = Hq // Hkv
    BLOCK_R, BLOCK_D = _pow2(R), _pow2(D)
    out = torch.empty((N, 1, Hq, D), dtype=query.dtype, device=query.device)
    # with one split the kernel writes `out` only; the partials' pointers are placeholders (distinct tensors: an
    # argument aliased with the output could be cloned apart from it by functionalization)
    part = torch.empty(0, dtype=torch.float32, device=query.device)
    stats = torch.empty(0, dtype=torch.float32, device=query.device)
    if splits > 1:
        part = torch.empty((N, Hkv, splits, BLOCK_R, BLOCK_D), dtype=torch.float32, device=query.device)
        stats = torch.empty((N, Hkv, splits, BLOCK_R, 2), dtype=torch.float32, device=query.device)
    kernel[(N, Hkv, splits)](
        query, key, value, keep, out, part, stats,
        query.stride(0), query.stride(1), query.stride(3), key.stride(0), key.stride(1), key.stride(2),
        key.stride(3), value.stride(0), value.stride(1), value.stride(2), value.stride(3), keep.stride(0),
        keep.stride(-1), out.stride(0), out.stride(2), out.stride(3), L, scale * 1.4426950408889634,
        R=R, D=D, SPLITS=splits, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, BLOCK_N=_block_n(BLOCK_D),
        BLOCK_M=BLOCK_M, IEEE=query.dtype == torch.float32, num_warps=4, num_stages=2)
    if splits == 1:
        return out
    m, l = stats[..., :R, 0], stats[..., :R, 1]  # (N, Hkv, S, R), log2 units
    top = m.amax(2, keepdim=True)
    w = torch.exp2(m - torch.where(top == float("-inf"), 0.0, top))  # e^(m_s − M)
    num = (w[..., None] * part[..., :R, :D]).sum(2)  # (N, Hkv, R, D)
    den = (w * l).sum(2)
    merged = num / torch.where(den == 0, 1.0, den)[..., None]
    return merged.reshape(N, 1, Hq, D).to(query.dtype)


@functools.cache
def _build():
    """Register groupwise::decode_attention, a torch.library.triton_op (torch.compile sees the kernel and captures
    it); called once, by prepare()."""
    from torch.library import triton_op, wrap_triton

    kernel = _kernel()

    @triton_op("groupwise::decode_attention", mutates_args={})
    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor, scale: float,
           splits: int) -> torch.Tensor:
        return _run(wrap_triton(kernel), query, key, value, keep, scale, splits)

    return op

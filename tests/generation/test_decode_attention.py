"""The Triton decode-attention kernel against a plain loop over rows and heads: on CUDA when a GPU is present, and
through Triton's interpreter on CPU when Triton is installed (neither on a CPU-only CI machine, where the static
loop attends with sdpa)."""

import importlib.util

import numpy as np
import pytest
import torch

from groupwise.generation import decode_attention as da


def _reference(q, k, v, keep, scale):
    """softmax(q·k_j · scale over the open slots j) · v, one (row, query head) at a time, in float64."""
    N, Hq, _, D = q.shape
    r = Hq // k.shape[1]
    out = torch.zeros(N, 1, Hq, D, dtype=torch.float64)
    for n in range(N):
        slots = keep[n].nonzero().squeeze(1).cpu()
        for h in range(Hq):
            kh, vh = k[n, h // r].double().cpu()[slots], v[n, h // r].double().cpu()[slots]
            w = torch.softmax(kh @ q[n, h, 0].double().cpu() * scale, 0)
            out[n, 0, h] = w @ vh
    return out


def _inputs(N, Hq, Hkv, L, D, dtype, device, seed=0, strided=False):
    """Rows whose open slots start after a left padding and have holes (every fifth slot closed), as a tool loop's
    left-padded prompts do; one row opens a single slot, and with L > 600 one row opens two slots far apart with a
    long hole between them (its open range spans several blocks of the mask scan, BLOCK_M = 128) and one opens
    none (its output is 0). strided: q, k, v and keep are views into larger tensors, as in the model (the query a
    transposed projection, the mask a slice of the 4-D mask)."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        q = torch.randn(N, 1, Hq, D + 3, generator=g)[..., :D].transpose(1, 2)
        k, v = (torch.randn(N, L, Hkv, D, generator=g).transpose(1, 2) for _ in range(2))
    else:
        q, k, v = (torch.randn(N, H, S, D, generator=g) for H, S in ((Hq, 1), (Hkv, L), (Hkv, L)))
    keep = torch.zeros(N, L, dtype=torch.bool)
    for n in range(N):
        a = int(torch.randint(0, L // 2, (1,), generator=g))
        b = int(torch.randint(a + 1, L + 1, (1,), generator=g))
        keep[n, a:b] = True
        keep[n, a + 1:b:5] = False
    keep[0] = False
    keep[0, L - 1] = True
    if L > 600:
        keep[1] = False
        keep[1, [3, L - 4]] = True
        keep[2] = False
    if strided:
        keep = torch.cat([keep, keep], 1)[:, :L]
    return (x.to(dtype).to(device) if x.dtype != torch.bool else x.to(device) for x in (q, k, v, keep))


# (N, Hq, Hkv, L, D): 3 queries per KV head; 7 (the Qwen2.5 family); 1; a long buffer with a head dim of 80
SHAPES = [(3, 6, 2, 70, 8), (2, 14, 2, 200, 64), (4, 4, 4, 130, 16), (3, 14, 2, 1300, 80)]


def _check(ours, q, k, v, keep, tol):
    ref = _reference(q, k, v, keep, 0.3)
    assert ours.shape == ref.shape and not ours.isnan().any()
    torch.testing.assert_close(ours.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [1, 3, "chosen"])
@pytest.mark.parametrize("strided", [False, True])
def test_kernel_equals_a_plain_loop_on_cuda(dtype, shape, splits, strided):
    assert da.prepare(torch.device("cuda"))
    q, k, v, keep = _inputs(*shape, dtype, "cuda", strided=strided)
    if splits == "chosen":
        splits = da.choose_splits(shape[0] * shape[2], shape[3])
    ours = da.decode_attention(q, k, v, keep, 0.3, splits=splits)
    assert ours.dtype == dtype
    _check(ours, q, k, v, keep, 1e-5 if dtype == torch.float32 else 2e-2)  # bf16: probabilities rounded before P·V


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]])
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_kernel_equals_a_plain_loop_in_the_interpreter(monkeypatch, shape, splits):
    """float32 only: the interpreter computes bfloat16 products wrongly (numpy has no bfloat16)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = da._kernel.__wrapped__()  # a fresh, interpreted kernel (not the cached compiled one)
    q, k, v, keep = _inputs(*shape, torch.float32, "cpu", seed=1, strided=splits == 2)
    try:
        ours = da._run(kernel, q, k, v, keep, 0.3, splits)
    except Exception as e:  # triton.runtime.errors.InterpreterError
        if "only 0-dimensional arrays can be converted" in str(e):  # Triton ≤ 3.6's interpreter under numpy ≥ 2.4
            pytest.skip(f"this Triton's interpreter does not run under numpy {np.__version__}: {e}")
        raise
    _check(ours, q, k, v, keep, 1e-5)


def test_splits_fill_the_gpu_but_not_beyond_the_slots(monkeypatch):
    """4 programs per SM (132 SMs: 528): 1024 programs need no split; 24 programs over 76 slots take 2 (one per 64
    slots at most); 256 over 320 slots take ceil(528 / 256) = 3."""
    monkeypatch.setattr(da, "_SMS", 132)
    assert da.choose_splits(1024, 320) == 1
    assert da.choose_splits(24, 76) == 2
    assert da.choose_splits(256, 320) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on CUDA")
@pytest.mark.parametrize("splits", [1, 3])
def test_compiled_kernel_writes_only_its_outputs_on_cuda(caplog, splits):
    """Under torch.compile, inductor reads from the kernel's Triton IR which arguments it stores to; where that
    analysis fails it assumes every input is written and functionalization copies them, i.e. the whole key and value
    cache of every layer at every decode step (a silent slowdown, found on CPU where the analysis cannot run). The
    compiled op must equal the eager one without that fallback."""
    import logging

    assert da.prepare(torch.device("cuda"))
    q, k, v, keep = _inputs(*SHAPES[1], torch.bfloat16, "cuda")
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="torch._higher_order_ops.triton_kernel_wrap"):
        compiled = torch.compile(lambda *a: da.decode_attention(*a, 0.3, splits=splits), fullgraph=True)(q, k, v, keep)
    assert "assuming every input is mutated" not in caplog.text
    torch.testing.assert_close(compiled, da.decode_attention(q, k, v, keep, 0.3, splits=splits))

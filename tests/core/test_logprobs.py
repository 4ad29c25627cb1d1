import ast
import pathlib

import torch

from groupwise.core.logprobs import entropy_from_logits, selective_log_softmax, top_entropy_mask


def test_selective_log_softmax_matches_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 11, generator=g)
    ids = torch.randint(0, 11, (5, 4), generator=g)
    got = selective_log_softmax(logits, ids, chunk_rows=2)
    for n in range(5):
        for t in range(4):
            expected = logits[n, t, ids[n, t]] - torch.log(torch.exp(logits[n, t]).sum())
            assert torch.allclose(got[n, t], expected, atol=1e-5)


def test_entropy_by_hand_and_loop():
    # uniform over 4 → log 4 = 1.386294; a one-hot-ish distribution → ≈ 0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    ent = entropy_from_logits(logits)
    assert torch.allclose(ent, torch.tensor([[1.386294, 0.0]]), atol=1e-5)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 7, generator=g)
    got = entropy_from_logits(logits, chunk_rows=1)
    for n in range(3):
        for t in range(2):
            p = torch.softmax(logits[n, t], -1)
            assert torch.allclose(got[n, t], -(p * p.log()).sum(), atol=1e-5)


def test_top_entropy_mask():
    # real-token entropies [1, 2, 3, 4] (the 0.9 is padding); quantile 0.5 keeps the top half: ≥ median 2.5
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.9, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert torch.equal(top_entropy_mask(ent, mask, 0.5), torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    assert torch.equal(top_entropy_mask(ent, mask, 1.0), mask.float())
    # this process holds the rows above; another holds entropies [5, 6, 7] (3 real tokens). Gathered, the real
    # entropies are [1, 2, 3, 4, 5, 6, 7], median 4: here only the 4 is kept (alone, the threshold was 2.5)
    other = torch.tensor([5.0, 6.0, 7.0])
    gathered = top_entropy_mask(ent, mask, 0.5, gather=lambda real: torch.cat([real, other]))
    assert torch.equal(gathered, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_core_imports_only_torch():
    core = pathlib.Path(__file__).parents[2] / "src" / "groupwise" / "core"
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in {"torch", "__future__", "math", "collections", "typing", "dataclasses"} or \
                    name.startswith("groupwise.core"), f"{path.name} imports {name}"


import pytest

from groupwise.core.logprobs import logps_from_hidden


@pytest.mark.parametrize("softcap, scale, temperature", [(None, 1.0, 1.0), (30.0, 1.0, 0.7), (None, 0.25, 1.3)])
def test_chunked_logps_equal_full_logits_values_and_gradients(softcap, scale, temperature):
    g = torch.Generator().manual_seed(0)
    N, T, H, V = 3, 5, 8, 50
    hidden = torch.randn(N, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N, T), generator=g)
    # reference: the full (N, T, V) logits, processed as the formula says
    logits = (hidden @ weight.T + bias) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    full = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    p = torch.softmax(logits / temperature, -1)
    full_entropy = -(p * p.log()).sum(-1)
    ref_grads = torch.autograd.grad(full.sum(), (hidden, weight, bias))
    got, entropy = logps_from_hidden(hidden, weight, targets, bias=bias, temperature=temperature, softcap=softcap,
                                     scale=scale, chunk_tokens=4, compute_entropy=True)  # 15 positions → 4 chunks
    assert torch.allclose(got.double(), full, atol=1e-5)
    assert torch.allclose(entropy.double(), full_entropy, atol=1e-5)
    grads = torch.autograd.grad(got.sum(), (hidden, weight, bias))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_entropy_with_gradient_matches_full_logits_autograd():
    """entropy_grad=True: the chunked, checkpointed entropy has the value and gradient of −Σ p log p on full logits."""
    from groupwise.core.logprobs import entropy_from_logits, logps_from_hidden

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    _, ent = logps_from_hidden(hidden, weight, targets, chunk_tokens=3, compute_entropy=True, entropy_grad=True)
    ent.sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    full = entropy_from_logits(hidden @ weight.T)
    full.sum().backward()
    # both paths upcast the logits to float32 (as in training): float32 tolerances, the head's gradient summing over
    # every position (the first GPU-machine run, another CPU and torch 2.11, differed from here by float32 rounding)
    close = dict(rtol=1e-4, atol=1e-5)
    assert torch.allclose(ent, full, **close) and torch.allclose(got[0], hidden.grad, **close)
    assert torch.allclose(got[1], weight.grad, **close)

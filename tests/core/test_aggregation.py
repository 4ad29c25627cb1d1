"""Every loss aggregation against a plain loop over its formula (groupwise.core.aggregation), and by hand."""

import pytest
import torch

from groupwise.core.aggregation import AGGREGATIONS, aggregate


def _loop(loss, mask, name, max_completion_length=None, num_items_in_batch=None):
    N, T = loss.shape
    rows = [[(loss[i, t].item(), mask[i, t].item()) for t in range(T)] for i in range(N)]
    total = sum(v * m for row in rows for v, m in row)
    tokens = sum(m for row in rows for _, m in row)
    if name == "grpo":  # mean over sequences of the per-sequence token mean (a sequence without tokens counts 0)
        return sum(sum(v * m for v, m in row) / max(sum(m for _, m in row), 1) for row in rows) / N
    if name == "bnpo":
        return total / max(tokens, 1)
    if name == "dr_grpo":
        return total / (N * max_completion_length)
    if name == "dapo":
        return total / max(tokens if num_items_in_batch is None else num_items_in_batch, 1)
    if name == "luspo":
        return sum(sum(v * m for v, m in row) for row in rows) / N
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregation_matches_loop(name):
    g = torch.Generator().manual_seed(5)
    loss = torch.randn(6, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 7, generator=g) < 0.6).long()
    mask[2] = 0  # a sequence without tokens
    kw = {"max_completion_length": 9, "num_items_in_batch": 31}
    assert aggregate(loss, mask, name, **kw).item() == pytest.approx(_loop(loss, mask, name, **kw), abs=1e-12)
    if name == "dapo":  # no global count given: this micro-batch's tokens
        assert aggregate(loss, mask, name).item() == pytest.approx(_loop(loss, mask, name), abs=1e-12)


def test_aggregations_with_an_empty_row_by_hand():
    # loss [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [0, 0, 0]]: masked sum 1 + 2 = 3 over 2 tokens
    # grpo: (3/2 + 0/1)/2 = 0.75; bnpo 3/2 = 1.5; dr_grpo 3/(2·4) = 0.375; dapo(num_items 6) 0.5; luspo (3 + 0)/2 = 1.5
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    got = {n: aggregate(loss, mask, n, max_completion_length=4, num_items_in_batch=6).item() for n in AGGREGATIONS}
    assert got == pytest.approx({"grpo": 0.75, "bnpo": 1.5, "dr_grpo": 0.375, "dapo": 0.5, "luspo": 1.5})

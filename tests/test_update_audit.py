"""Gradient accumulation for every loss type (groupwise.update.optimizer_step), with a real model, off-policy
(clipping engaged) and β > 0: k micro-batches accumulated give the gradient of TRL 1.16's accumulation semantics, the
per-micro-batch loss written out from TRL's formulas (tests/core/test_losses._trl_loss), and, for every loss type
whose normaliser composes, the gradient of one big batch.

TRL's semantics per loss type (k micro-batches in one optimizer step, one process):
    grpo, sapo, bnpo, dr_grpo, luspo   Σ_i L_i / k        (L_i the micro-batch's own aggregation)
    dapo, cispo, vespo                 Σ_i S_i / N_step   (S_i the micro-batch's masked sum, N_step the step's tokens)
With equal-size micro-batches, grpo / sapo (mean of sequence means), dr_grpo (N·L), luspo (mean of sequence sums),
dapo / cispo / vespo (the step's tokens; vespo's weight is per sequence) equal one batch holding them all; bnpo (each micro-batch's own token mean) does not
when the micro-batches hold different numbers of tokens."""

import copy
import math

import pytest
import torch

from groupwise.core.losses import LOSS_TYPES
from groupwise.modeling import PolicyForLogps
from groupwise.types import TrainBatch
from groupwise.update import windows
from tests.core.test_losses import _trl_loss
from tests.test_update import _batch, _grads

COMPOSES = {"grpo", "sapo", "dr_grpo", "dapo", "cispo", "luspo", "vespo"}


def _fields(loss_type, level):
    f = {"beta": 0.04, "importance_sampling_level": level}
    if loss_type == "cispo":
        f["epsilon_high"] = 1.3
    elif loss_type == "vespo":  # its sequence weight ignores the level (a warning, as TRL's)
        f["importance_sampling_level"] = "token"
    elif loss_type != "sapo":
        f.update(epsilon_high=0.28, delta=1.5)
    return f


def _off_policy(tokenizer, model, seed=3):
    """_batch's ragged rows with π_θold and π_ref 0.3-noise away from the model's own log-probs."""
    b = _batch(tokenizer)
    with torch.no_grad():
        lp, _ = PolicyForLogps(model)(b.input_ids, b.attention_mask, b.completion_mask.size(1))
    g = torch.Generator().manual_seed(seed)
    old = lp + 0.3 * torch.randn(lp.shape, generator=g)
    ref = lp + 0.3 * torch.randn(lp.shape, generator=g)
    return TrainBatch(b.input_ids, b.attention_mask, b.completion_mask, b.advantages, old, ref)


def _trl_accumulated_gradient(model, micro, loss_type, f):
    wrapped = PolicyForLogps(model)
    k = len(micro)
    n_step = sum(mb.completion_mask.sum() for mb in micro).double()
    total = 0.0
    for mb in micro:
        T = mb.completion_mask.size(1)
        lp, _ = wrapped(mb.input_ids, mb.attention_mask, T)
        mask = mb.completion_mask.to(lp.dtype)
        loss = _trl_loss(lp, mb.old_logps, mb.advantages, mask, loss_type=loss_type,
                         level=f["importance_sampling_level"], beta=f["beta"], ref=mb.ref_logps, bias_kl=False,
                         eps_low=0.2, eps_high=f.get("epsilon_high") or 0.2, delta=f.get("delta"), tau_pos=1.0,
                         tau_neg=1.05, max_len=T)
        if loss_type in ("dapo", "cispo", "vespo"):  # _trl_loss divides by this micro-batch's tokens; TRL by the step's
            total = total + loss * mask.sum().clamp(min=1.0) / n_step
        else:
            total = total + loss / k
    total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_loss_type_accumulates_as_trl_and_as_one_batch(tokenizer, tiny_model, loss_type, level):
    batch = _off_policy(tokenizer, tiny_model)
    f = _fields(loss_type, level)
    micro = windows(batch, 2, 4, 1, 4)  # one optimizer step of 4 micro-batches of 2 rows
    assert len(micro) == 1 and len(micro[0]) == 4
    tokens = [int(mb.completion_mask.sum()) for mb in micro[0]]
    assert len(set(tokens)) > 1  # ragged: bnpo's per-micro-batch mean differs from the batch's
    small, _ = _grads(copy.deepcopy(tiny_model), tokenizer, batch, micro, loss_type, **f)
    expected = _trl_accumulated_gradient(copy.deepcopy(tiny_model), micro[0], loss_type, f)
    assert small.keys() == expected.keys() and small
    for name in small:
        assert torch.allclose(small[name], expected[name], atol=1e-6, rtol=1e-4), name
    big, _ = _grads(copy.deepcopy(tiny_model), tokenizer, batch, [[batch]], loss_type, **f)
    same = all(torch.allclose(big[n], small[n], atol=1e-6, rtol=1e-4) for n in big)
    assert same == (loss_type in COMPOSES), loss_type


# ---- logged metrics over processes with unequal token counts (TRL's global_masked_mean) ------------------------------
def test_mean_metrics_are_token_weighted_over_processes_by_hand():
    """TRL logs kl, entropy and clip_ratio/*_mean as Σ over every process's tokens / every process's token count, not
    the mean of each process's mean. One micro-batch per process, W = 2, on-policy, β = 1, T = 3:
    process 0 holds one row with 3 real tokens, log π − log π_ref = [1, 1, 1]: k3 = e^{−1} + 1 − 1 = 0.367879 each;
    process 1 holds one row with 1 real token, log π − log π_ref = −1: k3 = e − 2 = 0.718282.
    kl = (3·0.367879 + 0.718282) / 4 = 0.455480 (the mean of the process means would be (0.367879 + 0.718282)/2
    = 0.543081). entropy 2·σ(log π + C) with C = −log π: 2·σ(0) = 1 on every token, so 1 either way."""
    from tests.test_update import _Comm, _Table, _ThreadDist, _threads
    from groupwise.config import GRPOConfig
    from groupwise.update import UpdateContext, optimizer_step

    P = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -5.0, -5.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -2.0, -2.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    comm = _Comm(2)
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=3, beta=1.0,
                      max_grad_norm=0.0, loss_type="bnpo")

    def rank(r):
        model = _Table(P, -P)
        ids = torch.tensor([[r, 0, 0, 0]])
        batch = TrainBatch(ids, torch.ones_like(ids), mask[r:r + 1], torch.zeros(1, dtype=torch.float64),
                           None, ref[r:r + 1])
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        ctx = UpdateContext(args, _ThreadDist(comm, r), model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1))
        return optimizer_step(ctx, [batch])

    for metrics in _threads(2, rank):
        assert metrics["kl"] == pytest.approx((3 * math.exp(-1) + math.e - 2) / 4, abs=1e-6)
        assert metrics["kl"] == pytest.approx(0.455480, abs=1e-6)
        assert metrics["entropy"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "luspo"])
@pytest.mark.parametrize("case", ["token", "sequence"])
def test_metrics_equal_trls_with_unequal_tokens_per_process(loss_type, case):
    """As test_update's comparison with TRL 1.16's _compute_loss, over 2 processes × 2 micro-batches × μ = 2, but the
    processes hold different numbers of tokens (process 0: 5 + 1, process 1: 5 + 9): gradients and every logged
    metric (token-weighted over processes) equal TRL's."""
    pytest.importorskip("trl")
    from tests.test_update import _case, _groupwise_steps, _trl_steps

    d, f, is_level = _case(loss_type, case)
    d["mask"] = (torch.arange(5) < torch.tensor([5, 0, 1, 0, 3, 2, 5, 4])[:, None]).double()
    ours, ours_metrics = _groupwise_steps(d, 2, 2, 2, 2, 2, f, is_level)
    theirs, their_metrics = _trl_steps(d, 2, 2, 2, 2, 2, f, is_level)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-12), (a - b).abs().max()
    shared = set(their_metrics) - {"policy_loss"}
    assert {"kl", "entropy"} <= shared <= set(ours_metrics)
    for name in shared:
        assert ours_metrics[name] == pytest.approx(their_metrics[name], abs=1e-6), name


def test_windows_refuses_rows_no_micro_batch_would_train_on(tokenizer):
    """8 rows cut as 2 micro-batches of 2 would leave rows 4–7 out of every optimizer step, silently."""
    batch = _batch(tokenizer, n=8)
    with pytest.raises(ValueError, match="8 rows per process is not steps_per_generation=2 micro-batches of 2 rows"):
        windows(batch, 2, 2, 1, 2)
    assert [len(w) for w in windows(batch, 2, 4, 1, 2)] == [2, 2]

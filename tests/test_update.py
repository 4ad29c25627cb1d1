import copy

import pytest
import torch

from groupwise.config import GRPOConfig
from groupwise.distributed import Distributed
from groupwise.modeling import PolicyForLogps
from groupwise.types import TrainBatch
from groupwise.update import UpdateContext, optimizer_step, windows


def _batch(tokenizer, n=8, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = 3
    ids = torch.randint(3, len(tokenizer), (n, P + T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)  # ragged completions
    cmask = (torch.arange(T) < lengths[:, None]).long()
    attn = torch.cat([torch.ones(n, P, dtype=torch.long), cmask], 1)
    return TrainBatch(ids, attn, cmask, torch.randn(n, generator=g))


def _grads(model, tokenizer, batch, windows_, loss_type, **fields):
    args = GRPOConfig(loss_type=loss_type, num_generations=2, per_device_train_batch_size=2, max_completion_length=5,
                      learning_rate=1e-3, max_grad_norm=0.0, **fields)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: inspect gradients before zero_grad
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    captured = {}
    orig_step = opt.step

    def capture(*a, **k):
        captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return orig_step(*a, **k)

    opt.step = capture
    ctx = UpdateContext(args, Distributed(), PolicyForLogps(model), opt, sched)
    for w in windows_:
        metrics = optimizer_step(ctx, w)
    return captured, metrics


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_accumulating_k_micro_batches_equals_one_big_batch(tokenizer, tiny_model, loss_type):
    """The silent-wrong-gradient trap (transformers #34191): 4 micro-batches of 2 rows accumulated must give the
    gradient of one batch of 8 rows (equal-size micro-batches for grpo's per-sequence mean)."""
    batch = _batch(tokenizer)
    m1, m2 = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    big, _ = _grads(m1, tokenizer, batch, [[batch]], loss_type)
    small, _ = _grads(m2, tokenizer, batch, windows(batch, 2, 4, 1, 4), loss_type)
    assert big.keys() == small.keys() and big
    for name in big:
        assert torch.allclose(big[name], small[name], atol=1e-6, rtol=1e-4), name


def test_windows_order_and_grouping(tokenizer):
    batch = _batch(tokenizer, n=4)
    w = windows(batch, micro_batch_size=2, steps_per_generation=2, num_iterations=2, gradient_accumulation_steps=2)
    # μ = 2 passes over 2 micro-batches, 2 micro-batches per optimizer step → 2 steps of [rows 0-1, rows 2-3]
    assert len(w) == 2 and all(len(x) == 2 for x in w)
    assert torch.equal(w[1][0].input_ids, batch.input_ids[:2]) and torch.equal(w[1][1].input_ids, batch.input_ids[2:])


def test_non_finite_step_is_skipped_and_weights_untouched(tokenizer, tiny_model):
    batch = _batch(tokenizer)
    bad = TrainBatch(batch.input_ids, batch.attention_mask, batch.completion_mask,
                     torch.full_like(batch.advantages, float("inf")))
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=8, max_completion_length=5)
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=0.1)
    ctx = UpdateContext(args, Distributed(), PolicyForLogps(tiny_model), opt,
                        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        metrics = optimizer_step(ctx, [bad])
    assert metrics["train/skipped"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in tiny_model.named_parameters())
    assert not opt.state  # AdamW moments untouched too
    metrics = optimizer_step(ctx, [batch])  # a finite step afterwards trains normally
    assert metrics["train/skipped"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in tiny_model.named_parameters())


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus_gradient_is_the_window_mean_of_micro_batch_entropies(tokenizer, tiny_model, loss_type):
    """entropy_coef = c: the step's gradient is ∇[L − c · (1/k) Σ_i H̄_i], H̄_i the mean token entropy of micro-batch
    i, whatever the loss type's normaliser (TRL's definition); checked against that objective built by hand."""
    from groupwise.core.aggregation import aggregate
    from groupwise.core.losses import policy_loss

    batch = _batch(tokenizer)
    c = 0.3
    model = copy.deepcopy(tiny_model)
    got, _ = _grads(model, tokenizer, batch, windows(batch, 2, 4, 1, 4), loss_type, entropy_coef=c)
    ref = copy.deepcopy(tiny_model)
    wrapped = PolicyForLogps(ref)
    micro = [batch.rows(2 * i, 2 * i + 2) for i in range(4)]
    num_items = sum(mb.completion_mask.sum() for mb in micro).float()
    total = 0.0
    for mb in micro:
        lp, ent = wrapped(mb.input_ids, mb.attention_mask, 5, compute_entropy=True, entropy_grad=True)
        mask = mb.completion_mask.float()
        loss, _ = policy_loss(lp, lp.detach(), mb.advantages, mask, loss_type=loss_type, num_items_in_batch=num_items)
        total = total + (loss if loss_type == "dapo" else loss / 4) - c * aggregate(ent, mask, "bnpo") / 4
    total.backward()
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-6, rtol=1e-4), name
    # and the bonus changes the gradient (the check above would hold trivially if H̄ carried no gradient)
    plain, _ = _grads(copy.deepcopy(tiny_model), tokenizer, batch, windows(batch, 2, 4, 1, 4), loss_type)
    assert any(not torch.allclose(got[n], plain[n], atol=1e-6) for n in plain)

import contextlib
import copy
import threading
import types
from collections import defaultdict

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


# ---- against TRL 1.16's own code path, over simulated processes ------------------------------------------------------
class _Comm:
    """All-gather between W threads standing for W processes (a barrier with a timeout: a failure cannot hang)."""

    def __init__(self, W):
        self.W, self.barrier, self.slots = W, threading.Barrier(W, timeout=60), [None] * W

    def allgather(self, rank, obj):
        self.barrier.wait()
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _ThreadDist:
    """groupwise.distributed.Distributed's collectives over _Comm; clip_grad_norm averages the gradients as DDP does
    (optimizer_step calls it once, after the window's last backward)."""

    def __init__(self, comm, rank):
        self.comm, self.rank, self.world_size, self.device = comm, rank, comm.W, torch.device("cpu")

    def sum(self, t):
        return sum(x.clone() for x in self.comm.allgather(self.rank, t.detach().clone()))

    def any(self, flag):
        return any(self.comm.allgather(self.rank, bool(flag)))

    def extreme(self, t, largest):
        fill = float("-inf") if largest else float("inf")
        # ±inf kept (nan_to_num's default would turn them into ±1.8e308), as Distributed.extreme: a micro-batch
        # without tokens reports ±inf, which must come back as NaN
        t = torch.nan_to_num(t.double(), nan=fill, posinf=float("inf"), neginf=float("-inf"))
        every = torch.stack(self.comm.allgather(self.rank, t))
        out = every.max(0).values if largest else every.min(0).values
        return torch.where(out == fill, torch.full_like(out, float("nan")), out)

    def gather_ragged(self, t):
        return torch.cat(self.comm.allgather(self.rank, t.detach().clone()))

    def no_sync(self, model, skip_sync):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    loss_scale = None  # no fp16 loss scale (Distributed's unscale / update_scale are no-ops without one)

    def unscale(self, optimizer):
        pass

    def update_scale(self):
        pass

    def clip_grad_norm(self, params, max_norm):
        params = [p for p in params if p.grad is not None]
        every = self.comm.allgather(self.rank, [p.grad.clone() for p in params])
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in every) / self.world_size
        return torch.stack([p.grad.norm() for p in params]).norm()


class _Table(torch.nn.Module):
    """A policy whose log-probs are parameters: log π(row, t) = P[row, t], entropy 2·σ(P + C) (differentiable), so
    P.grad is the gradient of the loss with respect to every token's log-prob. input_ids[:, 0] is the row."""

    def __init__(self, P, C):
        super().__init__()
        self.P, self.C = torch.nn.Parameter(P.clone()), C

    def forward(self, input_ids, attention_mask, T, temperature=1.0, compute_entropy=False, entropy_grad=False):
        logps = self.P[input_ids[:, 0]]
        entropy = 2 * torch.sigmoid(logps + self.C[input_ids[:, 0]])
        return logps, entropy if entropy_grad else entropy.detach()


def _threads(W, fn):
    out, errors = [None] * W, []

    def target(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001 — re-raised below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(W)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    return out


# TRL 1.16 GRPOConfig fields _compute_loss reads from args, at TRL's defaults unless a case sets them
TRL_DEFAULTS = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
                "entropy_target": 0.2, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005}


def _trl_steps(d, W, mbs, spg, mu, ga, f, is_level):
    """TRL 1.16: GRPOTrainer._compute_loss itself on every (process, micro-batch), its loss backpropagated, the
    gradients averaged over processes (DDP) every ga micro-batches; its metrics averaged over the micro-batches."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    comm, n = _Comm(W), d["P"].size(0) // W

    def rank(r):
        model, rows = _Table(d["P"], d["C"]), torch.arange(r * n, (r + 1) * n)
        adaptive = f.get("use_adaptive_entropy", False)
        me = types.SimpleNamespace(
            aux_loss_enabled=False, top_entropy_quantile=f["top_entropy_quantile"],
            off_policy_mask_threshold=f.get("off_policy_mask_threshold"),
            importance_sampling_level=f["importance_sampling_level"], beta=f["beta"], loss_type=f["loss_type"],
            epsilon_low=0.2, epsilon_high=f.get("epsilon_high") or 0.2, use_vllm=is_level is not None,
            vllm_importance_sampling_correction=is_level is not None, model=types.SimpleNamespace(training=True),
            current_gradient_accumulation_steps=ga, max_completion_length=d["P"].size(1),
            _entropy_bonus_enabled=f["entropy_coef"] != 0 or adaptive, entropy_coef=f["entropy_coef"],
            use_adaptive_entropy=adaptive, _last_world_entropy=float("inf"), _entropy_window_stats=None,
            _metrics=defaultdict(lambda: defaultdict(list)),
            args=types.SimpleNamespace(use_bias_correction_kl=f["use_bias_correction_kl"], delta=f.get("delta"),
                                       sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, steps_per_generation=spg,
                                       **{k: f.get(k, v) for k, v in TRL_DEFAULTS.items()}),
            accelerator=types.SimpleNamespace(
                num_processes=W, sync_gradients=True,
                gather=lambda t: torch.cat(comm.allgather(r, t.detach().reshape(-1).clone())),
                reduce=lambda t, reduction="sum": sum(comm.allgather(r, t.detach().clone())),
                pad_across_processes=lambda t, dim=0, pad_index=0: torch.nn.functional.pad(
                    t, (0, max(comm.allgather(r, t.numel())) - t.numel()), value=pad_index)))
        me.get_high_entropy_mask = lambda e, m, q: GRPOTrainer.get_high_entropy_mask(me, e, m, q)
        me.get_off_policy_mask, me.get_gamma_weights = GRPOTrainer.get_off_policy_mask, GRPOTrainer.get_gamma_weights
        me._get_per_token_logps_and_entropies = lambda _m, ids, *a, **k: (*model(ids, None, 0, entropy_grad=True), None)
        num_items = sum(comm.allgather(r, d["mask"][rows].sum()))  # the generation batch's tokens, all processes
        grads = []
        for k in range(mu * spg):
            rr = rows[(k % spg) * mbs:(k % spg + 1) * mbs]
            inputs = {"prompt_ids": rr[:, None], "prompt_mask": torch.ones(len(rr), 1),
                      "completion_ids": torch.zeros_like(d["mask"][rr]).long(), "completion_mask": d["mask"][rr],
                      "advantages": d["adv"][rr], "num_items_in_batch": num_items, "old_per_token_logps": d["old"][rr],
                      "ref_per_token_logps": d["ref"][rr]}
            if is_level is not None:  # vLLM: its log-probs too (OPSM reads them)
                inputs["importance_sampling_ratio"] = d["isw"][rr] if is_level == "token" else d["isw"][rr][:, :1]
                inputs["sampling_per_token_logps"] = d["old"][rr] - d["isw"][rr].log()
            me.accelerator.sync_gradients = (k + 1) % ga == 0  # the window's last micro-batch
            GRPOTrainer._compute_loss(me, model, inputs).backward()
            if (k + 1) % ga == 0:
                grads.append(sum(comm.allgather(r, model.P.grad.clone())) / W)
                model.P.grad = None
        return grads, {name: sum(v) / len(v) for name, v in me._metrics["train"].items()}

    return _threads(W, rank)[0]


def _groupwise_steps(d, W, mbs, spg, mu, ga, f, is_level):
    comm, n = _Comm(W), d["P"].size(0) // W
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=mbs, gradient_accumulation_steps=ga,
                      steps_per_generation=spg, num_iterations=mu, max_completion_length=d["P"].size(1),
                      max_grad_norm=0.0, **f)

    def rank(r):
        model, rows = _Table(d["P"], d["C"]), torch.arange(r * n, (r + 1) * n)
        ids = torch.cat([rows[:, None], torch.zeros_like(d["mask"][rows]).long()], 1)
        isw = None if is_level is None else d["isw"][rows] if is_level == "token" else d["isw"][rows][:, :1]
        sampled = None  # the sampler's log-probs reach the update for the off-policy mask (GRPOConfig.keeps_…)
        if is_level is not None and f.get("off_policy_mask_threshold") is not None:
            sampled = d["old"][rows] - d["isw"][rows].log()
        batch = TrainBatch(ids, torch.ones_like(ids), d["mask"][rows].long(), d["adv"][rows], d["old"][rows],
                           d["ref"][rows], isw, sampled)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        grads, step = [], opt.step
        opt.step = lambda *a, **k: (grads.append(model.P.grad.clone()), step(*a, **k))[1]
        ctx = UpdateContext(args, _ThreadDist(comm, r), model, opt, sched)
        metrics = [optimizer_step(ctx, w) for w in windows(batch, mbs, spg, mu, ga)]
        return grads, {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}

    return _threads(W, rank)[0]


def _case(loss_type, case, T=5):
    """8 rows over 2 processes × 2 micro-batches of 2, ragged (one empty), with equal token counts per micro-batch on
    both processes; π_θold and π_ref off π_θ; the fields of `case` ("token" or "sequence")."""
    g = torch.Generator().manual_seed(11)
    R = 8
    P = -torch.rand(R, T, generator=g, dtype=torch.float64) * 2 - 0.1
    lengths = torch.tensor([5, 0, 2, 4, 3, 2, 1, 5])[:, None]  # tokens per micro-batch: process 0: 5, 6; 1: 5, 6
    d = {"P": P, "C": torch.randn(R, T, generator=g, dtype=torch.float64),
         "old": P + 0.3 * torch.randn(R, T, generator=g, dtype=torch.float64),
         "ref": P + 0.3 * torch.randn(R, T, generator=g, dtype=torch.float64),
         "mask": (torch.arange(T) < lengths).double(),
         "adv": torch.randn(R, T, generator=g, dtype=torch.float64) if case == "token" else
         torch.randn(R, generator=g, dtype=torch.float64),
         "isw": torch.exp(0.2 * torch.randn(R, T, generator=g, dtype=torch.float64))}
    f = {"loss_type": loss_type, "beta": 0.04, "importance_sampling_level": case,
         "use_bias_correction_kl": case == "sequence", "top_entropy_quantile": 0.5 if case == "token" else 1.0,
         "entropy_coef": 0.1 if case == "token" else 0.0}
    if loss_type == "cispo":
        f["epsilon_high"] = 1.3
    elif loss_type != "sapo":
        f.update(epsilon_high=0.28, delta=1.5)
    return d, f, None if case == "token" else "sequence"


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"])
@pytest.mark.parametrize("case", ["token", "sequence"])
def test_every_loss_type_gives_trls_gradients_and_metrics_over_processes_and_micro_batches(loss_type, case):
    """2 processes × 2 micro-batches per optimizer step × μ = 2 iterations (4 optimizer steps: ratios ≠ 1 from an
    off-policy π_θold), ragged completions and an empty one, β > 0: every step's gradient with respect to every
    token's log-prob equals the one TRL 1.16's GRPOTrainer._compute_loss gives under DDP and its accumulation.
    "token": token-level ratio and process-style (N, T) advantages, top-entropy mask, entropy bonus;
    "sequence": GSPO's sequence ratio, bias-corrected KL and sequence-level sampler weights. The logged metrics
    agree too (token-weighted over processes in both; unequal token counts per process: test_update_audit.py)."""
    pytest.importorskip("trl")
    W, mbs, spg, mu, ga = 2, 2, 2, 2, 2
    d, f, is_level = _case(loss_type, case)
    ours, ours_metrics = _groupwise_steps(d, W, mbs, spg, mu, ga, f, is_level)
    theirs, their_metrics = _trl_steps(d, W, mbs, spg, mu, ga, f, is_level)
    assert len(ours) == len(theirs) == mu * spg // ga
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-12), (a - b).abs().max()
    assert any(b.abs().max() > 1e-3 for b in theirs)
    # TRL logs dapo's / cispo's policy_loss per micro-batch as its share of the window's loss, averaged: the loss / ga
    shared = set(their_metrics) - {"policy_loss"}
    assert shared and shared <= set(ours_metrics)
    for name in shared:
        assert ours_metrics[name] == pytest.approx(their_metrics[name], abs=1e-6), name


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"])
@pytest.mark.parametrize("case", ["token", "sequence"])
def test_two_processes_give_one_processs_gradients_for_every_loss_type(loss_type, case):
    """The same 8 rows trained by 2 processes (micro-batches of 2) and by 1 (micro-batches of 4 holding both
    processes' k-th micro-batch): every optimizer step's gradient is the same, for every loss type. Equal token
    counts per process make it exact for the per-micro-batch means too (bnpo; the entropy bonus, "sequence"); the
    top-entropy threshold is over every process's tokens of the micro-batch, as in one process ("token"). Not the
    two together: the bonus is then each process's mean over its top-entropy tokens, whose counts differ between
    processes (as in TRL)."""
    d, f, is_level = _case(loss_type, case)
    f["entropy_coef"] = 0.0 if case == "token" else 0.1
    two, _ = _groupwise_steps(d, 2, 2, 2, 2, 2, f, is_level)
    order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])  # one process: micro-batch k = both processes' micro-batch k
    one, _ = _groupwise_steps({k: v[order] for k, v in d.items()}, 1, 4, 2, 2, 2, f, is_level)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert torch.allclose(a, b[order], atol=1e-12), (a - b[order]).abs().max()


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("loss_type", ["vespo", "dapo", "grpo"])
@pytest.mark.parametrize("target", [0.5, 1.5])
def test_vespo_off_policy_mask_and_adaptive_entropy_give_trls_gradients_and_metrics(loss_type, target):
    """The same harness with a vLLM-style sampler (token weights and its log-probs), the off-policy sequence mask,
    and the adaptive entropy coefficient: every step's gradient and the logged metrics (vespo/phi_seq_mean,
    entropy_coef after each step's update) equal TRL 1.16's. The table's token entropies 2·σ(P + C) lie around 1:
    target 1.5 lets the bonus act from the second step on and raises c; target 0.5 lowers c and never applies it."""
    pytest.importorskip("trl")
    W, mbs, spg, mu, ga = 2, 2, 2, 4, 2  # μ = 4: 4 optimizer steps, the coefficient moves 4 times
    d, f, _ = _case(loss_type, "token")
    if loss_type == "vespo":
        f.pop("epsilon_high"), f.pop("delta")
    f.update(off_policy_mask_threshold=0.05, use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=target,
             entropy_coef_delta=0.03, entropy_coef_max=0.15)
    ours, ours_metrics = _groupwise_steps(d, W, mbs, spg, mu, ga, f, "token")
    theirs, their_metrics = _trl_steps(d, W, mbs, spg, mu, ga, f, "token")
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-12), (a - b).abs().max()
    shared = set(their_metrics) - {"policy_loss"}
    assert {"entropy_coef", "entropy"} <= shared <= set(ours_metrics)
    assert ("vespo/phi_seq_mean" in shared) == (loss_type == "vespo")
    for name in shared:
        assert ours_metrics[name] == pytest.approx(their_metrics[name], abs=1e-6), name
    # after steps 1–4 the coefficient is 0.13, 0.15, 0.15, 0.15 (+0.03, capped; mean 0.145) or 0.07, 0.04, 0.01, 0
    # (−0.03, floored at 0; mean 0.03)
    assert ours_metrics["entropy_coef"] == pytest.approx(0.145 if target == 1.5 else 0.03, abs=1e-12)

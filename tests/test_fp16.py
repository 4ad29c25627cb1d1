"""fp16 mixed precision (transformers' `fp16`): float32 master weights, the forward under float16 autocast, the loss
multiplied by a dynamic scale (torch.amp.GradScaler) before the backward and the gradients divided by it before they
are clipped; a step whose gradients overflow is skipped and halves the scale. Run on CPU here (CPU autocast and
GradScaler are the same code as on CUDA; accelerate's own fp16 applies on GPUs only, so groupwise does not use it),
and on CUDA where there is a GPU (scripts/gpu_session.sh fast)."""

import functools
import json
import warnings

import pytest
import torch

from groupwise import ConfigError, GRPOConfig, GRPOTrainer
from groupwise.core.losses import policy_loss
from groupwise.distributed import Distributed
from groupwise.modeling import PolicyForLogps
from groupwise.tasks import toy
from groupwise.types import TrainBatch
from groupwise.update import UpdateContext, optimizer_step, windows
from tests.conftest import small_args, training_lines

# _step wraps optimizer.step to record the gradients it sees, which torch's scheduler notices
# the device Distributed() trains on: CUDA where there is one (the same tests then check the CUDA kernels)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def _batch(tokenizer, n=4, P=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tokenizer), (n, P + T), generator=g)
    cmask = (torch.arange(T) < torch.tensor([5, 2, 4, 3])[:n, None]).long()
    attn = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])[:n], cmask], 1)
    return TrainBatch(ids.to(DEVICE), attn.to(DEVICE), cmask.to(DEVICE), torch.randn(n, generator=g).to(DEVICE))


def _step(tokenizer, dist, *, lr=0.0, hook=None, events=None, **kw):
    """One optimizer step of a fresh tiny policy over 2 accumulated micro-batches (dapo); returns the metrics, the
    gradients the optimizer saw (None when it did not step), the model and its scheduler."""
    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    if hook is not None:
        model.get_output_embeddings().weight.register_hook(hook)
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=5, max_grad_norm=1.0,
                      gradient_accumulation_steps=2, fp16=dist.precision == "fp16", **kw)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    seen = {}
    step = opt.step
    opt.step = lambda *a, **k: (seen.update({n: p.grad.clone() for n, p in model.named_parameters()}),
                                step(*a, **k))[1]
    wrapped, opt = dist.prepare(PolicyForLogps(model), opt)
    def event(name):  # what a callback sees: has the optimizer stepped, the schedule's step, the scale, gradients
        if events is not None:
            events.append((name, bool(seen), sched.last_epoch, dist.loss_scale,
                           any(p.grad is not None for p in model.parameters())))

    metrics = optimizer_step(UpdateContext(args, dist, wrapped, opt, sched, event),
                             windows(_batch(tokenizer), 2, 2, 1, 2)[0])
    return metrics, (seen or None), model, sched


def _reference_grads(tokenizer, autocast: bool, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The same step's gradient by hand: the two micro-batches' dapo losses (each its share of the step's token
    mean), under float16 autocast or in float32, each multiplied by `scale` before its backward, the sum divided by
    `scale`, then clipped to norm 1 as the step clips."""
    model = toy.build_model(tokenizer, seed=0, hidden_size=32).to(DEVICE)
    wrapped, batch = PolicyForLogps(model), _batch(tokenizer)
    for mb in (batch.rows(0, 2), batch.rows(2, 4)):
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=autocast):
            lp, _ = wrapped(mb.input_ids, mb.attention_mask, 5)
        loss, _ = policy_loss(lp, lp.detach(), mb.advantages, mb.completion_mask.float(), loss_type="dapo",
                              num_items_in_batch=batch.completion_mask.sum().float())
        (loss * scale).backward()
    for p in model.parameters():
        p.grad /= scale
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return {n: p.grad for n, p in model.named_parameters()}


def test_the_step_scales_the_float16_loss_then_unscales_the_gradient_before_clipping(tokenizer):
    metrics, grads, model, _ = _step(tokenizer, Distributed(fp16=True))
    assert metrics["train/loss_scale"] == 2.0 ** 16 and metrics["train/overflow"] == 0.0  # GradScaler's first scale
    assert metrics["train/skipped"] == 0.0 and all(p.dtype == torch.float32 for p in model.parameters())
    by_hand = _reference_grads(tokenizer, autocast=True, scale=2.0 ** 16)
    for name, g in grads.items():
        assert torch.allclose(g, by_hand[name], rtol=1e-5, atol=1e-9), name
    # the scale matters: without it, float16 gradients below 6e-8 flush to 0 and the step's gradient differs
    unscaled = _reference_grads(tokenizer, autocast=True)
    assert any(not torch.allclose(g, unscaled[n], rtol=1e-5, atol=1e-9) for n, g in grads.items())
    # and it is the float32 gradient to float16's precision (the forward ran in float16: not equal to it)
    fp32 = _reference_grads(tokenizer, autocast=False)
    for name, g in grads.items():
        assert (g - fp32[name]).abs().max() <= 2e-3 * fp32[name].abs().max(), name
    assert max((grads[n] - fp32[n]).abs().max().item() for n in grads) > 1e-5


def test_an_overflow_under_a_scale_of_one_or_more_is_skipped_silently_and_halves_the_scale(tokenizer, monkeypatch):
    dist = Distributed(fp16=True)
    dist.scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0 ** 60)  # loss · 2^60: its float16 gradients overflow
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the scale's search is not a failure to warn about
        metrics, grads, model, sched = _step(tokenizer, dist, lr=1.0)
    fresh = toy.build_model(tokenizer, seed=0, hidden_size=32).to(DEVICE)
    assert grads is None  # the optimizer never stepped …
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))  # … the weights are as built
    assert sched.last_epoch == 0  # and the schedule did not advance (transformers: optimizer_step_was_skipped)
    assert metrics["train/skipped"] == 1.0 and metrics["train/overflow"] == 1.0
    assert metrics["train/loss_scale"] == 2.0 ** 60 and dist.loss_scale == 2.0 ** 59  # backoff_factor 0.5


def test_non_finite_gradients_under_a_scale_below_one_are_a_failure(tokenizer):
    dist = Distributed(fp16=True)
    dist.scaler = torch.amp.GradScaler(DEVICE, init_scale=0.5)  # float16 itself overflows: not the scale's doing
    with pytest.warns(RuntimeWarning, match="non-finite loss or gradient"):
        metrics, grads, _, _ = _step(tokenizer, dist, lr=1.0, hook=lambda g: g * float("inf"))
    assert grads is None and metrics["train/skipped"] == 1.0 and metrics["train/overflow"] == 0.0
    # the same gradients under a scale ≥ 1 are an overflow (the scale halves and the step is retried next time)
    dist = Distributed(fp16=True)
    metrics, _, _, _ = _step(tokenizer, dist, lr=1.0, hook=lambda g: g * float("inf"))
    assert metrics["train/overflow"] == 1.0 and dist.loss_scale == 2.0 ** 15


def test_without_fp16_there_is_no_scale_and_no_scale_metrics(tokenizer):
    metrics, grads, _, _ = _step(tokenizer, Distributed())
    assert "train/loss_scale" not in metrics and "train/overflow" not in metrics
    fp32 = _reference_grads(tokenizer, autocast=False)
    assert all(torch.allclose(g, fp32[n], rtol=1e-5, atol=1e-8) for n, g in grads.items())


def _reward(completions, **_):
    return [float(len(c) % 3) for c in completions]


def test_overflowing_steps_do_not_stop_the_run(tmp_path, tokenizer, monkeypatch):
    # every step overflows (2^60 → 2^59 → 2^58); max_consecutive_skipped_steps=1 would stop a run at the first
    # non-finite step, but the loss scale's search is not one
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 60))
    args = small_args(tmp_path, fp16=True, max_steps=3, max_consecutive_skipped_steps=1)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_reward], args=args,
                    train_dataset=toy.dataset(12), processing_class=tokenizer)
    t.train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "out" / "metrics.jsonl")]
    assert [x["train/loss_scale"] for x in lines] == [2.0 ** 60, 2.0 ** 59, 2.0 ** 58]
    assert all(x["train/overflow"] == 1.0 for x in lines) and t.global_step == 3 and t.skipped_steps == 3


def _run(tmp_path, tokenizer, out, resume=None, crash=False, **kw):
    def reward(completions, **_):
        reward.calls += 1
        if crash and reward.calls == 3:
            raise RuntimeError("the machine went away")
        return _reward(completions)

    reward.calls = 0
    args = small_args(tmp_path, output_dir=str(tmp_path / out), fp16=True, max_steps=4, save_steps=2, **kw)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [reward], args=args,
                    train_dataset=toy.dataset(12), processing_class=tokenizer)
    if crash:
        with pytest.raises(Exception, match="the machine went away"):
            t.train()
    else:
        t.train(resume_from_checkpoint=resume)
    return t


def test_resume_restores_the_loss_scale_and_is_exact(tmp_path, tokenizer, monkeypatch):
    # from 2^20 the scale moves every step (halved on an overflow, doubled after each clean step: growth_interval 1),
    # so a resume that forgot it would go on from 2^20 again
    monkeypatch.setattr(torch.amp, "GradScaler",
                        functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 20, growth_interval=1))
    straight = _run(tmp_path, tokenizer, "straight")
    lines = [json.loads(x) for x in training_lines(tmp_path / "straight" / "metrics.jsonl")]
    scales = [x["train/loss_scale"] for x in lines]
    if DEVICE == "cpu":  # this tiny model overflows at 2^20 and 2^19, then steps at 2^18 and grows: both moves
        assert [x["train/overflow"] for x in lines] == [1.0, 1.0, 0.0, 0.0]
        assert scales == [2.0 ** 20, 2.0 ** 19, 2.0 ** 18, 2.0 ** 19] and straight.dist.loss_scale == 2.0 ** 20
    _run(tmp_path, tokenizer, "crashed", crash=True)
    saved = json.loads((tmp_path / "crashed" / "checkpoint-2" / "trainer_state.json").read_text())["grad_scaler"]
    assert saved["scale"] == scales[2]  # after step 2's update: what step 3 runs with
    resumed = _run(tmp_path, tokenizer, "crashed", resume=str(tmp_path / "crashed" / "checkpoint-2"))
    assert resumed.dist.scaler.state_dict() == straight.dist.scaler.state_dict()
    for (n, a), (_, b) in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.named_parameters()):
        assert torch.equal(a, b), n
    after = [json.loads(x)["train/loss_scale"] for x in training_lines(tmp_path / "crashed" / "metrics.jsonl")]
    assert after == scales


def test_fp16_needs_float32_trainable_weights(tmp_path, tokenizer, base_dir):
    args = small_args(tmp_path, fp16=True)
    half = toy.build_model(tokenizer, seed=0, hidden_size=32).half()
    with pytest.raises(ConfigError, match=r"^fp16 trains float32 weights under float16 autocast, but the policy's "
                                          r"trainable weights are torch.float16: load the model in float32"):
        GRPOTrainer(half, [_reward], args=args, train_dataset=toy.dataset(12), processing_class=tokenizer)
    args = small_args(tmp_path, fp16=True, model_init_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"model_init_kwargs loads the policy in torch.bfloat16: set its dtype to "
                                          r"float32"):  # from a path: before anything loads
        GRPOTrainer(base_dir, [_reward], args=args, train_dataset=toy.dataset(12), processing_class=tokenizer)


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(ConfigError, match=r"^bf16=True and fp16=True: choose one mixed precision"):
        GRPOConfig(bf16=True, fp16=True)
    with pytest.raises(ConfigError, match="bf16 and fp16 are both set"):
        Distributed(bf16=True, fp16=True)


def test_a_trl_fp16_config_is_accepted():
    # what a TRL user on a T4 writes: bf16 off, fp16 on
    args = GRPOConfig(fp16=True, bf16=False, fp16_full_eval=False)
    assert args.fp16 and not args.bf16


def test_qlora_trains_float32_adapters_under_fp16(tmp_path, base_dir):
    # the T4 recipe: a 4-bit base computing in float16, float32 LoRA adapters, fp16 mixed precision
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    args = small_args(tmp_path, fp16=True, max_steps=2)
    t = GRPOTrainer(base_dir, [_reward], args=args, train_dataset=toy.dataset(12),
                    quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float16),
                    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    adapters = {n: p.detach().clone() for n, p in t.unwrapped.named_parameters() if p.requires_grad}
    assert adapters and all(p.dtype == torch.float32 for n, p in t.unwrapped.named_parameters() if n in adapters)
    t.train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "out" / "metrics.jsonl")]
    assert [x["train/overflow"] for x in lines] == [0.0, 0.0] and lines[0]["train/loss_scale"] == 2.0 ** 16
    assert any(not torch.equal(adapters[n], p) for n, p in t.unwrapped.named_parameters() if n in adapters)


def test_the_optimizer_events_fire_at_every_step_skipped_or_not_as_transformers_fires_them(tokenizer):
    """transformers' loop calls on_pre_optimizer_step, optimizer.step() (which the scaler may skip; accelerate
    updates the scale inside it), then on_optimizer_step, then the schedule (unless skipped), then zero_grad, at
    every optimizer step; here a skipped step does not call optimizer.step() at all, and the events still come, in
    the same places. Each event records: had the optimizer stepped, the schedule's step, the loss scale, gradients."""
    events = []
    _step(tokenizer, Distributed(fp16=True), lr=1.0, events=events)  # a clean step under the default 2^16
    assert events == [("on_pre_optimizer_step", False, 0, 2.0 ** 16, True),
                      ("on_optimizer_step", True, 0, 2.0 ** 16, True)]
    fp32 = Distributed()
    cases = ((Distributed(fp16=True), 2.0 ** 60, 1.0), (Distributed(fp16=True), 0.5, 0.0), (fp32, None, None))
    for dist, scale, overflow in cases:  # an overflow (scale ≥ 1), non-finite under fp16, non-finite in float32
        if scale is not None:
            dist.scaler = torch.amp.GradScaler(DEVICE, init_scale=scale)
        events = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            metrics, grads, _, sched = _step(tokenizer, dist, lr=1.0, events=events, hook=lambda g: g * float("inf"))
        assert metrics["train/skipped"] == 1.0 and grads is None and sched.last_epoch == 0
        assert metrics.get("train/overflow") == overflow
        halved = None if scale is None else scale / 2  # the scale halves within the skipped step
        assert events == [("on_pre_optimizer_step", False, 0, scale, True),
                          ("on_optimizer_step", False, 0, halved, True)]

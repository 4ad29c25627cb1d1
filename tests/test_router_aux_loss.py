"""A Mixture-of-Experts policy's router load-balancing loss in the GRPO loss (TRL 1.16's router_aux_loss_coef): the
model's own aux_loss (what TRL reads from its forward with output_router_logits=True), weighted, scaled for
accumulation only, logged as aux_loss."""

import json

import pytest
import torch

from groupwise import ConfigError, GRPOConfig, GRPOTrainer
from groupwise.core.losses import policy_loss
from groupwise.distributed import Distributed
from groupwise.loading import router_aux_loss_coef
from groupwise.modeling import PolicyForLogps, position_ids_from_mask
from groupwise.tasks import toy
from groupwise.types import TrainBatch
from groupwise.update import UpdateContext, optimizer_step, windows
from tests.conftest import small_args, training_lines


def _mixtral(tokenizer, coef=0.02):
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           router_aux_loss_coef=coef, max_position_embeddings=128, tie_word_embeddings=False,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _batch(tokenizer, n=4, P=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tokenizer), (n, P + T), generator=g)
    cmask = (torch.arange(T) < torch.tensor([5, 2, 4, 3])[:n, None]).long()
    attn = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])[:n], cmask], 1)  # left padding too
    return TrainBatch(ids, attn, cmask, torch.randn(n, generator=g))


def test_router_loss_is_the_models_own_and_log_probs_are_unchanged(tokenizer):
    model = _mixtral(tokenizer)
    batch = _batch(tokenizer)
    wrapped = PolicyForLogps(model)
    logps, _, aux = wrapped(batch.input_ids, batch.attention_mask, 5, aux_loss=True)
    plain, _ = wrapped(batch.input_ids, batch.attention_mask, 5)
    assert torch.equal(logps, plain)
    theirs = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                   position_ids=position_ids_from_mask(batch.attention_mask), output_router_logits=True).aux_loss
    assert aux.requires_grad and aux.item() == pytest.approx(theirs.item(), rel=1e-6) and aux.item() > 0


def test_dense_model_has_no_router_loss(tokenizer, tiny_model):
    batch = _batch(tokenizer)
    with pytest.raises(ValueError, match="returned no aux_loss"):
        PolicyForLogps(tiny_model)(batch.input_ids, batch.attention_mask, 5, aux_loss=True)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_step_gradient_adds_the_weighted_router_loss_once_per_window(tokenizer):
    """dapo, 2 micro-batches of 2 rows in one optimizer step, coef c: the gradient is
    ∇[Σ_i ℓ_i + c · (aux_1 + aux_2) / 2] (ℓ_i the micro-batch's share of the step's token mean), and aux_loss is
    logged as the mean of the two micro-batches' router losses."""
    c = 0.5
    batch = _batch(tokenizer)
    ours = _mixtral(tokenizer)
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=5, max_grad_norm=0.0,
                      gradient_accumulation_steps=2, router_aux_loss_coef=c)
    opt = torch.optim.SGD(ours.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grads = {}
    step = opt.step
    opt.step = lambda *a, **k: (grads.update({n: p.grad.clone() for n, p in ours.named_parameters()
                                             if p.grad is not None}), step(*a, **k))[1]
    ctx = UpdateContext(args, Distributed(), PolicyForLogps(ours), opt, sched, router_aux_loss_coef=c)
    metrics = optimizer_step(ctx, windows(batch, 2, 2, 1, 2)[0])

    ref = _mixtral(tokenizer)
    wrapped = PolicyForLogps(ref)
    total, auxes = 0.0, []
    for mb in (batch.rows(0, 2), batch.rows(2, 4)):
        lp, _, aux = wrapped(mb.input_ids, mb.attention_mask, 5, aux_loss=True)
        loss, _ = policy_loss(lp, lp.detach(), mb.advantages, mb.completion_mask.float(), loss_type="dapo",
                              num_items_in_batch=batch.completion_mask.sum().float())
        total = total + loss + c * aux / 2
        auxes.append(aux.item())
    total.backward()
    router = [n for n, _ in ref.named_parameters() if "gate" in n and "experts" not in n]
    assert router  # the router weights get the load-balancing gradient
    for name, p in ref.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-7, rtol=1e-5), name
    assert metrics["aux_loss"] == pytest.approx(sum(auxes) / 2, rel=1e-6)
    # and the router loss changes the gradient (the check above would also hold if it were left out of both)
    plain = _mixtral(tokenizer)
    wrapped, base = PolicyForLogps(plain), 0.0
    for mb in (batch.rows(0, 2), batch.rows(2, 4)):
        lp, _ = wrapped(mb.input_ids, mb.attention_mask, 5)
        base = base + policy_loss(lp, lp.detach(), mb.advantages, mb.completion_mask.float(), loss_type="dapo",
                                  num_items_in_batch=batch.completion_mask.sum().float())[0]
    base.backward()
    assert any(not torch.allclose(grads[n], p.grad, atol=1e-7) for n, p in plain.named_parameters() if n in router)


def test_coefficient_resolution_as_trl(tokenizer, tiny_model):
    moe = _mixtral(tokenizer, coef=0.02).config
    assert router_aux_loss_coef(GRPOConfig(), moe) == 0.02  # unset: the model config's own
    assert router_aux_loss_coef(GRPOConfig(router_aux_loss_coef=0.0), moe) == 0.0  # off
    assert router_aux_loss_coef(GRPOConfig(router_aux_loss_coef=0.1), moe) == 0.1
    assert router_aux_loss_coef(GRPOConfig(), tiny_model.config) == 0.0  # dense: nothing to weight
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef=0.1 but LlamaConfig is not a Mixture-of-Experts"):
        router_aux_loss_coef(GRPOConfig(router_aux_loss_coef=0.1), tiny_model.config)
    # under FSDP2 the float32 head is its own unit, which the model's forward (for aux_loss) would call a second time
    sharded_cast = dict(fsdp="full_shard", cast_lm_head_to_fp32=True)
    with pytest.raises(ConfigError, match=r"^cast_lm_head_to_fp32 with fsdp and the router loss of MixtralConfig "
                                          r"\(router_aux_loss_coef=0.02\) is not supported yet"):
        router_aux_loss_coef(GRPOConfig(**sharded_cast), moe)
    assert router_aux_loss_coef(GRPOConfig(**sharded_cast, router_aux_loss_coef=0.0), moe) == 0.0
    assert router_aux_loss_coef(GRPOConfig(cast_lm_head_to_fp32=True), moe) == 0.02  # unsharded: one head call


def _spread(completions, **_):
    return [float(sum(map(ord, c)) % 5) for c in completions]


def test_a_moe_policy_trains_with_its_router_loss_logged(tmp_path, tokenizer):
    args = small_args(tmp_path, max_steps=1)
    t = GRPOTrainer(_mixtral(tokenizer), [_spread], args=args, train_dataset=toy.dataset(8), processing_class=tokenizer)
    assert t.update_ctx.router_aux_loss_coef == 0.02
    t.train()
    line = json.loads(training_lines(tmp_path / "out" / "metrics.jsonl")[0])
    assert line["aux_loss"] > 0
    # a dense model with the coefficient set stops before training, naming the field
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.1"):
        GRPOTrainer(toy.build_model(tokenizer, hidden_size=32), [_spread], processing_class=tokenizer,
                    args=small_args(tmp_path, output_dir=str(tmp_path / "dense"), router_aux_loss_coef=0.1),
                    train_dataset=toy.dataset(8))


def test_reentrant_checkpointing_would_drop_the_router_gradient_and_is_refused(tokenizer):
    """Reentrant activation checkpointing records the router logits without grad: the router loss would be logged
    yet add nothing to the gradient (TRL trains on silently), so the step stops naming the fix."""
    from groupwise.update import micro_batch_loss

    model = _mixtral(tokenizer)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, max_completion_length=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctx = UpdateContext(args, Distributed(), PolicyForLogps(model), opt,
                        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), router_aux_loss_coef=0.5)
    with pytest.raises(ConfigError, match="use_reentrant"):
        micro_batch_loss(ctx, _batch(tokenizer), None)

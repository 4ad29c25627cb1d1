"""torch_compile / torch_compile_backend / torch_compile_mode (transformers' fields): the policy's log-prob forward
runs through torch.compile. Checked by equivalence with the eager run, to float rounding (transformers takes other
code paths while dynamo traces, e.g. for the attention mask, so the sums are not bit-identical): with a backend
that runs dynamo's graph as traced and counts it, and with AOT autograd (aot_eager); checkpoints keep the model's own
parameter names. (The default inductor backend was checked by hand: 2 steps, weights within 3.2e-6 of eager, 66 s
of compilation on 2 CPU cores — too slow for the suite.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.loading import router_aux_loss_coef
from groupwise.tasks import toy
from tests.conftest import small_args

GRAPHS: list[int] = []


@torch._dynamo.register_backend(name="groupwise_test_traced")
def _traced(gm, example_inputs):
    """Runs dynamo's FX graph as traced (the same torch ops as eager, autograd as eager), counting the graphs."""
    GRAPHS.append(len(gm.graph.nodes))
    return gm.forward


def test_the_fields_follow_transformers_rules():
    assert GRPOConfig().compile_kwargs is None and GRPOConfig().torch_compile_backend is None
    on = GRPOConfig(torch_compile=True)  # transformers: the backend defaults to inductor once compiling
    assert on.torch_compile_backend == "inductor" and on.compile_kwargs == {"backend": "inductor", "mode": None}
    by_mode = GRPOConfig(torch_compile_mode="max-autotune")  # a backend or a mode turns compilation on
    assert by_mode.torch_compile and by_mode.compile_kwargs == {"backend": "inductor", "mode": "max-autotune"}
    assert GRPOConfig(torch_compile_backend="aot_eager").torch_compile
    with pytest.raises(ConfigError, match=r"torch_compile_backend='indcutor' is not a torch.compile backend: use "
                                          r"one of \[.*'inductor'"):
        GRPOConfig(torch_compile_backend="indcutor")
    with pytest.raises(ConfigError, match="torch_compile_mode"):
        GRPOConfig(torch_compile_mode="fastest")


def _reward(completions, **_):  # the length: groups with spread, so every step moves the weights
    return [float(len(c)) for c in completions]


def _train(tmp_path, tokenizer, **kw):
    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    args = small_args(tmp_path, max_steps=2, num_iterations=2, **kw)  # μ = 2: π_θold is computed too
    trainer = GRPOTrainer(model, _reward, args=args, train_dataset=toy.dataset(16), processing_class=tokenizer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


def test_compiled_training_is_the_eager_training(tmp_path, tokenizer):
    eager, eager_losses = _train(tmp_path / "eager", tokenizer)
    GRAPHS.clear()
    traced, traced_losses = _train(tmp_path / "traced", tokenizer, torch_compile_backend="groupwise_test_traced")
    assert GRAPHS and max(GRAPHS) > 50  # the decoder's forward went through torch.compile
    assert traced_losses == pytest.approx(eager_losses, abs=1e-6)
    assert all(torch.allclose(traced[k], eager[k], rtol=0, atol=1e-6) for k in eager)
    start = toy.build_model(tokenizer, seed=0, hidden_size=32).state_dict()
    assert not all(torch.equal(eager[k], start[k]) for k in eager)  # the runs trained
    # the compiled wrapper is not a submodule: the checkpoint has the model's own names (no _orig_mod.)
    with safe_open(str(tmp_path / "traced" / "out" / "checkpoint-2" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(start) - {"lm_head.weight"} or set(f.keys()) == set(start)
    config = json.loads((tmp_path / "traced" / "out" / "checkpoint-2" / "config.json").read_text())
    assert config["model_type"] == "llama"

    aot, aot_losses = _train(tmp_path / "aot", tokenizer, torch_compile_backend="aot_eager")  # AOT autograd
    assert all(torch.allclose(aot[k], eager[k], rtol=0, atol=1e-5) for k in eager)
    assert aot_losses == pytest.approx(eager_losses, abs=1e-5)


def test_the_router_loss_is_refused_with_compilation(tokenizer, tiny_model):
    from transformers import MixtralConfig

    moe = MixtralConfig(router_aux_loss_coef=0.02, output_router_logits=False)
    with pytest.raises(ConfigError, match=r"torch_compile with the router loss of MixtralConfig "
                                          r"\(router_aux_loss_coef=0.02\) is not supported yet"):
        router_aux_loss_coef(GRPOConfig(torch_compile_backend="aot_eager"), moe)
    assert router_aux_loss_coef(GRPOConfig(torch_compile_backend="aot_eager", router_aux_loss_coef=0.0), moe) == 0.0
    assert router_aux_loss_coef(GRPOConfig(torch_compile_backend="aot_eager"), tiny_model.config) == 0.0

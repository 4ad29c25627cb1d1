"""bf16=True (accelerate's mixed precision, as TRL / transformers run it): parameters and optimizer state stay
float32, the forward runs under bfloat16 autocast, and log-probs, the loss and advantages are float32."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise import GRPOTrainer
from groupwise.tasks import toy
from tests.conftest import small_args


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one mixed-precision setting per process: start this test from a clean state, and leave one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_training_runs_finite_with_float32_master_weights_and_logps(tmp_path, tokenizer):
    def length(completions, **_):  # varied rewards: every step moves the weights
        return [float(len(c)) for c in completions]

    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [length],
                    args=small_args(tmp_path, bf16=True, max_steps=3, beta=0.05), train_dataset=toy.dataset(12),
                    processing_class=tokenizer)
    assert t.dist.accelerator.mixed_precision == "bf16"
    before = [p.detach().clone() for p in t.unwrapped.parameters()]
    metrics = t.train()
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "kl", "entropy"))
    assert any(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(before, t.unwrapped.parameters()))  # it trained
    assert all(p.dtype == torch.float32 for p in t.unwrapped.parameters())  # master weights
    state = t.optimizer.state_dict()["state"]
    assert state and all(v.dtype == torch.float32 for st in state.values() for k, v in st.items() if k != "step")
    batch = t._collect().batch
    assert batch.advantages.dtype == torch.float32 and batch.ref_logps.dtype == torch.float32
    with t.dist.accelerator.autocast():
        logps, _ = t.trained(batch.input_ids, batch.attention_mask, batch.completion_mask.size(1))
    assert logps.dtype == torch.float32  # the head's logits are upcast before the log-softmax

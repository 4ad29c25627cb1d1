"""TRL 1.16's objective variants in a real training run: loss_type='vespo', the off-policy sequence mask
(off_policy_mask_threshold) and the adaptive entropy coefficient (use_adaptive_entropy). Their formulas and TRL
parity: tests/core/test_losses_vespo.py, tests/core/test_entropy_control.py, tests/test_update.py."""

import json

import pytest
import torch

from groupwise import GRPOTrainer
from groupwise import rollout as R
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines


def _spread(completions, **_):  # rewards that differ within a group, so that every step has a gradient
    return [float(sum(map(ord, c)) % 5) for c in completions]


def _trainer(tmp_path, tokenizer, out="run", **kw):
    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    args = small_args(tmp_path, output_dir=str(tmp_path / out), **kw)
    return GRPOTrainer(model, [_spread], args=args, train_dataset=toy.dataset(12), processing_class=tokenizer)


@pytest.mark.parametrize("generation_dtype", [None, "bfloat16"])
def test_off_policy_mask_reads_the_samplers_log_probs_when_the_sampler_differs(tmp_path, tokenizer, generation_dtype):
    """With a sampler of other numerics (here a bfloat16 copy; vLLM alike) the batch carries the sampler's own
    log-probs, even with the importance correction off, as TRL's OPSM reads vLLM's; sampling from the policy itself,
    the mask measures the KL from π_θold and nothing extra is kept."""
    t = _trainer(tmp_path, tokenizer, off_policy_mask_threshold=0.5, generation_dtype=generation_dtype,
                 vllm_importance_sampling_correction=False)
    batch = R.collect(t.rollout_ctx, t.sampling_model).batch
    assert batch.is_weights is None  # the correction is off
    if generation_dtype is None:
        assert batch.sampling_logps is None
        return
    mask = batch.completion_mask.bool()
    assert batch.sampling_logps.shape == mask.shape and torch.isfinite(batch.sampling_logps[mask]).all()
    assert (batch.sampling_logps[mask] <= 0).all() and (batch.sampling_logps[mask] < 0).any()


def test_vespo_with_the_off_policy_mask_trains(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, loss_type="vespo", off_policy_mask_threshold=0.0, generation_dtype="bfloat16",
                 vllm_importance_sampling_mode="token_mask", num_iterations=2)
    before = [p.detach().clone() for p in t.unwrapped.parameters()]
    t.train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "run" / "metrics.jsonl")]
    assert len(lines) == 2 and all(line["vespo/phi_seq_mean"] > 0 for line in lines)
    assert "clip_ratio/low_mean" not in lines[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, t.unwrapped.parameters()))


def test_adaptive_entropy_coefficient_survives_a_resume(tmp_path, tokenizer):
    """entropy_target far above the toy model's token entropy: the coefficient rises by δ every step; a run resumed
    from checkpoint-2 continues from the saved coefficient and ends bitwise where the straight run ends."""
    kw = dict(max_steps=4, save_steps=2, use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.02,
              entropy_target=100.0)
    straight = _trainer(tmp_path, tokenizer, "straight", **kw)
    straight.train()
    coefs = [json.loads(x)["entropy_coef"] for x in training_lines(tmp_path / "straight" / "metrics.jsonl")]
    assert coefs == pytest.approx([0.03, 0.05, 0.07, 0.09], abs=1e-12)  # 0.01 + 0.02 per step, logged after it
    saved = json.loads((tmp_path / "straight" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["entropy_control"]["entropy_coef"] == pytest.approx(0.05, abs=1e-12)
    resumed = _trainer(tmp_path, tokenizer, "resumed", **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert resumed.update_ctx.entropy.coef == pytest.approx(0.09, abs=1e-12)
    for a, b in zip(straight.unwrapped.parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(a, b)


def test_a_round_saved_with_the_samplers_log_probs_resumes_exactly(tmp_path, tokenizer):
    """μ = 2 with save_steps=1: checkpoint-1 holds a half-trained round, with the sampler's log-probs the off-policy
    mask reads; resumed, the run ends bitwise where the straight run ends. Resumed without the mask it is refused."""
    from groupwise.checkpoint import CheckpointError

    kw = dict(max_steps=2, save_steps=1, num_iterations=2, off_policy_mask_threshold=0.0,
              generation_dtype="bfloat16", vllm_importance_sampling_correction=False)
    straight = _trainer(tmp_path, tokenizer, "straight", **kw)
    straight.train()
    ckpt = str(tmp_path / "straight" / "checkpoint-1")
    with pytest.raises(CheckpointError, match=r"checkpoint-1 stopped inside a generation round built with "
                                              r"sampling_logps \(off_policy_mask_threshold changed since\)"):
        _trainer(tmp_path, tokenizer, "without", **{**kw, "off_policy_mask_threshold": None}).train(
            resume_from_checkpoint=ckpt)
    resumed = _trainer(tmp_path, tokenizer, "resumed", **kw)
    resumed.train(resume_from_checkpoint=ckpt)
    for a, b in zip(straight.unwrapped.parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form,signal", [("suffix_sum", False), ("step_return", True)])
def test_no_signal_is_read_from_the_step_advantage_form(form, signal):
    """Equal step rewards, step counts 2 and 3: suffix_sum's advantages are all 0 (no signal), step_return's are ±1
    (returns [2, 1] vs [3, 2, 1]), so dynamic sampling must keep the group and process/zero_std_groups is 0."""
    from types import SimpleNamespace

    from groupwise import GRPOConfig
    from groupwise.core.advantages import process_advantages
    from groupwise.dynamic import group_signal
    from groupwise.rollout_metrics import process_metrics
    from groupwise.types import StepScores

    R, E = [[[1.0, 1.0], [1.0, 1.0, 1.0]]], [[[1, 3], [1, 3, 5]]]
    assert bool((process_advantages(R, E, 6, form=form) != 0).any()) == signal
    scores = StepScores(R, E, [], (), torch.zeros(0), torch.zeros(0, 2))
    ctx = SimpleNamespace(args=GRPOConfig(supervision="process", step_advantage=form, num_generations=2,
                                          per_device_train_batch_size=2))
    assert group_signal(ctx, None, scores).tolist() == [signal]
    assert process_metrics(scores, form)["process/zero_std_groups"] == float(not signal)


def test_unscored_steps_counts_none_and_nan_step_rewards():
    """Two groups of 2. Rewards [[1, None], []] and [[nan, nan, 0.5], [0]]: None 1 + NaN 2 = 3 unscored steps
    (a count, like process/no_step_completions); steps 6, so steps_per_completion 6/4 = 1.5; the mean of the scored
    rewards {1, 0.5, 0} is 0.5."""
    from groupwise.rollout_metrics import process_metrics
    from groupwise.types import StepScores

    nan = float("nan")
    R = [[[1.0, None], []], [[nan, nan, 0.5], [0.0]]]
    E = [[[0, 1], []], [[0, 1, 2], [0]]]
    m = process_metrics(StepScores(R, E, [], (), torch.zeros(0), torch.zeros(0, 2)))
    assert m["process/unscored_steps"] == 3.0
    assert m["process/steps_per_completion"] == 1.5 and m["process/step_reward_mean"] == 0.5
    assert process_metrics(StepScores([[[0.5], [1.0]]], [[[0], [0]]], [], (), torch.zeros(0),
                                      torch.zeros(0, 2)))[
        "process/unscored_steps"] == 0.0

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from groupwise import GRPOTrainer
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines


def _trainer(tmp_path, model, tokenizer, funcs=(toy.letter_reward,), data=None, **kw):
    return GRPOTrainer(model, list(funcs), args=small_args(tmp_path, **kw), train_dataset=data or toy.dataset(16),
                       processing_class=tokenizer)


def test_every_parameter_changes_after_one_step(tmp_path, tokenizer, tiny_model):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    # random rewards: non-zero advantages in every group
    rand = lambda completions, **_: torch.rand(len(completions)).tolist()  # noqa: E731
    t = _trainer(tmp_path, tiny_model, tokenizer, funcs=[rand], max_steps=1, learning_rate=0.1)
    t.train()
    unchanged = [n for n, p in t.unwrapped.named_parameters() if torch.equal(before[n].cpu(), p.detach().cpu())]
    assert not unchanged, f"parameters not updated: {unchanged}"


def test_nothing_changes_when_every_completion_is_masked(tmp_path, tokenizer, tiny_model):
    # min_new_tokens = max_completion_length: no completion can end with EOS, all are truncated, all masked
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    rand = lambda completions, **_: torch.rand(len(completions)).tolist()  # noqa: E731
    t = _trainer(tmp_path, tiny_model, tokenizer, funcs=[rand], max_steps=1, learning_rate=0.1,
                 mask_truncated_completions=True, max_completion_length=4, generation_kwargs={"min_new_tokens": 4},
                 generation_backend="transformers")
    metrics = t.train()
    assert metrics["completions/clipped_ratio"] == 1.0
    assert all(torch.equal(before[n].cpu(), p.detach().cpu()) for n, p in t.unwrapped.named_parameters())


def test_outputs_metrics_and_loadable_checkpoint(tmp_path, tokenizer, tiny_model):
    t = _trainer(tmp_path, tiny_model, tokenizer, max_steps=2, save_steps=1, save_total_limit=1, beta=0.04,
                 eval_steps=None)
    t.train()
    out = tmp_path / "out"
    lines = [json.loads(x) for x in training_lines(out / "metrics.jsonl")]
    assert [x["step"] for x in lines] == [1, 2]
    for key in ("reward", "rewards/letter_reward/mean", "rewards/letter_reward/errors", "loss", "kl",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "completions/mean_length", "completions/clipped_ratio", "time/step"):
        assert key in lines[-1], key
    assert lines[-1]["kl"] >= 0.0
    # save_total_limit=1 keeps only the newest; no temporary folder left behind
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
    loaded = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    for (n, p), (_, q) in zip(t.unwrapped.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), n


@pytest.mark.parametrize("kw", [
    dict(num_iterations=2),  # π_θold kept explicitly
    dict(steps_per_generation=2, per_device_train_batch_size=4),  # 2 optimizer steps per round
    dict(importance_sampling_level="sequence", loss_type="grpo", scale_rewards="batch"),
    dict(top_entropy_quantile=0.5, loss_type="bnpo", epsilon_high=0.28, delta=2.0),
    dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, loss_type="dr_grpo"),
    dict(multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]),
    dict(dynamic_sampling=True, max_dynamic_sampling_rounds=2),
])
def test_variants_train(tmp_path, tokenizer, tiny_model, kw):
    funcs = [toy.letter_reward, lambda completions, **_: [float(len(c)) for c in completions]] \
        if "reward_weights" in kw else [toy.letter_reward]
    t = _trainer(tmp_path, tiny_model, tokenizer, funcs=funcs, **kw)
    ref_before = None if t.reference is None else [p.clone() for p in t.reference.model.parameters()]
    metrics = t.train()
    assert t.global_step == 2 and all(v == v for k, v in metrics.items() if k.startswith("loss"))
    if ref_before is not None:  # TR-DPO moved the reference model toward the policy
        assert any(not torch.equal(a, b) for a, b in zip(ref_before, t.reference.model.parameters()))


def test_ref_model_sync_mixes_the_weights_by_hand():
    """TR-DPO (TRL's sync_ref_model): ref ← α·policy + (1−α)·ref. α = 0.25, ref (1, 2), policy (3, −2):
    0.25·3 + 0.75·1 = 1.5 and 0.25·(−2) + 0.75·2 = 1.0; the policy is untouched."""
    from groupwise.adapters import Reference

    ref, policy = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([[1.0, 2.0]]))
        policy.weight.copy_(torch.tensor([[3.0, -2.0]]))
    Reference(ref, adapters_off=False).mix(policy, 0.25)
    assert torch.equal(ref.weight, torch.tensor([[1.5, 1.0]])) and torch.equal(policy.weight, torch.tensor([[3.0, -2.0]]))


def test_old_logps_only_when_needed(tmp_path, tokenizer, tiny_model):
    on_policy = _trainer(tmp_path, tiny_model, tokenizer)
    assert not on_policy.rollout_ctx.need_old_logps and on_policy.reference is None
    assert _trainer(tmp_path, tiny_model, tokenizer, num_iterations=2).rollout_ctx.need_old_logps
    # S = 1, μ = 2 passes accumulated into one optimizer step (gradient_accumulation_steps = 2): the policy does not move
    # within the round, so π_θold is π_θ detached (TRL skips the pass too); the same step as with the extra pass
    import dataclasses

    def one_step(force):
        model = toy.build_model(tokenizer, seed=0, hidden_size=32)
        t = _trainer(tmp_path, model, tokenizer, num_iterations=2, gradient_accumulation_steps=2, steps_per_generation=1,
                     max_steps=1, beta=0.0, output_dir=str(tmp_path / f"force-{force}"))
        assert not t.rollout_ctx.need_old_logps
        if force:
            t.rollout_ctx = dataclasses.replace(t.rollout_ctx, need_old_logps=True)
        t.train()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(one_step(False), one_step(True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chat_prompts(tmp_path, tokenizer, tiny_model):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    seen = []

    def check(prompts, completions, **_):
        seen.append((prompts[0], completions[0]))
        return [1.0 if "a" in c[0]["content"] else 0.0 for c in completions]

    data = [{"prompt": [{"role": "user", "content": "repeat a:"}]}] * 4
    _trainer(tmp_path, tiny_model, tokenizer, funcs=[check], data=data, max_steps=1).train()
    prompt, completion = seen[0]
    assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"


def test_reward_exception_stops_the_run_naming_the_function(tmp_path, tokenizer, tiny_model):
    def broken(completions, **_):
        raise KeyError("answer")

    from groupwise.rewards import RewardFunctionError

    with pytest.raises(RewardFunctionError, match="'broken' raised KeyError"):
        _trainer(tmp_path, tiny_model, tokenizer, funcs=[broken]).train()


def test_reward_exception_counted_when_configured(tmp_path, tokenizer, tiny_model):

    def half(completions, **_):
        out = []
        for c in completions:
            if len(c) % 2:
                raise RuntimeError("odd")
            out.append(1.0)
        return out

    t = _trainer(tmp_path, tiny_model, tokenizer, funcs=[toy.letter_reward, half], max_steps=1,
                 on_reward_error="nan")
    metrics = t.train()
    assert metrics["rewards/half/errors"] >= 1


def test_eval_dataset_is_logged(tmp_path, tokenizer, tiny_model):
    t = GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path, max_steps=2, eval_steps=1,
                                                                      eval_strategy="steps", eval_on_start=True),
                    train_dataset=toy.dataset(16), eval_dataset=toy.dataset(5, seed=3), processing_class=tokenizer)
    t.train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "out" / "metrics.jsonl")]
    evals = [x for x in lines if "eval_reward" in x]
    assert [x["step"] for x in evals] == [0, 1, 2]


def _steps_with_letter(prompts, steps, letter, **_):
    """Rule-based process reward: the share of the step's characters equal to the prompt's letter, plus a length
    term so that even a random policy's steps differ (a group with no spread would rightly not train)."""
    return [[s.count(c) / len(s) + len(s) / 10 for s in row] for row, c in zip(steps, letter)]


@pytest.mark.parametrize("supervision", ["process", "both"])
def test_process_supervision_trains_with_token_advantages(tmp_path, tokenizer, tiny_model, supervision, capsys):
    funcs = [] if supervision == "process" else [toy.letter_reward]
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    t = GRPOTrainer(tiny_model, funcs, args=small_args(tmp_path, supervision=supervision, max_completion_length=10,
                                                        dynamic_sampling=True,  # (N, T) rows re-padded on refill
                                                        score_truncated_step=True, log_completions=True, num_completions_to_print=1),
                    train_dataset=toy.dataset(16), processing_class=tokenizer, process_reward_funcs=[_steps_with_letter])
    rollout = t._collect()
    batch, metrics = rollout.batch, rollout.metrics
    assert batch.advantages.shape == batch.completion_mask.shape  # (N, T) token advantages reach the loss
    for key in ("process/step_reward_mean", "process/steps_per_completion", "process/zero_std_groups",
                "process/no_step_completions"):
        assert key in metrics
    final = t.train()
    assert "process/step_reward_mean" in final
    assert any(not torch.equal(before[n].cpu(), p.detach().cpu()) for n, p in t.unwrapped.named_parameters())
    assert "step 1:" in capsys.readouterr().out


def test_supervision_needs_matching_reward_sources(tmp_path, tokenizer, tiny_model):
    with pytest.raises(ValueError, match="supervision='process' needs process_reward_funcs"):
        GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path, supervision="process"),
                    train_dataset=toy.dataset(4), processing_class=tokenizer)
    with pytest.raises(ValueError, match="supervision='outcome'"):
        GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path), train_dataset=toy.dataset(4),
                    processing_class=tokenizer, process_reward_funcs=[_steps_with_letter])


def test_token_classification_prm_as_process_reward(tmp_path, tokenizer, tiny_model):
    """A PRM folder given as a spec (what a YAML config holds) scores steps inside a training run."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=2, pad_token_id=tokenizer.pad_token_id)
    prm_dir = tmp_path / "prm"
    LlamaForTokenClassification(cfg).save_pretrained(prm_dir)
    tokenizer.save_pretrained(prm_dir)
    t = GRPOTrainer(tiny_model, [], args=small_args(tmp_path, supervision="process", max_steps=1,
                                                    score_truncated_step=True),
                    train_dataset=toy.dataset(8), processing_class=tokenizer,
                    process_reward_funcs=[{"path": str(prm_dir), "kind": "token_classification"}])
    metrics = t.train()
    assert 0.0 < metrics["process/step_reward_mean"] < 1.0  # probabilities from the PRM
    assert t.process_sources[0].name == "prm"


@pytest.mark.parametrize("max_rounds, extra, unfilled", [(6, 3, 0), (1, 1, 2)])
def test_dynamic_sampling_drops_groups_without_signal_and_refills(tmp_path, tokenizer, tiny_model, max_rounds, extra,
                                                                   unfilled):
    """Prompts in order a a b b c c d d, 2 prompts (groups) per round; the reward is constant — no signal — for every
    letter but 'a'. Round 1 (a, a) keeps both groups. Round 2 (b, b) drops both; refilling generates c c, d d (still
    nothing) and then a a (epoch 2): 3 extra rounds, batch of 'a' groups only. With at most 1 extra round the batch is
    completed from dropped groups and the 2 unfilled groups are counted."""
    def only_a_varies(completions, letter, **_):  # random for 'a' so that every 'a' group has spread
        return [float(torch.rand(())) if l == "a" else 1.0 for l in letter]

    data = [{"prompt": f"repeat {c}:", "letter": c} for c in "aabbccdd"]
    args = small_args(tmp_path, dynamic_sampling=True, shuffle_dataset=False, max_dynamic_sampling_rounds=max_rounds)
    t = GRPOTrainer(tiny_model, [only_a_varies], args=args, train_dataset=data, processing_class=tokenizer)
    first = t._collect().metrics
    assert first["dynamic/dropped_groups"] == 0.0 and first["dynamic/extra_rounds"] == 0.0
    rollout = t._collect()
    batch, metrics, comp = rollout.batch, rollout.metrics, rollout.round.completions
    assert metrics["dynamic/dropped_groups"] == 2.0
    assert metrics["dynamic/extra_rounds"] == extra and metrics["dynamic/unfilled_groups"] == unfilled
    letters = [p[-2] for p in comp.prompts]
    assert letters == (["a"] * 8 if unfilled == 0 else ["b"] * 8)
    assert batch.input_ids.shape[0] == 8 and batch.advantages.shape == (8,)
    if unfilled == 0:
        assert batch.advantages.abs().sum() > 0


def test_dynamic_sampling_needs_whole_groups_per_process(monkeypatch):
    from groupwise import ConfigError, GRPOConfig

    monkeypatch.setenv("WORLD_SIZE", "2")  # 2 processes × 2 completions: a group of 4 would span both
    with pytest.raises(ConfigError, match="whole groups on each process"):
        GRPOConfig(dynamic_sampling=True, num_generations=4, per_device_train_batch_size=2)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("supervision", ["outcome", "process"])
def test_advantage_estimators_train(tmp_path, tokenizer, tiny_model, estimator, supervision):
    """advantage_estimator reaches the rollout: the batch's advantages are the estimator's over the round's
    rewards (outcome) or step rewards (§4.1.3 suffix sums), and a short run changes the weights."""
    from groupwise.core.advantages import outcome_advantages, process_advantages

    def length(completions, **_):  # every group has spread, so every advantage estimator has something to do
        return [float(len(c)) for c in completions]

    process = [_steps_with_letter] if supervision == "process" else None
    funcs = [] if supervision == "process" else [length]
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    t = GRPOTrainer(tiny_model, funcs, args=small_args(tmp_path, advantage_estimator=estimator, supervision=supervision,
                                                        score_truncated_step=supervision == "process"),
                    train_dataset=toy.dataset(16), processing_class=tokenizer, process_reward_funcs=process)
    rollout = t._collect()
    rnd, opts = rollout.round, t.args.estimator_options()
    if supervision == "outcome":
        expected = outcome_advantages(rnd.scores.rewards, **t.args.estimator_options(outcome=True)).flatten()
    else:
        s = rnd.step_scores
        expected = process_advantages(s.rewards, s.ends, t.args.max_completion_length, **opts).flatten(0, 1)
        expected = expected[:, :rollout.batch.advantages.size(1)]
    assert torch.equal(rollout.batch.advantages.cpu(), expected.cpu()) and rollout.batch.advantages.abs().sum() > 0
    t.train()
    assert t.global_step == 2
    assert any(not torch.equal(before[n].cpu(), p.detach().cpu()) for n, p in t.unwrapped.named_parameters())


def test_estimator_options_are_checked_against_the_estimator():
    from groupwise import ConfigError, GRPOConfig

    with pytest.raises(ConfigError, match=r"scale_rewards='batch' has no effect with advantage_estimator='rloo'"):
        GRPOConfig(advantage_estimator="rloo", scale_rewards="batch")
    assert GRPOConfig(advantage_estimator="rloo").estimator_options() == {"estimator": "rloo"}
    # normalize_then_sum reads reward_std and advantage_eps itself, whatever the estimator
    GRPOConfig(advantage_estimator="rloo", multi_objective_aggregation="normalize_then_sum", reward_std="unbiased")
    # normalize_then_sum fixes grpo's scale of the combined outcome reward to the batch (TRL); step rewards keep theirs
    with pytest.raises(ConfigError, match=r"scale_rewards='none' has no effect with multi_objective_aggregation="
                                          r"'normalize_then_sum'.*remove scale_rewards"):
        GRPOConfig(multi_objective_aggregation="normalize_then_sum", scale_rewards=False)
    summed = GRPOConfig(multi_objective_aggregation="normalize_then_sum", scale_rewards="batch")
    assert summed.estimator_options(outcome=True)["scale"] == "batch"
    assert GRPOConfig(multi_objective_aggregation="normalize_then_sum").estimator_options()["scale"] == "group"
    assert GRPOConfig(advantage_estimator="reinforce_plus_plus_baseline", advantage_eps=0.0).estimator_options() == \
        {"estimator": "reinforce_plus_plus_baseline", "std": "population", "eps": 0.0}


def test_a_path_object_as_the_model_is_named_with_the_fix(tmp_path, base_dir):
    """TRL takes a model path as a str; a pathlib.Path is refused before anything loads, saying to pass str(path)."""
    from pathlib import Path

    with pytest.raises(TypeError, match=r"got PosixPath: pass str\(PosixPath\(.*\)\), as TRL takes a path"):
        GRPOTrainer(Path(base_dir), [toy.letter_reward], args=small_args(tmp_path), train_dataset=toy.dataset(16))


def test_ctrl_c_is_a_keyboard_interrupt_and_a_second_train_call_is_refused(tmp_path, tokenizer):
    """A TRL script's `except KeyboardInterrupt: trainer.save_model()` missed groupwise's stop after Ctrl-C (a
    RuntimeError); a second train() on a trainer that had trained ran no step and returned the first call's
    results (TRL retrains from step 0)."""
    import os
    import signal

    from transformers import TrainerCallback

    from groupwise import ConfigError
    from groupwise.signals import TrainingInterrupted

    class CtrlC(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward], callbacks=[CtrlC()],
                    args=small_args(tmp_path, max_steps=4, save_steps=0), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)
    with pytest.raises(KeyboardInterrupt) as stopped:
        t.train()
    assert isinstance(stopped.value, TrainingInterrupted) and stopped.value.signum == signal.SIGINT
    assert t.state.global_step == 1 and "stopped by SIGINT after step 1" in str(stopped.value)
    with pytest.raises(ConfigError, match=r"train\(\) was already called on this trainer, which is at step 1: "
                                          "build a new GRPOTrainer"):
        t.train()

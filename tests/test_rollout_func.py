"""TRL's `rollout_func` (GRPOTrainer(rollout_func=…)): the user's function samples, groupwise trains on its output.

Checked by hand on a fixed output (padding, masks, TRL's truncation rule, env_mask → the loss mask and the turns,
None log-probs → NaN, extra keys → reward-function keywords), by equivalence (a rollout_func that replays groupwise's
own sampler trains bitwise as the built-in rollout), and by its errors."""

from __future__ import annotations

import math

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise import rollout as R
from groupwise.config_base import ConfigError
from groupwise.distributed import Distributed
from groupwise.tasks import toy
from groupwise.text import completion_masks, encode_prompts, trim_to_mask
from tests.conftest import small_args


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _ctx(tok, args, rollout_func):
    return R.RolloutContext(args=args, tokenizer=tok, generator=None, dist=Distributed(),
                            eos_token_ids=[tok.eos_token_id], rollout_func=rollout_func)


def test_a_fixed_output_becomes_the_completions_record(tokenizer):
    """Two rows. Row 0 is two assistant turns around 2 environment tokens: "ab<eos>" + "xy" (env) + "c<eos>" — kept
    whole although an EOS sits inside; env_mask 1 1 1 0 0 1 1 ⇒ turns end at indices 2 and 6. Row 1 is "d", cut
    (its last token is no EOS or pad ⇒ truncated, TRL's rule). Log-probs: row 1's None ⇒ NaN (unknown), padding 0."""
    eos = tokenizer.eos_token_id
    row0 = _ids(tokenizer, "ab") + [eos] + _ids(tokenizer, "xy") + _ids(tokenizer, "c") + [eos]
    row1 = _ids(tokenizer, "d")
    seen = []

    def func(prompts):
        seen.append(list(prompts))
        prompts[0] += " mutated"  # the function gets a copy: the record keeps the dataset's prompts
        return {"prompt_ids": [_ids(tokenizer, "q:"), _ids(tokenizer, "long q:")],
                "completion_ids": [row0, torch.tensor(row1)],  # a row may be a tensor
                "logprobs": [[-0.5] * 7, [None]], "env_mask": [[1, 1, 1, 0, 0, 1, 1], [1]],
                "answer": ["7", "8"], "source": "unit"}

    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8,
                      generation_dtype="bfloat16")  # the sampler differs: its log-probs are kept
    rows = [{"prompt": "q:", "answer": "x"}, {"prompt": "long q:", "answer": "y"}]
    comp = R.generate(_ctx(tokenizer, args, func), None, rows)
    assert seen == [["q:", "long q:"]] and comp.prompts == ["q:", "long q:"]
    pad = tokenizer.pad_token_id
    q, lq = _ids(tokenizer, "q:"), _ids(tokenizer, "long q:")
    assert comp.prompt_ids.tolist() == [[pad] * (len(lq) - len(q)) + q, lq]
    assert comp.prompt_mask.tolist() == [[0] * (len(lq) - len(q)) + [1] * len(q), [1] * len(lq)]
    assert comp.completion_ids.tolist() == [row0, row1 + [pad] * 6]
    assert comp.completion_mask.tolist() == [[1] * 7, [1] + [0] * 6]
    assert comp.truncated.tolist() == [False, True]
    assert comp.tool_mask.tolist() == [[1, 1, 1, 0, 0, 1, 1], [1] + [0] * 6]
    assert comp.turn_ends == [[2, 6], [0]]
    assert comp.lengths.tolist() == [5, 1]  # model tokens only, as TRL's completion lengths with env_mask
    lp = comp.sampling_logps
    assert lp[0].tolist() == [-0.5] * 7 and math.isnan(lp[1, 0]) and lp[1, 1:].tolist() == [0.0] * 6
    assert comp.completions == ["abxyc", "d"]  # decoded without special tokens, environment text included (TRL)
    # rollout_func's keys win over the dataset's columns; a single value goes to every row
    assert comp.columns == {"answer": ["7", "8"], "source": ["unit", "unit"]}


def test_chat_prompts_give_assistant_messages_and_unread_logprobs_may_be_none(tokenizer):
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    chat = [{"role": "user", "content": "hi"}]

    def func(prompts):
        return {"prompt_ids": [[3, 4]] * 2, "completion_ids": [_ids(tokenizer, "ok") + [tokenizer.eos_token_id]] * 2,
                "logprobs": None}

    comp = R.generate(_ctx(tokenizer, args, func), None, [{"prompt": chat}] * 2)
    assert comp.completions == [[{"role": "assistant", "content": "ok"}]] * 2
    assert comp.sampling_logps is None and comp.tool_mask is None and comp.turn_ends is None


@pytest.mark.parametrize("output, message", [
    ({"prompt_ids": [[1]], "completion_ids": [[2]]}, r"must return keys \['logprobs'\]"),
    ([1, 2], "must return a dict"),
    ({"prompt_ids": [[1]], "completion_ids": [[2], [3]], "logprobs": None}, r"'prompt_ids' must hold one row per "
                                                                            r"prompt \(2\), got 1 rows"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [3]], "logprobs": [[-1.0], [-1.0, -2.0]]},
     "'logprobs' row 1 has 2 values for 1 completion tokens"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], ["a"]], "logprobs": None}, "row 1 holds 'a'"),
    ({"prompt_ids": [[1], []], "completion_ids": [[2], [3]], "logprobs": None}, "empty prompt_ids row 1"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [3] * 9], "logprobs": None},
     "9 completion tokens in row 1, more than max_completion_length=8"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [3]], "logprobs": None, "env_mask": [[1], [2]]},
     "env_mask is 1 on model tokens"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [3]], "logprobs": None, "answer": ["a"]},
     "'answer' has 1 values for 2 prompts"),
])
def test_bad_output_is_one_clear_error(tokenizer, output, message):
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    with pytest.raises((ValueError, TypeError), match=message):
        R.generate(_ctx(tokenizer, args, lambda prompts: output), None, [{"prompt": "q"}] * 2)


def test_logprobs_none_when_the_correction_reads_them_is_an_error(tokenizer):
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8,
                      generation_dtype="bfloat16")
    func = lambda prompts: {"prompt_ids": [[1]] * 2, "completion_ids": [[2]] * 2, "logprobs": None}  # noqa: E731
    with pytest.raises(ValueError, match="logprobs=None, but the importance-sampling correction reads the "
                                         "sampler's log-probs: .* or set vllm_importance_sampling_correction=False$"):
        R.generate(_ctx(tokenizer, args, func), None, [{"prompt": "q"}] * 2)
    # the off-policy mask alone (a sampler that differs, no correction): TRL's mask then measures from π_θold
    # (inputs.get("sampling_per_token_logps", old_per_token_logps)); it was refused, naming the option already set
    mask_only = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8,
                           generation_dtype="bfloat16", vllm_importance_sampling_correction=False,
                           off_policy_mask_threshold=0.5)
    assert mask_only.keeps_sampling_logps
    assert R.generate(_ctx(tokenizer, mask_only, func), None, [{"prompt": "q"}] * 2).sampling_logps is None


def test_refused_beside_tools_and_when_not_callable(tmp_path, tokenizer, tiny_model):
    def tool(x: int) -> int:
        """Echo.

        Args:
            x: a number
        """
        return x

    with pytest.raises(ConfigError, match="rollout_func runs the whole rollout"):
        GRPOTrainer(tiny_model, toy.letter_reward, args=small_args(tmp_path), train_dataset=toy.dataset(8),
                    processing_class=tokenizer, tools=[tool], rollout_func=lambda p, t: {})
    with pytest.raises(TypeError, match="rollout_func must be a function"):
        GRPOTrainer(tiny_model, toy.letter_reward, args=small_args(tmp_path), train_dataset=toy.dataset(8),
                    processing_class=tokenizer, rollout_func="mine")


def _replay(prompts, trainer):
    """groupwise's own sampler called from a rollout_func, as a user would call theirs: the same prompts encoded
    the same way, the completions cut after their first EOS."""
    args, ctx = trainer.args, trainer.rollout_ctx
    ids, mask = encode_prompts(prompts, trainer.processing_class, args.max_prompt_length, args.chat_template_kwargs)
    out = ctx.generator(trainer.sampling_model, ids, mask)
    cmask, _ = completion_masks(out.completion_ids, ctx.eos_token_ids, args.max_completion_length, out.lengths)
    trainer.replayed += len(prompts)
    return {"prompt_ids": trim_to_mask(ids, mask), "completion_ids": trim_to_mask(out.completion_ids, cmask),
            "logprobs": None, "seen_by": "replay"}


def test_replaying_the_builtin_sampler_trains_bitwise_alike(tmp_path, tokenizer):
    """The same seed, the same sampler: the rollout_func path builds the batch the built-in rollout builds, so the
    two runs log the same metrics and end with the same weights, bit for bit (μ = 2 iterations, 3 steps; the
    replayed run's reward function also sees the function's extra key)."""
    seen = []

    def reward(completions, seen_by=None, **kw):  # the length: groups with spread, so every step moves the weights
        seen.append(None if seen_by is None else tuple(sorted(set(seen_by))))
        return [float(len(c)) for c in completions]

    runs = {}
    for name, func in (("builtin", None), ("replay", _replay)):
        model = toy.build_model(tokenizer, seed=0, hidden_size=32)
        args = small_args(tmp_path / name, max_steps=3, num_iterations=2)
        trainer = GRPOTrainer(model, reward, args=args, train_dataset=toy.dataset(16), processing_class=tokenizer,
                              rollout_func=func)
        trainer.replayed = 0
        trainer.train()
        history = [{k: v for k, v in h.items() if not k.startswith("time/") and k not in ("step_time",
                                                                                         "train_runtime",
                                                                                         "train_samples_per_second",
                                                                                         "train_steps_per_second")}
                   for h in trainer.state.log_history]
        runs[name] = (history, {k: v.clone() for k, v in model.state_dict().items()}, trainer.replayed)
    (h_a, w_a, n_a), (h_b, w_b, n_b) = runs["builtin"], runs["replay"]
    assert n_a == 0 and n_b == 8 * 2  # two rounds of 8 rows (μ = 2: one round feeds 2 optimizer steps)
    assert h_a == h_b
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    start = toy.build_model(tokenizer, seed=0, hidden_size=32).state_dict()
    assert not all(torch.equal(w_a[k], start[k]) for k in w_a)  # the runs trained
    assert set(seen) == {None, ("replay",)}


def test_evaluation_calls_it_with_the_eval_prompts(tmp_path, tokenizer, tiny_model):
    calls = []

    def func(prompts, trainer):
        calls.append(list(prompts))
        return {"prompt_ids": [_ids(tokenizer, p) for p in prompts],
                "completion_ids": [_ids(tokenizer, "aa") + [tokenizer.eos_token_id]] * len(prompts), "logprobs": None}

    data = toy.dataset(8)
    args = small_args(tmp_path, max_steps=1, num_generations_eval=2, per_device_eval_batch_size=4)
    trainer = GRPOTrainer(tiny_model, toy.letter_reward, args=args, train_dataset=data, eval_dataset=data[:2],
                          processing_class=tokenizer, rollout_func=func)
    metrics = trainer.evaluate()
    assert calls == [[data[0]["prompt"]] * 2 + [data[1]["prompt"]] * 2]  # k = 2 rows per eval prompt
    assert metrics["eval_completions/mean_length"] == 3.0


def _example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "rollout_func.py"
    spec = importlib.util.spec_from_file_location("rollout_func_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_and_its_sampler_logprobs_match_the_policy(tmp_path):
    """examples/rollout_func.py (two turns around an environment reply, env_mask, an extra key read by the reward),
    run for 2 steps with a float32 sampling copy (generation_dtype) so that the importance correction reads the
    function's log-probs: sampled by the same float32 policy, every ratio π_θold / π_sampler is 1 up to float
    rounding — a log-prob on the wrong token or shifted by one position would be far off."""
    example = _example()
    trainer = example.main(output_dir=str(tmp_path / "out"), max_steps=2, logging_steps=1,
                           per_device_train_batch_size=8, generation_dtype="float32",
                           vllm_importance_sampling_mode="token_truncate")
    first = trainer.state.log_history[0]
    for key in ("min", "mean", "max"):
        assert abs(first[f"sampling/importance_sampling_ratio/{key}"] - 1) < 1e-4, first
    assert first["sampling/sampling_logp_difference/max"] < 1e-4
    # the environment's 7 tokens are context: the logged lengths count the model's tokens only
    assert first["completions/max_length"] <= trainer.args.max_completion_length - len(example.FEEDBACK)
    assert "rewards/second_turn_reward/mean" in first

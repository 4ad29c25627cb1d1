"""Audit of TRL's `rollout_func` contract (groupwise.custom_rollout) against TRL 1.16's GRPOTrainer: what the function
is called with, what the off-policy mask reads (TRL: the function's log-probs whenever it returns them, without vLLM
too), a mid-round resume holding them, and the edge cases of its output (empty completions, pad endings, tuples as
one value, malformed rows: one line naming the key, the row and the fix). tests/test_rollout_func.py covers the
rest (a fixed output by hand, the replay equivalence, evaluation, the example)."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise import rollout as R
from groupwise.distributed import Distributed
from groupwise.tasks import toy
from tests.conftest import small_args


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _ctx(tok, args, rollout_func):
    return R.RolloutContext(args=args, tokenizer=tok, generator=None, dist=Distributed(),
                            eos_token_ids=[tok.eos_token_id], rollout_func=rollout_func)


def _trl_source() -> str:
    import trl.trainer.grpo_trainer as trl_grpo

    return inspect.getsource(trl_grpo)


def test_called_as_trl_calls_it_with_raw_repeated_prompts_and_the_trainer(tmp_path, tokenizer, tiny_model):
    """TRL 1.16: `output = self.rollout_func(prompts, self)` with the per-process slice of the RepeatSampler's rows
    (each prompt num_generations times, contiguous), deep-copied, chat messages as messages (not templated). Here:
    2 chat prompts × G = 4 rows, the trainer itself as second argument; the prompts as the dataset gives them."""
    src = _trl_source()
    assert "output = self.rollout_func(prompts, self)" in src and "prompts = copy.deepcopy(prompts)" in src
    calls = []

    def func(prompts, trainer):
        calls.append((prompts, trainer))
        ids = [_ids(tokenizer, p[0]["content"]) for p in prompts]  # the function templates as it likes
        return {"prompt_ids": ids, "completion_ids": [_ids(tokenizer, "ab") + [tokenizer.eos_token_id]] * len(ids),
                "logprobs": None}

    data = [{"prompt": [{"role": "user", "content": f"say {c}"}], "letter": c} for c in "ab"]
    args = small_args(tmp_path, max_steps=1, shuffle_dataset=False)
    trainer = GRPOTrainer(tiny_model, toy.letter_reward, args=args, train_dataset=data, processing_class=tokenizer,
                          rollout_func=func)
    trainer._collect()
    (prompts, got), = calls
    assert got is trainer
    assert prompts == [data[0]["prompt"]] * 4 + [data[1]["prompt"]] * 4
    assert prompts[0] is not data[0]["prompt"]  # a copy: the function may mutate it
    metrics = trainer.evaluate(eval_dataset=data)  # a dataset given to evaluate() is not templated here either
    assert len(calls) == 2 and calls[1][0] == [data[0]["prompt"], data[1]["prompt"]] and "eval_reward" in metrics


def _output(tokenizer, logprobs):
    eos = tokenizer.eos_token_id
    return {"prompt_ids": [_ids(tokenizer, "q:")] * 2, "completion_ids": [_ids(tokenizer, "ab") + [eos]] * 2,
            "logprobs": logprobs}


def test_the_off_policy_mask_reads_the_functions_logprobs_without_vllm(tokenizer):
    """TRL: `if sampling_per_token_logps is not None: output["sampling_per_token_logps"] = …` (any rollout_func
    that returns log-probs) and the mask reads `inputs.get("sampling_per_token_logps", old_per_token_logps)` —
    without use_vllm too. groupwise kept them only when the sampler 'differs' (use_vllm, generation_dtype), so the
    mask silently measured from π_θold. Now: given → kept (−0.25 on the 3 tokens); None → π_θold, no error (TRL);
    the importance correction is not switched on by them (TRL: use_vllm only)."""
    src = _trl_source()
    assert 'inputs.get("sampling_per_token_logps", old_per_token_logps)' in src
    assert 'if sampling_per_token_logps is not None:\n            output["sampling_per_token_logps"]' in src
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8,
                      off_policy_mask_threshold=0.5)
    assert not args.samples_apart and not args.corrects_sampling
    rows = [{"prompt": "q:"}] * 2
    comp = R.generate(_ctx(tokenizer, args, lambda p: _output(tokenizer, [[-0.25, None, -0.25]] * 2)), None, rows)
    lp = comp.sampling_logps
    assert lp[:, 0].tolist() == [-0.25] * 2 and lp[:, 2].tolist() == [-0.25] * 2 and torch.isnan(lp[:, 1]).all()
    comp = R.generate(_ctx(tokenizer, args, lambda p: _output(tokenizer, None)), None, rows)
    assert comp.sampling_logps is None
    # evaluation reads no log-probs: not kept there
    comp = R.generate(_ctx(tokenizer, args, lambda p: _output(tokenizer, [[-0.25] * 3] * 2)), None, rows,
                      evaluation=True)
    assert comp.sampling_logps is None
    # without the mask nothing reads them: not kept (as before)
    plain = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    comp = R.generate(_ctx(tokenizer, plain, lambda p: _output(tokenizer, [[-0.25] * 3] * 2)), None, rows)
    assert comp.sampling_logps is None


def test_a_mid_round_resume_accepts_the_functions_logprobs():
    """check_pending: a round saved with a rollout_func's log-probs (off-policy mask on, no vLLM) resumes under the
    same settings; turning the mask off is still refused, and a round saved without them under a sampler that
    differs is still refused."""
    from groupwise.checkpoint import CheckpointError
    from groupwise.checkpoint_load import check_pending

    kw = dict(num_generations=2, per_device_train_batch_size=2)
    x = torch.zeros(1)
    check_pending("ckpt", {"sampling_logps": x}, GRPOConfig(off_policy_mask_threshold=0.5, **kw))
    check_pending("ckpt", {}, GRPOConfig(off_policy_mask_threshold=0.5, **kw))  # logprobs=None: π_θold
    with pytest.raises(CheckpointError, match="built with sampling_logps"):
        check_pending("ckpt", {"sampling_logps": x}, GRPOConfig(**kw))
    apart = GRPOConfig(off_policy_mask_threshold=0.5, generation_dtype="bfloat16",
                       vllm_importance_sampling_correction=False, **kw)
    with pytest.raises(CheckpointError, match="built without sampling_logps"):
        check_pending("ckpt", {}, apart)
    check_pending("ckpt", {}, apart, custom_rollout=True)  # a rollout_func may return logprobs=None there: π_θold


def test_the_mask_trains_on_the_functions_logprobs(tmp_path, tokenizer, tiny_model):
    """End to end: a rollout_func returning log-probs of −50 for every token (far from the policy's, ≈ −log V) with
    off_policy_mask_threshold=0: every completion's mean KL(π_sampler ‖ π_θ) = −50 − log π_θ < 0 ≤ δ, so none is
    masked, and the TrainBatch carries the function's −50s (TRL's sampling_per_token_logps)."""
    def func(prompts, trainer):
        out = _output(tokenizer, None)
        n, c = len(prompts), out["completion_ids"][0]
        return {"prompt_ids": [out["prompt_ids"][0]] * n, "completion_ids": [c] * n, "logprobs": [[-50.0] * len(c)] * n}

    args = small_args(tmp_path, max_steps=1, off_policy_mask_threshold=0.0)
    trainer = GRPOTrainer(tiny_model, toy.letter_reward, args=args, train_dataset=toy.dataset(8),
                          processing_class=tokenizer, rollout_func=func)
    batch = trainer._collect().batch
    assert batch.sampling_logps is not None
    assert batch.sampling_logps[batch.completion_mask.bool()].unique().tolist() == [-50.0]


def test_empty_and_pad_ended_completions(tokenizer):
    """TRL's rule `ids[-1] not in eos_and_pad`: a row ending in the pad token is not truncated, one ending in a
    plain token is. An empty row (TRL: IndexError on ids[-1]) is truncated here, with no token in the mask.
    Widths: the longest row, 2 tokens."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    a = _ids(tokenizer, "a")[0]
    rows = [[a, pad], [a, a], [], [a, eos]]
    func = lambda p: {"prompt_ids": [[a]] * 4, "completion_ids": rows, "logprobs": None}  # noqa: E731
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, max_completion_length=4)
    comp = R.generate(_ctx(tokenizer, args, func), None, [{"prompt": "q"}] * 4)
    assert comp.truncated.tolist() == [False, True, True, False]
    assert comp.completion_mask.tolist() == [[1, 1], [1, 1], [0, 0], [1, 1]]
    assert comp.lengths.tolist() == [2, 2, 0, 2]


def test_a_tuple_or_scalar_is_one_value_for_every_row_as_trl(tokenizer):
    """TRL: `if isinstance(values, list) … values[i]`, else the value itself for every row: a tuple is one value."""
    assert "elif not isinstance(values, list):\n                        inp[key] = values" in _trl_source()
    out = {**_output(tokenizer, None), "pair": ("x", "y"), "n": 3}
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    comp = R.generate(_ctx(tokenizer, args, lambda p: out), None, [{"prompt": "q"}] * 2)
    assert comp.columns == {"pair": [("x", "y")] * 2, "n": [3, 3]}


@pytest.mark.parametrize("output, message", [
    ({"prompt_ids": [[1], [1]], "completion_ids": 5, "logprobs": None},
     r"'completion_ids' must hold one row per prompt \(2\), got int"),
    ({"prompt_ids": [[1], 1], "completion_ids": [[2], [3]], "logprobs": None}, "'prompt_ids' row 1 must be a list"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [3]], "logprobs": [[-1.0], ["x"]]},
     "'logprobs' row 1 holds 'x': log-probs are numbers"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [3.0]], "logprobs": None}, "holds 3.0: token ids are integers"),
    ({"prompt_ids": [[1], [1]], "completion_ids": [[2], [3]], "logprobs": None, "env_mask": [[1], [1, 0]]},
     "'env_mask' row 1 has 2 values for 1 completion tokens"),
])
def test_more_malformed_outputs_are_one_line_naming_key_and_row(tokenizer, output, message):
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    with pytest.raises(ValueError, match=message) as err:
        R.generate(_ctx(tokenizer, args, lambda prompts: output), None, [{"prompt": "q"}] * 2)
    assert "\n" not in str(err.value)


def test_keys_the_trainer_passes_itself_are_refused_and_prompt_completion_left_out(tokenizer):
    """TRL's reward keywords leave 'prompt' and 'completion' out of the columns; a key named as an argument the
    trainer passes ('completions', 'trainer_state', …) was forwarded, and the clash was blamed on the reward
    function (KeyError 'completions' on row 0). Now refused naming the key."""
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    out = {**_output(tokenizer, None), "prompt": ["x", "y"], "completion": ["z", "w"], "hint": ["h1", "h2"]}
    comp = R.generate(_ctx(tokenizer, args, lambda p: out), None, [{"prompt": "q"}] * 2)
    assert comp.columns == {"hint": ["h1", "h2"]}
    for key in ("completions", "trainer_state", "log_metric"):
        with pytest.raises(ValueError, match=rf"rollout_func returned a key '{key}', which is a reward-function "
                                             "argument the trainer passes itself: rename it"):
            R.generate(_ctx(tokenizer, args, lambda p, key=key: {**_output(tokenizer, None), key: [1, 2]}), None,
                       [{"prompt": "q"}] * 2)
    # 'steps' is the trainer's only for process reward functions: a column in an outcome-only run (as TRL)
    with_steps = lambda p: {**_output(tokenizer, None), "steps": [3, 4]}  # noqa: E731
    assert R.generate(_ctx(tokenizer, args, with_steps), None, [{"prompt": "q"}] * 2).columns == {"steps": [3, 4]}
    ctx = dataclasses.replace(_ctx(tokenizer, args, with_steps), process_sources=[object()])  # process rewards
    with pytest.raises(ValueError, match="rollout_func returned a key 'steps'"):
        R.generate(ctx, None, [{"prompt": "q"}] * 2)


def test_token_ids_outside_the_vocabulary_are_named(tokenizer):
    """−1 crashed in the tokenizer's decode (OverflowError), an id past the embeddings at the forward pass
    (IndexError on CPU, a device-side assert on CUDA). Now one line naming the key, the row and the id."""
    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    vocab = model.get_input_embeddings().num_embeddings
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8)
    eos = tokenizer.eos_token_id
    for key, bad, row in (("completion_ids", -1, 1), ("completion_ids", vocab, 0), ("prompt_ids", vocab + 5, 1)):
        out = {"prompt_ids": [[5], [5]], "completion_ids": [[6, eos], [6, eos]], "logprobs": None}
        out[key] = [list(r) for r in out[key]]
        out[key][row] = out[key][row] + [bad] if key == "prompt_ids" else [bad, eos]
        with pytest.raises(ValueError, match=rf"rollout_func's '{key}' row {row} holds token id {bad}, outside the "
                                             rf"model's vocabulary \[0, {vocab}\)"):
            R.generate(_ctx(tokenizer, args, lambda p, out=out: out), model, [{"prompt": "q"}] * 2)
    ok = {"prompt_ids": [[5], [5]], "completion_ids": [[vocab - 1, eos]] * 2, "logprobs": None}  # the last row: fine
    assert R.generate(_ctx(tokenizer, args, lambda p: ok), model, [{"prompt": "q"}] * 2).completion_ids[0, 0] == vocab - 1
    # the input embeddings wrapped by PEFT (LoRA on them, modules_to_save, trainable tokens) are read through
    # their base layer (lora.Embedding has no num_embeddings: the first version of this check crashed there)
    from peft import LoraConfig, get_peft_model

    from groupwise.modeling import embedding_rows

    for extra in ({"target_modules": ["q_proj", "embed_tokens"]}, {"modules_to_save": ["embed_tokens"]},
                  {"trainable_token_indices": [3, 4]}):
        config = LoraConfig(r=4, **{"target_modules": ["q_proj"], **extra})
        wrapped = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32), config)
        assert embedding_rows(wrapped) == vocab
        assert R.generate(_ctx(tokenizer, args, lambda p: ok), wrapped, [{"prompt": "q"}] * 2).completion_ids.size(0) == 2


def test_a_2d_tensor_output_is_accepted(tokenizer):
    """Rows as one (N, L) tensor (a batched engine's output): each row one completion of L tokens."""
    eos = tokenizer.eos_token_id
    a = _ids(tokenizer, "a")[0]
    ids = torch.tensor([[a, eos], [a, a]])
    func = lambda p: {"prompt_ids": torch.tensor([[a], [a]]), "completion_ids": ids,  # noqa: E731
                      "logprobs": torch.full((2, 2), -1.0)}
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=2,
                      generation_dtype="bfloat16")  # the correction reads them
    comp = R.generate(_ctx(tokenizer, args, func), None, [{"prompt": "q"}] * 2)
    assert comp.completion_ids.tolist() == ids.tolist() and comp.truncated.tolist() == [False, True]
    assert comp.sampling_logps.tolist() == [[-1.0, -1.0]] * 2 and not math.isnan(comp.sampling_logps.sum())

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from groupwise.generation.hf import TransformersGenerator
from groupwise.text import completion_masks, encode_prompts
from groupwise.modeling import completion_logps
from groupwise.tasks import toy


def test_eos_is_part_of_the_completion_when_pad_equals_eos():
    # pad == eos == 0. Row 0 ends with EOS at t=2: mask covers t=0..2 (EOS included), the rest is padding.
    # Row 1 never emits EOS within T = max_completion_length = 4: all 4 tokens count, truncated.
    # Row 2 emits EOS first: a one-token completion [EOS].
    ids = torch.tensor([[5, 6, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]])
    mask, truncated = completion_masks(ids, [0], max_completion_length=4)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_several_eos_ids():
    mask, truncated = completion_masks(torch.tensor([[3, 9, 4, 1]]), [1, 9], max_completion_length=4)
    assert mask.tolist() == [[1, 1, 0, 0]] and truncated.tolist() == [False]


def test_generated_from_an_engine_s_ragged_rows():
    # rows of 2, 3 and 0 tokens, pad 9: right-padded to T = 3, lengths [2, 3, 0]; log-probs None / NaN → NaN, a row
    # without log-probs all NaN, padding NaN
    from groupwise.generation import Generated

    out = Generated.from_rows([[5, 6], [7, 8, 1], []], [[-0.5, None], None, []], 9, torch.device("cpu"))
    assert out.completion_ids.tolist() == [[5, 6, 9], [7, 8, 1], [9, 9, 9]] and out.lengths.tolist() == [2, 3, 0]
    nan = float("nan")
    torch.testing.assert_close(out.logprobs, torch.tensor([[-0.5, nan, nan], [nan] * 3, [nan] * 3]), equal_nan=True)
    assert Generated.from_rows([[5]], None, 9, torch.device("cpu")).logprobs is None


def test_pad_rows_matches_a_plain_loop():
    from groupwise.text import pad_rows

    rows = [[3, 1], [], [4, 1, 5]]
    for side in ("left", "right"):
        for pad, dtype, width in ((0, torch.long, None), (float("nan"), torch.float, 5)):
            values, mask = pad_rows(rows, pad, side=side, width=width, dtype=dtype)
            L = width or 3
            for i, row in enumerate(rows):  # the loop: each row placed at its side, the rest pad / mask 0
                placed = [pad] * (L - len(row)) + row if side == "left" else row + [pad] * (L - len(row))
                span = range(L - len(row), L) if side == "left" else range(len(row))
                torch.testing.assert_close(values[i], torch.tensor(placed, dtype=dtype), equal_nan=True)
                assert mask[i].tolist() == [int(j in span) for j in range(L)]
            assert values.dtype == dtype and mask.dtype == torch.long


def test_encode_prompts_left_pads_and_truncates(tokenizer):
    ids, mask = encode_prompts(["ab", "abcd"], tokenizer, max_prompt_length=3)
    pad = tokenizer.pad_token_id
    a, b, c, d = (tokenizer.convert_tokens_to_ids(x) for x in "abcd")
    assert ids.tolist() == [[pad, a, b], [b, c, d]]  # "abcd" keeps its last 3 tokens
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_chat_prompts_use_the_template(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}a:"
    ids, _ = encode_prompts([[{"role": "user", "content": "hi"}]], tokenizer, None)
    assert tokenizer.decode(ids[0]) == "u:hi\na:"


def test_string_prompts_get_the_tokenizers_special_tokens_as_in_trl():
    """TRL tokenizes a string prompt with processing_class(text=prompts) (special tokens added: the BOS of Llama- and
    Gemma-style tokenizers) and chat prompts with apply_chat_template(tokenize=True), which adds none. The dataset's
    length check counts the same tokens as the rollout."""
    from tokenizers.processors import TemplateProcessing

    from groupwise.config_base import ConfigError
    from groupwise.data import PromptData
    from groupwise.text import prompt_token_ids

    tok = toy.build_tool_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    chat = [{"role": "user", "content": "hi"}]
    plain = tok(text=["ab"])["input_ids"][0]  # TRL's string prompt
    assert plain[0] == tok.bos_token_id and len(plain) == 3
    templated = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert prompt_token_ids(["ab", chat], tok) == [plain, list(templated)]
    ids, mask = encode_prompts(["ab", chat], tok, None)
    assert ids[0, mask[0].bool()].tolist() == plain
    # "ab" is 3 tokens with its BOS: a limit of 2 cuts it (refused with truncate_prompt="error")
    with pytest.raises(ConfigError, match="row 0 has 3 prompt tokens > max_prompt_length=2"):
        PromptData([{"prompt": "ab"}], "train_dataset").check_lengths(
            tok, max_prompt_length=2, max_completion_length=4, truncate_prompt="error", max_positions=64)


def test_generation_kwargs_override_the_transformers_fields_as_in_trl(tokenizer, tiny_model):
    """TRL updates its generation fields with generation_kwargs (they override; it used to be a TypeError here);
    greedy calls stay greedy; the log-probs stay at GRPOConfig.temperature, as TRL's."""
    gen = TransformersGenerator(max_completion_length=5, temperature=0.9, top_p=1.0, top_k=0, min_p=None,
                                repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
                                eos_token_ids=[tokenizer.eos_token_id],
                                generation_kwargs={"top_k": 3, "temperature": 0.5, "do_sample": True})
    sample, greedy = gen.configs[False], gen.configs[True]
    assert (sample.top_k, sample.temperature, sample.do_sample) == (3, 0.5, True)
    assert greedy.do_sample is False and gen.temperature == 0.9
    assert sample.disable_compile is greedy.disable_compile is True  # as TRL's GenerationConfig
    ids, mask = encode_prompts(["ab", "c"], tokenizer, None)
    assert gen(tiny_model, ids, mask, logprobs=True).logprobs.shape[0] == 2
    from groupwise.config_base import ConfigError
    from tests.conftest import small_args

    with pytest.raises(ConfigError, match=r"generation_kwargs\['max_new_tokens'\] would change the shape of the "
                                          r"completions: set max_completion_length instead"):
        small_args(Path("unused"), generation_backend="transformers", generation_kwargs={"max_new_tokens": 4})
    # TRL passes generation_kwargs to model.generate: the transformers backend does; the fast sampler names both ways
    with pytest.raises(ConfigError, match=r"generation_kwargs \['temperature'\] need generation_backend="
                                          r"'transformers' \(model.generate takes them, as in TRL\); the fast sampler "
                                          "reads temperature"):
        small_args(Path("unused"), generation_kwargs={"temperature": 0.9})


def test_a_model_asking_for_beams_is_still_sampled_and_beams_in_generation_kwargs_are_refused(tokenizer):
    """A model whose generation_config sets num_beams=2: generate() merged it in and beam-sampled (as TRL does),
    and with log-probs asked for the stacking of per-step values crashed. The transformers backend now samples one
    completion per row: the same tokens, under one seed, as with the model's num_beams unset, with log-probs.
    generation_kwargs={'num_beams': 2} is refused with the config."""
    import copy

    from groupwise.config_base import ConfigError
    from tests.conftest import small_args

    model = toy.build_model(tokenizer, seed=0, hidden_size=32).eval()
    beams = copy.deepcopy(model)
    beams.generation_config.num_beams = 2
    gen = TransformersGenerator(max_completion_length=5, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                                repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
                                eos_token_ids=[tokenizer.eos_token_id])
    ids, mask = encode_prompts(["ab", "c", "ab"], tokenizer, None)
    torch.manual_seed(3)
    plain = gen(model, ids, mask, logprobs=True)
    torch.manual_seed(3)
    out = gen(beams, ids, mask, logprobs=True)
    assert torch.equal(out.completion_ids, plain.completion_ids) and torch.equal(out.logprobs, plain.logprobs)
    with pytest.raises(ConfigError, match=r"generation_kwargs\['num_beams'\]=2 would run beam search, whose "
                                          r"completions are not samples of the policy"):
        small_args(Path("unused"), generation_backend="transformers", generation_kwargs={"num_beams": 2})


def test_logps_match_generation_scores_under_left_padding(tokenizer):
    """The training forward must see the same positions as generate(): compare our log-probs of the sampled
    tokens with the scores generate() produced, on left-padded prompts of different lengths."""
    model = toy.build_model(tokenizer, seed=3, hidden_size=32).eval()
    ids, mask = encode_prompts(["repeat a:", "ab", "x"], tokenizer, None)
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True,
                         generation_config=GenerationConfig(do_sample=False, max_new_tokens=5, min_new_tokens=5,
                                                            pad_token_id=tokenizer.pad_token_id,
                                                            eos_token_id=tokenizer.eos_token_id))
    completion = out.sequences[:, ids.size(1):]  # (3, 5)
    expected = torch.stack([torch.log_softmax(l.float(), -1).gather(-1, completion[:, t:t + 1]).squeeze(-1)
                            for t, l in enumerate(out.logits)], dim=1)  # (3, 5)
    full_mask = torch.cat([mask, torch.ones_like(completion)], 1)
    logps, _ = completion_logps(model, out.sequences, full_mask, 5)
    assert torch.allclose(logps, expected, atol=1e-4)


def test_transformers_generator_greedy_is_deterministic(tokenizer, tiny_model):
    gen = TransformersGenerator(max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                                repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
                                eos_token_ids=[tokenizer.eos_token_id])
    ids, mask = encode_prompts(["repeat a:", "b"], tokenizer, None)
    tiny_model.train()
    a = gen(tiny_model, ids, mask, greedy=True).completion_ids
    assert tiny_model.training  # generation runs in eval mode and restores the caller's mode
    b = gen(tiny_model.eval(), ids, mask, greedy=True).completion_ids
    assert not tiny_model.training
    assert torch.equal(a, b) and a.size(1) <= 4
    # a later tool turn's limit: the first tokens of the same greedy completions, their log-probs with them
    c = gen(tiny_model, ids, mask, greedy=True, logprobs=True, max_new_tokens=2)
    assert torch.equal(c.completion_ids, a[:, :2]) and c.logprobs.shape == (2, 2)


def test_policy_wrapper_equals_full_logits_path(tokenizer):
    """PolicyForLogps (hidden states + chunked, checkpointed head) gives the same log-probs, entropies and gradients
    as the plain forward with full logits."""
    import copy

    from groupwise.modeling import PolicyForLogps

    model = toy.build_model(tokenizer, seed=4, hidden_size=32)
    ref = copy.deepcopy(model)
    ids, mask = encode_prompts(["repeat a:", "b"], tokenizer, None)
    comp = torch.randint(3, len(tokenizer), (2, 6))
    full_ids, full_mask = torch.cat([ids, comp], 1), torch.cat([mask, torch.ones_like(comp)], 1)
    a, ea = PolicyForLogps(model, chunk_tokens=5)(full_ids, full_mask, 6, temperature=0.7, compute_entropy=True)
    b, eb = completion_logps(ref, full_ids, full_mask, 6, temperature=0.7, compute_entropy=True)
    assert PolicyForLogps(model).chunked
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-5)
    a.sum().backward()
    b.sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_backends_return_the_log_probs_they_sampled_with(tokenizer, backend):
    """logprobs=True: log softmax(logits / temperature) of each sampled token, as the sampler saw it. With the
    sampler and the trainer on the same weights and numerics this equals the trainer's own log π_θold (what an
    importance-sampling correction compares), on every completion token; top-k does not enter it."""
    from groupwise.config import GRPOConfig
    from groupwise.generation import BACKENDS, build_generator

    model = toy.build_model(tokenizer, seed=2, hidden_size=32).eval()
    args = GRPOConfig(generation_backend=backend, num_generations=2, per_device_train_batch_size=6,
                      max_completion_length=7, temperature=0.7, top_k=5)
    gen = build_generator(args, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    assert isinstance(gen, BACKENDS[backend].load())
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz"] for _ in range(2)], tokenizer, None)
    torch.manual_seed(0)
    out = gen(model, ids, mask, logprobs=True)
    T = out.completion_ids.size(1)
    assert out.logprobs.shape == out.completion_ids.shape
    cmask, _ = completion_masks(out.completion_ids, [tokenizer.eos_token_id], T)
    seq = torch.cat([ids, torch.where(cmask.bool(), out.completion_ids, tokenizer.pad_token_id)], 1)
    expected, _ = completion_logps(model, seq, torch.cat([mask, cmask], 1), T, temperature=0.7)
    real = cmask.bool()
    assert torch.allclose(out.logprobs[real], expected[real], atol=1e-4)
    assert (out.logprobs[real] < 0).all()
    assert gen(model, ids, mask).logprobs is None  # not computed unless asked
    gen.update_weights(model)  # in-process backends sample from the policy itself: a no-op that must exist


@pytest.mark.parametrize("greedy,logprobs", [(False, True), (True, False)])
def test_transformers_generator_sets_the_outputs_in_its_generation_config(tokenizer, tiny_model, greedy, logprobs):
    """generate() deprecates output arguments passed next to a generation_config (a warning on every run, "will be
    removed"): return_dict_in_generate and output_logits belong in the config, which the caller's
    generation_kwargs cannot turn off either."""
    gen = TransformersGenerator(max_completion_length=4, temperature=0.7, top_p=1.0, top_k=0, min_p=None,
                                repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
                                eos_token_ids=[tokenizer.eos_token_id],
                                generation_kwargs={"return_dict_in_generate": False})
    seen = []
    original = tiny_model.generate
    tiny_model.generate = lambda **kw: seen.append(kw) or original(**kw)
    ids, mask = encode_prompts(["ab", "c"], tokenizer, None)
    out = gen(tiny_model, ids, mask, greedy=greedy, logprobs=logprobs)
    assert set(seen[0]) == {"input_ids", "attention_mask", "generation_config"}
    # never output_logits: generate() would keep every step's (N, V) logits (the log-probs are read step by step)
    assert seen[0]["generation_config"].output_logits is False
    assert (out.logprobs is not None) is logprobs and out.completion_ids.size(0) == 2
    assert not tiny_model._forward_hooks  # the step-by-step reader is gone after the call


def test_transformers_log_probs_equal_generate_s_logits_under_peft_and_penalties(tokenizer):
    """The transformers backend reads each sampled token's log-prob step by step from the forward generate() runs
    (one (N, V) step kept at a time): the same numbers as the plain way, log softmax(output_logits_t / τ)[y_t] over
    the logits generate() keeps for every step, for sampled rows under a repetition penalty and top-k (processors
    the log-prob leaves out), with rows ending at different steps, through a PEFT model (whose generate() runs its
    base model's forward)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(toy.build_model(tokenizer, seed=4, hidden_size=32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    eos = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list("abcdefgh"))]  # rows end early
    kw = dict(max_completion_length=9, temperature=0.8, top_p=1.0, top_k=6, min_p=None, repetition_penalty=1.3,
              pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos)
    ids, mask = encode_prompts(["repeat a:", "ab", "x", "repeat b:"], tokenizer, None)
    torch.manual_seed(5)
    out = TransformersGenerator(**kw)(model, ids, mask, logprobs=True)
    # the plain way: the same draw again with output_logits (the same seed, the same processors)
    torch.manual_seed(5)
    gen = TransformersGenerator(**kw)
    plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
        **{**gen.configs[False].to_dict(), "output_logits": True}))
    completion = plain.sequences[:, ids.size(1):]
    assert torch.equal(completion, out.completion_ids)
    expected = torch.stack([torch.log_softmax(l.float() / 0.8, -1).gather(-1, completion[:, t:t + 1]).squeeze(-1)
                            for t, l in enumerate(plain.logits)], dim=1)
    cmask, _ = completion_masks(completion, eos, completion.size(1))
    assert 0 < cmask.sum() < cmask.numel()  # some rows ended early: their tail is padding
    assert torch.allclose(out.logprobs, expected, atol=1e-6)
    assert not model.get_base_model()._forward_hooks

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from groupwise.generation.fast import FastGenerator
from groupwise.text import encode_prompts
from groupwise.generation.fast import GrowingLayer
from groupwise.tasks import toy


def _fast(tok, **kw):
    base = dict(max_completion_length=12, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    return FastGenerator(**{**base, **kw})


def _generate(model, tok, ids, mask, max_new=12, **kw):
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id, **kw)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.size(1):]


@pytest.mark.parametrize("pad_is_eos", [False, True])
@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_greedy_equals_generate_token_for_token(pad_is_eos, repetition_penalty):
    tok = toy.build_tokenizer(pad_is_eos=pad_is_eos)
    model = toy.build_model(tok, seed=1, hidden_size=32).eval()
    # 3 groups of G = 4 with prompts of different lengths (left padding), a trained-ish EOS bias so rows finish
    # at different steps and leave the batch
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += 0.3 * model.lm_head.weight.mean(0)
    prompts = [p for p in ["repeat a:", "b", "xyz 12"] for _ in range(4)]
    ids, mask = encode_prompts(prompts, tok, None)
    fast = _fast(tok, group_size=4, repetition_penalty=repetition_penalty)(model, ids, mask, greedy=True).completion_ids
    ref = _generate(model, tok, ids, mask, repetition_penalty=repetition_penalty)
    assert torch.equal(fast, ref)


def test_rows_that_are_not_grouped_are_their_own_group(tokenizer):
    model = toy.build_model(tokenizer, seed=2, hidden_size=32).eval()
    ids, mask = encode_prompts(["a", "bc", "a", "d"], tokenizer, None)  # not contiguous groups of 2
    gen = _fast(tokenizer, group_size=2)
    assert gen._groups(ids, mask) == 1
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tokenizer, ids, mask))


def test_sampled_frequencies_match_the_processed_softmax(tokenizer):
    """One prompt, 6000 rows sharing it, one sampled token each. Expected probabilities: softmax of the logits after
    transformers' own temperature → top-k → top-p → min-p processors. Tolerance: every token's frequency within
    4.5 standard errors, sqrt(p(1−p)/n), of its probability (a false alarm has probability < 1e-4 over the
    vocabulary); tokens the processors removed are never sampled."""
    model = toy.build_model(tokenizer, seed=3, hidden_size=32).eval()
    n = 6000
    ids, mask = encode_prompts(["repeat a:"] * n, tokenizer, None)
    gen = _fast(tokenizer, max_completion_length=1, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, group_size=n)
    torch.manual_seed(0)
    first = gen(model, ids, mask).completion_ids[:, 0]
    freq = torch.bincount(first, minlength=len(tokenizer)).double() / n
    with torch.no_grad():
        logits = model(input_ids=ids[:1], attention_mask=mask[:1]).logits[:, -1].float()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9),
                                      MinPLogitsWarper(0.02)])
    p = torch.softmax(processors(ids[:1], logits), -1)[0].double()
    assert (freq[p == 0] == 0).all()
    se = torch.sqrt(p * (1 - p) / n)
    assert ((freq - p).abs() <= 4.5 * se + 1e-12).all(), (freq - p).abs().max()
    assert (p > 0).sum() > 2  # the test exercises a real distribution


def test_growing_layer_appends_in_place():
    layer = GrowingLayer()
    k = torch.randn(2, 1, 3, 4)
    keys, _ = layer.update(k, k)
    assert torch.equal(keys, k)
    buf = layer._k
    for _ in range(5):
        step = torch.randn(2, 1, 1, 4)
        keys, values = layer.update(step, step)
        assert torch.equal(keys[..., -1:, :], step)
    assert layer._k is buf and keys.shape[-2] == 8  # capacity 16: no reallocation, no concatenation
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape[0] == 1 and layer.get_seq_length() == 8

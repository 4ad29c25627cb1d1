import inspect

import pytest
import torch
import transformers.generation.utils
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from groupwise.generation.fast import FastGenerator, penalty_ids
from groupwise.modeling import position_ids_from_mask
from groupwise.text import completion_masks, encode_prompts
from groupwise.generation.fast import GrowingLayer
from groupwise.generation.static import StaticLayer, fused_pick, grouped_decode_attention
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


@pytest.mark.parametrize("pad_is_eos,seed", [(True, 15), (False, 0)])
@pytest.mark.parametrize("compile", [False, True])
def test_repetition_penalty_skips_the_left_padding_as_generate_does(pad_is_eos, seed, compile):
    """generate() leaves a row's left padding out of the repetition penalty; penalising it (the pad token, which
    may be EOS) changed this row's greedy completion for these seeds before the fix."""
    tok = toy.build_tokenizer(pad_is_eos=pad_is_eos)
    model = _eos_biased_model(tok, seed=seed)
    ids, mask = encode_prompts(["q", "xyz 12 long prompt"], tok, None)  # row 0 heavily left-padded
    gen = _fast(tok, max_completion_length=16, repetition_penalty=1.3, compile=compile, compile_mode="eager")
    out = gen(model, ids, mask, greedy=True).completion_ids
    alone = _generate(model, tok, ids[:1, mask[0].bool()], mask[:1, mask[0].bool()], max_new=16,
                      repetition_penalty=1.3)
    assert torch.equal(out[0, :alone.size(1)], alone[0])
    if "prompt_ignore_length=" not in inspect.getsource(transformers.generation.utils):
        pytest.skip(f"transformers {transformers.__version__}'s generate() penalises the left padding")
    ref = _generate(model, tok, ids, mask, max_new=16, repetition_penalty=1.3)
    assert torch.equal(out[:, :ref.size(1)], ref) and out.size(1) == ref.size(1)


def test_a_model_switched_to_eager_attention_gets_its_own_static_state(tokenizer):
    """The static state keeps the mask kind of the attention it was built for (boolean for sdpa, additive for
    eager): the same model object switched to eager attention must not reuse the sdpa state."""
    model = _eos_biased_model(tokenizer)
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12"] for _ in range(4)], tokenizer, None)
    gen = _fast(tokenizer, group_size=4, compile=True, compile_mode="eager")
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tokenizer, ids, mask))
    model.config._attn_implementation = "eager"
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tokenizer, ids, mask))
    assert len(gen._static) == 2


def test_penalty_ids_overwrite_only_the_left_padding():
    ids = torch.tensor([[0, 0, 5, 6, 0], [7, 8, 9, 1, 2], [0, 0, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    expected = ids.clone()
    for r in range(3):  # the slots before the first real token take that token; a row without one stays
        real = mask[r].nonzero()
        if len(real):
            expected[r, :int(real[0])] = ids[r, int(real[0])]
    assert expected.tolist() == [[5, 5, 5, 6, 0], [7, 8, 9, 1, 2], [0, 0, 0, 0, 0]]
    assert torch.equal(penalty_ids(ids, mask), expected)


def test_rows_that_are_not_grouped_are_their_own_group(tokenizer):
    model = toy.build_model(tokenizer, seed=2, hidden_size=32).eval()
    ids, mask = encode_prompts(["a", "bc", "a", "d"], tokenizer, None)  # not contiguous groups of 2
    gen = _fast(tokenizer, group_size=2)
    assert gen._groups(ids, mask) == 1
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tokenizer, ids, mask))


@pytest.mark.parametrize("G,k,shared", [(8, 4, 4), (4, 6, 6), (8, 16, 8), (2, None, 3)])
def test_evaluation_rows_share_their_prompt_whatever_k(tokenizer, G, k, shared):
    """Training lays a prompt's G rows side by side, evaluation its k = num_generations_eval rows: the prefill is
    shared by the rows of one prompt for either size (the vLLM server's rule, `repeats`: G first, then k, then the
    first run of identical rows). 3 prompts of k (or 3) rows each: 12 rows with G = 8, k = 4: 12 % 8 ≠ 0, so 4;
    18 rows with G = 4, k = 6: 18 % 4 = 2, so 6; 48 rows with G = 8, k = 16: groups of 8 hold one prompt each and G
    comes first (as on the server), so 8; 9 rows with G = 2 and k None (greedy): 9 % 2 ≠ 0, the first run, 3.
    Greedy completions equal generate()'s either way."""
    model = toy.build_model(tokenizer, seed=2, hidden_size=32).eval()
    per = k or 3
    ids, mask = encode_prompts([p for p in ["a", "repeat bc:", "d"] for _ in range(per)], tokenizer, None)
    gen = _fast(tokenizer, group_size=G, eval_group_size=k)
    assert gen._groups(ids, mask) == shared
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tokenizer, ids, mask))
    # rows of one prompt split across two groups are not shared: [a a a | a b b] with k = 3 is its own groups
    ids, mask = encode_prompts(["a"] * 4 + ["d"] * 2, tokenizer, None)
    assert _fast(tokenizer, group_size=4, eval_group_size=3)._groups(ids, mask) == 1


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


# ---- the static decode loop (generation_compile; on by default on CUDA) ---------------------------------------------
# compile_mode "eager" runs the fixed-shape loop as is; {"backend": "aot_eager", "fullgraph": True} traces the decode
# step with torch.compile (as on a GPU, without inductor's code generation) and fails on any graph break.
STATIC_MODES = ["eager", {"backend": "aot_eager", "fullgraph": True}]


def _eos_biased_model(tok, seed=1, boost=0.3):
    model = toy.build_model(tok, seed=seed, hidden_size=32).eval()
    with torch.no_grad():  # rows finish at different steps
        model.lm_head.weight[tok.eos_token_id] += boost * model.lm_head.weight.mean(0)
    return model


@pytest.mark.parametrize("mode", STATIC_MODES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("pad_is_eos,repetition_penalty", [(False, 1.0), (True, 1.3)])
def test_static_loop_greedy_equals_generate(mode, attn, pad_is_eos, repetition_penalty):
    tok = toy.build_tokenizer(pad_is_eos=pad_is_eos)
    model = _eos_biased_model(tok)
    model.config._attn_implementation = attn  # boolean 4-D mask for sdpa, additive for eager attention
    prompts = [p for p in ["repeat a:", "b", "xyz 12"] for _ in range(4)]
    ids, mask = encode_prompts(prompts, tok, None)
    gen = _fast(tok, group_size=4, repetition_penalty=repetition_penalty, compile=True, compile_mode=mode)
    ref = _generate(model, tok, ids, mask, repetition_penalty=repetition_penalty)
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, ref)
    # a second batch with other prompt lengths reuses the buffers (same rows, same rounded width)
    ids2, mask2 = encode_prompts([p for p in ["a b c d e f", "q", "12 +"] for _ in range(4)], tok, None)
    ref2 = _generate(model, tok, ids2, mask2, repetition_penalty=repetition_penalty)
    (state,) = gen._static.values()
    assert torch.equal(gen(model, ids2, mask2, greedy=True).completion_ids, ref2)
    assert list(gen._static.values()) == [state]


def test_static_loop_stops_early_when_every_row_has_finished(tokenizer):
    """With a strong EOS bias every row ends within a few tokens: the output has as many columns as generate()'s
    (the loop checks every 8 steps, but columns after the last active step are cut)."""
    model = toy.build_model(tokenizer, seed=1, hidden_size=32).eval()
    eos = torch.tensor([tokenizer.eos_token_id])
    model.lm_head.register_forward_hook(lambda m, i, out: out.index_add_(-1, eos, torch.full((*out.shape[:-1], 1), 0.3)))
    ids, mask = encode_prompts(["a", "bc", "d e f"], tokenizer, None)
    ref = _generate(model, tokenizer, ids, mask, max_new=40)
    assert 1 < ref.size(1) < 8  # the case under test: rows end at different steps, long before the limit
    out = _fast(tokenizer, max_completion_length=40, compile=True, compile_mode="eager")(model, ids, mask,
                                                                                          greedy=True)
    assert torch.equal(out.completion_ids, ref)


@pytest.mark.parametrize("mode", STATIC_MODES)
def test_static_loop_samples_the_tokens_and_logprobs_of_the_eager_loop(tokenizer, mode):
    """Same seed, same processors: the static loop draws exactly the tokens of the eager loop (with row dropping off,
    both draw from N rows at every step), so it samples the distribution the eager loop's frequency test checks;
    and the sampler's log-probs agree."""
    model = _eos_biased_model(tokenizer, seed=4)
    ids, mask = encode_prompts([p for p in ["repeat a:", "xyz 12"] for _ in range(3)], tokenizer, None)
    kw = dict(max_completion_length=16, temperature=0.8, top_k=30, top_p=0.95, group_size=3)
    torch.manual_seed(7)
    eager = _fast(tokenizer, compact_fraction=2.0, compile=False, **kw)(model, ids, mask, logprobs=True)
    torch.manual_seed(7)
    static = _fast(tokenizer, compile=True, compile_mode=mode, **kw)(model, ids, mask, logprobs=True)
    assert torch.equal(static.completion_ids, eager.completion_ids)
    torch.testing.assert_close(static.logprobs, eager.logprobs, atol=1e-5, rtol=1e-5)
    assert (eager.logprobs < 0).any()


def test_attention_kernel_is_refused_where_it_cannot_run(tokenizer):
    model = _eos_biased_model(tokenizer)
    ids, mask = encode_prompts(["a", "b"], tokenizer, None)
    gen = _fast(tokenizer, compile=True, compile_mode="eager", attention_kernel=True)
    with pytest.raises(ValueError, match="attention_kernel=True needs a CUDA device"):
        gen(model, ids, mask, greedy=True)


def test_static_loop_refuses_attention_it_cannot_mask(tokenizer):
    model = _eos_biased_model(tokenizer)
    model.config._attn_implementation = "flash_attention_2"
    ids, mask = encode_prompts(["a"], tokenizer, None)
    with pytest.raises(ValueError, match="generation_compile=False"):
        _fast(tokenizer, compile=True, compile_mode="eager")(model, ids, mask, greedy=True)


def test_static_layer_writes_at_the_shared_position():
    pos = torch.tensor([2])
    keys, values = torch.zeros(2, 1, 5, 3), torch.zeros(2, 1, 5, 3)
    layer = StaticLayer(keys, values, pos)
    k = torch.randn(2, 1, 1, 3)
    out_k, out_v = layer.update(k, -k)
    assert out_k is keys and torch.equal(keys[:, :, 2:3], k) and torch.equal(values[:, :, 2:3], -k)
    assert keys[:, :, [0, 1, 3, 4]].abs().sum() == 0  # nothing else written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compiled_cuda_graph_loop_equals_generate_and_the_eager_loop(tokenizer):
    """On CUDA the default: the decode step compiled by inductor and replayed as a CUDA graph."""
    model = _eos_biased_model(tokenizer).cuda()
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12"] for _ in range(4)], tokenizer, None)
    ids, mask = ids.cuda(), mask.cuda()
    gen = _fast(tokenizer, group_size=4)  # compile=None: static and compiled on CUDA
    assert gen._use_static(model, ids.device)
    for _ in range(2):  # the second call replays the captured graph
        assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tokenizer, ids, mask))
    assert [state.kernel for state in gen._static.values()] == [True]  # attention by the Triton decode kernel
    fused = _fast(tokenizer, group_size=4, fuse_projections=True)  # q/k/v and gate/up fused, in the CUDA graph
    for _ in range(2):
        assert torch.equal(fused(model, ids, mask, greedy=True).completion_ids, _generate(model, tokenizer, ids, mask))
    kw = dict(max_completion_length=16, temperature=0.8, top_k=30, group_size=4)  # top-k: the logits path
    torch.manual_seed(3)
    eager = _fast(tokenizer, compact_fraction=2.0, compile=False, **kw)(model, ids, mask, logprobs=True)
    torch.manual_seed(3)
    static = _fast(tokenizer, **kw)(model, ids, mask, logprobs=True)
    assert torch.equal(static.completion_ids, eager.completion_ids)
    torch.testing.assert_close(static.logprobs, eager.logprobs, atol=1e-4, rtol=1e-4)
    _check_fused_logprobs(model, tokenizer, ids, mask, _fast(tokenizer, max_completion_length=16, temperature=0.8,
                                                             group_size=4))
    # rows that are not groups (one dynamic-shape graph) of changing number and width, through the Triton kernel
    from torch._dynamo.utils import counters

    ungrouped = _fast(tokenizer, max_completion_length=10)
    ungrouped.keep_shapes = 8
    counters.clear()
    for prompts in (["a", "bb", "c c"], ["long prompt " * 10, "q"] * 3, ["x"] * 9):
        ids, mask = (x.cuda() for x in encode_prompts(prompts, tokenizer, None))
        assert torch.equal(ungrouped(model, ids, mask, greedy=True).completion_ids,
                           _generate(model, tokenizer, ids, mask, max_new=10))
    assert all(state.kernel for state in ungrouped._static.values()) and len(ungrouped._static) == 3
    assert counters["stats"]["unique_graphs"] == 1


def _check_fused_logprobs(model, tok, ids, mask, gen):
    """Temperature only: the fused step samples (its own random stream); its log-probs are the model's own."""
    out = gen(model, ids, mask, logprobs=True)
    m, _ = completion_masks(out.completion_ids, [tok.eos_token_id], gen.max_new)  # up to the first EOS (the model
    m = m.bool()  # may sample the pad token before it: the sampler attended to it, so the reference does too)
    full, full_mask = torch.cat([ids, out.completion_ids], 1), torch.cat([mask, m.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask,
                       position_ids=position_ids_from_mask(full_mask)).logits.float()
    ref = torch.log_softmax(logits / gen.temperature, -1)[:, ids.size(1) - 1:-1]
    ref = ref.gather(-1, out.completion_ids[..., None])[..., 0]
    assert m.sum() > 20
    torch.testing.assert_close(out.logprobs[m], ref[m], atol=1e-4, rtol=1e-4)


def test_fused_step_logprobs_are_the_models(tokenizer):
    model = _eos_biased_model(tokenizer)
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12"] for _ in range(4)], tokenizer, None)
    gen = _fast(tokenizer, max_completion_length=16, temperature=0.8, group_size=4, compile=True,
                compile_mode="eager")
    _check_fused_logprobs(model, tokenizer, ids, mask, gen)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("chunk", [512, 5])
def test_fused_pick_samples_the_tempered_softmax(device, chunk):
    """The two-level exponential race against its formula: 20 000 draws from one row of logits over 12 tokens, two
    of them impossible (−inf); chunk 5 makes 3 chunks, the last padded with 3 entries (one chunk: 512). Every
    frequency within 4.5 standard errors, sqrt(p(1−p)/n), of softmax(logits / T) (a false alarm has probability
    < 1e-4 over the vocabulary), the impossible tokens never drawn. Greedy is argmax; the log-probs are
    log softmax(logits / T) at the picks."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(12, generator=g) * 2
    row[[4, 11]] = float("-inf")
    n, T = 20000, 0.7
    logits = row.expand(n, 12).contiguous().to(device)
    torch.manual_seed(1)
    pick = torch.compile(fused_pick) if device == "cuda" else fused_pick
    nxt, logp = pick(logits, T, False, chunk)
    p = torch.softmax(row.double() / T, -1)
    freq = torch.bincount(nxt.cpu(), minlength=12).double() / n
    assert freq[4] == 0 and freq[11] == 0
    assert ((freq - p).abs() <= 4.5 * torch.sqrt(p * (1 - p) / n)).all(), (freq - p).abs().max()
    expected = torch.log_softmax(row / T, -1)
    torch.testing.assert_close(logp.cpu(), expected[nxt.cpu()])
    top, top_logp = fused_pick(logits[:2], T, True, chunk)
    assert top.tolist() == [int(row.argmax())] * 2
    torch.testing.assert_close(top_logp.cpu(), expected[[int(row.argmax())] * 2])


def test_fused_pick_races_chunks_by_their_mass(monkeypatch):
    """The race's first level weighs chunk c by its mass s_c = Σ_{v∈c} e^(x_v − m), not by its largest entry: with
    every draw E = 1 (−log E = 0) the winner is the chunk of largest mass, found here by a plain loop. Logits over 7
    entries, chunk 3, m = 2: masses 3·e^(−0.1) = 2.715, e^0 + 2·e^(−7) = 1.002, e^(−2) (+ 2 pads) = 0.135; chunk 0
    wins, then its first largest entry, token 0, although token 3 has the largest logit."""
    logits = torch.tensor([[1.9, 1.9, 1.9, 2.0, -5.0, -5.0, 0.0]])
    masses = [sum(torch.exp(logits[0, i:i + 3] - 2.0).tolist()) for i in range(0, 7, 3)]
    assert max(range(3), key=masses.__getitem__) == 0 and abs(masses[0] - 2.715) < 1e-3
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.fill_(1.0))
    nxt, logp = fused_pick(logits, 1.0, False, 3)
    assert nxt.tolist() == [0]
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[:, 0])


def _one_prompt_sampled(model, tok, device, n, T, new, seed):
    """n rows of one prompt through the static loop (compiled on CUDA, the eager backend on CPU): the prompt ids
    and the (n, new) completions, on the CPU."""
    ids, mask = (x.to(device) for x in encode_prompts(["repeat a:"] * n, tok, None))
    gen = _fast(tok, max_completion_length=new, temperature=T, group_size=n, compile=True,
                compile_mode="eager" if device == "cpu" else None)
    torch.manual_seed(seed)
    out = gen(model, ids, mask).completion_ids.cpu()
    assert out.shape == (n, new)
    return ids, out


def _assert_drawn_from(draws, p, what):
    """Every token's frequency among `draws` within 4.5 standard errors of its probability in p."""
    freq = torch.bincount(draws, minlength=p.numel()).double() / len(draws)
    assert ((freq - p).abs() <= 4.5 * torch.sqrt(p * (1 - p) / len(draws)) + 1e-12).all(), what


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
def test_static_loop_samples_the_later_tokens_from_the_model(tokenizer, device):
    """End to end through the fused step: 4000 rows share one prompt; for every prefix (the first token, the first
    two) drawn by ≥ 400 rows, the next tokens' frequencies are within 4.5 standard errors of softmax(logits / T) of
    the model after prompt + that prefix (on CUDA, through the compiled step and its CUDA graph)."""
    model = toy.build_model(tokenizer, seed=5, hidden_size=32).eval().to(device)
    with torch.no_grad():
        model.lm_head.weight *= 12  # a peaked distribution, so that some prefixes are drawn often
    n, T, new = 4000, 0.9, 3
    ids, out = _one_prompt_sampled(model, tokenizer, device, n, T, new, seed=2)
    checked = 0
    for k in range(1, new):
        for prefix, count in zip(*torch.unique(out[:, :k], dim=0, return_counts=True)):
            if count < 400 or (prefix == tokenizer.eos_token_id).any():
                continue
            rows = (out[:, :k] == prefix).all(1)
            with torch.no_grad():
                logits = model(input_ids=torch.cat([ids[:1].cpu(), prefix[None]], 1).to(device)).logits[0, -1]
            _assert_drawn_from(out[rows, k], torch.softmax(logits.double().cpu() / T, -1), (k, prefix))
            checked += 1
    assert checked >= 2  # a first token and a pair of first tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
def test_every_replay_of_the_step_draws_fresh_random_numbers(tokenizer, device):
    """The logits are pinned to one vector whatever the input, so every column is an independent draw from
    softmax(fixed / T). 6 new tokens: the fused step runs 5 times; on CUDA, CUDA-graph trees run it eagerly once,
    record it on the second call, then replay it, so columns 3-5 come from the 2nd to 4th replays. Random numbers
    frozen between replays would make column k equal column k − 1 in every row; independent draws agree with
    probability Σ p² (here ≈ 0.1)."""
    model = toy.build_model(tokenizer, seed=5, hidden_size=32).eval().to(device)
    g = torch.Generator().manual_seed(0)
    fixed = (torch.randn(len(tokenizer), generator=g) * 1.5).to(device)
    fixed[tokenizer.eos_token_id] = float("-inf")  # every row runs to the limit
    model.lm_head.register_forward_hook(lambda module, inputs, out: fixed.to(out.dtype).expand_as(out).clone())
    n, T, new = 4000, 0.8, 6
    _, out = _one_prompt_sampled(model, tokenizer, device, n, T, new, seed=3)
    p = torch.softmax(fixed.double().cpu() / T, -1)
    same = float((p * p).sum())
    for k in range(new):
        _assert_drawn_from(out[:, k], p, k)
        if k:
            agree = float((out[:, k] == out[:, k - 1]).double().mean())
            assert abs(agree - same) <= 4.5 * (same * (1 - same) / n) ** 0.5, (k, agree, same)


@pytest.mark.parametrize("boolean", [True, False])
def test_grouped_decode_attention_equals_sdpa_with_repeated_kv(boolean):
    """Against transformers' own sdpa path (which repeats each KV head for its query heads): 6 query heads over 2
    KV heads, one query token, a mask hiding some slots (boolean, or additive with the dtype's minimum)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    N, Hq, Hkv, L, D = 3, 6, 2, 9, 8
    q, k, v = (torch.randn(N, H, S, D, generator=g) for H, S in ((Hq, 1), (Hkv, L), (Hkv, L)))
    keep = torch.rand(N, 1, 1, L, generator=g) > 0.3
    keep[..., 0] = True
    mask = keep if boolean else torch.where(keep, 0.0, torch.finfo(torch.float32).min)

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = Hq // Hkv, False

    ours, _ = grouped_decode_attention(Module(), q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.3)
    assert ours.shape == (N, 1, Hq, D)
    torch.testing.assert_close(ours, ref)


def test_ungrouped_batches_of_changing_shapes_share_one_dynamic_graph(tokenizer):
    """The later turns of a tool loop: rows are their own groups and their number and widths change every call. Their
    step compiles once with dynamic shapes (one graph for four shapes), and greedy still equals generate()."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = toy.build_model(tokenizer, seed=1, hidden_size=32).eval()
    gen = _fast(tokenizer, max_completion_length=10, compile=True,
                compile_mode={"backend": "eager", "dynamic": False})  # dynamic: the ungrouped rule's job
    gen.keep_shapes = 8
    for prompts in (["a", "bb", "c c"], ["x"] * 5, ["long prompt " * 10, "q"], ["z y", "w"] * 3):
        ids, mask = encode_prompts(prompts, tokenizer, None)
        assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids,
                           _generate(model, tokenizer, ids, mask, max_new=10))
    assert counters["stats"]["unique_graphs"] == 1 and len(gen._static) == 4


@pytest.mark.parametrize("compile", [False, True])
def test_the_cache_goes_by_the_keyword_the_model_takes(compile):
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40): the
    fast sampler, eager and static loops alike, passes its cache by the name the model's forward takes, so a user
    sees no FutureWarning and a later transformers does not drop the cache."""
    import warnings

    import peft
    from packaging.version import Version

    from groupwise.modeling import cache_keyword

    tok = toy.build_tokenizer()
    model = _eos_biased_model(tok, seed=0)
    renamed = Version(transformers.__version__).release >= (5, 24)  # a 5.24 dev build too
    assert cache_keyword(model) == ("cache" if renamed else "past_key_values")
    wrapped = peft.get_peft_model(_eos_biased_model(tok, seed=0), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_keyword(wrapped) == cache_keyword(model)  # a PeftModel forwards to the base model's forward
    assert cache_keyword(torch.compile(model)) == cache_keyword(model)  # and so does a compiled model

    class Old(torch.nn.Module):  # a model written against transformers before 5.24 (remote code, say)
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None, **kwargs): ...

    assert cache_keyword(Old()) == "past_key_values"
    ids, mask = encode_prompts(["repeat a:", "b"], tok, None)
    ref = _generate(model, tok, ids, mask)
    for policy in (model, wrapped):  # LoRA B = 0: the wrapped model samples what the model does
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
            out = _fast(tok, compile=compile, compile_mode="eager")(policy, ids, mask, greedy=True).completion_ids
        assert torch.equal(out, ref[:, :out.size(1)])


@pytest.mark.parametrize("compile,repetition_penalty", [(False, 1.0), (True, 1.3), (True, 1.0)],
                         ids=["eager", "static", "static-fused"])
def test_a_call_s_max_new_tokens_equals_generate_with_that_limit(compile, repetition_penalty):
    """A later tool turn asks for fewer tokens than max_completion_length (what is left of it, or of the positions):
    every decode loop (eager, static, static with the pick fused into the step) stops there, token for token as
    generate(max_new_tokens=5), and the buffers of the full length are reused, not rebuilt."""
    tok = toy.build_tokenizer()
    model = _eos_biased_model(tok, boost=0.05)
    ids, mask = encode_prompts(["repeat a:", "b", "xyz 12"], tok, None)
    gen = _fast(tok, repetition_penalty=repetition_penalty, compile=compile, compile_mode="eager")
    full = gen(model, ids, mask, greedy=True).completion_ids
    assert full.size(1) > 5  # the limit cuts
    out = gen(model, ids, mask, greedy=True, max_new_tokens=5).completion_ids
    assert torch.equal(out, _generate(model, tok, ids, mask, max_new=5, repetition_penalty=repetition_penalty))
    assert torch.equal(out, full[:, :5]) and len(gen._static) == (1 if compile else 0)

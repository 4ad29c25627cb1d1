"""The fast sampler on model families other than Llama: hybrid models whose cache holds recurrent / convolution states
(Qwen3.5, Falcon-H1), models whose attention does not go through transformers' AttentionInterface (Falcon), and the
families the static decode loop cannot serve, which it refuses in one line naming the fix."""

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from groupwise.generation.fast import FastGenerator
from groupwise.modeling import completion_logps
from groupwise.tasks import toy
from groupwise.text import completion_masks, encode_prompts


def _config(name, tok):
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **ids)
    linear = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    return {
        "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**small, num_key_value_heads=2, head_dim=8, **linear,
                                                          layer_types=["linear_attention", "full_attention"]),
        "falcon_h1": lambda: transformers.FalconH1Config(**small, num_key_value_heads=2, head_dim=8, mamba_d_ssm=16,
                                                         mamba_n_heads=2, mamba_d_head=8, mamba_d_state=4,
                                                         mamba_n_groups=1, mamba_chunk_size=4),
        "recurrent_gemma": lambda: transformers.RecurrentGemmaConfig(**{**small, "num_hidden_layers": 3},
                                                                     num_key_value_heads=2, lru_width=32,
                                                                     attention_window_size=4),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(  # MLA: value heads (8) smaller than query / key (24)
            **small, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            first_k_dense_replace=1, n_group=1, topk_group=1),
        "falcon": lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **ids),
        "falcon_alibi": lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                          alibi=True, **ids),
        "mistral_window": lambda: transformers.MistralConfig(**small, num_key_value_heads=2, sliding_window=4),
        "gpt_neo": lambda: transformers.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                                     attention_types=[[["global", "local"], 1]], **ids),
    }[name]()


def _model(name, tok, seed=0, eos_bias=0.0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(name, tok)).eval()
    if eos_bias:  # rows end at different steps
        eos = torch.tensor([tok.eos_token_id])
        model.lm_head.register_forward_hook(
            lambda module, inputs, out: out.index_add_(-1, eos, torch.full((*out.shape[:-1], 1), eos_bias)))
    return model


def _fast(tok, **kw):
    base = dict(max_completion_length=16, temperature=0.8, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], group_size=2)
    return FastGenerator(**{**base, **kw})


def _generate(model, tok, ids, mask, max_new=16):
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.size(1):]


@pytest.mark.parametrize("name,seed,eos_bias", [("qwen3_5", 0, 0.1), ("falcon_h1", 1, 0.15)])
def test_hybrid_models_share_the_prompt_and_drop_rows_as_generate(name, seed, eos_bias):
    """Qwen3.5 (linear-attention layers: convolution and recurrent states) and Falcon-H1 (a layer holding both Mamba
    states and attention keys/values): the prompt's states are shared by its group and finished rows leave the batch
    (both went through batch_repeat_interleave / batch_select_indices, which linear-attention layers lack: an
    AttributeError before the fix). Greedy equals generate() with rows ending at different steps, and the sampled
    log-probs equal the trainer's forward over the same tokens."""
    tok = toy.build_tokenizer()
    model = _model(name, tok, seed, eos_bias)
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12 long", "q 7"] for _ in range(2)], tok, None)
    ref = _generate(model, tok, ids, mask)
    lengths = completion_masks(ref, [tok.eos_token_id], 16)[0].sum(1)
    assert len(set(lengths.tolist())) > 2  # the case under test: rows leave the batch at different steps
    gen = _fast(tok)
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, ref)
    torch.manual_seed(0)
    out = gen(model, ids, mask, logprobs=True)
    T = out.completion_ids.size(1)
    cmask, _ = completion_masks(out.completion_ids, [tok.eos_token_id], T)
    seq = torch.cat([ids, torch.where(cmask.bool(), out.completion_ids, tok.pad_token_id)], 1)
    expected, _ = completion_logps(model, seq, torch.cat([mask, cmask], 1), T, temperature=0.8)
    real = cmask.bool()
    torch.testing.assert_close(out.logprobs[real], expected[real], atol=1e-4, rtol=1e-4)


def test_a_model_keeping_its_recurrent_state_outside_the_cache_is_refused():
    """RecurrentGemma keeps its recurrent and convolution states in its modules, not in the cache: sharing a prompt's
    state or dropping rows cannot reach them (completions differed from generate() in every row)."""
    tok = toy.build_tokenizer()
    model = _model("recurrent_gemma", tok)
    ids, mask = encode_prompts(["ab", "ab"], tok, None)
    with pytest.raises(ValueError, match="RecurrentGemmaForCausalLM keeps its recurrent state outside the cache.*"
                                         "use generation_backend='transformers'"):
        _fast(tok)(model, ids, mask, greedy=True)


def test_a_model_that_ignores_the_cache_is_refused():
    """openai-gpt takes no cache (its forward swallows the keyword): each decode step saw its one new token alone,
    a RuntimeError about tensor sizes deep in the decode loop (or, where the shapes allowed, wrong tokens)."""
    tok = toy.build_tokenizer()
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(transformers.OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4,
                                                                          n_positions=64, **ids)).eval()
    ids_, mask = encode_prompts(["ab", "ab"], tok, None)
    with pytest.raises(ValueError, match="OpenAIGPTLMHeadModel keeps no KV cache .*use generation_backend="
                                         "'transformers'"):
        _fast(tok)(model, ids_, mask, greedy=True)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_loop_on_a_model_that_branches_on_its_attention_name(attn):
    """Falcon picks sdpa itself (`_attn_implementation == "sdpa"`) instead of calling AttentionInterface: under the
    static loop's grouped-attention name it took its eager branch and added the boolean mask to its scores
    (3 of 9 greedy rows differed from generate())."""
    tok = toy.build_tokenizer()
    model = _model("falcon", tok)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model.config._attn_implementation = attn
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12 long prompt here"] for _ in range(3)], tok,
                               None)
    gen = _fast(tok, max_completion_length=12, group_size=3, compile=True, compile_mode="eager")
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tok, ids, mask, 12))


def test_static_loop_on_a_model_whose_value_heads_are_smaller_than_its_key_heads(monkeypatch):
    """MLA (DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM3, Kimi): grouped_decode_attention shaped its output with the
    query's head size (24), not the value's (8): "shape '[6, 4, 1, 24]' is invalid", the first generation on CUDA
    (where the static loop is the default) crashed. Greedy equals generate() with the grouped attention in use."""
    from groupwise.generation import static

    tok = toy.build_tokenizer()
    model = _model("deepseek_v3", tok)
    model.config._attn_implementation = "sdpa"
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12 long prompt here"] for _ in range(2)], tok,
                               None)
    calls = []
    grouped = static.grouped_decode_attention

    def counted(*a, **kw):
        calls.append(1)
        return grouped(*a, **kw)

    monkeypatch.setattr(static, "grouped_decode_attention", counted)  # what the loop registers when it starts
    gen = _fast(tok, max_completion_length=12, compile=True, compile_mode="eager")
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _generate(model, tok, ids, mask, 12))
    monkeypatch.undo()
    static._register_grouped_attention()
    assert calls  # the grouped attention decoded (it is what had the wrong shape)


@pytest.mark.parametrize("name,why", [
    ("gpt_neo", "local \\(windowed\\) attention layers"),  # completions were silently wrong
    ("falcon_alibi", "ALiBi position biases"),  # "too many values to unpack"
    ("qwen3_5", "cache layers other than full attention \\(LinearAttentionLayer"),  # AttributeError: 'keys'
])
def test_static_loop_refuses_what_it_cannot_decode_in_one_line(name, why):
    tok = toy.build_tokenizer()
    model = _model(name, tok)
    ids, mask = encode_prompts(["repeat a:", "xyz 12 long prompt"], tok, None)
    with pytest.raises(ValueError, match=f"^generation_compile: {type(model).__name__} (has|uses) {why}.*: set "
                                         "generation_compile=False for this model$"):
        _fast(tok, compile=True, compile_mode="eager", group_size=1)(model, ids, mask, greedy=True)
    # the eager loop serves them (equal to generate())
    assert torch.equal(_fast(tok, group_size=1)(model, ids, mask, greedy=True).completion_ids,
                       _generate(model, tok, ids, mask))


@pytest.mark.parametrize("name", ["gpt_neo", "falcon_alibi", "qwen3_5", "mistral_window"])
def test_by_default_on_cuda_the_models_the_static_loop_cannot_serve_decode_with_the_eager_loop(name):
    """generation_compile unset means "the static loop on CUDA where it serves the model": the models it refuses
    are sampled by the eager loop, named once in a warning (they used to fail at the first generation, after the
    model had loaded). generation_compile=True keeps the error. The decision reads the config and an empty cache,
    so it is checked here without a GPU."""
    import warnings

    tok = toy.build_tokenizer()
    model, cuda = _model(name, tok), torch.device("cuda")
    auto = _fast(tok, group_size=1)
    with pytest.warns(UserWarning, match=rf"^generation_compile: {type(model).__name__} .*; generation_compile is "
                                         "unset, so the eager decode loop samples"):
        assert auto._use_static(model, cuda) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert auto._use_static(model, cuda) is False  # once per model
    with pytest.raises(ValueError, match="set generation_compile=False for this model$"):
        _fast(tok, compile=True, group_size=1)._use_static(model, cuda)
    llama = toy.build_model(tok, seed=0, hidden_size=32)
    assert auto._use_static(llama, cuda) is True and auto._use_static(llama, torch.device("cpu")) is False

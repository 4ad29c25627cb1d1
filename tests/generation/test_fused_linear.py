"""Fused q/k/v and gate/up projections in the static decode loop: greedy output still equals generate() (Llama
without biases, Qwen2 with q/k/v biases), the model's own layers are back after the loop, and a projection called
on another input than the fused product's computes itself."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

from groupwise.generation.fast import FastGenerator
from groupwise.generation.fused_linear import FusedProjections, _Part, _Slot
from groupwise.text import encode_prompts
from groupwise.tasks import toy


def _qwen2(tok):
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # biases large enough to matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _fused_gen(tok, **kw):
    return FastGenerator(max_completion_length=12, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                         repetition_penalty=1.0, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                         compile=True, fuse_projections=True, **{"compile_mode": "eager", **kw})


def _greedy_ref(model, tok, ids, mask):
    cfg = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.size(1):]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["eager", {"backend": "aot_eager", "fullgraph": True}])
def test_fused_projections_decode_as_generate(arch, mode):
    tok = toy.build_tokenizer()
    model = toy.build_model(tok, seed=1, hidden_size=32).eval() if arch == "llama" else _qwen2(tok)
    layer = model.model.layers[0]
    originals = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.up_proj)
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12"] for _ in range(4)], tok, None)
    gen = _fused_gen(tok, group_size=4, compile_mode=mode)
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _greedy_ref(model, tok, ids, mask))
    assert (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.up_proj) == originals  # restored
    assert len(gen._projections[1]) == 4  # 2 layers × (q/k/v, gate/up)
    # new weights reach the fused copies at the next call
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, _greedy_ref(model, tok, ids, mask))


def test_the_fused_weights_are_the_concatenated_weights():
    """q (32×32), k and v (16×32 each): rows 0–31 of the fused weight are W_q, 32–47 W_k, 48–63 W_v; the Qwen2
    biases likewise; gate/up (64×32 each) stack to 128 rows with no bias."""
    tok = toy.build_tokenizer()
    model = _qwen2(tok)
    proj = FusedProjections(model)
    with proj.active():
        a = model.model.layers[1].self_attn
        qkv = next(g for g in proj.groups if g.owner is a)
        gu = next(g for g in proj.groups if g.owner is model.model.layers[1].mlp)
        w = qkv.originals
        assert torch.equal(qkv.weight, torch.cat([w[0].weight, w[1].weight, w[2].weight]))
        assert torch.equal(qkv.bias, torch.cat([w[0].bias, w[1].bias, w[2].bias]))
        assert qkv.weight.shape == (64, 32) and gu.weight.shape == (128, 32) and gu.bias is None


def test_a_part_called_on_another_input_computes_itself():
    slot, linear = _Slot(), torch.nn.Linear(4, 3)
    part = _Part(1, True, slot, linear)
    x, other = torch.randn(2, 4), torch.randn(2, 4)
    slot.x, slot.parts = x, (torch.zeros(2, 5), torch.ones(2, 3))
    assert torch.equal(part(other), linear(other))  # not the fused product's input: its own layer
    assert torch.equal(part(x), torch.ones(2, 3)) and slot.x is None  # the last part empties the slot


def test_fuse_projections_refuses_a_model_with_nothing_to_fuse():
    tok = toy.build_tokenizer()
    model = toy.build_model(tok, seed=1, hidden_size=32).eval()
    for layer in model.model.layers:  # stand-ins for PEFT / sharded layers: not plain nn.Linear
        layer.self_attn.q_proj = torch.nn.Sequential(layer.self_attn.q_proj)
        layer.mlp.gate_proj = torch.nn.Sequential(layer.mlp.gate_proj)
    ids, mask = encode_prompts(["a", "b"], tok, None)
    gen = FastGenerator(max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                        repetition_penalty=1.0, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                        compile=True, compile_mode="eager", fuse_projections=True)
    with pytest.raises(ValueError, match="fuse_projections: LlamaForCausalLM has no plain nn.Linear"):
        gen(model, ids, mask)


def test_fuse_projections_without_the_static_loop_is_refused():
    tok = toy.build_tokenizer()
    model = toy.build_model(tok, seed=1, hidden_size=32).eval()
    ids, mask = encode_prompts(["a", "b"], tok, None)
    gen = FastGenerator(max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                        repetition_penalty=1.0, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                        fuse_projections=True)  # compile=None: the static loop on CUDA only
    with pytest.raises(ValueError, match="fuse_projections needs the static decode loop.*device cpu"):
        gen(model, ids, mask)


def test_a_projection_replaced_between_calls_is_used_and_kept():
    """A projection swapped on the same model object after a call (as injecting an adapter does): the next call
    decodes with it (fused projections built anew), and the loop leaves it in place."""
    tok = toy.build_tokenizer()
    model = toy.build_model(tok, seed=1, hidden_size=32).eval()
    ids, mask = encode_prompts([p for p in ["repeat a:", "b", "xyz 12"] for _ in range(4)], tok, None)
    gen = _fused_gen(tok, group_size=4)
    gen(model, ids, mask, greedy=True)
    attn = model.model.layers[0].self_attn
    new = torch.nn.Linear(32, 32, bias=False)
    torch.nn.init.normal_(new.weight, std=0.5)
    attn.q_proj = new
    ref = _greedy_ref(model, tok, ids, mask)
    assert torch.equal(gen(model, ids, mask, greedy=True).completion_ids, ref)
    assert attn.q_proj is new
    stale = FusedProjections(model)
    attn.q_proj = torch.nn.Linear(32, 32, bias=False)
    with pytest.raises(RuntimeError, match="replaced or moved"):
        with stale.active():
            pass


def test_the_model_s_layers_are_back_when_a_refresh_raises(monkeypatch):
    tok = toy.build_tokenizer()
    model = toy.build_model(tok, seed=1, hidden_size=32).eval()
    proj = FusedProjections(model)
    originals = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    last, refresh = proj.groups[-1], type(proj.groups[-1]).refresh

    def failing(self):
        if self is last:
            raise KeyboardInterrupt
        refresh(self)

    monkeypatch.setattr(type(last), "refresh", failing)
    with pytest.raises(KeyboardInterrupt):
        with proj.active():
            pass
    assert [m for m in model.modules() if isinstance(m, torch.nn.Linear)] == originals
    # and when the block raises
    monkeypatch.setattr(type(last), "refresh", refresh)
    with pytest.raises(ValueError):
        with proj.active():
            raise ValueError
    assert [m for m in model.modules() if isinstance(m, torch.nn.Linear)] == originals

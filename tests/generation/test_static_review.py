"""Review of the static decode loop's CUDA path, by what a CPU can check of it."""

import pytest
import torch

from groupwise.generation.fast import FastGenerator
from groupwise.tasks import toy
from groupwise.text import encode_prompts


def test_more_shapes_than_dynamo_s_recompile_limit_all_decode_compiled(tokenizer):
    """Every prompt width (rounded to 64) is a new (N, L) shape of the fixed-shape step. Dynamo stops compiling a
    code object after recompile_limit (8) graphs and runs it uncompiled from then on (on CUDA: no CUDA graph, a
    silent slowdown); each shape's step has its code of its own, so the shapes past the limit compile too, and a shape
    seen before (its state dropped since, keep_shapes = 2) reuses its graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = toy.build_model(tokenizer, seed=1, hidden_size=32).eval()
    gen = FastGenerator(max_completion_length=2, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                        repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
                        eos_token_ids=[tokenizer.eos_token_id], group_size=2, compile=True,
                        compile_mode={"backend": "eager", "dynamic": False})
    limit = 2  # (8 by default: the same, slower)
    with torch._dynamo.config.patch(recompile_limit=limit):
        for w in range(1, limit + 3):
            ids, mask = encode_prompts(["a " * (64 * w - 40)] * 2, tokenizer, None)
            gen(model, ids, mask)
            assert counters["stats"]["unique_graphs"] == w, w
        ids, mask = encode_prompts(["a " * 24] * 2, tokenizer, None)  # the first shape again
        gen(model, ids, mask)
        assert counters["stats"]["unique_graphs"] == limit + 2


def test_a_recurrent_block_whose_cache_layer_stays_empty_is_state_kept_outside_the_cache():
    """transformers 5.17 (the GPU environment's) gives RecurrentGemma's recurrent blocks sliding-window cache layers
    (not linear-attention ones), which its prefill never writes: that must still read as state kept in the modules
    (refused), where the written attention layer and a config without block types do not."""
    from types import SimpleNamespace

    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from groupwise.generation.fast import _state_outside_cache

    def model(kinds):
        text = SimpleNamespace(layers_block_type=kinds)
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder=True: text))

    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4) for _ in range(3)]
    kv = torch.zeros(1, 1, 2, 4)
    cache.layers[2].update(kv, kv)  # the attention block, written by the prefill
    assert _state_outside_cache(model(["recurrent", "recurrent", "attention"]), cache)
    assert not _state_outside_cache(model(None), cache)
    for layer in cache.layers[:2]:
        layer.update(kv, kv)
    assert not _state_outside_cache(model(["recurrent", "recurrent", "attention"]), cache)


@pytest.mark.parametrize("top_k", [0, 5])  # 0: the fused step (sampling in the graph); 5: the logits step
def test_floats_are_constants_of_the_dynamic_shape_graph(tokenizer, top_k):
    """Rows that are not groups of one prompt decode through one dynamic-shape graph. There dynamo makes float
    arguments and attributes (the temperature, the model's norm eps and attention scale) 0-d CPU tensor inputs of the
    graph, which a CUDA graph cannot take as it takes the static device buffers; they are constants of the graph
    instead. The sampled tokens are those of the uncompiled loop (same seed)."""
    inputs = []

    def record(gm, example_inputs):
        inputs.append([x for x in example_inputs if isinstance(x, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    model = toy.build_model(tokenizer, seed=1, hidden_size=32).eval()
    ids, mask = encode_prompts(["ab", "a b c", "b"], tokenizer, None)  # three prompts: not groups of one

    def run(compile_mode):
        gen = FastGenerator(max_completion_length=4, temperature=0.7, top_p=1.0, top_k=top_k, min_p=None,
                            repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
                            eos_token_ids=[tokenizer.eos_token_id], group_size=3, compile=True,
                            compile_mode=compile_mode)
        torch.manual_seed(0)
        return gen(model, ids, mask).completion_ids

    ours = run({"backend": record, "dynamic": True})
    assert inputs, "the step was not compiled"
    for graph in inputs:
        assert not [x for x in graph if x.dim() == 0 and x.is_floating_point()], "a float became a graph input"
    assert torch.equal(ours, run("eager"))

"""The chunked log-prob head (PolicyForLogps) equals the model's own forward for models whose forward changes
lm_head's output (a scale, a softcap, read from the text config), and falls back to the full logits, with a warning,
for a model that does something groupwise does not reproduce. Before, Granite's logits / logits_scaling was dropped:
π_θ, π_old and π_ref came from another distribution than the one generation sampled from (ratio 1, wrong
gradient)."""

import warnings

import pytest
import torch

from groupwise.modeling import PolicyForLogps, batched_logps, logit_transform


def _own_logps(model, ids, mask, T):
    """log softmax of the model's own logits at the completion's tokens, and the entropies."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -T - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, ids[:, -T:, None])[..., 0], -(logp.exp() * logp).sum(-1)


def _check(model, vocab):
    """PolicyForLogps' log-probs and entropies = the model's own, through the chunked head."""
    torch.manual_seed(1)
    ids = torch.randint(1, vocab, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: the transform is reproduced
        wrapped = PolicyForLogps(model)
    assert wrapped.chunked
    with torch.no_grad():
        lp, ent = wrapped(ids[:1], mask[:1], 4, compute_entropy=True)
    own_lp, own_ent = _own_logps(model, ids[:1], mask[:1], 4)
    torch.testing.assert_close(lp, own_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, own_ent, rtol=1e-5, atol=1e-5)
    return wrapped


def _sharpen(model, factor):
    """A random tiny model's logits are near 0, where a scale or a softcap barely shows: scale the head up."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model


def test_granite_divides_by_logits_scaling():
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, logits_scaling=8.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = _sharpen(GraniteForCausalLM(cfg).eval(), 20.0)
    assert logit_transform(model) == (0.125, None)  # logits / 8 = logits · 0.125
    _check(model, 64)


def test_cohere_multiplies_by_logit_scale():
    from transformers import CohereConfig, CohereForCausalLM

    cfg = CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, logit_scale=0.25, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = _sharpen(CohereForCausalLM(cfg).eval(), 20.0)
    assert logit_transform(model) == (0.25, None)
    _check(model, 64)


def test_gemma2_softcap():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0)
    torch.manual_seed(0)
    model = _sharpen(Gemma2ForCausalLM(cfg).eval(), 50.0)  # logits of tens: the cap at 2 bites
    assert logit_transform(model) == (1.0, 2.0)
    _check(model, 64)


def test_gemma4_reads_the_softcap_of_its_text_config():
    """AutoModelForCausalLM builds Gemma 4's conditional-generation model, whose config keeps the softcap in
    text_config: it was read from the top level (None), and the cap was dropped."""
    from transformers import AutoModelForCausalLM, Gemma4Config

    cfg = Gemma4Config(text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                                        final_logit_softcapping=2.0, hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=128,
                                        layer_types=["sliding_attention", "full_attention"]),
                       vision_config=None, audio_config=None)
    torch.manual_seed(0)
    model = _sharpen(AutoModelForCausalLM.from_config(cfg).eval(), 200.0)
    assert getattr(model.config, "final_logit_softcapping", None) is None  # where it used to be read
    assert logit_transform(model) == (1.0, 2.0)
    _check(model, 128)



def test_an_unreproduced_transform_falls_back_to_the_full_logits(tiny_model):
    original = type(tiny_model).forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 3.0 + 1.0  # e.g. a μP multiplier under a config name groupwise does not read
        return out

    model = type("ScaledLlama", (type(tiny_model),), {"forward": forward})(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    model = _sharpen(model.eval(), 20.0)
    with pytest.warns(RuntimeWarning, match=r"ScaledLlama: its forward changes lm_head's output .* full logits"):
        wrapped = PolicyForLogps(model)
    assert not wrapped.chunked
    ids = torch.randint(1, model.config.vocab_size, (2, 10))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        lp, _ = wrapped(ids, mask, 4)
    torch.testing.assert_close(lp, _own_logps(model, ids, mask, 4)[0], rtol=1e-5, atol=1e-5)
    # checked once per model: batched_logps (π_old, π_ref) wraps it again without a second forward or warning
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched_logps(model, ids, mask, 4, temperature=1.0, batch_size=2)
    assert len(calls) == 1  # the log-probs' own forward only


def test_the_check_moves_no_random_stream(tiny_model):
    tiny_model.train()  # dropout-free Llama, but the check runs in eval mode and forks the RNG anyway
    before = torch.get_rng_state()
    PolicyForLogps(tiny_model)
    assert torch.equal(before, torch.get_rng_state()) and tiny_model.training


def test_a_granite_run_sampled_in_its_own_precision_has_importance_ratio_1(tmp_path, tokenizer):
    """The trainer end to end: a float32 sampler copy (generation_dtype) of a Granite policy samples with the model's
    own logits / logits_scaling; the training log-probs now agree, so every importance ratio is 1 (it was 0.62 on
    average, min 0.04, with logits_scaling 8)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from groupwise import GRPOTrainer
    from groupwise.tasks import toy
    from tests.conftest import small_args

    cfg = GraniteConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0, tie_word_embeddings=False,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = _sharpen(GraniteForCausalLM(cfg), 8.0)
    trainer = GRPOTrainer(model, [toy.letter_reward], args=small_args(tmp_path, generation_dtype="float32"),
                          train_dataset=toy.dataset(12), processing_class=tokenizer)
    metrics = trainer._collect().metrics
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-5

"""Adding a generation backend is a class plus one registry entry; the trainer builds it from the config and
hands it the new weights after every optimizer step that changed them."""

import torch

from groupwise import GRPOTrainer
from groupwise.generation import BACKENDS, Backend
from groupwise.generation.fast import FastGenerator
from groupwise.tasks import toy
from tests.conftest import small_args


class RecordingGenerator(FastGenerator):
    """The fast sampler, plus a record of the weights it was handed."""

    built_from = None
    updates: list = []

    @classmethod
    def from_config(cls, args, **kw):
        gen = super().from_config(args, **kw)
        RecordingGenerator.built_from, RecordingGenerator.updates = args, []
        return gen

    def update_weights(self, model):
        RecordingGenerator.updates.append({n: p.detach().clone() for n, p in model.named_parameters()})


def test_a_registered_backend_is_built_from_the_config_and_receives_weights(tmp_path, tokenizer, tiny_model,
                                                                            monkeypatch):
    monkeypatch.setitem(BACKENDS, "recording", Backend(f"{__name__}:RecordingGenerator", generation_kwargs=False,
                                                       summary="test backend"))
    args = small_args(tmp_path, generation_backend="recording", max_steps=2)  # the config validates against BACKENDS
    t = GRPOTrainer(tiny_model, [lambda completions, **_: [float(len(c)) for c in completions]], args=args,
                    train_dataset=toy.dataset(8), processing_class=tokenizer)
    assert isinstance(t.rollout_ctx.generator, RecordingGenerator) and RecordingGenerator.built_from is args
    t.train()
    assert len(RecordingGenerator.updates) == 2  # one per optimizer step
    final = dict(t.unwrapped.named_parameters())
    assert all(torch.equal(v, final[n]) for n, v in RecordingGenerator.updates[-1].items())
    assert any(not torch.equal(v, RecordingGenerator.updates[1][n]) for n, v in RecordingGenerator.updates[0].items())


def test_a_model_generation_config_processor_the_backend_skips_is_named(tmp_path, tokenizer):
    """generate() merges the model's generation_config into the one it is given, so TRL's transformers path applies
    e.g. no_repeat_ngram_size from the model; the fast sampler does not, and says so (it used to skip it silently).
    Checked on greedy output: with no_repeat_ngram_size=1 generate() never repeats a token, the fast sampler does."""
    import pytest

    from groupwise.generation.hf import TransformersGenerator

    def reward(completions, **_):
        return [0.0] * len(completions)

    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.min_p = 0.1
    with pytest.warns(UserWarning, match=r"generation_config sets no_repeat_ngram_size=1, min_p=0.1, which "
                                         r"generation_backend='fast' does not apply"):
        GRPOTrainer(model, [reward], args=small_args(tmp_path), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)
    with pytest.warns(UserWarning, match=r"sets no_repeat_ngram_size=1, which"):  # min_p set in the config: applied
        GRPOTrainer(model, [reward], args=small_args(tmp_path, min_p=0.05), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOTrainer(model, [reward], args=small_args(tmp_path, generation_backend="transformers"),
                    train_dataset=toy.dataset(8), processing_class=tokenizer)
    # the premise: generate() applies it, the fast sampler does not
    model.generation_config.min_p = None
    enc = tokenizer(["abc"], return_tensors="pt")
    kw = dict(max_completion_length=12, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
              pad_token_id=tokenizer.pad_token_id, eos_token_ids=[len(tokenizer) + 5])  # no EOS: 12 tokens each
    hf = TransformersGenerator(**kw)(model, enc.input_ids, enc.attention_mask, greedy=True).completion_ids[0]
    fast = FastGenerator(**kw)(model, enc.input_ids, enc.attention_mask, greedy=True).completion_ids[0]
    assert len(hf) == len(fast) == 12
    assert len(set(hf.tolist())) == 12 and len(set(fast.tolist())) < 12

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

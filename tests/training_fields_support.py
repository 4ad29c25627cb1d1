"""Shared by tests/test_trl_training_fields.py and tests/test_trl_training_switches.py: a reward that trains every
step and a trainer on the toy task."""

from __future__ import annotations

from groupwise import GRPOTrainer
from groupwise.tasks import toy
from tests.conftest import small_args


def _length(completions, **_):
    return [float(len(c)) for c in completions]


def _trainer(tmp_path, tokenizer, funcs=(_length,), data=None, model=None, optimizers=(None, None), eval_data=None,
             **kw):
    kw.setdefault("output_dir", str(tmp_path / "run"))
    return GRPOTrainer(model or toy.build_model(tokenizer, seed=0, hidden_size=32), list(funcs),
                       args=small_args(tmp_path, **kw), train_dataset=data if data is not None else toy.dataset(12),
                       eval_dataset=eval_data, processing_class=tokenizer, optimizers=optimizers)

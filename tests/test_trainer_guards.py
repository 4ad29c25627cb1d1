"""What a TRL script does to a trainer that groupwise would have ignored silently (groupwise.guards): a subclass
overriding a TRL / transformers method the loop never calls, and trainer.args changed after the trainer is built."""

import json

import pytest

from groupwise import GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.tasks import toy
from tests.conftest import small_args


def _length(completions, **_):
    return [float(len(c)) for c in completions]


def _build(cls, tmp_path, tokenizer, model=None, **fields):
    return cls(model if model is not None else toy.build_model(tokenizer, seed=0, hidden_size=32), [_length],
               args=small_args(tmp_path, **fields), train_dataset=toy.dataset(8), processing_class=tokenizer)


def test_a_subclass_overriding_trl_methods_groupwise_never_calls_is_refused_before_the_model_loads(tmp_path,
                                                                                                  tokenizer):
    """compute_loss and create_optimizer were overridden without effect: groupwise's loop calls neither. The error
    names both and what to use instead, before the model path (which does not exist) is read."""
    class Custom(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise AssertionError("never called")

        def create_optimizer(self):
            raise AssertionError("never called")

    with pytest.raises(TypeError) as err:
        _build(Custom, tmp_path, tokenizer, model=str(tmp_path / "no-such-model"))
    message = str(err.value)
    assert message.startswith("Custom overrides compute_loss(), create_optimizer() of TRL's / transformers' trainer")
    assert "loss_type" in message and "optimizers=(optimizer, lr_scheduler)" in message


def test_the_check_walks_the_subclass_chain_and_mixins_and_gives_a_general_hint_for_other_hooks(tmp_path, tokenizer):
    """An override inherited from an intermediate class counts, and so does a mixin listed after GRPOTrainer (it
    was missed: only the classes before GRPOTrainer in the MRO were read); a `_` hook of transformers' Trainer the
    table has no hint for (_wrap_model) gets the general one."""
    class Base(GRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            pass

    class Child(Base):
        def _wrap_model(self, model, training=True, dataloader=None):
            return model

    with pytest.raises(TypeError, match=r"^Child overrides _wrap_model\(\), training_step\(\) .*"
                                        r"use a callback \(transformers' events\).*loss_type"):
        _build(Child, tmp_path, tokenizer)

    class LossMixin:
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            pass

    class Mixed(GRPOTrainer, LossMixin):
        pass

    with pytest.raises(TypeError, match=r"^Mixed overrides compute_loss\(\)"):
        _build(Mixed, tmp_path, tokenizer)


def test_public_trainer_methods_groupwise_lacks_are_the_subclass_s_own_and_save_model_is_warned(tmp_path, tokenizer):
    """predict() is not called by any loop: a subclass's predict is its own method, called by its user (it was
    refused). save_model is overridden with a warning: transformers calls it for each checkpoint, groupwise not."""
    class WithPredict(GRPOTrainer):
        def predict(self, rows):
            return len(rows)

        def save_model(self, output_dir=None, _internal_call=False):
            super().save_model(output_dir, _internal_call)

    with pytest.warns(UserWarning, match=r"^WithPredict overrides save_model\(\): transformers also calls it to "
                                         r"write each checkpoint's model; .*on_save"):
        trainer = _build(WithPredict, tmp_path, tokenizer)
    assert trainer.predict([1, 2]) == 2


def test_a_subclass_overriding_what_groupwise_calls_and_adding_helpers_trains(tmp_path, tokenizer):
    """log() is called by groupwise's loop (each log line goes through it, as in transformers): a subclass may
    override it; a method of the subclass's own (a helper) is no TRL method."""
    class Custom(GRPOTrainer):
        lines: list = []

        def log(self, logs, start_time=None):
            self.lines.append(self.tag({**logs, "start_time": start_time}))
            super().log(logs, start_time)

        def tag(self, logs):
            return {**logs, "tagged": True}

    trainer = _build(Custom, tmp_path, tokenizer)
    trainer.train()
    assert [line["tagged"] for line in Custom.lines] == [True, True, True]  # steps 1, 2 and the end-of-run line
    assert "loss" in Custom.lines[0] and "train_runtime" in Custom.lines[-1]
    # transformers passes train()'s start time with training lines (an override doing arithmetic on it crashed)
    assert [type(line["start_time"]) for line in Custom.lines] == [float, float, type(None)]


def test_args_changed_after_the_trainer_is_built_are_refused_by_name(tmp_path, tokenizer):
    """max_steps and logging_steps set on trainer.args after building were ignored (the schedule and the state's
    logging steps were built from the old values); a list changed in place counts too. train() refuses, naming each
    change, before anything is written."""
    trainer = _build(GRPOTrainer, tmp_path, tokenizer, reward_weights=[1.0])
    trainer.args.max_steps = 5
    trainer.args.logging_steps = 3
    with pytest.raises(ConfigError, match=r"^trainer.args changed after the GRPOTrainer was built "
                                          r"\(logging_steps: 1 → 3; max_steps: 2 → 5\).*before building the trainer"):
        trainer.train()
    trainer.args.max_steps, trainer.args.logging_steps = 2, 1
    trainer.args.reward_weights[0] = 2.0
    trainer.args.hub_model_id, trainer.args.hub_token = "me/model", "hf_SECRET"  # a token may change (not shown)
    with pytest.raises(ConfigError, match=r"\(hub_model_id: None → 'me/model'; reward_weights: \[1.0\] → \[2.0\]\)"):
        trainer.train()
    assert not (tmp_path / "out").exists()


def test_fields_read_where_they_are_used_may_change_after_building(tmp_path, tokenizer):
    """num_generations_eval is read by evaluate() when it runs (an evaluation after changing it samples 2 per
    prompt): changing it before train() was refused."""
    trainer = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length],
                          args=small_args(tmp_path, max_steps=1), train_dataset=toy.dataset(8),
                          eval_dataset=toy.dataset(2, seed=1), processing_class=tokenizer)
    trainer.args.num_generations_eval = 2
    assert "eval_rewards/_length/mean@2" in trainer.evaluate()
    trainer.train()
    assert trainer.state.global_step == 1


def test_resume_from_checkpoint_set_on_args_after_building_is_read_by_train(tmp_path, tokenizer):
    """resume_from_checkpoint is train()'s to read (TRL's meaning): set on trainer.args after building, it resumes."""
    _build(GRPOTrainer, tmp_path, tokenizer, save_steps=1).train()
    trainer = _build(GRPOTrainer, tmp_path, tokenizer, save_steps=1, max_steps=3)
    trainer.args.resume_from_checkpoint = str(tmp_path / "out" / "checkpoint-2")
    trainer.train()
    assert trainer.state.global_step == 3
    steps = [json.loads(line).get("step") for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert 3 in steps and steps.count(1) == 1  # step 3 trained here; steps 1–2 not again

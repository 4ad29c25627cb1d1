"""transformers' stateful callbacks: every checkpoint's trainer_state.json holds `stateful_callbacks` (each
ExportableState callback's and the TrainerControl's `.state()`, keyed by class name), and a resume with
restore_callback_states_from_checkpoint=True rebuilds those callbacks from it (Trainer._load_callback_state)."""

import json

import pytest
from transformers import EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import ExportableState

from groupwise import GRPOTrainer
from groupwise.tasks import toy
from tests.conftest import small_args


def _worse_after_step_2(completions, trainer_state, **_):
    """Training rewards vary; the evaluation's reward is −(step − 2)²: best after step 2, worse after it."""
    if trainer_state.global_step and len(completions) == 4:  # the evaluation: 4 prompts, one greedy completion each
        return [-float(trainer_state.global_step - 2) ** 2] * len(completions)
    return [float(sum(map(ord, c)) % 5) for c in completions]


def _trainer(tmp_path, tokenizer, callbacks=None, **kw):
    args = small_args(tmp_path, **{"max_steps": 6, "eval_strategy": "steps", "eval_steps": 1, "save_steps": 1,
                                   "metric_for_best_model": "reward", **kw})
    return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_worse_after_step_2], args=args,
                       train_dataset=toy.dataset(12), eval_dataset=toy.dataset(4, seed=1), processing_class=tokenizer,
                       callbacks=callbacks)


def _own(trainer) -> list:
    """The callbacks the test gave (or restored), without the default flow and printing ones of the list."""
    from transformers import DefaultFlowCallback, PrinterCallback, ProgressCallback

    defaults = (DefaultFlowCallback, PrinterCallback, ProgressCallback)
    return [c for c in trainer.callback_handler.callbacks if not isinstance(c, defaults)]


def _saved(run, step: int) -> dict:
    return json.loads((run / "out" / f"checkpoint-{step}" / "trainer_state.json").read_text())


def _as_transformers_writes(*callbacks) -> dict:
    """transformers' TrainerState(stateful_callbacks=[…]) as its save_to_json writes it."""
    return json.loads(json.dumps(TrainerState(stateful_callbacks=list(callbacks)).stateful_callbacks))


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory):
    """An uninterrupted run (its folder, read only: resumed runs write elsewhere): eval rewards −1, 0, −1, −4 at
    steps 1–4; patience 2 stops it after step 4's evaluation."""
    run = tmp_path_factory.mktemp("early_stopped")
    stopper = EarlyStoppingCallback(early_stopping_patience=2)
    t = _trainer(run, toy.build_tokenizer(), callbacks=[stopper])
    t.train()
    assert t.global_step == 4 and stopper.early_stopping_patience_counter == 2
    return run, t


def test_checkpoints_hold_the_callbacks_states_as_transformers_writes_them(early_stopped):
    run, trainer = early_stopped
    # step 3: one evaluation without improvement; the save happens with should_save set (as in transformers)
    expected = _as_transformers_writes(EarlyStoppingCallback(2, 0.0), TrainerControl(should_save=True))
    expected["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] = 1
    assert _saved(run, 3)["stateful_callbacks"] == expected
    assert expected["TrainerControl"]["args"]["should_save"] is True and expected["EarlyStoppingCallback"] == {
        "args": {"early_stopping_patience": 2, "early_stopping_threshold": 0.0},
        "attributes": {"early_stopping_patience_counter": 1}}
    # step 4: the callback stopped the run at that step's evaluation, before its save
    (stopper,) = _own(trainer)
    assert _saved(run, 4)["stateful_callbacks"] == _as_transformers_writes(
        stopper, TrainerControl(should_save=True, should_training_stop=True))


def test_resume_restores_the_early_stopping_counter_only_when_asked(tmp_path, tokenizer, early_stopped):
    run, uninterrupted = early_stopped
    for restore, stops_at in ((True, 4), (False, 5)):
        given = EarlyStoppingCallback(early_stopping_patience=2)
        t = _trainer(tmp_path / str(restore), tokenizer, callbacks=[given],
                     restore_callback_states_from_checkpoint=restore)
        t.train(resume_from_checkpoint=str(run / "out" / "checkpoint-3"))  # its own checkpoints go to tmp_path
        # restored: the counter continues from 1 and the run stops at step 4, as the uninterrupted run did; not
        # restored: it starts from 0 (transformers' default), so two more worse evaluations are needed (steps 4, 5)
        assert t.global_step == stops_at == uninterrupted.global_step + (not restore), restore
        (stopper,) = _own(t)
        assert (stopper is given) is (not restore)  # transformers replaces the callback with one built from the state
        assert stopper.early_stopping_patience_counter == 2 and stopper.early_stopping_patience == 2


class Tally(TrainerCallback, ExportableState):
    """A user's stateful callback: its args and attributes are what a checkpoint keeps."""

    def __init__(self, label: str = "unset", every: int = 1):
        self.label, self.every = label, every
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.steps.append(state.global_step)

    def state(self) -> dict:
        return {"args": {"label": self.label, "every": self.every}, "attributes": {"steps": self.steps}}


class Other(TrainerCallback):
    pass


def test_a_users_stateful_callbacks_round_trip_and_missing_ones_are_warned_about(tmp_path, tokenizer):
    first = [Tally("a"), Other(), Tally("b", every=2)]
    t = _trainer(tmp_path, tokenizer, first, max_steps=3, eval_strategy="no", metric_for_best_model=None)
    t.train()
    assert _saved(tmp_path, 2)["stateful_callbacks"] == {  # several of one class: a list, in their order
        "Tally": [{"args": {"label": "a", "every": 1}, "attributes": {"steps": [1, 2]}},
                  {"args": {"label": "b", "every": 2}, "attributes": {"steps": [2]}}],
        "TrainerControl": TrainerControl(should_save=True).state()}

    other = Other()
    t = _trainer(tmp_path, tokenizer, [Tally("new", every=5), other, Tally()], max_steps=3, eval_strategy="no",
                 metric_for_best_model=None, restore_callback_states_from_checkpoint=True)
    with pytest.warns(UserWarning, match="set aside"):
        t.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    # the stored args rebuild each Tally (in order), its attributes are set, and it trains on; restored callbacks
    # move to the end of the list, as transformers' add_callback puts them
    kept, a, b = _own(t)
    assert kept is other
    assert (a.label, a.every, a.steps) == ("a", 1, [1, 2, 3]) and (b.label, b.every, b.steps) == ("b", 2, [2])

    # a checkpoint's callbacks the new run lacks: transformers' warning (the control's flags are still restored)
    t = _trainer(tmp_path / "elsewhere", tokenizer, [Other()], max_steps=3, eval_strategy="no",
                 metric_for_best_model=None, restore_callback_states_from_checkpoint=True)
    with pytest.warns(UserWarning, match=r"Checkpoint included callbacks not included in current configuration\. "
                                         r"Ignoring\. \(Tally\)"):
        t.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert t.global_step == 3


def test_restored_callbacks_come_back_in_class_name_order_as_transformers_restores_them(tmp_path, tokenizer):
    """transformers writes trainer_state.json with sorted keys and re-adds the restored callbacks walking that dict:
    by class name (EarlyStoppingCallback before Tally), whatever order the resumed run listed them in; groupwise
    re-added them in the list's order."""
    first = [Tally("a"), EarlyStoppingCallback(early_stopping_patience=50)]
    _trainer(tmp_path, tokenizer, first, max_steps=2).train()
    t = _trainer(tmp_path, tokenizer, [Tally(), EarlyStoppingCallback(early_stopping_patience=50)], max_steps=3,
                 restore_callback_states_from_checkpoint=True)
    t.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert [type(c).__name__ for c in _own(t)] == ["EarlyStoppingCallback", "Tally"]
    assert _own(t)[1].steps == [1, 2, 3]

"""transformers' best-model tracking in a GRPO run: metric_for_best_model / greater_is_better / load_best_model_at_end
(state.best_metric, best_global_step, best_model_checkpoint; the best checkpoint kept by the rotation and loaded at the
end), and transformers' EarlyStoppingCallback, which reads state.best_metric."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from groupwise import ConfigError, GRPOConfig, GRPOTrainer
from groupwise.tasks import toy
from tests.conftest import small_args


def _peak_at_step_2(completions, trainer_state, **_):
    """Training rewards vary (a gradient every step); the evaluation's reward is −(step − 2)², best after step 2."""
    if trainer_state.global_step and len(completions) == 4:  # the evaluation: 4 prompts, one greedy completion each
        return [-float(trainer_state.global_step - 2) ** 2] * len(completions)
    return [float(sum(map(ord, c)) % 5) for c in completions]


def _trainer(tmp_path, tokenizer, callbacks=None, **kw):
    args = small_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=1,
                      metric_for_best_model="reward", **kw)
    return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_peak_at_step_2], args=args,
                       train_dataset=toy.dataset(12), eval_dataset=toy.dataset(4, seed=1), processing_class=tokenizer,
                       callbacks=callbacks)


@pytest.mark.parametrize("kwargs, match", [
    (dict(load_best_model_at_end=True, eval_strategy="steps"), r"needs metric_for_best_model: .* no eval_loss"),
    (dict(load_best_model_at_end=True, metric_for_best_model="reward"), r"eval_strategy and save_strategy to match"),
    # TRL's evaluation computes eval_loss; this one does not: named now (it was a KeyError after training steps)
    (dict(metric_for_best_model="eval_loss"), r"metric_for_best_model='eval_loss': groupwise's evaluation reports "
                                              r"no eval_loss"),
    (dict(metric_for_best_model="loss"), r"metric_for_best_model='loss'"),
    (dict(load_best_model_at_end=True, metric_for_best_model="reward", eval_strategy="steps", eval_steps=3,
          save_steps=4), r"save_steps \(4\) to be a multiple of eval_steps \(3\)"),
])
def test_best_model_fields_are_checked_as_transformers_checks_them(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


def _steps(prompts, completions, steps, **_):
    return [[1.0] * len(row) for row in steps]


@pytest.mark.parametrize("metric, outcome, process, match", [
    ("reward", [], [_steps], "this run has no outcome reward functions"),
    ("rewards/_peak_at_step_2/mean", [], [_steps], "this run has no outcome reward functions"),
    ("eval_rewards/acuracy/mean", [_peak_at_step_2], [], r"no reward function named 'acuracy' among the outcome "
                                                         r"reward functions \['_peak_at_step_2'\]"),
    ("process/step_reward_mean", [_peak_at_step_2], [], "this run has no process reward functions"),
    ("process/nope/errors", [_peak_at_step_2], [_steps], "no reward function named 'nope'"),
    ("process/nope/mean", [_peak_at_step_2], [_steps], "no reward function named 'nope' among the process"),
    ("rewards/_peak_at_step_2/pass@4", [], [_steps], "this run has no outcome reward functions"),
])
def test_a_metric_the_evaluation_cannot_report_is_refused_at_construction(tmp_path, tokenizer, metric, outcome,
                                                                          process, match):
    """It was a KeyError at the first evaluation, after training steps."""
    supervision = "both" if outcome and process else "process" if process else "outcome"
    with pytest.raises(ConfigError, match=match):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), outcome, process_reward_funcs=process,
                    args=small_args(tmp_path, metric_for_best_model=metric, supervision=supervision),
                    train_dataset=toy.dataset(8), processing_class=tokenizer)


@pytest.mark.parametrize("metric, hint", [("rewards/judge/agreement", None), ("process/judge_latency", None),
                                          ("my_metric", None), ("rewrd", "reward"),
                                          ("completions/mean_lenght", "completions/mean_length"),
                                          ("rewards/_peak_at_step_2/sdt", "rewards/_peak_at_step_2/std")])
def test_names_a_reward_function_may_log_are_a_warning_not_an_error(tmp_path, tokenizer, metric, hint):
    """log_metric names are reported by evaluation too, and may be anything: only evaluation's own names are
    refused (a first version refused every rewards/… and process/… name). Any other name is a warning now, with the
    close match a misspelling has (it was found only at the first evaluation, after training steps)."""
    with pytest.warns(UserWarning, match=rf"metric_for_best_model='{metric}': evaluation reports no '{metric}' by "
                                         "itself; unless a reward function logs it with log_metric") as caught:
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_peak_at_step_2],
                    args=small_args(tmp_path, metric_for_best_model=metric), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)
    said = next(str(w.message) for w in caught if "metric_for_best_model" in str(w.message))
    assert said.endswith(f"(did you mean '{hint}'?)" if hint else "stops the run")


@pytest.mark.parametrize("metric", ["reward", "rewards/_peak_at_step_2/pass@4", "completions/clipped_ratio",
                                    "num_tokens", "eval_runtime"])
def test_names_evaluation_reports_are_not_warned_about(tmp_path, tokenizer, metric):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="metric_for_best_model")
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_peak_at_step_2],
                    args=small_args(tmp_path, metric_for_best_model=metric), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)


@pytest.mark.parametrize("metric", ["process/step_reward_mean", "process/_steps/mean"])
def test_process_metrics_may_pick_the_best_model(tmp_path, tokenizer, metric):
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [], process_reward_funcs=[_steps],
                    args=small_args(tmp_path, metric_for_best_model=metric, supervision="process",
                                    max_steps=1, eval_strategy="steps", eval_steps=1, save_steps=1),
                    train_dataset=toy.dataset(8), eval_dataset=toy.dataset(2, seed=1), processing_class=tokenizer)
    t.train()
    assert t.state.best_metric == 1.0 and t.state.best_global_step == 1  # _steps scores every step 1


def test_greater_is_better_defaults_from_the_metrics_name():
    assert GRPOConfig(metric_for_best_model="reward").greater_is_better is True
    assert GRPOConfig(metric_for_best_model="eval_judge_loss").greater_is_better is False  # a log_metric name
    assert GRPOConfig(metric_for_best_model="reward", greater_is_better=False).greater_is_better is False


def test_the_best_checkpoint_is_tracked_kept_and_loaded_at_the_end(tmp_path, tokenizer):
    from transformers import TrainerCallback

    saved = {}  # step → (the checkpoint's weights, its trainer_state.json's best), read as each save happens

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            best = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["best"]
            saved[state.global_step] = load_file(str(Path(checkpoint) / "model.safetensors")), best

    t = _trainer(tmp_path, tokenizer, callbacks=[Record()], load_best_model_at_end=True, save_total_limit=1)
    t.train()
    out = tmp_path / "out"
    assert t.state.best_metric == 0.0 and t.state.best_global_step == 2
    assert t.state.best_model_checkpoint == str(out / "checkpoint-2")
    # a resume continues from it; checkpoint-2 names itself (transformers sets it before writing the state)
    best_state = {"best_metric": 0.0, "best_global_step": 2, "best_model_checkpoint": str(out / "checkpoint-2")}
    assert saved[2][1] == saved[4][1] == best_state
    # save_total_limit=1 kept the newest checkpoint and, older, the best one during training; at the end the newest
    # is deleted (transformers' train() end): the best one remains
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    best, last = saved[2][0], saved[4][0]
    state = t.unwrapped.state_dict()
    assert all(torch.equal(state[k], v) for k, v in best.items())  # the model is step 2's again
    assert any(not torch.equal(best[k], last[k]) for k in best)  # which is not the last step's


def test_early_stopping_callback_stops_once_the_metric_worsens(tmp_path, tokenizer):
    from transformers import EarlyStoppingCallback

    t = _trainer(tmp_path, tokenizer, callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    t.train()  # transformers logs that the best model will not be loaded: load_best_model_at_end is off
    # rewards −1, 0, −1: step 3 is worse than the best (step 2), so patience 1 stops the run after step 3
    assert t.global_step == 3 and t.state.best_metric == 0.0 and t.state.best_global_step == 2


def test_the_best_checkpoint_survives_a_resume_with_output_dir_spelt_otherwise(tmp_path, tokenizer, monkeypatch):
    """A run with a relative output_dir records its best as 'out/checkpoint-2'. Resumed from another working
    directory with the absolute path, it used to forget the best (that relative path is not there), so the rotation
    deleted checkpoint-2 and the run ended with the last step's weights; the same working directory with another
    spelling kept it unprotected too (the rotation compared paths as written)."""
    from transformers import TrainerCallback

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    monkeypatch.chdir(first)
    kw = dict(output_dir="out", load_best_model_at_end=True, save_total_limit=2)
    t = _trainer(tmp_path, tokenizer, callbacks=[StopAt3()], **kw)
    t.train()
    assert t.global_step == 3 and t.state.best_model_checkpoint == "out/checkpoint-2"
    best = load_file(str(first / "out" / "checkpoint-2" / "model.safetensors"))
    monkeypatch.chdir(second)
    t = _trainer(tmp_path, tokenizer, **{**kw, "output_dir": str(first / "out")})
    t.train(resume_from_checkpoint=True)
    assert t.global_step == 4 and t.state.best_model_checkpoint == str(first / "out" / "checkpoint-2")
    assert sorted(p.name for p in (first / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    state = t.unwrapped.state_dict()
    assert all(torch.equal(state[k], v) for k, v in best.items())  # load_best_model_at_end: step 2's weights


def test_without_checkpoints_the_best_metric_is_tracked_but_no_best_step(tmp_path, tokenizer):
    """transformers records best_global_step only under a save strategy that writes checkpoints (steps, epoch,
    best): with save_strategy='no' the best metric is kept and best_global_step stays None (it was set)."""
    t = _trainer(tmp_path, tokenizer, save_strategy="no")
    t.train()
    assert t.state.best_metric == 0.0 and t.state.best_global_step is None and t.state.best_model_checkpoint is None


def _peaks_by_dataset(completions, trainer_state, **_):
    """Evaluation rewards per eval dataset, told apart by size: 'a' (3 prompts) gives −(step − 3)², 'b' (4 prompts)
    −(step − 2)²; training rounds (8 completions) vary, so every step has a gradient."""
    step = trainer_state.global_step
    if step and len(completions) in (3, 4):
        return [-float(step - (3 if len(completions) == 3 else 2)) ** 2] * len(completions)
    return [float(sum(map(ord, c)) % 5) for c in completions]


def test_eval_datasets_given_by_name_are_each_evaluated_during_training(tmp_path, tokenizer):
    """transformers / TRL: GRPOTrainer(eval_dataset={name: dataset}) evaluates each dataset at every evaluation, its
    metrics named eval_<name>_…, one evaluate() (a log line, an on_evaluate) per dataset; metric_for_best_model names
    one dataset's metric. Steps 1–4: a's reward −(s−3)² = −4, −1, 0, −1; b's −(s−2)² = −1, 0, −1, −4; the best by
    b_reward is step 2 (by a's it would be step 3)."""
    from transformers import TrainerCallback

    evaluated = []

    class Record(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            evaluated.append((state.global_step, sorted({k.split("_")[1] for k in metrics if k.startswith("eval_")})))

    a, b = toy.dataset(3, seed=1), toy.dataset(4, seed=2)
    args = small_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=1,
                      metric_for_best_model="b_reward")
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_peaks_by_dataset], args=args,
                    train_dataset=toy.dataset(12), eval_dataset={"a": a, "b": b}, processing_class=tokenizer,
                    callbacks=[Record()])
    assert t.eval_dataset == {"a": a, "b": b}
    t.train()
    assert evaluated == [(s, [name]) for s in (1, 2, 3, 4) for name in ("a", "b")]
    lines = [x for x in t.state.log_history if any(k.startswith("eval_") for k in x)]
    assert [(x["step"], x.get("eval_a_reward"), x.get("eval_b_reward")) for x in lines] == [
        (1, -4.0, None), (1, None, -1.0), (2, -1.0, None), (2, None, 0.0),
        (3, 0.0, None), (3, None, -1.0), (4, -1.0, None), (4, None, -4.0)]
    assert t.state.best_metric == 0.0 and t.state.best_global_step == 2
    # by name, as transformers' get_eval_dataloader takes one: the trainer's dataset 'a', under the plain prefix
    assert t.evaluate("a")["eval_reward"] == -1.0
    assert set(k for k in t.evaluate() if k.endswith("_reward")) == {"eval_a_reward", "eval_b_reward"}
    with pytest.raises(ConfigError, match=r"evaluate\(eval_dataset='c'\): a name picks one of the trainer's eval "
                                          r"datasets given as \{name: dataset\}, which are \['a', 'b'\]"):
        t.evaluate("c")


def test_eval_datasets_given_by_name_are_checked_when_the_trainer_is_built(tmp_path, tokenizer):
    """The metric must name one dataset's (a plain 'reward' was a KeyError at the first evaluation in transformers),
    and each dataset is checked as the single one is (here: a reward column missing from 'b' only)."""
    def build(metric=None, funcs=(_peaks_by_dataset,), **eval_data):
        return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), list(funcs),
                           args=small_args(tmp_path, metric_for_best_model=metric), train_dataset=toy.dataset(8),
                           eval_dataset=eval_data, processing_class=tokenizer)

    with pytest.raises(ConfigError, match=r"metric_for_best_model='reward': the eval datasets are given as "
                                          r"\{name: dataset\}, so every evaluation metric is eval_<name>_<metric>, "
                                          r"with <name> one of \['a', 'b'\]: name one dataset's, e.g. 'a_reward'"):
        build("reward", a=toy.dataset(2), b=toy.dataset(2))
    with pytest.raises(ConfigError, match=r"metric_for_best_model='reward': the eval datasets"):  # before a load
        GRPOTrainer(str(tmp_path / "no-such-model"), [_peaks_by_dataset],
                    args=small_args(tmp_path, metric_for_best_model="reward"), train_dataset=toy.dataset(8),
                    eval_dataset={"a": toy.dataset(2), "b": toy.dataset(2)})
    with pytest.raises(ConfigError, match=r"metric_for_best_model='a_loss': groupwise's evaluation reports no loss"):
        build("a_loss", a=toy.dataset(2), b=toy.dataset(2))
    # the dataset prefix is taken off before the metric is checked against the run's reward functions
    with pytest.raises(ConfigError, match=r"no reward function named 'acuracy'"):
        build("eval_b_rewards/acuracy/mean", a=toy.dataset(2), b=toy.dataset(2))
    build("b_rewards/_peaks_by_dataset/mean", a=toy.dataset(2), b=toy.dataset(2))
    with pytest.raises(ConfigError, match=r"eval_dataset is an empty dict: pass a dataset, or \{name: dataset, …\}"):
        build()
    with pytest.raises(ConfigError, match=r"eval_dataset is a dict of datasets whose key 1 is not a name: its metrics "
                                          r"are named eval_<key>_…, so use non-empty strings as keys"):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_peaks_by_dataset],
                    args=small_args(tmp_path), train_dataset=toy.dataset(8), eval_dataset={1: toy.dataset(2)},
                    processing_class=tokenizer)
    with pytest.raises(ConfigError, match=r"eval_dataset\['b'\].*letter"):
        build(funcs=(toy.letter_reward,), a=toy.dataset(2), b=[{"prompt": "repeat a:"}])


def test_a_dict_of_columns_is_not_a_dict_of_datasets():
    """A dict of columns without a 'prompt' one (an environment's rows may have none) was split into one 'dataset'
    per column."""
    from datasets import Dataset

    from groupwise.data import named_datasets

    assert not named_datasets({"question": ["1+1", "2+2"], "answer": ["2", "4"]})
    assert not named_datasets({"prompt": [{"role": "user"}]})  # a 'prompt' column: columns
    assert named_datasets({"a": [{"prompt": "x"}], "b": Dataset.from_dict({"prompt": ["y"]})})
    assert named_datasets({"a": [{"prompt": "x"}], "b": [{"prompt": "y"}]})  # rows with prompts: named sets
    assert named_datasets({"a": Dataset.from_list([{"task": 1}])})  # a Dataset says it is one
    # columns whose values are dicts (an environment's rows need no prompt), or named lists of such rows: both
    # readings are plausible, so neither is guessed (it was read as one evaluation set per column)
    with pytest.raises(ConfigError, match=r"eval_dataset is a dict whose values \(under 'info', 'meta'\) are all "
                                          r"lists of "
                                          r"dicts without a 'prompt' key.*Dataset.from_list.*Dataset.from_dict"):
        named_datasets({"info": [{"level": 1}, {"level": 2}], "meta": [{"id": "a"}, {"id": "b"}]})


def test_a_best_evaluation_between_two_saves_is_saved_and_loaded_at_the_end(tmp_path, tokenizer):
    """eval_steps 1, save_steps 2 (a multiple, as transformers asks): the best evaluation, after step 1 (−(1−1)² = 0
    with the peak moved to step 1), falls between two saves. It is saved then, so load_best_model_at_end loads it;
    transformers would keep the last model, with state.best_metric describing another one."""
    def peak_at_step_1(completions, trainer_state, **_):
        if trainer_state.global_step and len(completions) == 4:
            return [-float(trainer_state.global_step - 1) ** 2] * len(completions)
        return [float(sum(map(ord, c)) % 5) for c in completions]

    args = small_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_steps=2,
                      metric_for_best_model="reward", load_best_model_at_end=True)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [peak_at_step_1], args=args,
                    train_dataset=toy.dataset(12), eval_dataset=toy.dataset(4, seed=1), processing_class=tokenizer)
    t.train()
    out = Path(args.output_dir)
    assert t.state.best_metric == 0.0 and t.state.best_global_step == 1
    assert t.state.best_model_checkpoint == str(out / "checkpoint-1")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    saved = load_file(out / "checkpoint-1" / "model.safetensors")
    mine = {n: p.detach().cpu() for n, p in t.model.named_parameters() if n in saved}
    assert len(mine) == len(list(t.model.parameters())) and all(torch.equal(saved[n], p) for n, p in mine.items())


def test_a_metric_no_evaluation_reports_stops_the_run_with_one_line(tmp_path, tokenizer):
    """'rewrd' matches no metric family the checks before loading know (a log_metric name may be anything): the
    first evaluation names it and the metrics there are, as a ConfigError (the CLI's one line, exit 2), where it was
    a KeyError traceback."""
    args = small_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="rewrd")
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_peak_at_step_2], args=args,
                    train_dataset=toy.dataset(12), eval_dataset=toy.dataset(4, seed=1), processing_class=tokenizer)
    with pytest.raises(ConfigError, match=r"metric_for_best_model='rewrd': 'eval_rewrd' is not among the evaluation "
                                          r"metrics \[.*'eval_reward'.*\]"):
        t.train()

"""What a TRL 1.16 user sees in their trackers, checked against transformers' TensorBoardCallback / WandbCallback and
report_to resolution: the run's config (the model's config, PEFT config, parameter count), TensorBoard's text and
scalar tags, tensorboardX as a fallback, transformers' other integrations, wandb's environment variables, and a
tracker failing mid-run. wandb and tensorboard are not installed here: fake modules record the calls."""

import json
import sys
import types

import pytest

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.logging import MetricsLogger
from groupwise.trackers import resolve_report_to, tracker_names, wandb_config
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines


def _length(completions, **_):
    return [float(len(c)) for c in completions]


def _trainer(tmp_path, tokenizer, **kw):
    args = small_args(tmp_path, output_dir=str(tmp_path / "run"), **kw)
    return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length], args=args,
                       train_dataset=toy.dataset(12), eval_dataset=toy.dataset(2), processing_class=tokenizer)


class _Run:
    def __init__(self, fail_at=None, **kw):
        self.init, self.logged, self.summary, self.updates, self.finished = kw, [], {}, [], None
        self.fail_at = fail_at
        self.config = types.SimpleNamespace(update=lambda values, **k: self.updates.append((values, k)))

    def log(self, metrics):
        if self.fail_at is not None and metrics.get("train/global_step") == self.fail_at:
            raise ConnectionError("wandb went away")
        self.logged.append(metrics)

    def define_metric(self, name, **kw):
        pass

    def finish(self, exit_code=None):
        self.finished = exit_code


def _wandb(monkeypatch, run=None, fail_at=None):
    runs, watched = [], []
    module = types.SimpleNamespace(run=run, init=lambda **kw: runs.append(_Run(fail_at, **kw)) or runs[-1],
                                   watch=lambda model, **kw: watched.append((model, kw)), Table=lambda dataframe: 0)
    monkeypatch.setitem(sys.modules, "wandb", module)
    for name in ("WANDB_PROJECT", "WANDB_RESUME", "WANDB_WATCH", "WANDB_LOG_MODEL"):
        monkeypatch.delenv(name, raising=False)
    return runs, watched


class _Writer:
    made: list = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.texts = log_dir, [], {}
        _Writer.made.append(self)

    def add_scalar(self, k, v, step):
        self.scalars.append((k, v, step))

    def add_text(self, k, v, step=None):
        self.texts[k] = (v, step)

    def flush(self):
        pass

    def close(self):
        pass


def test_the_wandb_run_config_holds_the_model_config_as_transformers(tmp_path, tokenizer, monkeypatch):
    """transformers' WandbCallback.setup sets the run's config to {**model.config, **args} (the arguments win),
    plus `model/num_parameters` (and `peft_config` for a PEFT model); a run the user started gets the same update."""
    runs, _ = _wandb(monkeypatch)
    t = _trainer(tmp_path, tokenizer, max_steps=1, report_to=["wandb"])
    t.train()
    config = runs[0].init["config"]
    assert config["vocab_size"] == t.model.config.vocab_size and config["model_type"] == t.model.config.model_type
    assert config["model/num_parameters"] == t.model.num_parameters() and config["max_steps"] == 1
    assert config["learning_rate"] == 1e-2  # a key of both: the training argument's value
    users = _Run()
    _wandb(monkeypatch, run=users)
    _trainer(tmp_path, tokenizer, max_steps=1, report_to=["wandb"], overwrite_output_dir=True).train()
    assert users.updates[0][0]["model_type"] == t.model.config.model_type and users.finished is None
    peft = types.SimpleNamespace(config={"a": 1, "lr": 0}, peft_config={"default": types.SimpleNamespace(
        to_dict=lambda: {"r": 8})}, num_parameters=lambda: 7)
    assert wandb_config({"lr": 1}, peft) == {"peft_config": {"default": {"r": 8}}, "a": 1, "lr": 1,
                                             "model/num_parameters": 7}
    assert wandb_config({"lr": 1}) == {"lr": 1}


def test_wandb_environment_variables_as_transformers(tmp_path, tokenizer, monkeypatch):
    """WANDB_PROJECT names the project, WANDB_RESUME (when set) decides resuming, WANDB_WATCH watches the model
    (log_freq max(100, logging_steps)); WANDB_LOG_MODEL, which groupwise does not implement, warns."""
    runs, watched = _wandb(monkeypatch)
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    monkeypatch.setenv("WANDB_RESUME", "never")
    monkeypatch.setenv("WANDB_WATCH", "gradients")
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    t = _trainer(tmp_path, tokenizer, max_steps=1, report_to=["wandb"])
    with pytest.warns(RuntimeWarning, match="WANDB_LOG_MODEL=end is not supported"):
        t.train()
    assert runs[0].init["project"] == "mine" and runs[0].init["resume"] == "never"
    assert watched == [(t.unwrapped, {"log": "gradients", "log_freq": 100})]
    runs, watched = _wandb(monkeypatch)
    monkeypatch.setenv("WANDB_WATCH", "all")  # logging_steps a share of max_steps: transformers' absolute count
    from transformers import TrainerCallback

    class StopAtOne(TrainerCallback):  # the plan is 1000 steps; one is enough to see the watch
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = True

    long = _trainer(tmp_path, tokenizer, max_steps=1000, logging_steps=0.5, report_to=["wandb"],
                    overwrite_output_dir=True)
    long.add_callback(StopAtOne)
    long.train()
    assert watched[0][1] == {"log": "all", "log_freq": 500}
    runs, watched = _wandb(monkeypatch)
    monkeypatch.setenv("WANDB_WATCH", "all")  # sized by epochs: the planned steps' share (max_steps -1 in the config)
    by_epochs = _trainer(tmp_path, tokenizer, max_steps=-1, num_train_epochs=1000, logging_steps=0.5,
                         report_to=["wandb"], overwrite_output_dir=True)
    by_epochs.add_callback(StopAtOne)
    by_epochs.train()
    assert by_epochs.state.logging_steps > 1000 and watched[0][1]["log_freq"] == by_epochs.state.logging_steps
    runs, watched = _wandb(monkeypatch)
    _trainer(tmp_path, tokenizer, max_steps=1, report_to=["wandb"], overwrite_output_dir=True).train()
    assert runs[0].init["project"] == "huggingface" and runs[0].init["resume"] == "allow" and watched == []


def test_tensorboard_as_transformers_writes_it(tmp_path, tokenizer, monkeypatch):
    """TensorBoardCallback: texts `args` (the config as JSON) and `model_config`, scalars (bools included) at
    state.global_step under rewrite_logs' names, text values as text; output_dir/runs/<date>_<host> or
    $TENSORBOARD_LOGGING_DIR; tensorboardX's writer when torch's cannot be imported."""
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_Writer))
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    _Writer.made = []
    t = _trainer(tmp_path, tokenizer, max_steps=2, report_to="tensorboard", eval_strategy="steps", eval_steps=2)
    t.train()
    writer = _Writer.made[0]
    assert writer.log_dir.startswith(str(tmp_path / "run" / "runs") + "/")
    assert json.loads(writer.texts["args"][0])["max_steps"] == 2
    assert json.loads(writer.texts["model_config"][0])["vocab_size"] == t.model.config.vocab_size
    steps = {k: [s for name, _, s in writer.scalars if name == k] for k in ("train/loss", "eval/reward")}
    assert steps == {"train/loss": [1, 2], "eval/reward": [2]}
    logger = MetricsLogger(str(tmp_path / "unit"), ["tensorboard"], enabled=True, config={})
    logger.log(5, {"flag": True, "note": "hi", "gone": None})
    logger.close()
    unit = _Writer.made[-1]
    assert unit.scalars == [("train/flag", True, 5)] and unit.texts["train/note"] == ("hi", 5)
    # tensorboardX alone: transformers' is_tensorboard_available and its SummaryWriter fallback
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "tensorboard")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else (
        object() if n == "tensorboardX" else real(n, *a)))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=_Writer))
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    assert resolve_report_to("tensorboard") == ["tensorboard"]
    MetricsLogger(str(tmp_path / "x"), ["tensorboard"], enabled=True, config={}).close()
    assert _Writer.made[-1].log_dir == str(tmp_path / "tb")


def test_report_to_spellings_and_errors(monkeypatch):
    """transformers' spellings: "none" / ["none"] / None → none, "all" / ["all"] → the installed trackers, a string →
    [it]. transformers' other integrations (trackio, mlflow, …) are an error naming the field and the fix; a
    tracker that is not installed names the extra to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.delitem(sys.modules, "trackio", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "wandb" else (
        None if n in ("tensorboard", "tensorboardX", "trackio") else real(n, *a)))
    assert resolve_report_to("all") == resolve_report_to(["all"]) == ["wandb"]
    assert resolve_report_to("none") == resolve_report_to(["none"]) == resolve_report_to(None) == []
    assert resolve_report_to("wandb") == ["wandb"] and GRPOConfig(report_to="wandb").report_to == ["wandb"]
    for name in ("mlflow", "comet_ml", "swanlab"):
        with pytest.raises(ConfigError, match=rf"report_to='{name}': groupwise reports to \['tensorboard', 'wandb', "
                                              rf"'trackio'\] "
                                              rf"only .* drop '{name}' from report_to"):
            GRPOConfig(report_to=["wandb", name])
    with pytest.raises(ConfigError, match=r"report_to='tensorboard' needs `pip install groupwise\[tensorboard\]` "
                                          r"\(or drop it from report_to\)"):
        GRPOConfig(report_to="tensorboard")
    assert tracker_names({"eval_reward": 1, "test_x": 2, "evaluation": 3, "train/skipped_steps": 4}) == {
        "eval/reward": 1, "test/x": 2, "train/evaluation": 3, "train/skipped_steps": 4}  # not train/train/…


def test_a_tracker_failing_mid_run_stops_the_run_as_transformers_callbacks_do(tmp_path, tokenizer, monkeypatch):
    """A tracker's log raising (transformers' on_log callback raising) ends train() with that error; the line was
    written to metrics.jsonl first, and the wandb run is finished as failed (exit code 1)."""
    runs, _ = _wandb(monkeypatch, fail_at=2)
    t = _trainer(tmp_path, tokenizer, max_steps=3, report_to=["wandb"])
    with pytest.raises(ConnectionError, match="wandb went away"):
        t.train()
    assert [m["train/global_step"] for m in runs[0].logged] == [1] and runs[0].finished == 1
    assert [json.loads(x)["step"] for x in training_lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def test_trackio_gets_what_transformers_trackio_callback_logs(tmp_path, tokenizer):
    """report_to='trackio' (real trackio, its local store, read back): the run `run_name` in `project`, the config
    with the model's, each log line under tracker_names with train/global_step and without the end-of-training
    values, TRL's completions table; a resume goes on logging into the same run (trackio's resume='allow')."""
    from trackio.sqlite_storage import SQLiteStorage

    project = f"groupwise-test-{tmp_path.name}"
    t = _trainer(tmp_path, tokenizer, max_steps=2, logging_steps=1, save_steps=1, report_to="trackio",
                 project=project, run_name="first", log_completions=True, eval_strategy="steps", eval_steps=2)
    t.train()
    logs = SQLiteStorage.get_logs(project, "first")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in logs if "train/loss" in x]
    assert [x["train/global_step"] for x in train] == [1, 2]
    for logged, line in zip(train, [x for x in lines if "loss" in x]):
        assert logged["train/reward"] == pytest.approx(line["reward"])
        assert logged["train/learning_rate"] == pytest.approx(line["learning_rate"])
    assert any("eval/reward" in x and x["train/global_step"] == 2 for x in logs)
    assert not any("train/train_runtime" in x or "train/total_flos" in x for x in logs)  # SUMMARY_ONLY
    tables = [x["completions"] for x in logs if "completions" in x]
    assert len(tables) == 2 and {row["step"] for row in tables[0]["_value"]} == {1}
    config = SQLiteStorage.get_run_config(project, "first")
    assert config["project"] == project and config["learning_rate"] == t.args.learning_rate
    assert config["hidden_size"] == 32  # the model's config, under the arguments (transformers)
    resumed = _trainer(tmp_path, tokenizer, max_steps=3, logging_steps=1, save_steps=1, report_to="trackio",
                       project=project, run_name="first", resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    resumed.train()
    steps = [x["train/global_step"] for x in SQLiteStorage.get_logs(project, "first") if "train/loss" in x]
    assert steps == [1, 2, 3]


def test_trackios_fields_as_transformers_reads_them():
    """project, trackio_space_id and trackio_bucket_id are read (transformers' defaults); no static Space is made,
    so trackio_static_space_id may only say so (None / False)."""
    assert (GRPOConfig().project, GRPOConfig().trackio_space_id, GRPOConfig().trackio_bucket_id) == \
        ("huggingface", None, None)
    assert GRPOConfig(trackio_static_space_id=False).trackio_static_space_id is False
    with pytest.raises(ConfigError, match=r"trackio_static_space_id='me/static' is not supported by groupwise: "
                                          r"report_to 'trackio' makes no static Space"):
        GRPOConfig(trackio_static_space_id="me/static")


def test_warnings_above_bars_writes_a_warning_on_its_own_line_and_puts_the_hook_back(capsys):
    """`prm train`'s loop: within warnings_above_bars a warning raised while a bar is drawn is written on its own
    line (tqdm clears the bar first), not after the bar's text; the hook from before is back after the block, and
    left alone when something else replaced it inside."""
    import sys
    import warnings

    from tqdm import tqdm

    from groupwise.logging import warnings_above_bars

    def to_stderr(message, category, filename, lineno, file=None, line=None):  # Python's own, which pytest replaces
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = to_stderr
        with warnings_above_bars():
            bar = tqdm(total=3, desc="PRM", file=sys.stderr)
            bar.update(1)
            warnings.warn("a step without a label", UserWarning)
            bar.close()
        assert warnings.showwarning is to_stderr
        err = capsys.readouterr().err
        shown = [p for line in err.split("\n") for p in line.split("\r") if "UserWarning: a step without" in p]
        assert len(shown) == 1 and "PRM" not in shown[0] and "PRM" in err

        def other(*a, **k):
            pass
        with warnings_above_bars():
            warnings.showwarning = other  # a hook put over it inside the block stays
        assert warnings.showwarning is other


def test_the_warnings_hook_is_put_back_when_bars_end_in_any_order():
    """Two bars (two trainers, two threads) that end in the order they began left the first bar's hook installed
    for good (each bar restored only its own); one hook for all bars now, put back when the last one ends."""
    import warnings

    from groupwise.logging import hook_warnings, unhook_warnings

    def original(*a, **k):
        pass

    with warnings.catch_warnings():
        warnings.showwarning = original
        hook_warnings()  # bar A begins
        hook_warnings()  # bar B begins
        assert warnings.showwarning.shows is original
        unhook_warnings()  # A ends first
        assert warnings.showwarning.shows is original  # B still draws
        unhook_warnings()
        assert warnings.showwarning is original


def test_trim_jsonl_rewrites_line_by_line_keeping_other_runs_and_dropping_a_torn_line(tmp_path):
    """On resume at step 2: the run's lines of steps 3+ go, other runs' lines and lines without a run id at or
    before the step stay, a torn last line (no newline, not JSON) is dropped with a warning; keep_records=False
    (completions files) returns nothing, the file rewritten all the same."""
    import json

    from groupwise.logging import trim_jsonl

    lines = [{"step": 1, "run_id": "r"}, {"step": 2, "run_id": "other"}, {"step": 3, "run_id": "r"},
             {"step": 5, "run_id": "other"}, {"step": 2}]
    path = tmp_path / "eval_completions.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n" + '{"step": 4, "run_')
    with pytest.warns(RuntimeWarning, match=r"line 7 is not valid JSON"):
        assert trim_jsonl(path, 2, "r", keep_records=False) == []
    assert [json.loads(x) for x in path.read_text().splitlines()] == [lines[0], lines[1], lines[3], lines[4]]
    assert trim_jsonl(path, 2, "r") == [lines[0], lines[4]]  # the run's records (no run id counts as the run's)

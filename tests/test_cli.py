import json
import subprocess
import sys
from pathlib import Path

import pytest

from groupwise.cli import main, parse_overrides
from groupwise.config import ConfigError
from tests.conftest import training_lines


def test_parse_overrides():
    """Each value is read by its field's type: text stays text (numbers are checked as the field's type later, by
    GRPOConfig), a bare boolean is true, a YAML flow list is a list."""
    assert parse_overrides(["--beta", "0.1", "--bf16", "--report_to=[tensorboard]", "--loss-type", "grpo"]) == \
        {"beta": "0.1", "bf16": True, "report_to": ["tensorboard"], "loss_type": "grpo"}


def _config(tmp_path, model_dir, **extra):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"repeat {c}:", "letter": c}) + "\n" for c in "abcdabcd"))
    cfg = {"model_name_or_path": model_dir, "dataset_name": str(data),
           "reward_funcs": ["groupwise.tasks.toy:letter_reward"], "num_generations": 4,
           "per_device_train_batch_size": 8, "max_completion_length": 5, "logging_steps": 1,
           "output_dir": str(tmp_path / "run"), "learning_rate": "1e-3", **extra}
    path = tmp_path / "config.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_train_from_yaml_with_overrides_then_resume(tmp_path, model_dir):
    cfg = _config(tmp_path, model_dir)
    assert main(["train", cfg, "--max_steps", "2", "--save_steps", "1"]) == 0
    run = tmp_path / "run"
    assert [json.loads(x)["step"] for x in training_lines(run / "metrics.jsonl")] == [1, 2]
    assert (run / "checkpoint-2" / "model.safetensors").exists()
    assert main(["train", cfg, "--max_steps", "3", "--resume_from_checkpoint", str(run / "checkpoint-2")]) == 0
    assert [json.loads(x)["step"] for x in training_lines(run / "metrics.jsonl")] == [1, 2, 3]
    # true (YAML's boolean, or the string a script passes on) resumes the newest checkpoint, as transformers
    assert main(["train", cfg, "--max_steps", "4", "--resume_from_checkpoint", "true"]) == 0
    assert main(["train", cfg, "--max_steps", "5", "--resume_from_checkpoint", "True"]) == 0
    assert [json.loads(x)["step"] for x in training_lines(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_resume_from_a_checkpoint_that_is_not_there_is_named_before_the_model_loads(tmp_path, model_dir, capsys,
                                                                                    monkeypatch):
    import groupwise.trainer

    def no_model(*a, **k):
        raise AssertionError("the trainer was built")

    monkeypatch.setattr(groupwise.trainer, "GRPOTrainer", no_model)
    cfg = _config(tmp_path, model_dir)
    missing = str(tmp_path / "run" / "checkpoint-7")
    assert main(["train", cfg, "--resume_from_checkpoint", missing]) == 2
    err = capsys.readouterr().err
    assert f"resume_from_checkpoint={missing!r} does not exist; give a checkpoint-N folder" in err
    assert "not a checkpoint written by groupwise" not in err  # it is not there at all
    assert main(["train", cfg, "--resume_from_checkpoint", "true"]) == 2
    assert ("resume_from_checkpoint=True: no checkpoint-N folder in output_dir" in (err := capsys.readouterr().err)
            and "drop resume_from_checkpoint to start a new run, or set output_dir to the run to continue" in err)
    (tmp_path / "run" / "checkpoint-7").mkdir(parents=True)
    assert main(["train", cfg, "--resume_from_checkpoint", missing]) == 2
    assert "holds no trainer_state.json: not a checkpoint" in capsys.readouterr().err


def test_configuration_errors_exit_2_and_name_the_field(tmp_path, model_dir, capsys):
    cfg = _config(tmp_path, model_dir)
    assert main(["train", cfg, "--num_generations", "3"]) == 2
    assert "divisible by num_generations=3" in capsys.readouterr().err
    assert main(["train", cfg, "--use_vllm", "true", "--vllm_mode", "server",
                 "--vllm_server_base_url", "gen:8000"]) == 2
    assert "vllm_server_base_url='gen:8000' must be an http(s) URL" in capsys.readouterr().err
    assert main(["train", cfg, "--datset_name", "x"]) == 2
    assert "did you mean 'dataset_name'" in capsys.readouterr().err
    # GRPOTrainer's Python arguments are not config fields: named as such, with what to do instead
    assert main(["train", cfg, "--tools", "[calc]"]) == 2
    assert "tools is an argument of GRPOTrainer, not a config field: tools are Python functions" in \
        capsys.readouterr().err
    assert main(["train", cfg, "--environment_factory", "Env"]) == 2
    assert "dataset_name: builtin:calculator" in capsys.readouterr().err
    # the trl command's launcher keys (TRL's CLI docs put them in the config): named, with accelerate launch
    for key, value in (("accelerate_config", "zero2"), ("num_processes", "4")):
        assert main(["train", cfg, f"--{key}", value]) == 2
        assert f"{key} is a key of the trl command's launcher, not a config field: launch with accelerate" in \
            capsys.readouterr().err


def test_a_file_missing_once_training_began_stops_the_run_and_is_not_a_configuration_error(tmp_path, model_dir,
                                                                                            capsys, monkeypatch):
    """Before training, a missing file is the user's input (exit 2); once train() has begun it is the run's (exit 1,
    'run stopped'), as a checkpoint folder deleted under a running job is."""
    import groupwise.trainer

    def vanished(self, *a, **k):
        raise FileNotFoundError(2, "No such file or directory", str(tmp_path / "run" / "checkpoint-1"))

    monkeypatch.setattr(groupwise.trainer.GRPOTrainer, "train", vanished)
    cfg = _config(tmp_path, model_dir)
    assert main(["train", cfg, "--max_steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "groupwise: run stopped: [Errno 2] No such file or directory" in err and "during training" in err
    assert "configuration error" not in err
    assert main(["train", cfg, "--max_steps", "1", "--dataset_name", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "none.jsonl" in err  # named before anything loads


def test_python_dash_m_entry_point(tmp_path, model_dir):
    cfg = _config(tmp_path, model_dir, max_steps=1)
    proc = subprocess.run([sys.executable, "-m", "groupwise", "train", cfg], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-1" / "config.json").exists()


def test_process_supervision_from_the_command_line(tmp_path, model_dir):
    cfg = _config(tmp_path, model_dir, supervision="process", reward_funcs=[], score_truncated_step=True,
                  process_reward_funcs=["tests.test_trainer:_steps_with_letter"])
    assert main(["train", cfg, "--max_steps", "1"]) == 0
    line = json.loads(training_lines(tmp_path / "run" / "metrics.jsonl")[-1])
    assert "process/step_reward_mean" in line and "reward" not in line


def test_demo_settings_without_its_before_after_table_are_named_before_the_policy_loads(tmp_path, capsys):
    """The table reads the evaluations of step 0 and of the last step: without them it printed the wrong numbers
    (eval_strategy no: 'after' was step 0's) or crashed after training (IndexError)."""
    out = ["--output_dir", str(tmp_path / "demo")]
    assert main(["train", "--eval_strategy", "no", *out]) == 2
    assert "eval_strategy='no': the builtin:arithmetic demo prints held-out accuracy before" in capsys.readouterr().err
    assert main(["train", "builtin:calculator", "--eval_on_start", "false", *out]) == 2
    assert "eval_on_start=False: the builtin:calculator demo" in capsys.readouterr().err
    assert main(["train", "builtin:arithmetic", "--step_split", "turn", *out]) == 2
    assert "builtin:arithmetic's completions are one turn of text" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_demo_runs_two_steps(tmp_path, capsys):
    """`groupwise train` with no config runs the embedded demo: shipped policy, process supervision, eval before and
    after, table, metrics with eval_rewards/accuracy/mean at step 0 and at the end, checkpoint, plot."""
    out = tmp_path / "demo"
    assert main(["train", "--max_steps", "2", "--output_dir", str(out)]) == 0
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    assert (out / "reward_accuracy.png").stat().st_size > 1000
    lines = [json.loads(x) for x in training_lines(out / "metrics.jsonl")]
    evals = [x for x in lines if "eval_rewards/accuracy/mean" in x]
    assert [x["step"] for x in evals] == [0, 2]
    assert 0.15 <= evals[0]["eval_rewards/accuracy/mean"] <= 0.5  # the shipped warm start leaves room for RL
    assert any("process/step_reward_mean" in x for x in lines)
    printed = capsys.readouterr().out
    assert "before" in printed and "supervision process, 2 steps, " in printed and "resumed" not in printed
    # resumed, the summary's time is this call's steps only, and says so
    assert main(["train", "--max_steps", "3", "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 0
    assert "3 steps, " in (printed := capsys.readouterr().out) and "(steps 3-3, resumed from checkpoint-2)" in printed


def test_builtin_task_brings_its_step_rewards(tmp_path):
    """`dataset_name: builtin:<task>` with supervision process uses the task's PROCESS_REWARD_FUNCS."""
    from groupwise.demo import POLICY_DIR

    out = tmp_path / "run"
    assert main(["train", "--model_name_or_path", str(POLICY_DIR), "--dataset_name", "builtin:arithmetic",
                 "--supervision", "process", "--max_steps", "1", "--num_generations", "4",
                 "--per_device_train_batch_size", "8", "--max_completion_length", "16", "--max_prompt_length", "null",
                 "--output_dir", str(out), "--save_steps", "0"]) == 0
    line = json.loads(training_lines(out / "metrics.jsonl")[-1])
    assert "process/step_correct/errors" in line and "rewards/accuracy/mean" in line
    assert main(["train", "--model_name_or_path", str(POLICY_DIR), "--dataset_name", "builtin:nope"]) == 2


def test_builtin_task_splits():
    """A built-in task's split is its held-out split: eval_dataset_name builtin:arithmetic evaluates on held-out
    problems (eval_split defaults to 'test'), never on training ones."""
    from groupwise.cli import load_dataset_spec
    from groupwise.tasks.splits import is_held_out

    assert all(is_held_out(r["problem"]) for r in load_dataset_spec("builtin:arithmetic", "test"))
    assert all(is_held_out(r["problem"]) for r in load_dataset_spec("builtin:arithmetic", None, default="test"))
    assert not any(is_held_out(r["problem"]) for r in load_dataset_spec("builtin:calculator", None))
    with pytest.raises(ConfigError, match="'train' and 'test'"):
        load_dataset_spec("builtin:calculator", "validation")
    # a slice in datasets' syntax (row numbers)
    test = load_dataset_spec("builtin:arithmetic", "test")
    assert load_dataset_spec("builtin:arithmetic", "test[:5]") == test[:5]
    assert load_dataset_spec("builtin:arithmetic", "test[10:-10]") == test[10:-10]
    with pytest.raises(ConfigError, match=r"split 'test\[:5%\]' of 'builtin:arithmetic'.*e.g. 'test\[:100\]'"):
        load_dataset_spec("builtin:arithmetic", "test[:5%]")
    assert len(load_dataset_spec("builtin:toy", None)) > 0
    with pytest.raises(ConfigError, match="builtin:toy.*no train/test split.*give eval_dataset_name: builtin:toy"):
        load_dataset_spec("builtin:toy", "test")
    # the run's seed draws the training problems (it was ignored: every config run trained on seed 0's); the
    # held-out problems are the same whatever the seed
    train = {s: load_dataset_spec("builtin:arithmetic", None, seed=s) for s in (0, 1)}
    assert train[0] != train[1] and len(train[1]) == 2000
    assert not any(is_held_out(r["problem"]) for r in train[1])
    assert load_dataset_spec("builtin:arithmetic", "test", seed=1) == test
    assert load_dataset_spec("builtin:toy", None, seed=1) != load_dataset_spec("builtin:toy", None)
    from groupwise.script_args import load_mixture  # a built-in task inside a datasets: mixture takes it too

    mixed = [load_mixture([{"path": "builtin:arithmetic"}], streaming=False, seed=s) for s in (0, 1)]
    assert list(mixed[1]) == train[1] and list(mixed[0]) == train[0]
    # and evaluation rows read from a training split (builtin:toy has only that) are the rows the run trains on
    from types import SimpleNamespace

    from groupwise.script_args import RUN_FIELDS, load_run_datasets

    run = {**{k: d for k, (_, d, _) in RUN_FIELDS.items()}, "dataset_name": "builtin:toy",
           "eval_dataset_name": "builtin:toy"}
    args = SimpleNamespace(seed=1, eval_strategy="steps", eval_on_start=False)
    rows, held = load_run_datasets(run, args)
    assert rows == held == load_dataset_spec("builtin:toy", None, seed=1)
    assert load_run_datasets(run, args, evaluation=True)[1] == rows


def test_help_piped_to_head_and_groupwise_demo(capsys):
    proc = subprocess.run(f"{sys.executable} -m groupwise train --help | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("usage: groupwise train") and "Traceback" not in proc.stderr
    with pytest.raises(SystemExit):  # argparse's usage error, exit 2, naming where the demo is
        main(["demo"])
    assert "the demo is `groupwise train`" in capsys.readouterr().err


def test_config_run_of_the_calculator_task(tmp_path):
    """`dataset_name: builtin:calculator` from a config: the task brings its environment (CalculatorEnv, whose
    get_reward is the outcome reward), so no reward_funcs are needed."""
    import yaml

    from groupwise.demo import CALCULATOR_POLICY_DIR

    out = tmp_path / "run"
    cfg = tmp_path / "calculator.yaml"
    cfg.write_text(yaml.safe_dump({
        "model_name_or_path": str(CALCULATOR_POLICY_DIR), "dataset_name": "builtin:calculator", "max_steps": 1,
        "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 160,
        "max_prompt_length": None, "max_tool_calling_iterations": 5, "save_steps": 0,
        "per_device_eval_batch_size": 8}))
    common = ["train", str(cfg)]
    # the held-out split's first 16 problems (two eval batches): all 2000 through the tool loop took most of a minute
    assert main([*common, "--eval_dataset_name", "builtin:calculator", "--eval_split", "test[:16]", "--eval_strategy",
                 "steps", "--eval_steps", "1", "--output_dir", str(out)]) == 0
    lines = [json.loads(x) for x in training_lines(out / "metrics.jsonl")]
    train = [x for x in lines if "rewards/CalculatorEnv/mean" in x]
    assert train and train[-1]["tools/call_frequency"] > 0
    assert any("eval_rewards/CalculatorEnv/mean" in x for x in lines)  # held-out problems, through the tool loop
    # process supervision reads the environment's per-turn rewards: with step_split turn it trains ...
    assert main([*common, "--supervision", "process", "--step_split", "turn", "--output_dir", str(tmp_path / "p")]) == 0
    line = json.loads(training_lines(tmp_path / "p" / "metrics.jsonl")[-1])
    assert line["process/CalculatorEnv.get_step_rewards/errors"] == 0 and line["process/steps_per_completion"] > 2
    # ... and with a text split it is refused before the model loads, naming the fix
    assert main([*common, "--supervision", "process", "--output_dir", str(tmp_path / "q")]) == 2
    assert not (tmp_path / "q").exists()


def test_an_unknown_command_names_the_nearest_one_and_trls(capsys):
    """`groupwise trian` and TRL's `grpo` were 'unknown command' alone."""
    for command, hint in (("trian", "did you mean 'train'?"), ("grpo", "TRL's `trl grpo --config X` is `groupwise "
                                                                         "train X`"), ("zzz", "(commands: train,")):
        with pytest.raises(SystemExit) as stop:
            main([command, "x.yaml"])
        assert stop.value.code == 2 and f"unknown command {command!r}" in (err := capsys.readouterr().err), err
        assert hint in err, err


def test_a_jsonl_file_with_a_broken_line_names_the_line():
    """Arrow said 'JSON parse error: Invalid encoding in string. in row 5' for line 6 cut in the middle."""
    import tempfile

    from groupwise.script_args import load_dataset_spec

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "data.jsonl"
        rows = [json.dumps({"prompt": f"p{i}"}) for i in range(5)] + ['{"prompt": "cut in the mid']
        path.write_text("\n".join(rows) + "\n")
        with pytest.raises(ConfigError, match=r"^dataset_name='.*data\.jsonl': line 6 is not valid JSON "
                                              r"\(Unterminated string .*\): fix or delete it$"):
            load_dataset_spec(str(path), None)

"""Fault injection: what a careless or unlucky user sees — exit code, first line of the message — and that nothing
is lost. Every case of the reliability issue has a test here or, for checkpoints (previous runs, faults during
saves, corrupted or mismatched checkpoints), in tests/test_faults_checkpoints.py (small models, short timeouts)."""

import json
import math
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from groupwise import ConfigError, GRPOTrainer
from groupwise.checkpoint import verify_checkpoint
from groupwise.cli import main
from groupwise.core.advantages import outcome_advantages
from groupwise.rewards import compute_rewards, load_reward_sources
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines
from tests.faults_support import ROOT, _config, _exit_and_first_line, _length, _run_script, _trainer
from tests.launcher import torchrun


# ---- 1. configuration errors: exit 2, one line naming the field or file, before anything loads ---------------------
def test_trl_s_dotted_reward_path_imports_the_function():
    """TRL's grpo script reads `my_lib.rewards.custom_reward` as module + function; 'module:function' too."""
    from groupwise.rewards.sources import resolve_spec

    assert resolve_spec("tests.test_faults._length", "reward_funcs[0]") is _length
    assert resolve_spec("tests.test_faults:_length", "reward_funcs[0]") is _length


@pytest.mark.parametrize("override, first_line", [
    (["--learning_rate", "nan"], "learning_rate must be a finite number, got nan"),
    (["--beta", "inf"], "beta must be a finite number, got inf"),
    (["--max_grad_norm", "-inf"], "max_grad_norm must be a finite number"),
    (["--max_steps", "-5"], "max_steps must be ≥ -1, got -5"),
    (["--model_name_or_path", "./no/such/model"], "model_name_or_path='./no/such/model' does not exist"),
    (["--dataset_name", "data/trian.jsonl"], "dataset_name='data/trian.jsonl' does not exist"),
    (["--reward_funcs", "[tests.test_faults.nothing]"], "reward_funcs[0]='tests.test_faults.nothing': cannot import it"),
    (["--reward_funcs", "[tests.test_faults:nothing]"], "reward_funcs[0]='tests.test_faults:nothing': cannot import it"),
    (["--output_dir", "a\x00b"], "output_dir='a\\x00b' is not a usable folder name"),
])
def test_config_errors_exit_2_with_one_line(tmp_path, model_dir, capsys, override, first_line):
    code, line = _exit_and_first_line(capsys, ["train", _config(tmp_path, model_dir), *override])
    assert code == 2 and line.startswith("groupwise: configuration error: ") and first_line in line
    assert not (tmp_path / "run").exists()  # nothing was started


def test_hub_ids_pass_and_local_looking_paths_must_exist(tmp_path):
    from groupwise.config_base import check_location

    for hub_id in ("gpt2", "Qwen/Qwen2.5-0.5B", "peiyi9979/math-shepherd-mistral-7b-prm"):
        assert check_location(hub_id, "model_name_or_path") == "hub"
    assert check_location(str(tmp_path), "model_name_or_path") == "local"
    for path in ("./model", "/no/such", "~/model", "org/name/extra", "x/y/", "data.jsonl"):
        with pytest.raises(ConfigError, match="does not exist"):
            check_location(path, "model_name_or_path")


def test_a_model_folder_without_a_saved_model_is_named(tmp_path, model_dir, capsys):
    (tmp_path / "empty").mkdir()
    code, line = _exit_and_first_line(capsys, ["train", _config(tmp_path, model_dir), "--model_name_or_path",
                                               str(tmp_path / "empty")])
    assert code == 2 and f"model_name_or_path='{tmp_path / 'empty'}' is a folder without config.json" in line
    with pytest.raises(ConfigError, match="is a folder without config.json"):
        GRPOTrainer(str(tmp_path / "empty"), _length, args=small_args(tmp_path), train_dataset=toy.dataset(4))
    (tmp_path / "good.jsonl").write_text('{"prompt": "a"}\n')  # a file: was transformers' "not a valid JSON file"
    code, line = _exit_and_first_line(capsys, ["train", _config(tmp_path, model_dir), "--model_name_or_path",
                                               str(tmp_path / "good.jsonl")])
    assert code == 2 and line.endswith(f"model_name_or_path='{tmp_path / 'good.jsonl'}' is a file, not a model "
                                       "folder: give a folder holding config.json and the weights "
                                       "(model.save_pretrained(folder)), or a hub id")


def test_a_reward_keyword_no_column_fills_is_found_before_training(tmp_path, tokenizer):
    def needs_letter(completions, letter, **_):
        return [0.0] * len(completions)

    def optional(completions, letter=None, trainer_state=None, **_):
        return [0.0] * len(completions)

    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    rows = [{"prompt": "repeat a:", "answer": "a"}] * 4
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\] 'needs_letter' needs the keyword 'letter': "
                                          r"train_dataset has no column 'letter' \(columns: \['answer', 'prompt'\]\)"):
        GRPOTrainer(model, [optional, needs_letter], args=small_args(tmp_path), train_dataset=rows,
                    processing_class=tokenizer)
    rows = [{"prompt": "repeat a:", "letter": "a"}] * 4
    with pytest.raises(ConfigError, match="remove_unused_columns=True passes only the prompt: set it False"):
        GRPOTrainer(model, [needs_letter], args=small_args(tmp_path, remove_unused_columns=True), train_dataset=rows,
                    processing_class=tokenizer)
    GRPOTrainer(model, [needs_letter, optional], args=small_args(tmp_path), train_dataset=rows,
                processing_class=tokenizer)  # filled by the column

    def needs_prompt(prompt, completions, **_):  # TRL's keyword is `prompts`; the column `prompt` is never passed
        return [0.0] * len(completions)

    def needs_completion(completions, completion, **_):  # a reference column named `completion`: never passed
        return [0.0] * len(completions)

    # the errors sent the user around in a circle: "has no column 'prompt' (columns: ['prompt', …])" with
    # remove_unused_columns=False, "set it False" with True
    for remove in (False, True):
        with pytest.raises(ConfigError, match=r"'needs_prompt' needs the keyword 'prompt': the 'prompt' column is "
                                              r"never passed to reward functions \(as in TRL\); read 'prompts'"):
            GRPOTrainer(model, [needs_prompt], args=small_args(tmp_path, remove_unused_columns=remove),
                        train_dataset=rows, processing_class=tokenizer)
    with pytest.raises(ConfigError, match=r"'needs_completion' needs the keyword 'completion': the 'completion' "
                                          r"column is never passed .*; read 'completions'.*or rename the column"):
        GRPOTrainer(model, [needs_completion], args=small_args(tmp_path), processing_class=tokenizer,
                    train_dataset=[{"prompt": "repeat a:", "completion": "a"}] * 4)

    def doc_spelling(completions_ids, **_):  # TRL's docs spell the keyword so (TRL 1.16 fails on it too)
        return [0.0] * len(completions_ids)

    with pytest.raises(ConfigError, match=r"needs the keyword 'completions_ids': .*has no column 'completions_ids' "
                                          r".*; did you mean the keyword 'completion_ids', which every call gets\?"):
        GRPOTrainer(model, [doc_spelling], args=small_args(tmp_path), train_dataset=rows, processing_class=tokenizer)


def test_a_column_named_as_a_reward_keyword_and_a_step_functions_missing_column_are_named(tmp_path, tokenizer):
    """A dataset column `prompts` (or `steps`, common in PRM data) would collide with the keyword of that name at
    every call: blamed on the reward function, or every row NaN with on_reward_error='nan' (zero process advantages,
    training going on). A step-reward function's required keyword is checked as an outcome function's. Both before
    the model loads; remove_unused_columns=True (no column passed) has no collision."""
    def steps_fn(prompts, completions, steps, solution, **_):
        return [[0.0] * len(s) for s in steps]

    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    process = small_args(tmp_path, supervision="both")
    for column in ("prompts", "trainer_state"):
        with pytest.raises(ConfigError, match=rf"train_dataset has a column '{column}', which is also a keyword every "
                                              rf"reward_funcs function receives: rename the column"):
            GRPOTrainer(model, [_length], args=small_args(tmp_path), train_dataset=[{"prompt": "a:", column: 1}] * 4,
                        processing_class=tokenizer)
    rows = [{"prompt": "a:", "steps": ["x"], "solution": "a"}] * 4
    with pytest.raises(ConfigError, match=r"train_dataset has a column 'steps', which is also a keyword every "
                                          r"process_reward_funcs function receives"):
        GRPOTrainer(model, [_length], args=process, train_dataset=rows, processing_class=tokenizer,
                    process_reward_funcs=[steps_fn])
    GRPOTrainer(model, [_length], args=small_args(tmp_path), train_dataset=rows, processing_class=tokenizer)  # outcome
    rows = [{"prompt": "a:", "answer": "a"}] * 4
    with pytest.raises(ConfigError, match=r"process_reward_funcs\[0\] 'steps_fn' needs the keyword 'solution': "
                                          r"train_dataset has no column 'solution'"):
        GRPOTrainer(model, [_length], args=process, train_dataset=rows, processing_class=tokenizer,
                    process_reward_funcs=[steps_fn])
    GRPOTrainer(model, [_length], args=process, train_dataset=[{**r, "solution": "a"} for r in rows],
                processing_class=tokenizer, process_reward_funcs=[steps_fn])


def test_one_reward_spec_given_as_a_string_is_a_list_of_one(tmp_path, model_dir):
    from groupwise.cli import build_run

    run, _ = build_run({"model_name_or_path": model_dir, "reward_funcs": "groupwise.tasks.toy:letter_reward",
                        "output_dir": str(tmp_path / "run")})
    assert run["reward_funcs"] == ["groupwise.tasks.toy:letter_reward"]
    with pytest.raises(ConfigError, match="reward_funcs=3: give a list"):
        build_run({"model_name_or_path": model_dir, "reward_funcs": 3, "output_dir": str(tmp_path / "run")})


def test_config_file_errors_exit_2(tmp_path, capsys):
    code, line = _exit_and_first_line(capsys, ["train", str(tmp_path / "missing.yaml")])
    assert code == 2 and "config file" in line and "does not exist" in line
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: [unclosed\n")
    code, line = _exit_and_first_line(capsys, ["train", str(bad)])
    assert code == 2 and "not valid YAML at line 2" in line
    # a key given twice: PyYAML kept the last one silently (a run of max_steps 3 where 2 was meant, or the reverse)
    bad.write_text("model_name_or_path: m\nmax_steps: 2\nlearning_rate: 1e-5\nmax_steps: 3\n")
    code, line = _exit_and_first_line(capsys, ["train", str(bad)])
    assert code == 2 and "not valid YAML at line 4, column 1: the key 'max_steps' is given twice (lines 2 and 4): " \
                         "keep one" in line
    code, line = _exit_and_first_line(capsys, ["train", "--dataset_name", "builtin:toy"])
    assert code == 2 and "dataset_name is set but model_name_or_path is not" in line


def test_debug_shows_the_traceback(tmp_path, model_dir, capsys):
    # with the exit code of the error (2), as without --debug
    assert main(["train", _config(tmp_path, model_dir), "--learning_rate", "nan", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConfigError: learning_rate must be a finite number" in err


# ---- 2. the dataset, checked whole before the model loads -------------------------------------------------------------
def test_bad_rows_are_found_before_the_model_loads(tmp_path, model_dir, capsys):
    rows = [{"prompt": "repeat a:"}] * 3 + [{"prompt": "  "}] + [{"prompt": "repeat b:"}] * 3 + [{"prompt": []}]
    code, line = _exit_and_first_line(capsys, ["train", _config(tmp_path, model_dir, rows=rows)])
    assert code == 2 and "train_dataset row 3 has an empty prompt; 2 of 8 rows are unusable" in line
    rows = [{"prompt": [{"role": "user", "content": None}]}]
    with pytest.raises(ConfigError, match=r"row 0 has message 0 that is not a \{'role': str, 'content': str \| "
                                          r"content blocks\} dict \(content None only for an assistant turn\)"):
        GRPOTrainer("./not/loaded", _length, args=small_args(tmp_path), train_dataset=rows)


def test_empty_dataset_names_the_file(tmp_path, model_dir, capsys):
    cfg = _config(tmp_path, model_dir)
    Path(yaml.safe_load(Path(cfg).read_text())["dataset_name"]).write_text("")
    code, line = _exit_and_first_line(capsys, ["train", cfg])
    assert code == 2 and "prompts.jsonl' is empty" in line
    with pytest.raises(ConfigError, match="train_dataset is empty"):
        GRPOTrainer("./not/loaded", _length, args=small_args(tmp_path), train_dataset=[])


def test_prompt_lengths_against_max_prompt_length_and_positions(tmp_path, tokenizer):
    long = [{"prompt": "repeat " + "a" * 40 + ":", "letter": "a"}] + toy.dataset(7)  # every row: the same columns
    with pytest.raises(ConfigError, match=r"train_dataset row 0 has \d+ prompt tokens > max_prompt_length=12 "
                                          r"\(1 of 8 rows\)"):
        GRPOTrainer(toy.build_model(tokenizer, hidden_size=32), _length, processing_class=tokenizer,
                    train_dataset=long, args=small_args(tmp_path, max_prompt_length=12, truncate_prompt="error"))
    with pytest.warns(UserWarning, match=r"1 of 8 prompts longer than max_prompt_length=12 tokens are cut from the left"):
        GRPOTrainer(toy.build_model(tokenizer, hidden_size=32), _length, processing_class=tokenizer,
                    train_dataset=long, args=small_args(tmp_path, max_prompt_length=12))
    # the toy model has 256 positions: a 250-token completion leaves no room for the prompts
    with pytest.raises(ConfigError, match=r"row 0: \d+ prompt tokens \+ max_completion_length=250 exceed the "
                                          r"model's 256 positions \(8 of 8 rows\)"):
        GRPOTrainer(toy.build_model(tokenizer, hidden_size=32), _length, processing_class=tokenizer,
                    train_dataset=toy.dataset(8), args=small_args(tmp_path, max_completion_length=250))


# ---- 3. non-finite values cannot hide ---------------------------------------------------------------------------------
def test_huge_rewards_keep_their_signal():
    # [1e20, 0, 0, 0]: mean 2.5e19, population std sqrt(7.5e39 / 4) = 4.3301e19 → [1.7321, −0.5774 ×3]
    adv = outcome_advantages(torch.tensor([[1e20, 0.0, 0.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(adv, torch.tensor([[1.7321, -0.5774, -0.5774, -0.5774]]), atol=1e-4)
    # [1e30, −1e30, 0, 0]: mean 0, std sqrt(2e60 / 4) = 7.0711e29 → [1.4142, −1.4142, 0, 0]
    adv = outcome_advantages(torch.tensor([[1e30, -1e30, 0.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(adv, torch.tensor([[1.4142, -1.4142, 0.0, 0.0]]), atol=1e-4)
    rewards, _ = compute_rewards(load_reward_sources([lambda completions, **_: [1e30, 0.0]]), ["p"] * 2, ["a", "b"],
                                 [[1], [2]], {})
    assert rewards.dtype == torch.float64 and rewards[0, 0].item() == 1e30


def test_infinite_reward_is_unscored_and_counted(tmp_path, tokenizer):
    with pytest.warns(RuntimeWarning, match=r"'<lambda>' returned ±inf for 1 row\(s\)"):
        rewards, errors = compute_rewards(load_reward_sources([lambda completions, **_: [math.inf, 1.0]]),
                                          ["p"] * 2, ["a", "b"], [[1], [2]], {})
    assert math.isnan(rewards[0, 0]) and rewards[1, 0] == 1.0 and errors.tolist() == [1.0]

    def inf_first(completions, **_):
        return [math.inf] + [float(len(c)) for c in completions[1:]]

    t = _trainer(tmp_path, tokenizer, reward=inf_first, max_steps=2)
    with pytest.warns(RuntimeWarning, match="returned ±inf"):
        metrics = t.train()
    assert metrics["train/skipped_steps"] == 0.0 and metrics["rewards/inf_first/errors"] == 1.0


def test_consecutive_non_finite_steps_stop_the_run(tmp_path, tokenizer, model_dir, capsys, monkeypatch):
    from groupwise.trainer import TrainingStopped

    t = _trainer(tmp_path, tokenizer, max_steps=10, beta=0.1, save_steps=0, max_consecutive_skipped_steps=3)
    with torch.no_grad():
        next(t.reference.model.parameters()).fill_(float("nan"))  # a reference model gone bad: every loss is NaN
    weights = {n: p.detach().clone() for n, p in t.unwrapped.named_parameters()}
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        with pytest.raises(TrainingStopped, match=r"3 optimizer steps in a row were skipped .*steps 1–3"):
            t.train()
    assert t.global_step == 3 and all(torch.equal(weights[n], p) for n, p in t.unwrapped.named_parameters())
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # the untrained policy was not saved as a result

    def stopped(self, resume_from_checkpoint=None):
        raise TrainingStopped("3 optimizer steps in a row were skipped")

    monkeypatch.setattr(GRPOTrainer, "train", stopped)
    code, line = _exit_and_first_line(capsys, ["train", _config(tmp_path, model_dir, output_dir=str(tmp_path / "cli"))])
    assert code == 1 and line == "groupwise: run stopped: 3 optimizer steps in a row were skipped"


def test_the_count_of_skipped_steps_in_a_row_survives_a_resume(tmp_path, tokenizer):
    """Steps 1-2 are skipped and checkpoint-2 is written; the resumed run stops after step 3, as the straight run
    does (the count restarted from 0 and allowed 2 more bad steps)."""
    from groupwise.trainer import TrainingStopped

    def bad_reference(t):
        with torch.no_grad():
            next(t.reference.model.parameters()).fill_(float("nan"))  # every loss is NaN
        return t

    kw = dict(max_steps=10, beta=0.1, save_steps=1, max_consecutive_skipped_steps=3)
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"), pytest.raises(TrainingStopped, match="1–3"):
        bad_reference(_trainer(tmp_path, tokenizer, out="straight", **kw)).train()
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"), pytest.raises(TrainingStopped, match="1–3"):
        bad_reference(_trainer(tmp_path, tokenizer, **kw)).train(
            resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))


# ---- 4. hung rewards and signals --------------------------------------------------------------------------------------
def test_reward_timeout_scores_the_call_nan_and_goes_on(tmp_path, tokenizer):
    calls = []

    def slow_once(completions, **_):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(3)
        return _length(completions)

    t = _trainer(tmp_path, tokenizer, reward=slow_once, max_steps=2, reward_timeout=0.5)
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match=r"'slow_once' did not return within reward_timeout=0.5 s: its 8 rows"):
        t.train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "run" / "metrics.jsonl")]
    assert lines[0]["rewards/slow_once/errors"] == 8.0 and lines[1]["rewards/slow_once/errors"] == 0.0
    assert time.perf_counter() - start < 30


@pytest.mark.slow
def test_a_hung_reward_does_not_keep_the_process_alive(tmp_path):
    proc = _run_script(tmp_path, f"""
        import threading, warnings
        from groupwise import GRPOTrainer
        from groupwise.tasks import toy
        from tests.conftest import small_args
        from pathlib import Path
        def hangs(completions, **_):
            threading.Event().wait()  # forever
        tok = toy.build_tokenizer()
        args = small_args(Path({str(tmp_path)!r}), max_steps=1, reward_timeout=1.0)
        warnings.simplefilter("ignore")
        GRPOTrainer(toy.build_model(tok, hidden_size=32), [hangs], args=args, train_dataset=toy.dataset(8),
                    processing_class=tok).train()
        print("finished")
    """)
    done = proc.wait(timeout=120)
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-2000:]


def _stop_with(tmp_path, model_dir, signum, **fields):
    """A CLI run (max_steps 500) sent `signum` once it has logged 2 lines: (its config, its exit, its stderr)."""
    cfg = _config(tmp_path, model_dir, max_steps=500, save_steps=0, **fields)
    proc = _run_script(tmp_path, f"""
        import sys
        from groupwise.cli import main
        sys.exit(main(["train", {cfg!r}]))
    """)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 90
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.2)
    sent = time.time()
    proc.send_signal(signum)
    done = proc.wait(timeout=60)
    assert time.time() - sent < 30, "did not stop within seconds"
    return cfg, done.returncode, done.stderr


@pytest.mark.slow
def test_a_signal_with_save_only_model_says_its_checkpoint_cannot_be_resumed(tmp_path, model_dir):
    _, code, err = _stop_with(tmp_path, model_dir, signal.SIGTERM, save_only_model=True)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "written (the model only: save_only_model=True, not resumable)" in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_with_a_checkpoint(tmp_path, model_dir, signum):
    cfg, code, err = _stop_with(tmp_path, model_dir, signum)
    assert code == 128 + signum, err[-2000:]
    ckpts = list((tmp_path / "run").glob("checkpoint-*"))
    assert len(ckpts) == 1 and f"stopped by {signal.Signals(signum).name} after step" in err
    assert f"{ckpts[0].name} written: resume it with resume_from_checkpoint=True (--resume_from_checkpoint " \
           "true)" in err
    verify_checkpoint(ckpts[0])  # complete and resumable
    assert main(["train", cfg, "--resume_from_checkpoint", str(ckpts[0]),
                 "--max_steps", str(int(ckpts[0].name.split("-")[1]) + 1)]) == 0


# ---- 7. several processes -------------------------------------------------------------------------------------------
def _torchrun(tmp_path, mode):
    """dist_worker.py MODE on 2 processes whose launcher never stops the survivor (torchrun would, the moment rank
    1 fails, and so hide whether groupwise stops it): the seconds until both exited."""
    start = time.perf_counter()
    proc = torchrun(ROOT / "tests" / "dist_worker.py", mode, tmp_path / "out", timeout=240, grace=240)
    return proc, time.perf_counter() - start


@pytest.mark.slow
def test_an_exception_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    proc, seconds = _torchrun(tmp_path, "fault_raises")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120
    assert "only on rank 1" in out and "a reward function failed on another process: RewardFunctionError" in out


@pytest.mark.slow
def test_an_error_every_rank_shares_lets_rank_0_finish_closing_before_the_others_exit(tmp_path):
    """A reward function raising on rank 1 stops every rank together (run_together). Rank 0 then closes its trackers
    (wandb's finish, the completions upload; here 6 s). The others wait for it at exit: a launcher stops every
    process once one exits (torchrun: SIGTERM, SIGKILL 30 s later; here 2 s), so a rank leaving at once got rank 0
    killed mid-close. Only an error of one process alone skips that wait (the next tests)."""
    start = time.perf_counter()
    proc = torchrun(ROOT / "tests" / "dist_worker.py", "fault_raises_slow_close", tmp_path / "out", timeout=240,
                    grace=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.perf_counter() - start < 120, out[-2000:]
    assert "only on rank 1" in out
    assert (tmp_path / "out" / "rank0_closed").exists(), out[-2000:]  # not killed while closing


@pytest.mark.slow
def test_a_process_leaving_with_a_collective_in_flight_does_not_wait_for_it(tmp_path):
    """destroy_process_group waits for the process's own collectives in flight (gloo: until the group's timeout,
    120 s here); a process leaving on its own error destroys its group from a thread it waits on 10 s at most."""
    proc, seconds = _torchrun(tmp_path, "inflight")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 1 leaves with a collective in flight" in out, out[-2000:]
    assert seconds < 60, (seconds, out[-2000:])


@pytest.mark.slow
def test_a_dead_rank_makes_the_others_exit_within_the_timeout(tmp_path):
    proc, seconds = _torchrun(tmp_path, "fault_dies")  # ddp_timeout=20 in the worker
    assert proc.returncode != 0 and seconds < 150, (seconds, proc.stderr[-2000:])


@pytest.mark.slow
def test_an_error_outside_a_shared_step_on_one_rank_does_not_wait_at_exit(tmp_path):
    """A callback raising on rank 1 only: rank 0 goes on into the next collective. Rank 1's exit waited in a barrier
    that gloo bounds on rank 0 only, so it stayed alive for ddp_timeout (30 min here) and the launcher, seeing no
    process exit, never stopped rank 0. Leaving on an error it now skips the barrier; its closed group ends rank 0's
    wait at once."""
    proc, seconds = _torchrun(tmp_path, "fault_callback")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120, (seconds, out[-2000:])
    assert "callback raised only on rank 1" in out
    # the script catching it and calling sys.exit (sys.last_value unset): train() marked the error as this process's
    proc, seconds = _torchrun(tmp_path / "caught", "fault_callback_caught")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120, (seconds, out[-2000:])
    assert "caught: callback raised only on rank 1" in out
    # a reward function calling sys.exit on rank 1: every process stops with it (rank 0 waited in the gather)
    proc, seconds = _torchrun(tmp_path / "exit", "fault_sysexit")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120, (seconds, out[-2000:])
    assert "a reward function failed on another process: SystemExit: 3" in out, out[-2000:]


def test_the_row_by_row_retry_keeps_the_timeout():
    """The batch call raises, so the rows are retried one by one; one row hangs: it is unscored, not a hang."""
    def bad_batch(completions, **_):
        if len(completions) > 1:
            raise ValueError("batch")
        if completions[0] == "hang":
            time.sleep(5)
        return [1.0]

    start = time.perf_counter()
    with pytest.warns(RuntimeWarning):
        rewards, errors = compute_rewards(load_reward_sources([bad_batch]), ["p"] * 2, ["ok", "hang"], [[1], [2]], {},
                                          on_error="nan", timeout=0.5)
    assert rewards[0, 0] == 1.0 and math.isnan(rewards[1, 0]) and errors.tolist() == [1.0]
    assert time.perf_counter() - start < 3


@pytest.mark.slow
def test_a_dataset_that_differs_between_processes_is_refused_on_every_process(tmp_path):
    """Rank 1's train_dataset is rank 0's reversed (same rows, same length: only the fingerprint tells): each
    process draws the same indices and a group's completions may be split between processes, so it would train on
    groups of different prompts. Every process refuses it, naming the dataset and the two digests; evaluate() with
    a dataset reversed on rank 1 likewise."""
    proc, seconds = _torchrun(tmp_path, "fault_shuffled")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120, (seconds, out[-2000:])
    said = re.findall(r"train_dataset differs between processes \(process 0: 16 rows, digest (\w+); process 1: "
                      r"16 rows, digest (\w+)\)", out)
    assert len(said) == 2 and said[0] == said[1] and said[0][0] != said[0][1], out[-3000:]  # each process, same text
    proc, seconds = _torchrun(tmp_path / "eval", "fault_shuffled_eval")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120, (seconds, out[-2000:])
    assert out.count("eval_dataset differs between processes (process 0: 8 rows") == 2, out[-3000:]


@pytest.mark.slow
def test_a_collective_that_waits_ddp_timeout_names_it_and_where(tmp_path):
    """Rank 1's reward function sleeps 18 s with no reward_timeout; rank 0 waits in the rewards' gather until
    ddp_timeout (10 s). It ended in gloo's own "Timed out waiting 10000ms for recv operation to complete", naming
    neither the setting nor the phase; now the error names the process, ddp_timeout, the phase and step, and the fix."""
    proc, seconds = _torchrun(tmp_path, "fault_stuck")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120, (seconds, out[-2000:])
    assert ("CollectiveTimeout: process 0 waited ddp_timeout=10 s for the other processes in a round › scoring the "
            "completions (reward functions) at step 1: one of them is stuck") in out, out[-3000:]
    assert "set reward_timeout" in out
    # rank 1, waking into the gather rank 0 has left, names it rather than gloo's "Connection closed by peer" alone
    assert "ProcessFailed: process 1: another process left during a round › scoring the completions" in out


def test_which_exits_wait_for_the_other_processes(monkeypatch, tmp_path):
    """An error of this process alone skips the exit barrier; one every process raised together (`shared`: a
    run_together failure, an agreed stop, a check made alike everywhere) keeps it. The CLI marks its error exits;
    an uncaught exception is read at exit from sys.last_value (set by the interpreter whatever sys.excepthook is)."""
    from groupwise import cli, distributed
    from groupwise.distributed import _leaving_alone, mark_failed, shared
    from groupwise.signals import interrupted

    monkeypatch.setattr(distributed, "_FAILED", False)
    monkeypatch.delattr(sys, "last_value", raising=False)
    monkeypatch.delattr(sys, "last_exc", raising=False)
    assert not _leaving_alone(at_exit=True)
    mark_failed(shared(ConfigError("on every process")))
    assert not _leaving_alone(at_exit=True)
    monkeypatch.setattr(sys, "last_value", interrupted(signal.SIGTERM, "stopped after step 3"), raising=False)
    assert not _leaving_alone(at_exit=True)  # an agreed stop (SIGTERM / Ctrl-C after a step) waits
    monkeypatch.setattr(sys, "last_value", KeyboardInterrupt(), raising=False)  # a second Ctrl-C: at once
    assert _leaving_alone(at_exit=True) and not _leaving_alone(at_exit=False)  # Trainer.end() reads no last_value
    monkeypatch.setattr(distributed, "_STALE", sys.last_value)  # set before the group: pytest's, IPython's
    assert not _leaving_alone(at_exit=True)
    monkeypatch.delattr(sys, "last_value")
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2  # the CLI's error exit
    assert _leaving_alone(at_exit=False)


@pytest.mark.slow
def test_save_model_on_the_main_process_alone_under_fsdp_names_what_to_do(tmp_path):
    """save_model() is a collective under fsdp: rank 0 calling it alone (transformers users write `if
    trainer.is_world_process_zero(): trainer.save_model()`) waits ddp_timeout (10 s here) for rank 1, or sees rank 1's
    exit close the connection, whichever comes first; either way it says where and what to do, where it ended in
    gloo's own error ("Timed out waiting …" / "Connection closed by peer")."""
    from tests.fsdp_support import launch

    proc = launch(tmp_path / "out", dict(max_steps=1, fsdp="full_shard", ddp_timeout=10, save_steps=0,
                                         save_model_main_only=True))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    said = re.search(r"groupwise\.distributed\.(\w+): process 0(?: waited ddp_timeout=10 s for the other processes in|: "
                     r"another process left during) save_model\(\) \(with fsdp or push_to_hub every process must call "
                     r"it\)", out)
    assert said and said.group(1) in ("CollectiveTimeout", "ProcessFailed"), out[-3000:]


def test_only_the_backend_s_own_errors_are_renamed_as_a_stuck_or_departed_process():
    """naming_stuck_collectives reads gloo's plain RuntimeErrors by their text; a reward function's HTTP error that
    says 'Connection reset by peer' is not one (it was renamed 'another process left', and lost its shared tag)."""
    import types

    from groupwise.distributed import Distributed, ProcessFailed, shared
    from groupwise.rewards.sources import RewardFunctionError
    from groupwise.trainer import GRPOTrainer

    fake = types.SimpleNamespace(world_size=2, rank=1, timeout=1800)

    def under(error):
        def score():  # a phase of PHASES
            raise error

        try:
            with Distributed.naming_stuck_collectives(fake, GRPOTrainer.PHASES, lambda names: "at step 5"):
                score()
        except Exception as e:  # noqa: BLE001
            return e

    judge = shared(RewardFunctionError("reward function 'judge' raised ConnectionError: ('Connection aborted.', "
                                       "ConnectionResetError(104, 'Connection reset by peer')) on row 3"))
    assert under(judge) is judge and judge.groupwise_shared
    http = RuntimeError("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))")
    assert under(http) is http
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:40371")
    renamed = under(gloo)
    assert isinstance(renamed, ProcessFailed) and str(renamed).startswith(
        "process 1: another process left during scoring the completions (reward functions) at step 5")

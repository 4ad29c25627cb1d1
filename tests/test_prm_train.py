import json
import os
import random

import pytest

from groupwise.cli import main
from groupwise.config import ConfigError
from groupwise.prm_train import PRMTrainConfig, read_step_jsonl, train_prm
from groupwise.rewards.prm import TokenClassificationPRM, load_prm


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _synthetic(n, seed):
    """A learnable rule: a step is bad (0) exactly when it contains 'x'."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        steps = ["".join(rng.choice("abcx") for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 3))]
        rows.append({"prompt": "q:", "steps": steps, "labels": [int("x" not in s) for s in steps]})
    return rows


def test_train_a_prm_then_use_it(tmp_path, model_dir):
    rows = _synthetic(240, 0)
    for r in rows[::2]:  # every other line in TRL's stepwise-supervision shape: the steps in `completions`
        r["completions"] = r.pop("steps")
    train = _write(tmp_path / "steps.jsonl", rows)
    out = tmp_path / "prm"
    # max_length 64 cuts nothing here (at most "q:" + 3 × (4 + "\n") = 17 tokens); it is recorded for scoring
    assert main(["prm", "train", "--model_name_or_path", model_dir, "--train_file", train, "--output_dir", str(out),
                 "--learning_rate", "3e-3", "--num_train_epochs", "4", "--per_device_train_batch_size", "16",
                 "--max_length", "64"]) == 0
    metrics = json.loads((out / "eval_metrics.json").read_text())
    # measured: step accuracy 0.547 (untrained head) → 0.981 on the held-out 10%; bad-step F1 0.983
    assert metrics["eval_before/accuracy"] < 0.8 and metrics["eval/accuracy"] >= 0.9
    assert metrics["eval/bad_f1"] >= 0.8
    assert json.loads((out / "groupwise_prm.json").read_text())["max_length"] == 64
    prm = load_prm(str(out))  # kind, separator and max_length recorded by the trainer
    assert isinstance(prm, TokenClassificationPRM) and prm.max_length == 64
    assert load_prm(str(out), max_length=8).max_length == 8  # a spec's own max_length wins
    good, bad = prm(prompts=["q:", "q:"], completions=["", ""], steps=[["abc"], ["axb"]])
    assert good[0] > 0.5 > bad[0]


def test_bad_step_files_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt": "q", "steps": ["a", "b"], "labels": [1]}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: 1 labels for 2 steps \(give 'labels' one label per step"):
        read_step_jsonl(str(p))
    p.write_text(json.dumps({"prompt": "q", "steps": ["a"]}) + "\n")
    with pytest.raises(ConfigError, match=r":1: missing 'labels'"):
        read_step_jsonl(str(p))
    p.write_text(json.dumps({"prompt": "q", "steps": ["a"], "labels": [2]}) + "\n")
    with pytest.raises(ConfigError, match=r"labels must be 0/1"):
        read_step_jsonl(str(p))
    p.write_text(json.dumps({"prompt": "q", "completions": "a", "labels": [1]}) + "\n")
    with pytest.raises(ConfigError, match=r":1: 'completions' must be a list of strings"):
        read_step_jsonl(str(p))
    p.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: not JSON"):
        read_step_jsonl(str(p))
    with pytest.raises(ConfigError, match="unknown field 'epochs'"):
        PRMTrainConfig(model_name_or_path="m", train_file="f", epochs=3)


def test_a_missing_train_file_is_named(tmp_path, model_dir, capsys):
    assert main(["prm", "train", "--model_name_or_path", model_dir, "--train_file", str(tmp_path / "steps.jsonl"),
                 "--output_dir", str(tmp_path / "out")]) == 2
    assert f"train_file='{tmp_path / 'steps.jsonl'}' does not exist" in capsys.readouterr().err


def test_a_multi_process_launch_is_refused_before_anything_loads(tmp_path, model_dir, capsys, monkeypatch):
    """Under torchrun every process would train the whole run into one output_dir (twice the work, two run ids
    racing over the checkpoints): one line, exit 2, before the data or the model is read."""
    from groupwise.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["prm", "train", "--model_name_or_path", model_dir, "--train_file", str(tmp_path / "none.jsonl"),
                 "--output_dir", str(tmp_path / "prm")]) == 2
    assert "prm train runs in one process, but WORLD_SIZE=2" in capsys.readouterr().err
    assert not (tmp_path / "prm").exists()


def test_steps_containing_the_separator_are_counted_in_a_warning(tmp_path, model_dir):
    """A step "ab\nc" with separator "\n" is labelled at its end only; GRPO's step_delimiter "\n" would make two
    steps of it, the first scored at a token the PRM never learned."""
    rows = _synthetic(16, 0)
    rows[0]["steps"][0] = "ab\nc"
    train = _write(tmp_path / "steps.jsonl", rows)
    with pytest.warns(UserWarning, match=r"1 step\(s\) of .* contain the separator '\\n'.*choose a separator no "
                                         r"step contains"):
        train_prm(PRMTrainConfig(model_name_or_path=model_dir, train_file=train, output_dir=str(tmp_path / "prm"),
                                 per_device_train_batch_size=8, num_train_epochs=1, max_length=64))


def test_a_missing_model_folder_is_one_line_exit_2(tmp_path, capsys):
    # it was a hub lookup, then a 77-line traceback and exit 1
    good = _write(tmp_path / "ok.jsonl", [{"prompt": "q", "steps": ["a", "b"], "labels": [1, 0]}] * 4)
    assert main(["prm", "train", "--model_name_or_path", str(tmp_path / "no-model"), "--train_file", good,
                 "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("groupwise: configuration error: model_name_or_path=") and "does not exist" in err
    assert len(err.strip().splitlines()) == 1


def test_config_flag_and_env_mapping_as_groupwise_train(tmp_path, model_dir, monkeypatch, capsys):
    # `prm train --config FILE` was "unknown field 'config'", and a config's env: mapping "unknown field 'env'"
    monkeypatch.delenv("GROUPWISE_PRM_TEST_VAR", raising=False)
    missing = tmp_path / "steps.jsonl"
    cfg = tmp_path / "prm.yaml"
    cfg.write_text(f"model_name_or_path: {model_dir}\ntrain_file: {missing}\nenv:\n  GROUPWISE_PRM_TEST_VAR: 1e3\n")
    assert main(["prm", "train", "--config", str(cfg), "--output_dir", str(tmp_path / "out")]) == 2
    # the file was read (its train_file is the one named missing) and its env: set first, as written
    assert f"train_file='{missing}' does not exist" in capsys.readouterr().err
    assert os.environ["GROUPWISE_PRM_TEST_VAR"] == "1e3"
    assert main(["prm", "train", str(cfg), "--config", str(cfg)]) == 2
    assert "two configs" in capsys.readouterr().err


def test_trl_stepwise_supervision_rows_are_read(tmp_path):
    # TRL's shape (prompt, completions, labels as bools) and groupwise's (steps, 0/1) give the same rows
    p = _write(tmp_path / "trl.jsonl", [{"prompt": "q", "completions": ["a", "b"], "labels": [True, False]},
                                        {"prompt": "r", "steps": ["c"], "labels": [1]}])
    assert read_step_jsonl(p) == [{"prompt": "q", "steps": ["a", "b"], "labels": [1, 0]},
                                  {"prompt": "r", "steps": ["c"], "labels": [1]}]


def test_a_bad_data_line_is_one_line_and_exit_2(tmp_path, model_dir, capsys):
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "q", "steps": ["a", "b"], "labels": [1]}])
    assert main(["prm", "train", "--model_name_or_path", model_dir, "--train_file", bad,
                 "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"groupwise: configuration error: {bad}:1: 1 labels for 2 steps (give 'labels' one label per step)\n"


def test_prm_train_help_lists_the_fields(capsys):
    assert main(["prm", "train", "--help"]) == 0
    out = capsys.readouterr().out
    for name, help_text, _, _ in PRMTrainConfig.describe():
        assert f"{name:32s} {help_text}" in out
    assert "max_length" in out and "Tokens kept per example" in out


def _gpt2_dir(tmp_path, tokenizer, n_positions):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=n_positions, n_embd=16, n_layer=1, n_head=2,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                               eos_token_id=tokenizer.eos_token_id)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_base_model_with_fewer_positions_than_max_length(tmp_path, tokenizer):
    # GPT-2 with 16 positions, max_length 1024 (the default): a 5-char prompt + 3 steps of 4 chars + "\n" = 20
    # tokens indexed past the position table (IndexError). The input now stops at 16 tokens: steps 1–2 (separators
    # at 9 and 14) are trained on, step 3 (19) is not, and scoring reads the same 16 (recorded max_length)
    from groupwise.prm_train import train_prm

    rows = [{"prompt": "q: ab", "steps": ["abcd", "xbcd", "abca"], "labels": [1, 0, 1]}] * 8
    cfg = PRMTrainConfig(model_name_or_path=_gpt2_dir(tmp_path, tokenizer, 16), output_dir=str(tmp_path / "prm"),
                         train_file=_write(tmp_path / "train.jsonl", rows), eval_file=_write(tmp_path / "e.jsonl", rows))
    metrics = train_prm(cfg)
    assert metrics["eval/steps"] == 16.0  # 8 rows × the 2 steps that fit
    assert json.loads((tmp_path / "prm" / "groupwise_prm.json").read_text())["max_length"] == 16
    prm = load_prm(str(tmp_path / "prm"))
    assert prm.max_length == 16 and prm(prompts=["q: ab"], completions=[""], steps=[rows[0]["steps"]])[0][2] is None


def test_batches_without_a_labelled_step_are_skipped(tmp_path, model_dir):
    # max_length 12: "q:" + "abc\n" + "xbc\n" = 10 tokens fit; a 20-char prompt leaves no step inside the limit.
    # 6 training rows, 3 of each, batch size 1, 2 epochs: 6 updates, not 12 — a batch with no labelled step made
    # a NaN loss (0 / 0) and still moved the weights through AdamW's momentum
    from groupwise.prm_train import train_prm

    short = {"prompt": "q:", "steps": ["abc", "xbc"], "labels": [1, 0]}
    long_ = {"prompt": "q" * 20, "steps": ["abc"], "labels": [1]}
    cfg = dict(model_name_or_path=model_dir, output_dir=str(tmp_path / "prm"), max_length=12,
               per_device_train_batch_size=1, num_train_epochs=2, eval_file=_write(tmp_path / "e.jsonl", [short]))
    metrics = train_prm(PRMTrainConfig(train_file=_write(tmp_path / "t.jsonl", [short, long_] * 3), **cfg))
    assert metrics["train/steps"] == 6.0 and metrics["train/examples"] == 6.0
    # nothing fits at all: an error naming max_length instead of a run that trains on nothing
    with pytest.raises(ConfigError, match=r"no step of .*t2.jsonl fits in max_length=12 tokens"):
        train_prm(PRMTrainConfig(train_file=_write(tmp_path / "t2.jsonl", [long_] * 3),
                                 **{**cfg, "output_dir": str(tmp_path / "prm2")}))  # (prm holds the finished run)


def test_schedule_warmup_and_clipping(tmp_path, model_dir):
    # 8 rows (eval_file given: none held out), batch 2, 1 epoch: 4 steps. linear with warmup_steps=2 (transformers):
    # the rate of step k (0-based) is lr·k/2 while k < 2, then lr·(4 − k)/(4 − 2): 1e-3 × [0, 1/2, 1, 1/2]
    from safetensors.torch import load_file

    from groupwise.prm_train import train_prm

    rows = _synthetic(8, 1)
    cfg = dict(model_name_or_path=model_dir, train_file=_write(tmp_path / "t.jsonl", rows),
               eval_file=_write(tmp_path / "e.jsonl", rows[:2]), per_device_train_batch_size=2, logging_steps=1)
    train_prm(PRMTrainConfig(output_dir=str(tmp_path / "a"), learning_rate=1e-3, warmup_steps=2, **cfg))
    log = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4]
    assert [x["learning_rate"] for x in log] == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])
    assert all(x["grad_norm"] > 0 and x["loss"] > 0 for x in log)
    # clipping to norm 1e-12: Adam's first step moves each weight by lr·g/(|g| + 1e-8) with |g| ≤ 1e-12, so
    # ≤ 0.1 × 1e-4 = 1e-5; unclipped the same step moves the new head's weights by about lr = 0.1
    moved = {}
    for name, clip in (("clipped", 1e-12), ("free", 0.0)):
        train_prm(PRMTrainConfig(output_dir=str(tmp_path / name), learning_rate=0.1, lr_scheduler_type="constant",
                                 max_grad_norm=clip, **{**cfg, "train_file": _write(tmp_path / "one.jsonl", rows[:2])}))
        moved[name] = load_file(str(tmp_path / name / "model.safetensors"))
    start = load_file(str(tmp_path / "tiny-model" / "model.safetensors"))  # the base's weights the PRM shares
    shared = [k for k in start if k in moved["clipped"] and start[k].shape == moved["clipped"][k].shape]
    assert shared and max((moved["clipped"][k] - start[k]).abs().max().item() for k in shared) < 1e-4
    assert max((moved["free"][k] - start[k]).abs().max().item() for k in shared) > 1e-2


def test_the_example_config_reads():
    from pathlib import Path

    import yaml

    path = Path(__file__).resolve().parent.parent / "examples" / "prm.yaml"
    cfg = PRMTrainConfig(**yaml.safe_load(path.read_text()))  # an unknown or mistyped field raises here
    assert cfg.separator == "\n" and cfg.warmup_steps == 100 and cfg.num_train_epochs == 10


def test_the_example_s_step_file_is_read_by_prm_train(tmp_path):
    """examples/make_prm_steps.py writes the steps.jsonl examples/prm.yaml names: worked solutions of the arithmetic
    task with some lines made wrong, labelled by the task's judge (a corrupted line 0, every true line 1)."""
    import runpy

    from groupwise.tasks import arithmetic

    make = runpy.run_path("examples/make_prm_steps.py")
    path = tmp_path / "steps.jsonl"
    make["main"](str(path), 40)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 40 and len(read_step_jsonl(str(path))) == 40
    for row in rows:
        truth = arithmetic.solution_lines(row["prompt"].removeprefix("Q: ").strip())
        assert row["labels"] == [int(s == t) for s, t in zip(row["steps"], truth)]
    labels = [x for row in rows for x in row["labels"]]
    assert 0 < labels.count(0) < labels.count(1)  # both kinds, mostly good steps
    # a held-out file of the test split, scored by the task's own judge through `groupwise prm eval` (as its
    # docstring says): the labels' source, so every metric is 1
    held = tmp_path / "held.jsonl"
    make["main"](str(held), 30, "test")
    test_prompts = {json.loads(line)["prompt"] for line in held.read_text().splitlines()}
    assert not test_prompts & {row["prompt"] for row in rows}
    out = tmp_path / "judge.json"
    assert main(["prm", "eval", "--process_reward_func", "groupwise.tasks.arithmetic:step_correct", "--eval_file",
                 str(held), "--output_file", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert all(metrics[f"eval/{k}"] == 1 for k in ("accuracy", "auroc", "bad_f1", "good_f1", "first_error_accuracy"))


def test_prm_help_and_a_bare_prm_say_the_usage(capsys):
    assert main(["prm", "--help"]) == 0  # was an argparse error (exit 2)
    assert "usage: groupwise prm train|eval [CONFIG.yaml | --config CONFIG.yaml]" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["prm"])
    assert e.value.code == 2 and "usage: groupwise prm train|eval [CONFIG.yaml" in capsys.readouterr().err


def test_a_signal_stops_prm_training_with_the_prm_so_far_saved(tmp_path, model_dir):
    """SIGTERM during `groupwise prm train`: the step in progress finishes, then the PRM trained so far is evaluated
    and saved (loadable, its eval_metrics.json counting the steps done of those planned), and the process exits
    with 128 + 15 and one line saying so. It was killed with nothing saved."""
    import signal
    import subprocess
    import sys
    import time

    train = _write(tmp_path / "steps.jsonl", _synthetic(400, 0))
    out = tmp_path / "prm"
    proc = subprocess.Popen([sys.executable, "-m", "groupwise", "prm", "train", "--model_name_or_path", model_dir,
                             "--train_file", train, "--output_dir", str(out), "--num_train_epochs", "50",
                             "--per_device_train_batch_size", "4", "--logging_steps", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "train_log.jsonl"
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "groupwise: stopped by SIGTERM after step" in stderr and "--resume_from_checkpoint true" in stderr, \
        stderr[-2000:]
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert 3 <= metrics["train/steps"] < metrics["train/planned_steps"] == 50 * 90  # 360 rows / 4 per step
    assert metrics["train/steps"] == len(log.read_text().splitlines())  # it stopped where its log stops
    assert "PRM step accuracy" in stdout
    assert isinstance(load_prm(str(out)), TokenClassificationPRM)
    # and a resumable checkpoint of that step (test_prm_checkpoint.py resumes them)
    from groupwise.checkpoint import read_state, resume_folder

    ckpt = resume_folder(True, out, command="prm train")
    assert ckpt == str(out / f"checkpoint-{int(metrics['train/steps'])}")
    assert read_state(ckpt)["step"] == metrics["train/steps"]  # (read_state verifies the checksums)


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_off_in_training_by_default_as_trl(tmp_path, model_dir, monkeypatch, disable):
    """TRL's PRMConfig.disable_dropout (True): the head's dropout 0.1 trained on; with it off each training forward
    is deterministic. Checked on the model at its first training step."""
    import torch

    import groupwise.prm_train as prm_train

    seen = []
    real_step = prm_train._train_step

    def step(model, *args, **kwargs):
        if not seen:
            seen.append(sorted({m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}))
        return real_step(model, *args, **kwargs)

    monkeypatch.setattr(prm_train, "_train_step", step)
    rows = _write(tmp_path / "t.jsonl", _synthetic(12, 0))
    prm_train.train_prm(PRMTrainConfig(model_name_or_path=model_dir, train_file=rows, output_dir=str(tmp_path / "o"),
                                       max_length=64, disable_dropout=disable))
    assert seen == [[0.0]] if disable else seen[0][-1] == 0.1


def test_a_separator_the_tokenizer_cannot_write_is_refused(tmp_path, model_dir):
    """The toy tokenizer has no 'ки': every separator became its unknown token and the PRM was trained to judge
    steps there, without a word."""
    from groupwise.prm_train import train_prm

    row = {"prompt": "q:", "steps": ["abc", "xbc"], "labels": [1, 0]}
    with pytest.raises(ConfigError, match=r"separator='ки' is not text the tokenizer of .* can write .* so every step "
                                          r"would be judged at its unknown token"):
        train_prm(PRMTrainConfig(model_name_or_path=model_dir, output_dir=str(tmp_path / "prm"), separator="ки",
                                 train_file=_write(tmp_path / "t.jsonl", [row] * 4)))

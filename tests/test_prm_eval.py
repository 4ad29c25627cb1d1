"""`groupwise prm eval` (groupwise.prm_eval): a step scorer against step labels. step_metrics by hand, AUROC against
a loop over pairs, a trained PRM evaluated on its held-out file = its training's eval_metrics.json, a step-reward
function with its dataset columns, and the inputs named."""

from __future__ import annotations

import json
import math
import random

import pytest

from groupwise.cli import main
from groupwise.prm_eval import _auroc, step_metrics
from groupwise.prm_train import PRMTrainConfig, train_prm


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_step_metrics_by_hand():
    # e1 scores .9 .2 .7 labels 1 0 1; e2 .6 .2 (third unscored) labels 1 1 0; e3 .8 .3 labels 1 1
    # scored pairs (score, gold): (.9,1) (.2,0) (.7,1) (.6,1) (.2,1) (.8,1) (.3,1): 7 steps, 1 unscored
    # judged good (> .5):          T      F      T      T      F      T      F  → right 5 of 7
    # good: tp 4 (.9 .7 .6 .8), fp 0, fn 2 (.2 .3) → P 1, R 2/3, F1 2·(2/3)/(5/3) = 4/5
    # bad:  tp 1 (.2 of e1), fp 2 (.2 of e2, .3), fn 0 → P 1/3, R 1, F1 2·(1/3)/(4/3) = 1/2
    # AUROC: good {.9 .7 .6 .2 .8 .3} vs bad {.2}: 5 above, 1 tie (½) → 5.5 / 6 = 11/12
    # mean scores: good 3.5 / 6, bad .2
    # first error (complete examples e1, e3): e1 judged-bad first at step 1 = labelled-bad first 1 (right); e3 judged
    # bad at 1, labelled none (wrong) → 1/2
    m = step_metrics([[0.9, 0.2, 0.7], [0.6, 0.2, None], [0.8, 0.3]], [[1, 0, 1], [1, 1, 0], [1, 1]])
    assert m == pytest.approx({
        "eval/steps": 7, "eval/unscored": 1, "eval/accuracy": 5 / 7,
        "eval/good_precision": 1, "eval/good_recall": 2 / 3, "eval/good_f1": 4 / 5,
        "eval/bad_precision": 1 / 3, "eval/bad_recall": 1, "eval/bad_f1": 1 / 2,
        "eval/auroc": 11 / 12, "eval/good_mean_score": 3.5 / 6, "eval/bad_mean_score": 0.2,
        "eval/first_error_accuracy": 1 / 2})
    # a ±1 scorer with threshold 0: the same judgements
    assert step_metrics([[1, -1, 1]], [[1, 0, 1]], threshold=0)["eval/accuracy"] == 1
    # no bad step: AUROC and the bad mean are undefined (NaN), not 0 or 1
    m = step_metrics([[0.7, 0.8]], [[1, 1]])
    assert math.isnan(m["eval/auroc"]) and math.isnan(m["eval/bad_mean_score"]) and m["eval/first_error_accuracy"] == 1


def test_auroc_equals_the_share_of_good_bad_pairs_ordered_right():
    rng = random.Random(0)
    for _ in range(50):
        good = [rng.choice([0.1, 0.2, 0.5, 0.7, 0.9, rng.random()]) for _ in range(rng.randint(1, 12))]
        bad = [rng.choice([0.1, 0.2, 0.5, rng.random()]) for _ in range(rng.randint(1, 12))]
        pairs = sum(1.0 if g > b else 0.5 if g == b else 0.0 for g in good for b in bad)  # the plain loop
        assert _auroc(good, bad) == pytest.approx(pairs / (len(good) * len(bad)))


DATA = [{"prompt": f"q{k}:", "steps": [a, b, c], "labels": [int("x" not in s) for s in (a, b, c)]}
        for k, (a, b, c) in enumerate((("ab", "xb", "ca"), ("xa", "cb", "ax"), ("bb", "ca", "xc"), ("ac", "bx", "cc")))]


def test_a_trained_prm_on_its_held_out_file_gives_its_training_metrics(tmp_path, model_dir, capsys):
    """The same numbers from the CLI, which scores through load_prm as GRPO does, and from training, which reads the
    logits of the model it holds; max_length 14 cuts each example's third step (unscored in both)."""
    held = _write(tmp_path / "e.jsonl", DATA)
    with pytest.warns(UserWarning, match="4 prompt.* also in train_file"):  # the held-out file is its training's
        train_prm(PRMTrainConfig(model_name_or_path=model_dir, train_file=_write(tmp_path / "t.jsonl", DATA * 4),
                                 eval_file=held, output_dir=str(tmp_path / "prm"), separator=" .\n", max_length=14,
                                 learning_rate=3e-3, num_train_epochs=2))
    trained = json.loads((tmp_path / "prm" / "eval_metrics.json").read_text())
    out = tmp_path / "m" / "prm_eval.json"
    with pytest.warns(RuntimeWarning, match="steps past max_length=14"):
        assert main(["prm", "eval", "--process_reward_func", str(tmp_path / "prm"), "--eval_file", held,
                     "--output_file", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["eval/unscored"] == 4 and got["eval/steps"] == 8 and got["eval/examples"] == 4
    assert {k: v for k, v in got.items() if k in trained} == pytest.approx(
        {k: v for k, v in trained.items() if k.startswith("eval/")}, nan_ok=True)
    assert set(trained) >= {"eval/auroc", "eval/first_error_accuracy", "eval_before/auroc"}
    printed = capsys.readouterr().out
    assert "eval/auroc" in printed and f"groupwise: wrote {out}" in printed


def no_x(prompts, completions, steps, answer, **_):
    """A step-reward function: 1 for a step without 'x'. It checks it got the file's `answer` column and the steps
    joined by the step delimiter."""
    assert answer == [f"a{p[1]}" for p in prompts]
    assert completions == [" | ".join(s) for s in steps]
    return [[float("x" not in s) for s in row] for row in steps]


def test_a_step_reward_function_is_scored_with_its_columns(tmp_path, capsys):
    held = _write(tmp_path / "e.jsonl", [dict(r, answer=f"a{k}") for k, r in enumerate(DATA)])
    assert main(["prm", "eval", "--process_reward_func", "tests.test_prm_eval:no_x", "--eval_file", held,
                 "--step_delimiter", " | "]) == 0
    lines = dict(line.split() for line in capsys.readouterr().out.splitlines())
    assert float(lines["eval/accuracy"]) == 1 and float(lines["eval/auroc"]) == 1
    assert float(lines["eval/first_error_accuracy"]) == 1 and float(lines["eval/steps"]) == 12


def test_inputs_are_named_before_anything_loads(tmp_path, model_dir, capsys):
    held = _write(tmp_path / "e.jsonl", DATA)
    assert main(["prm", "eval", "--process_reward_func", model_dir]) == 2
    assert "eval_file is required" in capsys.readouterr().err
    assert main(["prm", "eval", "--process_reward_func", model_dir, "--eval_file", str(tmp_path / "no.jsonl")]) == 2
    assert "no.jsonl" in capsys.readouterr().err
    # a model folder that is not a PRM written by prm train: the kind is asked for
    assert main(["prm", "eval", "--process_reward_func", model_dir, "--eval_file", held]) == 2
    assert "is a folder without groupwise_prm.json" in capsys.readouterr().err
    assert main(["prm", "eval", "--process_reward_func", '{"path": ', "--eval_file", held]) == 2
    assert "process_reward_func: not a JSON mapping" in capsys.readouterr().err
    assert main(["prm", "eval", "--process_reward_func", json.dumps({"path": model_dir, "kind": "step_tagg"}),
                 "--eval_file", held]) == 2
    assert "step_tagg" in capsys.readouterr().err
    assert main(["prm", "eval", "--help"]) == 0 and "threshold" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's usage error
        main(["prm", "evaluate"])
    assert "usage: groupwise prm train|eval" in capsys.readouterr().err


def test_a_step_reward_module_of_the_working_directory_imports(tmp_path, monkeypatch, capsys):
    """As in groupwise train: `mysteps:fn` next to the user was 'No module named mysteps'."""
    (tmp_path / "mysteps_gw.py").write_text("def fn(steps, **_):\n    return [[1.0] * len(s) for s in steps]\n")
    held = _write(tmp_path / "e.jsonl", DATA)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert main(["prm", "eval", "--process_reward_func", "mysteps_gw:fn", "--eval_file", held]) == 0
    lines = dict(line.split() for line in capsys.readouterr().out.splitlines())
    assert float(lines["eval/good_recall"]) == 1 and float(lines["eval/bad_recall"]) == 0


def fails_on_q1(steps, prompts, **_):
    if "q1:" in prompts:
        raise ValueError("cannot judge q1")
    return [[1.0] * len(s) for s in steps]


def test_a_keyword_named_key_is_refused_and_on_reward_error_nan_leaves_a_failing_row_unscored(tmp_path, capsys):
    """A line holding both `steps` and TRL's `completions` passed `completions` twice (an opaque TypeError inside
    the call); the error named on_reward_error, which prm eval did not have. Now the line is refused before loading
    (as `prm train` refuses it), and on_reward_error='nan' leaves the failing rows' steps unscored."""
    both = _write(tmp_path / "both.jsonl", [dict(r, completions=r["steps"]) for r in DATA])
    assert main(["prm", "eval", "--process_reward_func", "tests.test_prm_eval:no_x", "--eval_file", both]) == 2
    assert "both.jsonl:1: both 'steps' and 'completions' (TRL's name for them): keep one" in capsys.readouterr().err
    held = _write(tmp_path / "e.jsonl", DATA)
    assert main(["prm", "eval", "--process_reward_func", "tests.test_prm_eval:fails_on_q1", "--eval_file", held]) == 1
    assert "set on_reward_error='nan'" in capsys.readouterr().err
    assert main(["prm", "eval", "--process_reward_func", "tests.test_prm_eval:fails_on_q1", "--eval_file", held,
                 "--on_reward_error", "nan"]) == 0
    lines = dict(line.split() for line in capsys.readouterr().out.splitlines())
    assert float(lines["eval/unscored"]) == 3 and float(lines["eval/steps"]) == 9  # q1's 3 steps of 12

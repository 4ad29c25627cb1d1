"""`groupwise prm train` checkpoints: written every save_steps, loadable as PRMs, resumed exactly (the weights and the
log of a resumed run equal an uninterrupted run's), refused when the run they belong to differs."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from groupwise.checkpoint import CheckpointError, resume_folder
from groupwise.prm_train import PRMTrainConfig, train_prm
from groupwise.rewards.prm import TokenClassificationPRM, load_prm
from tests.test_prm_train import _synthetic, _write


def _cfg(model_dir, train, out, **kw):
    # 60 rows: 6 held out, 54 trained on in batches of 8 → 7 steps per epoch, 14 in 2 epochs; save_steps 5 puts
    # checkpoints inside the first epoch (5) and the second (10). LlamaForTokenClassification's head has dropout 0.1,
    # kept on (disable_dropout=False): the resume must restore the torch RNG for the weights to match.
    return PRMTrainConfig(**{"model_name_or_path": model_dir, "train_file": train, "output_dir": str(out),
                             "disable_dropout": False,
                             "learning_rate": 3e-3, "num_train_epochs": 2, "per_device_train_batch_size": 8,
                             "max_length": 64, "logging_steps": 1, "save_steps": 5, "warmup_steps": 3, **kw})


@pytest.fixture
def straight(tmp_path, model_dir):
    """An uninterrupted 14-step run, and its training file."""
    train = _write(tmp_path / "steps.jsonl", _synthetic(60, 0))
    out = tmp_path / "straight"
    metrics = train_prm(_cfg(model_dir, train, out))
    assert metrics["train/steps"] == metrics["train/planned_steps"] == 14
    return out, train, metrics


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, model_dir, straight):
    out, train, metrics = straight
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
    state = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["command"] == "prm train" and state["step"] == 5
    # each checkpoint scores as a PRM, with the recorded separator and max_length
    prm = load_prm(str(out / "checkpoint-5"))
    assert isinstance(prm, TokenClassificationPRM) and prm.max_length == 64
    # the run copied whole and resumed from checkpoint-5 in place: checkpoint-10 (the branch given up) is set aside,
    # written again, and the end equals the straight run's: weights, log lines, held-out metrics
    again = tmp_path / "again"
    shutil.copytree(out, again)
    with pytest.warns(UserWarning, match="set aside, not deleted: checkpoint-10.abandoned"):
        resumed = train_prm(_cfg(model_dir, train, again, resume_from_checkpoint=str(again / "checkpoint-5")))
    assert (again / "checkpoint-10.abandoned").is_dir() and (again / "checkpoint-10").is_dir()
    a, b = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (again / "train_log.jsonl").read_text() == (out / "train_log.jsonl").read_text()
    assert resumed == metrics
    # and the weights did move from checkpoint-5 (the equality above is not of an untrained model)
    five = load_file(str(out / "checkpoint-5" / "model.safetensors"))
    assert any(not torch.equal(a[k], five[k]) for k in a)


def test_resume_true_takes_the_newest_and_a_mid_run_checkpoint_in_another_folder(tmp_path, model_dir, straight):
    out, train, metrics = straight
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(out / "checkpoint-10", moved / "checkpoint-10")  # no train_log.jsonl: the log starts at 11
    assert resume_folder(True, moved, command="prm train") == str(moved / "checkpoint-10")
    assert train_prm(_cfg(model_dir, train, moved, resume_from_checkpoint=True)) == metrics
    assert [json.loads(line)["step"] for line in (moved / "train_log.jsonl").read_text().splitlines()] == [11, 12, 13,
                                                                                                            14]


def test_a_resume_must_repeat_the_run(tmp_path, model_dir, straight, monkeypatch):
    out, train, _ = straight
    import transformers

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the error")

    monkeypatch.setattr(transformers.AutoModelForTokenClassification, "from_pretrained", no_load)
    ckpt = str(out / "checkpoint-5")
    with pytest.raises(CheckpointError, match=r"checkpoint-5' was trained with learning_rate=0.003, this config has "
                                              r"learning_rate=0.001: resume with learning_rate: 0.003"):
        train_prm(_cfg(model_dir, train, out, resume_from_checkpoint=ckpt, learning_rate=1e-3))
    changed = _write(tmp_path / "other.jsonl", _synthetic(60, 1))
    with pytest.raises(CheckpointError, match=r"train_file '.*other.jsonl' is not the file .* was trained on"):
        train_prm(_cfg(model_dir, changed, out, resume_from_checkpoint=ckpt))
    with pytest.raises(CheckpointError, match=r"'.*nowhere' does not exist"):
        train_prm(_cfg(model_dir, train, out, resume_from_checkpoint=str(tmp_path / "nowhere")))
    # a new run into a folder holding this run's checkpoints: refused, naming the ways out
    with pytest.raises(CheckpointError, match=r"already holds a run \(checkpoint-10, checkpoint-5, eval_metrics.json, "
                                              r"groupwise_prm.json …\): resume it with "
                                              r"resume_from_checkpoint, .* overwrite_output_dir"):
        train_prm(_cfg(model_dir, train, out))
    # the same base folder spelled another way (relative, with a trailing slash) passes the check: the model loads
    # (last: the resume sets checkpoint-10 aside before loading)
    monkeypatch.chdir(tmp_path)
    relative = str(__import__("os").path.relpath(model_dir, tmp_path)) + "/"
    with pytest.raises(AssertionError, match="the model loaded"):
        train_prm(_cfg(relative, train, out, resume_from_checkpoint=ckpt))
    with pytest.raises(CheckpointError, match=r"was trained with model_name_or_path='.*', this config has "
                                              r"model_name_or_path='other-base'"):
        train_prm(_cfg("other-base", train, out, resume_from_checkpoint=ckpt))


def test_checkpoints_of_the_other_command_are_refused(tmp_path, straight):
    out, _, _ = straight
    with pytest.raises(CheckpointError, match=r"is a checkpoint of `groupwise prm train`, not of `groupwise train`: "
                                              r"resume it with `groupwise prm train`"):
        resume_folder(str(out / "checkpoint-5"), out)  # GRPO's resume (command "train")
    grpo = tmp_path / "grpo" / "checkpoint-3"
    grpo.mkdir(parents=True)
    (grpo / "trainer_state.json").write_text(json.dumps({"run_id": "x", "sampler": {}, "global_step": 3}))
    with pytest.raises(CheckpointError, match=r"is a checkpoint of `groupwise train`, not of `groupwise prm train`"):
        resume_folder(str(grpo), tmp_path / "grpo", command="prm train")


def test_overwrite_and_the_rotation(tmp_path, model_dir, straight):
    out, train, _ = straight
    # overwrite_output_dir deletes the old run's checkpoints; save_total_limit 1 keeps only the newest of this one
    train_prm(_cfg(model_dir, train, out, overwrite_output_dir=True, save_total_limit=1, save_steps=4))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", ".")))[:1] == ["checkpoint-12"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary or set-aside folder left
    state = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["config"]["learning_rate"] == 3e-3


def test_save_steps_0_writes_no_checkpoint(tmp_path, model_dir):
    train = _write(tmp_path / "steps.jsonl", _synthetic(60, 0))
    out = tmp_path / "prm"
    train_prm(_cfg(model_dir, train, out, save_steps=0))
    assert not list(out.glob("checkpoint-*")) and (out / "model.safetensors").exists()

    # a finished PRM without checkpoints (save_steps 500 is longer than most runs) is still a run: a second run
    # into the same folder is refused, the trained PRM untouched; overwrite_output_dir deletes it, then trains anew
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=r"already holds a run \(eval_metrics.json, groupwise_prm.json, "
                                              r"train_log.jsonl\)"):
        train_prm(_cfg(model_dir, train, out, save_steps=0, learning_rate=1e-6))
    assert (out / "model.safetensors").read_bytes() == before
    train_prm(_cfg(model_dir, train, out, save_steps=0, learning_rate=1e-6, overwrite_output_dir=True))
    assert (out / "model.safetensors").read_bytes() != before
    # nor does a GRPO run write its policy over a PRM's folder
    from groupwise.checkpoint import claim_output_dir

    with pytest.raises(CheckpointError, match="already holds a run"):
        claim_output_dir(out, overwrite=False)

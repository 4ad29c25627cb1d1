"""Checkpoints, the best model and the hub as transformers' Trainer has them: the final push after
load_best_model_at_end uploads the best weights; a user's save_model() pushes ("Model save"); save_total_limit counts
the best checkpoint (transformers' rotate_checkpoints, and its save_total_limit=1 end); save_strategy="best";
hub_strategy "checkpoint" / "all_checkpoints"; the config rules transformers has (eval_strategy "steps" with no
eval_steps nor logging_steps, fsdp + save_only_model + load_best_model_at_end); a transformers / TRL checkpoint
is named, never resumed; a kill during the rotation leaves no half checkpoint-N."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from groupwise import ConfigError, GRPOConfig, GRPOTrainer
from groupwise.best import BestModel
from groupwise.checkpoint import (CheckpointError, _rotate, _write_manifest, claim_output_dir, keep_only_best,
                                  latest_checkpoint, publish, put_back_replaced, resume_folder, verify_checkpoint)
from groupwise.tasks import toy
from tests.conftest import small_args


def _peak_at(step):
    """Training rewards vary (a gradient every step); the evaluation's reward is −(global_step − step)²: best at
    `step`."""
    def reward(completions, trainer_state, **_):
        if trainer_state.global_step and len(completions) == 4:  # the evaluation: 4 prompts, greedy
            return [-float(trainer_state.global_step - step) ** 2] * len(completions)
        return [float(sum(map(ord, c)) % 5) for c in completions]
    reward.__name__ = "peak"
    return reward


def _trainer(tmp_path, tokenizer, best_at=2, **kw):
    kw = {"max_steps": 4, "eval_strategy": "steps", "eval_steps": 1, "save_steps": 1, "metric_for_best_model": "reward",
          **kw}
    return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_peak_at(best_at)],
                       args=small_args(tmp_path, **kw), train_dataset=toy.dataset(12),
                       eval_dataset=toy.dataset(4, seed=1), processing_class=tokenizer)


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class _FakeHub:
    """huggingface_hub.HfApi as the trainer calls it: each upload recorded with the sha256 of the folder's model."""
    uploads: list = []

    def __init__(self, token=None):
        pass

    def create_repo(self, repo_id, private=None, exist_ok=False):
        return type("Repo", (), {"repo_id": repo_id})()

    def create_branch(self, repo, branch, exist_ok=False):
        pass

    def upload_folder(self, repo_id, folder_path, commit_message, revision=None, ignore_patterns=None,
                      path_in_repo=None, delete_patterns=None):
        model = Path(folder_path, "model.safetensors")
        self.uploads.append({"message": commit_message, "folder": str(folder_path), "path_in_repo": path_in_repo,
                             "delete": delete_patterns, "ignore": ignore_patterns,
                             "files": sorted(p.name for p in Path(folder_path).iterdir()),
                             "model": _sha(model) if model.exists() else None})
        return type("Info", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    _FakeHub.uploads = []
    return _FakeHub.uploads


HUB = dict(push_to_hub=True, hub_model_id="me/x", hub_token="hf_x")


# ---- 1. push_to_hub + load_best_model_at_end ------------------------------------------------------------------------
@pytest.mark.slow
def test_the_final_push_after_load_best_model_at_end_uploads_the_best_weights(tmp_path, tokenizer, hub):
    """Evaluation rewards −1, 0, −1, −4 over steps 1–4: the best is step 2. Every save pushes (steps 1–4, the last
    with step 4's weights); the best weights loaded at the end are pushed once more (it used to stop at step 4's)."""
    t = _trainer(tmp_path, tokenizer, load_best_model_at_end=True, **HUB)
    t.train()
    out = tmp_path / "out"
    assert t.state.best_model_checkpoint == str(out / "checkpoint-2")
    assert [u["message"] for u in hub] == [f"groupwise: step {i}" for i in (1, 2, 3, 4)] + ["groupwise: end of training"]
    best = _sha(out / "checkpoint-2" / "model.safetensors")
    assert hub[3]["model"] == _sha(out / "checkpoint-4" / "model.safetensors") != best
    assert hub[-1]["model"] == best == _sha(out / "model.safetensors")  # the hub and output_dir end with the best


@pytest.mark.slow
def test_no_second_push_when_the_best_is_the_last_step(tmp_path, tokenizer, hub):
    """Rewards −9, −4, −1, 0: the best is step 4, whose weights step 4's save pushed: no end push."""
    t = _trainer(tmp_path, tokenizer, best_at=4, load_best_model_at_end=True, **HUB)
    t.train()
    assert [u["message"] for u in hub] == [f"groupwise: step {i}" for i in (1, 2, 3, 4)]


# ---- 2. save_model() pushes, as transformers' --------------------------------------------------------------------------
@pytest.mark.slow
def test_a_users_save_model_pushes_and_internal_saves_do_not(tmp_path, tokenizer, hub):
    from transformers import TrainerCallback

    class Pushes(TrainerCallback):  # transformers fires on_push_begin before each upload (it was never fired)
        steps: list = []

        def on_push_begin(self, args, state, control, **kwargs):
            self.steps.append((state.global_step, len(hub)))

    t = _trainer(tmp_path, tokenizer, max_steps=2, eval_strategy="no", metric_for_best_model=None, **HUB)
    t.add_callback(Pushes)
    t.train()
    # the saves of steps 1 and 2 push once each (push_to_hub's own save_model is internal): the end is step 2's
    assert [u["message"] for u in hub] == ["groupwise: step 1", "groupwise: step 2"]
    assert Pushes.steps == [(1, 0), (2, 1)]  # each before its upload
    t.save_model(str(tmp_path / "final"))
    assert len(hub) == 3 and hub[-1]["message"] == "Model save"  # transformers' commit message
    assert hub[-1]["folder"] == str(tmp_path / "out") and (tmp_path / "final" / "model.safetensors").exists()
    t.args.push_to_hub = False
    t.save_model(str(tmp_path / "final2"))
    assert len(hub) == 3


def test_groupwise_train_with_push_to_hub_does_not_push_the_final_model_twice(tmp_path, model_dir, monkeypatch):
    """train() ends by saving output_dir's model and pushing it; the CLI's save_model (TRL's script has one) is left
    out then (with a user's save_model now pushing, it would upload the same model again)."""
    import groupwise.trainer
    from groupwise.cli import main
    from tests.test_cli_audit import FakeTrainer, _cfg

    FakeTrainer.made = []
    monkeypatch.setattr(groupwise.trainer, "GRPOTrainer", FakeTrainer)
    assert main(["train", _cfg(tmp_path, model_dir, push_to_hub=True, hub_token="hf_x")]) == 0
    assert FakeTrainer.made[-1].saved is None
    assert main(["train", _cfg(tmp_path, model_dir, output_dir=str(tmp_path / "run2"))]) == 0
    assert FakeTrainer.made[-1].saved == str(tmp_path / "run2")  # without push_to_hub: saved as before


# ---- 3. fsdp + save_only_model + load_best_model_at_end ---------------------------------------------------------------
BEST = dict(load_best_model_at_end=True, metric_for_best_model="reward", eval_strategy="steps", eval_steps=1,
            save_steps=1)


def test_fsdp_with_save_only_model_and_load_best_model_at_end_is_refused_at_once(monkeypatch):
    message = r"^load_best_model_at_end=True with fsdp and save_only_model=True: .* drop save_only_model or load_best"
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(fsdp="full_shard", save_only_model=True, **BEST)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an accelerate FSDP2 launch shards too
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(save_only_model=True, **BEST)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    GRPOConfig(save_only_model=True, **BEST)  # without fsdp the best model loads from model.safetensors
    GRPOConfig(fsdp="full_shard", **BEST)


# ---- 4. a transformers / TRL checkpoint ---------------------------------------------------------------------------
def _groupwise_checkpoint(root: Path, step: int) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "run_id": "r", "sampler": {},
                                                           "world_size": 1}))
    _write_manifest(folder)
    return folder


def _transformers_checkpoint(root: Path, step: int) -> Path:
    from transformers import TrainerState

    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    TrainerState(global_step=step, max_steps=10).save_to_json(str(folder / "trainer_state.json"))
    return folder


def test_a_transformers_checkpoint_is_named_and_never_resumed(tmp_path):
    foreign = _transformers_checkpoint(tmp_path, 5)
    message = (r"^resume_from_checkpoint='.*checkpoint-5' is a transformers / TRL checkpoint .*not groupwise's: .*"
               r"start a new run from its weights with model='.*checkpoint-5'$")
    with pytest.raises(CheckpointError, match=message):
        resume_folder(str(foreign), tmp_path)
    with pytest.raises(CheckpointError, match=message):  # not "predates checksums" and a resume
        verify_checkpoint(foreign)
    # resume_from_checkpoint=True: passed over (named), nothing else there: the "no complete checkpoint" error
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in output_dir .* \(checkpoint-5 \(a "
                                              r"transformers / TRL checkpoint, not groupwise's\)\); start a new run"):
        latest_checkpoint(tmp_path)
    ours = _groupwise_checkpoint(tmp_path, 2)
    with pytest.warns(RuntimeWarning, match=r"resuming from checkpoint-2; newer folders are not complete "
                                            r"checkpoints: checkpoint-5 \(a transformers / TRL checkpoint"):
        assert resume_folder(True, tmp_path) == str(ours)


def test_a_trl_lora_checkpoint_is_named_with_the_way_to_train_its_adapter_on(tmp_path):
    """A TRL LoRA run's checkpoint holds the adapter only: the advice model=<checkpoint> was refused in turn (an
    adapter folder is not a model), so the message names PeftModel.from_pretrained(..., is_trainable=True)."""
    foreign = _transformers_checkpoint(tmp_path, 3)
    (foreign / "adapter_config.json").write_text('{"base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}')
    with pytest.raises(CheckpointError, match=r"start a new run from its weights with model=PeftModel.from_pretrained"
                                              r"\(AutoModelForCausalLM.from_pretrained\('Qwen/Qwen2.5-0.5B'\), "
                                              r"'.*checkpoint-3', is_trainable=True\) \(a LoRA checkpoint.*, or from "
                                              r"a config, `groupwise export .*checkpoint-3 --merge OUT`, then "
                                              r"model_name_or_path: OUT$"):
        resume_folder(str(foreign), tmp_path)


def test_training_from_a_transformers_checkpoint_or_a_save_state_output_dir_says_what_to_do(tmp_path, tokenizer):
    """It used to stop with a bare KeyError('world_size')."""
    foreign = _transformers_checkpoint(tmp_path / "out", 5)
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward],
                    args=small_args(tmp_path, max_steps=10), train_dataset=toy.dataset(12), processing_class=tokenizer)
    with pytest.raises(CheckpointError, match="is a transformers / TRL checkpoint"):
        t.train(resume_from_checkpoint=str(foreign))
    t.save_state()  # output_dir/trainer_state.json: transformers' TrainerState
    with pytest.raises(CheckpointError, match="is a transformers / TRL checkpoint"):
        t.train(resume_from_checkpoint=str(tmp_path / "out"))


# ---- 5. save_total_limit counts the best checkpoint (transformers' rotate_checkpoints) --------------------------------
def _run_checkpoints(root: Path, steps) -> None:
    for step in steps:
        _groupwise_checkpoint(root, step)


def _names(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir()), key=lambda n: (not n.startswith("checkpoint-"), len(n), n))


@pytest.mark.parametrize("limit, best, kept", [
    # checkpoints 1–5 saved in turn, the best at step 1, the rotation after each save. transformers, limit 3:
    # save 4 → [1, 2, 3, 4] > 3, protected {4, 1}, keep max(3, 2) = 3: 2 goes; save 5 → [1, 3, 4, 5]: 3 goes
    (3, 1, ["checkpoint-1", "checkpoint-4", "checkpoint-5"]),  # (groupwise kept 1, 3, 4, 5)
    # limit 2, best 2: save 3 → 1 goes; save 4 → [2, 3, 4]: 3 goes; save 5 → [2, 4, 5]: 4 goes
    (2, 2, ["checkpoint-2", "checkpoint-5"]),  # (groupwise kept 2, 4, 5)
    # limit 1, best 2: keep max(1, 2) = 2, the best and the newest
    (1, 2, ["checkpoint-2", "checkpoint-5"]),
    (2, None, ["checkpoint-4", "checkpoint-5"]),  # no best: the newest two
])
def test_the_rotation_keeps_what_transformers_keeps(tmp_path, limit, best, kept):
    for step in range(1, 6):
        _groupwise_checkpoint(tmp_path, step)
        protected = {tmp_path / f"checkpoint-{step}"} | ({tmp_path / f"checkpoint-{best}"} if best and best <= step
                                                         else set())
        _rotate(tmp_path, limit, "r", keep=protected)
    assert _names(tmp_path) == kept


def test_a_save_at_the_new_best_step_protects_itself_not_the_former_best(tmp_path):
    """save_total_limit=2, checkpoints 1 (the former best) and 2, step 3's save is the new best: transformers'
    best_model_checkpoint is checkpoint-3 when it rotates, so the protected are {3}, and 1 goes: [2, 3] (groupwise
    used to protect checkpoint-1 too: [1, 2, 3])."""
    from transformers import TrainerState

    _run_checkpoints(tmp_path, (1, 2))
    state = TrainerState(best_global_step=3, best_model_checkpoint=str(tmp_path / "checkpoint-1"))
    keep = BestModel.at_save(state, tmp_path, 3)
    assert keep == str(tmp_path / "checkpoint-3")
    tmp = _groupwise_checkpoint(tmp_path / "new", 3).rename(tmp_path / ".tmp-checkpoint-3")
    publish(tmp, tmp_path / "checkpoint-3", tmp_path, 3, 2, "r", keep)
    assert _names(tmp_path) == ["checkpoint-2", "checkpoint-3", "new"]


def test_save_total_limit_one_keeps_only_the_best_at_the_end(tmp_path):
    """transformers' train() end: with save_total_limit=1 and a best checkpoint, every other one is deleted (here
    the newest, 5, which the rotation kept beside the best, 2); another run's checkpoint is not touched."""
    _run_checkpoints(tmp_path, (2, 5))
    other = _groupwise_checkpoint(tmp_path / "x", 7).rename(tmp_path / "checkpoint-7")
    state = json.loads((other / "trainer_state.json").read_text())
    (other / "trainer_state.json").write_text(json.dumps({**state, "run_id": "other"}))
    keep_only_best(tmp_path, "r", str(tmp_path / "checkpoint-2"))
    assert _names(tmp_path) == ["checkpoint-2", "checkpoint-7", "x"]


@pytest.mark.slow
def test_a_run_with_the_best_and_save_total_limit_keeps_transformers_checkpoints(tmp_path, tokenizer):
    """5 steps, evaluated and saved every step, best at step 2 (rewards −1, 0, −1, −4, −9), save_total_limit=2:
    checkpoints 2 (the best) and 5 (the newest), as transformers (groupwise kept 4 too)."""
    t = _trainer(tmp_path, tokenizer, max_steps=5, load_best_model_at_end=True, save_total_limit=2)
    t.train()
    assert t.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-2")
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]


# ---- 6. eval_strategy="steps" needs eval_steps or logging_steps --------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(eval_strategy="steps", logging_steps=0, logging_strategy="no"),
    # with load_best_model_at_end it used to fail in best.check_fields with ZeroDivisionError
    dict(eval_strategy="steps", logging_steps=0, logging_strategy="no", load_best_model_at_end=True,
         metric_for_best_model="reward", save_steps=0.5),
])
def test_eval_strategy_steps_without_eval_steps_or_logging_steps_is_refused(kwargs):
    with pytest.raises(ConfigError, match=r"^eval_strategy='steps' needs eval_steps, which defaults to logging_steps "
                                          r"\(0 here\): set eval_steps or logging_steps > 0$"):
        GRPOConfig(**kwargs)
    assert GRPOConfig(eval_strategy="steps", logging_steps=5).eval_steps == 5  # transformers' fallback
    assert GRPOConfig(eval_strategy="steps", logging_steps=0, logging_strategy="no", eval_steps=3).eval_steps == 3


# ---- 7. save_strategy="best", hub_strategy "checkpoint" / "all_checkpoints" --------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(save_strategy="best", eval_strategy="steps"), r"^save_strategy='best' needs metric_for_best_model"),
    (dict(save_strategy="best", metric_for_best_model="reward"), r"^save_strategy='best' saves after an evaluation "
                                                                 r".*set eval_strategy to 'steps' or 'epoch'$"),
])
def test_save_strategy_best_needs_a_metric_and_evaluations(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


def test_save_strategy_best_with_load_best_model_at_end_takes_any_eval_strategy():
    """transformers: with save_strategy='best' the eval and save strategies need not match, nor the steps."""
    GRPOConfig(save_strategy="best", load_best_model_at_end=True, metric_for_best_model="reward",
               eval_strategy="epoch")
    GRPOConfig(save_strategy="best", load_best_model_at_end=True, metric_for_best_model="reward",
               eval_strategy="steps", eval_steps=3, save_steps=4)


@pytest.mark.slow
def test_save_strategy_best_saves_at_each_new_best_only(tmp_path, tokenizer):
    """Rewards −1, 0, −1, −4 at steps 1–4: new bests at steps 1 (the first) and 2, so checkpoints 1 and 2 only (no
    save at the last step: transformers saves there under 'steps' only); the best model is step 2's."""
    t = _trainer(tmp_path, tokenizer, save_strategy="best", load_best_model_at_end=True)
    t.train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert t.state.best_model_checkpoint == str(out / "checkpoint-2") and t.state.best_global_step == 2
    from safetensors.torch import load_file
    import torch

    best = load_file(str(out / "checkpoint-2" / "model.safetensors"))
    assert all(torch.equal(t.unwrapped.state_dict()[k], v) for k, v in best.items())


@pytest.mark.slow
@pytest.mark.parametrize("strategy, folders", [("checkpoint", ["last-checkpoint", "last-checkpoint"]),
                                               ("all_checkpoints", ["checkpoint-1", "checkpoint-2"])])
def test_hub_strategy_checkpoint_uploads_the_checkpoints(tmp_path, tokenizer, hub, strategy, folders):
    """Two steps saved: each save pushes the model, then the whole checkpoint (for resuming: checksums.json,
    trainer_state.json, optimizer, RNG) to last-checkpoint/ (its earlier files deleted in the commit) or to
    checkpoint-N/; the end is step 2's: pushed already."""
    t = _trainer(tmp_path, tokenizer, max_steps=2, eval_strategy="no", metric_for_best_model=None,
                 hub_strategy=strategy, **HUB)
    t.train()
    assert [u["message"] for u in hub] == ["groupwise: step 1", "groupwise: step 1, checkpoint",
                                           "groupwise: step 2", "groupwise: step 2, checkpoint"]
    model_pushes, checkpoint_pushes = hub[0::2], hub[1::2]
    assert all(u["path_in_repo"] is None and u["folder"] == str(tmp_path / "out") for u in model_pushes)
    assert [u["path_in_repo"] for u in checkpoint_pushes] == folders
    assert [u["folder"] for u in checkpoint_pushes] == [str(tmp_path / "out" / f"checkpoint-{i}") for i in (1, 2)]
    assert all({"checksums.json", "trainer_state.json", "optimizer.safetensors", "rng_state_0.safetensors",
                "model.safetensors"} <= set(u["files"]) and u["ignore"] is None for u in checkpoint_pushes)
    assert [u["delete"] for u in checkpoint_pushes] == ([["*"]] * 2 if strategy == "checkpoint" else [None] * 2)


# ---- 8. a kill during the rotation -------------------------------------------------------------------------------
class _Killed(BaseException):
    pass


def test_a_kill_while_the_rotation_deletes_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """save_total_limit=1: publishing checkpoint-2 deletes checkpoint-1; the process dies after the removal deleted
    one file. checkpoint-1 is gone whole (renamed .old-checkpoint-1.deleted first), resume picks checkpoint-2, hub
    uploads ignore the leftover, and the next resume removes it (it used to leave checkpoint-1 without its model)."""
    import shutil

    from huggingface_hub.utils import filter_repo_objects

    import groupwise.checkpoint as C
    from groupwise.hub import IGNORE

    _groupwise_checkpoint(tmp_path, 1)
    real = shutil.rmtree

    def killed(path, ignore_errors=False):
        if Path(path).is_dir() and not ignore_errors:
            Path(path, "model.safetensors").unlink()
            raise _Killed()
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(C.shutil, "rmtree", killed)
    tmp = _groupwise_checkpoint(tmp_path / "new", 2).rename(tmp_path / ".tmp-checkpoint-2")
    with pytest.raises(_Killed):
        publish(tmp, tmp_path / "checkpoint-2", tmp_path, 2, 1, "r")
    monkeypatch.setattr(C.shutil, "rmtree", real)
    assert _names(tmp_path) == ["checkpoint-2", "new", ".old-checkpoint-1.deleted"]
    assert not list(filter_repo_objects([".old-checkpoint-1.deleted/trainer_state.json"], ignore_patterns=IGNORE))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    put_back_replaced(tmp_path)  # what resume_folder and every save call first
    assert _names(tmp_path) == ["checkpoint-2", "new"]


def test_a_new_run_with_overwrite_output_dir_deletes_a_rotation_leftover(tmp_path):
    _groupwise_checkpoint(tmp_path, 1).rename(tmp_path / ".old-checkpoint-1.deleted")
    with pytest.raises(CheckpointError, match=r"already holds a run \(.old-checkpoint-1.deleted\)"):
        claim_output_dir(tmp_path, overwrite=False)
    claim_output_dir(tmp_path, overwrite=True)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_groupwise_train_names_a_hub_dataset_in_the_final_pushs_model_card(tmp_path, model_dir, hub, monkeypatch):
    """TRL's script pushes with push_to_hub(dataset_name=script_args.dataset_name): the card's `datasets` names the
    hub dataset (the CLI's push, made by train() itself, had none). A local data file is no hub id: left out, as a
    local base model is."""
    import datasets
    import groupwise.cli
    from groupwise.cli import main
    from tests.test_cli_audit import _cfg, _rows

    rows = datasets.Dataset.from_list(_rows())
    monkeypatch.setattr(groupwise.cli, "load_run_datasets", lambda run, args, **_: (rows, None))
    hub_run = dict(push_to_hub=True, hub_token="hf_x", hub_model_id="me/x", max_steps=1, save_strategy="no")
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name="someorg/math", **hub_run)]) == 0
    assert [u["message"] for u in hub] == ["groupwise: end of training"]
    card = (tmp_path / "run" / "README.md").read_text()
    assert "datasets:\n- someorg/math\n" in card and "on someorg/math." in card
    assert main(["train", _cfg(tmp_path, model_dir, output_dir=str(tmp_path / "run2"), **hub_run)]) == 0
    assert "datasets:" not in (tmp_path / "run2" / "README.md").read_text()  # p.jsonl, a local file

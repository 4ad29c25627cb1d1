"""`groupwise eval`: a model (an output_dir, a checkpoint-N folder, a LoRA run's adapter folder) evaluated as
training's evaluation does, from the training config: the same numbers as trainer.evaluate() on the same model and
rows, written to output_dir/eval_results.json; nothing claimed, trained or pushed; missing inputs named."""

from __future__ import annotations

import json

import pytest

from groupwise import GRPOTrainer
from groupwise.cli import main
from groupwise.tasks import toy
from tests.conftest import small_args
from tests.test_cli_audit import _cfg, _jsonl, _rows

EVAL = ["--num_generations_eval", "4", "--per_device_eval_batch_size", "4", "--max_completion_length", "4"]


def _api_metrics(tmp_path, model, rows, **kw):
    """trainer.evaluate() in-process: what `groupwise eval` must report for the same model, rows and settings."""
    args = small_args(tmp_path / "api", num_generations_eval=4, per_device_eval_batch_size=4, max_completion_length=4,
                      seed=42, **kw)  # the CLI's default seed: the same samples
    trainer = GRPOTrainer(model, [toy.letter_reward], args=args, train_dataset=rows, eval_dataset=rows)
    return trainer.evaluate()


@pytest.mark.slow
def test_eval_reports_what_trainer_evaluate_reports_for_a_trained_checkpoint(tmp_path, model_dir, capsys):
    cfg = _cfg(tmp_path, model_dir, max_steps=2, save_steps=2)
    assert main(["train", cfg]) == 0
    run = tmp_path / "run"
    before = sorted(p.name for p in run.iterdir())
    held = _jsonl(tmp_path / "held.jsonl", _rows(6))
    # the training config as it is (its output_dir holds the run: not claimed, nothing deleted or written there)
    assert main(["eval", cfg, "--model_name_or_path", str(run / "checkpoint-2"), "--eval_dataset_name", held,
                 "--output_dir", str(tmp_path / "ev"), *EVAL]) == 0
    assert sorted(p.name for p in run.iterdir()) == before
    got = json.loads((tmp_path / "ev" / "eval_results.json").read_text())
    printed = capsys.readouterr().out
    assert "eval_rewards/letter_reward/pass@4" in printed and "eval_results.json" in printed
    want = _api_metrics(tmp_path, str(run / "checkpoint-2"), _rows(6))
    timing = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
    assert set(got) == set(want) and "eval_rewards/letter_reward/mean@4" in got
    assert {k: v for k, v in got.items() if k not in timing} == pytest.approx(
        {k: v for k, v in want.items() if k not in timing})
    # without eval_dataset_name: dataset_name's dataset_test_split, which a data file does not have: named
    assert main(["eval", cfg, "--model_name_or_path", str(run)]) == 2
    assert "groupwise eval evaluates split 'test' of dataset_name" in (err := capsys.readouterr().err)
    assert err.rstrip().endswith("give eval_split, or eval_dataset_name")
    assert main(["eval", cfg, "--model_name_or_path", str(run), "--eval_split", "train[:4]", "--output_dir",
                 str(tmp_path / "ev2"), *EVAL]) == 0  # that file's first 4 rows


@pytest.mark.slow
def test_eval_reads_a_lora_runs_adapter_over_its_base_and_pushes_nothing(tmp_path, model_dir, monkeypatch):
    """An adapter folder is evaluated as PeftModel(base, adapter): the numbers of the merged model (groupwise export
    --merge) evaluated as a plain one. A training config's push_to_hub is not an evaluation's (no token needed)."""
    import huggingface_hub

    cfg = _cfg(tmp_path, model_dir, max_steps=2, save_steps=2, use_peft=True, lora_target_modules="all-linear",
               learning_rate=0.05)
    assert main(["train", cfg]) == 0
    monkeypatch.setattr(huggingface_hub, "HfApi", None)  # any upload would fail
    held = _jsonl(tmp_path / "held.jsonl", _rows(6))
    assert main(["eval", cfg, "--model_name_or_path", str(tmp_path / "run" / "checkpoint-2"), "--eval_dataset_name",
                 held, "--output_dir", str(tmp_path / "ev"), "--push_to_hub", "true", *EVAL]) == 0
    got = json.loads((tmp_path / "ev" / "eval_results.json").read_text())
    assert main(["export", str(tmp_path / "run" / "checkpoint-2"), "--merge", str(tmp_path / "merged")]) == 0
    want = _api_metrics(tmp_path, str(tmp_path / "merged"), _rows(6))
    assert got["eval_rewards/letter_reward/mean"] == pytest.approx(want["eval_rewards/letter_reward/mean"])
    assert got["eval_completions/mean_length"] == pytest.approx(want["eval_completions/mean_length"])


def test_eval_names_what_it_lacks(tmp_path, model_dir, capsys):
    assert main(["eval", "--dataset_name", "builtin:arithmetic"]) == 2
    assert "groupwise eval needs model_name_or_path" in capsys.readouterr().err
    (tmp_path / "no_data.yaml").write_text(f"model_name_or_path: {model_dir}\n"
                                           "reward_funcs: [groupwise.tasks.toy:letter_reward]\n")
    assert main(["eval", str(tmp_path / "no_data.yaml")]) == 2
    assert "dataset_name is required" in capsys.readouterr().err
    assert main(["eval", "--help"]) == 0 and "eval_results.json" in capsys.readouterr().out


def test_eval_takes_the_rewards_of_the_training_task_and_a_mixtures_held_out_share(tmp_path, monkeypatch, capsys):
    """dataset_name: builtin:arithmetic with eval_dataset_name a file: the task's reward (and step-reward) functions
    score the evaluation, as in training (eval took the file's task: none, 'reward_funcs is required'). A datasets:
    mixture with test_split_size evaluates its held-out share, as training does."""
    import groupwise.trainer
    from groupwise.demo import POLICY_DIR
    from groupwise.tasks import arithmetic

    made = []

    class Evaluates:
        dist = type("D", (), {"is_main": True})()

        def __init__(self, model, reward_funcs, **kwargs):
            self.reward_funcs, self.kwargs = reward_funcs, kwargs
            made.append(self)

        def evaluate(self):
            return {"eval_reward": 0.5}

        def save_metrics(self, split, metrics):
            pass

    monkeypatch.setattr(groupwise.trainer, "GRPOTrainer", Evaluates)
    held = _jsonl(tmp_path / "held.jsonl", [{"prompt": "Q: 1+1", "problem": "1+1"}] * 3)
    assert main(["eval", "--model_name_or_path", str(POLICY_DIR), "--dataset_name", "builtin:arithmetic",
                 "--eval_dataset_name", held, "--supervision", "both", "--output_dir", str(tmp_path / "ev")]) == 0
    assert made[-1].reward_funcs == arithmetic.REWARD_FUNCS
    assert made[-1].kwargs["process_reward_funcs"] == arithmetic.PROCESS_REWARD_FUNCS
    assert len(made[-1].kwargs["eval_dataset"]) == 3
    mixture = tmp_path / "mix.yaml"
    mixture.write_text(f"model_name_or_path: {POLICY_DIR}\nreward_funcs: [groupwise.tasks.arithmetic:accuracy]\n"
                       f"datasets: [{{path: {held}}}]\ntest_split_size: 1\noutput_dir: {tmp_path / 'ev2'}\n")
    assert main(["eval", str(mixture)]) == 0 and len(made[-1].kwargs["eval_dataset"]) == 1
    assert "eval_reward" in capsys.readouterr().out
    # dataset_name alone: its evaluation split only (a folder with a test split and no train split: the training
    # split was loaded first, and refused)
    only_test = tmp_path / "only_test"
    only_test.mkdir()
    _jsonl(only_test / "test.jsonl", [{"prompt": "Q: 2+2", "problem": "2+2"}] * 5)
    assert main(["eval", "--model_name_or_path", str(POLICY_DIR), "--dataset_name", str(only_test),
                 "--reward_funcs", "groupwise.tasks.arithmetic:accuracy", "--output_dir", str(tmp_path / "ev3")]) == 0
    assert len(made[-1].kwargs["eval_dataset"]) == 5
    # a training config whose dataset_name file is not on this machine: unread with eval_dataset_name, not asked for
    # (was: "dataset_name: no such file"); without eval_dataset_name it is the rows evaluated, and named
    gone = ["--model_name_or_path", str(POLICY_DIR), "--dataset_name", str(tmp_path / "gone.jsonl"),
            "--reward_funcs", "groupwise.tasks.arithmetic:accuracy", "--output_dir", str(tmp_path / "ev4")]
    assert main(["eval", *gone, "--eval_dataset_name", held]) == 0 and len(made[-1].kwargs["eval_dataset"]) == 3
    assert main(["eval", *gone]) == 2 and "gone.jsonl" in capsys.readouterr().err


def test_eval_names_an_adapter_without_its_base_and_a_run_without_evaluation_rows(tmp_path, tokenizer, capsys):
    """An adapter saved from a policy built in memory names no base model: merging it with --base is the way. A run
    with neither dataset_name nor eval_dataset_name has no evaluation rows (load_run_datasets says so itself)."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from groupwise.config_base import ConfigError
    from groupwise.script_args import RUN_FIELDS, load_run_datasets

    model = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    held = _jsonl(tmp_path / "held.jsonl", _rows(4))
    assert main(["eval", "--model_name_or_path", str(tmp_path / "adapter"), "--eval_dataset_name", held,
                 "--reward_funcs", "groupwise.tasks.toy:letter_reward", "--output_dir", str(tmp_path / "ev")]) == 2
    assert "is an adapter that does not name its base model" in (err := capsys.readouterr().err)
    assert "groupwise export" in err and "--base BASE" in err
    run = {k: d for k, (_, d, _) in RUN_FIELDS.items()}
    with pytest.raises(ConfigError, match="groupwise eval needs evaluation rows: give eval_dataset_name"):
        load_run_datasets(run, SimpleNamespace(seed=0), evaluation=True)


def test_damaged_or_incomplete_model_folders_and_tokenizer_less_adapters(tmp_path, model_dir, tokenizer, capsys,
                                                                         monkeypatch):
    """From the eval/export walkthrough. A folder with config.json but no weights, or a torn model.safetensors (the
    header, or the tensors, cut short), is one line before anything loads (it was a traceback from the loading). A
    run's folder whose final model is only in its checkpoints names the newest. An adapter saved without a tokenizer
    (PEFT writes none) takes its base's, for `eval` and `export` (it was a traceback, and export had already written
    the merged weights into OUT, which a second try then refused as not empty); a full model without one is named
    before anything is written. `eval` names itself for an unknown field, and uploads nothing, so it asks for no
    hub token for log_completions_hub_repo."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from groupwise.config_base import ConfigError, check_model_location

    def refused(folder, message):
        with pytest.raises(ConfigError, match=message):
            check_model_location(str(folder), "model_name_or_path")

    shutil.copytree(model_dir, tmp_path / "m")
    weights = (tmp_path / "m" / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(weights[:len(weights) - 100])
    refused(tmp_path / "m", r"model\.safetensors is damaged \(\d+ bytes, where its tensors end at byte \d+\)")
    (tmp_path / "m" / "model.safetensors").write_bytes(weights[:5])
    refused(tmp_path / "m", r"model\.safetensors is damaged \(header length past the file's end\): a torn copy")
    (tmp_path / "m" / "model.safetensors").unlink()
    refused(tmp_path / "m", r"has a config but no weights \(model\.safetensors \(or its shards\)\): an incomplete copy")
    for step in (2, 10):
        (tmp_path / "run" / f"checkpoint-{step}").mkdir(parents=True)
    refused(tmp_path / "run", r"is a run's folder without a final model \(config\.json\), only checkpoints: give its "
                              r"newest, '.*checkpoint-10'$")
    check_model_location(str(model_dir), "model_name_or_path")
    # weights under other names load: save_pretrained(variant=…), a GGUF file beside a config.json (gguf_file)
    toy.build_model(tokenizer, seed=0, hidden_size=32).save_pretrained(tmp_path / "variant", variant="fp16")
    assert [p.name for p in (tmp_path / "variant").glob("*.safetensors")] == ["model.fp16.safetensors"]
    check_model_location(str(tmp_path / "variant"), "model_name_or_path")
    shutil.copy(tmp_path / "variant" / "config.json", tmp_path / "m" / "config.json")
    (tmp_path / "m" / "tiny.gguf").write_bytes(b"GGUF")
    check_model_location(str(tmp_path / "m"), "model_name_or_path")

    # a full model without a tokenizer: named, OUT never created
    shutil.copytree(model_dir, tmp_path / "notok", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert main(["export", str(tmp_path / "notok"), "--merge", str(tmp_path / "out")]) == 2
    assert "export: " in (err := capsys.readouterr().err) and "holds no tokenizer" in err
    assert not (tmp_path / "out").exists()
    # an adapter without one: its base's
    adapter = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32),
                             LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.peft_config["default"].base_model_name_or_path = str(model_dir)
    adapter.save_pretrained(tmp_path / "adapter")
    assert not list((tmp_path / "adapter").glob("tokenizer*"))
    (tmp_path / ".tmp-export-merged").mkdir()  # what an export killed while writing leaves (beside OUT, not in it)
    (tmp_path / ".tmp-export-merged" / "model.safetensors").write_bytes(b"torn")
    assert main(["export", str(tmp_path / "adapter"), "--merge", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "tokenizer_config.json").exists() and not (tmp_path / ".tmp-export-merged").exists()
    # a tokenizer there that does not load is named: the base's may differ from it (added tokens)
    shutil.copytree(tmp_path / "adapter", tmp_path / "torn")
    (tmp_path / "torn" / "tokenizer_config.json").write_text('{"added_tokens_decoder": {')
    assert main(["export", str(tmp_path / "torn"), "--merge", str(tmp_path / "merged2")]) == 2
    assert "export: the tokenizer in" in (err := capsys.readouterr().err) and "does not load" in err
    assert not (tmp_path / "merged2").exists()
    held = _jsonl(tmp_path / "held.jsonl", _rows(4))
    common = ["--eval_dataset_name", held, "--reward_funcs", "groupwise.tasks.toy:letter_reward", *EVAL]
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no `hf auth login` either
    assert main(["eval", "--model_name_or_path", str(tmp_path / "adapter"), "--output_dir", str(tmp_path / "ev"),
                 "--log_completions", "true", "--log_completions_hub_repo", "me/logs", *common]) == 0
    assert main(["eval", "--model_name_or_path", str(model_dir), "--bogus_field", "1", *common]) == 2
    assert "groupwise eval: unknown field 'bogus_field'" in capsys.readouterr().err

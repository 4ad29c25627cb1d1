"""`groupwise train` as `trl grpo`: TRL's script fields (ScriptArguments, ModelConfig, DatasetMixtureConfig,
GRPOScriptArguments), TRL's command-line habits, the datasets a run names (files, folders, splits, mixtures) with
one-line errors, the policy's dtype as TRL loads it, and prompts the tokenizer cannot template."""

from __future__ import annotations

import json
import os
import sys

import datasets
import pytest
import torch
import yaml

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.cli import main, parse_overrides
from groupwise.config_base import ConfigError
from groupwise.data import PromptData
from groupwise.tasks import toy
from tests.conftest import small_args


def _rows(n=8, **extra):
    return [{"prompt": f"repeat {c}:", "letter": c, **extra} for c in "abcdabcdabcdabcd"[:n]]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class FakeTrainer:
    """Stands in for GRPOTrainer: records what the CLI passes, trains and saves nothing."""

    made: list[FakeTrainer] = []

    def __init__(self, model, reward_funcs, **kwargs):
        self.model, self.reward_funcs, self.kwargs = model, reward_funcs, kwargs
        self.saved = None
        FakeTrainer.made.append(self)

    def train(self):
        pass

    def save_model(self, output_dir=None):
        self.saved = output_dir


@pytest.fixture
def fake(monkeypatch):
    import groupwise.trainer

    FakeTrainer.made = []
    monkeypatch.setattr(groupwise.trainer, "GRPOTrainer", FakeTrainer)
    return FakeTrainer.made


def _cfg(tmp_path, model_dir, **extra):
    cfg = {"model_name_or_path": model_dir, "dataset_name": _jsonl(tmp_path / "p.jsonl", _rows()),
           "reward_funcs": ["groupwise.tasks.toy:letter_reward"], "num_generations": 4,
           "per_device_train_batch_size": 8, "max_completion_length": 4, "output_dir": str(tmp_path / "run"), **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_trl_grpo_config_runs_and_leaves_the_model_in_output_dir(tmp_path, tokenizer):
    """TRL's ModelConfig / ScriptArguments fields load with TRL's meanings; the policy loads in TRL's float32 from a
    bfloat16 checkpoint (from_pretrained alone would keep bfloat16); the trained model is saved to output_dir even
    with save_strategy 'no', as `trl grpo` saves it."""
    model = tmp_path / "bf16-model"
    toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16).save_pretrained(model)
    tokenizer.save_pretrained(model)
    cfg = _cfg(tmp_path, str(model), model_revision="main", dtype="float32", attn_implementation="eager",
               dataset_train_split="train", dataset_test_split="test", dataset_streaming=False,
               learning_rate="1e-6", max_steps=1,
               save_strategy="no", use_peft=False, lora_r=16, load_in_4bit=False, bnb_4bit_quant_type="nf4")
    assert main(["train", "--config", cfg]) == 0  # TRL's spelling of the config argument
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_policy_dtype_follows_trl(tmp_path, tokenizer):
    """model_init_kwargs dtype: float32 unless given; 'auto' keeps the checkpoint's; torch_dtype is read as dtype; a
    bad name is a ConfigError before anything loads."""
    model = tmp_path / "bf16-model"
    toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16).save_pretrained(model)
    tokenizer.save_pretrained(model)
    reward = [lambda completions, **_: [0.0] * len(completions)]

    def dtype(**kw):
        t = GRPOTrainer(str(model), reward, args=small_args(tmp_path, **kw), train_dataset=_rows())
        return next(t.unwrapped.parameters()).dtype

    assert dtype() == torch.float32
    assert dtype(model_init_kwargs={"dtype": "auto"}) == torch.bfloat16
    assert dtype(model_init_kwargs={"torch_dtype": "bfloat16"}) == torch.bfloat16
    with pytest.raises(ConfigError, match=r"model_init_kwargs dtype='bf16' is not one of \['auto', 'bfloat16'"):
        GRPOTrainer(str(model), reward, args=small_args(tmp_path, model_init_kwargs={"dtype": "bf16"}),
                    train_dataset=_rows())


def test_help_and_trl_command_line_habits(tmp_path, model_dir, capsys, fake):
    assert main(["train", "--help"]) == 0 and main(["train", "-h"]) == 0
    out = capsys.readouterr().out
    assert "usage: groupwise train" in out and "dataset_test_split" in out and "model_revision" in out
    # --field a b (a list, as TRL's parser reads list fields), --no_<flag> (false)
    assert parse_overrides(["--reward_funcs", "a:b", "c:d", "--bf16"]) == {"reward_funcs": ["a:b", "c:d"], "bf16": True}
    cfg = _cfg(tmp_path, model_dir)
    assert main(["train", cfg, "--lora_target_modules", "q_proj", "v_proj", "--no_shuffle_dataset", "--run_name",
                 "2024", "--max_prompt_length", "None", "--reward_weights", "1e-1"]) == 0
    args = fake[-1].kwargs["args"]
    assert args.lora_target_modules == ["q_proj", "v_proj"] and args.shuffle_dataset is False
    assert args.run_name == "2024" and args.max_prompt_length is None and args.reward_weights == [0.1]
    assert args.model_init_kwargs == {"dtype": "float32"}  # TRL ModelConfig's default dtype
    assert fake[-1].saved == args.output_dir
    assert main(["train", cfg, "--config", cfg]) == 2
    assert "two configs" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (dict(dtype="bf16"), r"dtype='bf16' is not one of \['auto', 'bfloat16', 'float16', 'float32'\]"),
    (dict(dtype="float32", torch_dtype="bfloat16"), "dtype='float32' and torch_dtype='bfloat16' name the same thing"),
    (dict(dataset_split="train", dataset_train_split="test"), "dataset_split='train' and dataset_train_split='test'"),
    (dict(bnb_4bit_quant_type="fp4"), "bnb_4bit_quant_type='fp4' has no effect without load_in_4bit=True"),
    (dict(model_revison="x"), "unknown field 'model_revison'; did you mean 'model_revision'"),
    (dict(datasets=[{"path": "x.jsonl", "splt": "train"}]), r"datasets\[0\]: unknown field 'splt'; did you mean 'split'"),
    (dict(test_split_size=1.5), r"test_split_size=1.5 must be a share in \(0, 1\) or a whole number of rows"),
])
def test_script_field_errors_are_one_line_exit_2(tmp_path, model_dir, capsys, fake, extra, message):
    assert main(["train", _cfg(tmp_path, model_dir, **extra)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("groupwise: configuration error:")
    assert __import__("re").search(message, err), err
    assert not fake


def test_trl_reward_names_and_working_directory_modules(tmp_path, model_dir, monkeypatch, fake):
    """The names of TRL's reward registry are groupwise's functions (get_soft_overlong_punishment built as the
    script builds it); reward_model_name_or_path comes first; a module in the working directory imports from the
    console script too (whose sys.path[0] is its bin folder), as in TRL."""
    (tmp_path / "my_rewards.py").write_text("def zero(completions, **_):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    from groupwise.rewards import accuracy_reward

    rows = [{"prompt": "1+1=", "solution": "2"}] * 8
    cfg = _cfg(tmp_path, model_dir, dataset_name=_jsonl(tmp_path / "s.jsonl", rows),
               reward_funcs=["accuracy_reward", "my_rewards:zero"], reward_model_name_or_path=model_dir)
    assert main(["train", cfg]) == 0
    funcs = fake[-1].reward_funcs
    assert funcs[0] == model_dir and funcs[1] == "groupwise.rewards:accuracy_reward" and funcs[2] == "my_rewards:zero"
    from groupwise.rewards.sources import resolve_spec

    assert resolve_spec(funcs[1], "x") is accuracy_reward and resolve_spec(funcs[2], "x").__name__ == "zero"
    from groupwise import rewards
    from groupwise.script_args import reward_specs

    names = ["reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"]
    found = [resolve_spec(spec, "x") for spec in reward_specs({"reward_model_name_or_path": None,
                                                              "reward_funcs": names})]
    assert found[:2] == [rewards.reasoning_accuracy_reward, rewards.think_format_reward]
    assert (found[2].max_completion_len, found[2].soft_punish_cache) == (1280, 256)  # trl/scripts/grpo.py's


def test_dataset_forms_and_splits(tmp_path, model_dir, capsys, fake):
    """A folder of data files loads as load_dataset reads it; a saved DatasetDict gives the split asked; with
    eval_strategy ≠ 'no' the evaluation rows are dataset_name's dataset_test_split (TRL) or the test_split_size share."""
    folder = tmp_path / "files"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", _rows(8))
    _jsonl(folder / "test.jsonl", _rows(4))
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(folder), eval_strategy="steps")]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == 8 and len(fake[-1].kwargs["eval_dataset"]) == 4
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(8)),
                          "validation": datasets.Dataset.from_list(_rows(2))}).save_to_disk(str(saved))
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(saved), eval_strategy="steps",
                               dataset_test_split="validation")]) == 0
    assert len(fake[-1].kwargs["eval_dataset"]) == 2
    one = [{"path": str(tmp_path / "p.jsonl")}]  # test_split_size splits TRL's mixture (no effect without one)
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=None, datasets=one, test_split_size=2,
                               eval_on_start=True)]) == 0
    assert (len(fake[-1].kwargs["train_dataset"]), len(fake[-1].kwargs["eval_dataset"])) == (6, 2)
    # TRL's mixture: each dataset's columns, shares by fraction (the largest mixture that oversamples none)
    other = _jsonl(tmp_path / "o.jsonl", _rows(16, extra="x"))
    mixture = [{"path": str(tmp_path / "p.jsonl"), "fraction": 1}, {"path": other, "columns": ["prompt", "letter"],
                                                                     "fraction": 3}]
    with pytest.warns(UserWarning, match="the datasets mixture is used and dataset_name is ignored, as in TRL"):
        assert main(["train", _cfg(tmp_path, model_dir, datasets=mixture)]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == 21 and fake[-1].kwargs["eval_dataset"] is None
    assert main(["train", _cfg(tmp_path, model_dir, dataset_streaming=True, max_steps=2)]) == 0
    assert isinstance(fake[-1].kwargs["train_dataset"], datasets.IterableDataset)
    capsys.readouterr()
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(saved), dataset_split="test")]) == 2
    assert "dataset_name='" + str(saved) + "' has no split 'test' (splits: ['train', 'validation'])" in \
        capsys.readouterr().err
    assert main(["train", _cfg(tmp_path, model_dir, eval_strategy="steps")]) == 2
    assert "evaluates on split 'test' of dataset_name" in capsys.readouterr().err
    datasets.Dataset.from_list(_rows(8)).save_to_disk(str(tmp_path / "one"))  # never its training rows again
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(tmp_path / "one"), eval_strategy="steps")]) == 2
    assert "is one saved Dataset, one split ('train'): it has no split 'test'" in capsys.readouterr().err
    # a slice of a saved folder's split, in datasets' syntax, is those rows (it was ignored: every row trained);
    # a split a one-Dataset folder does not have is named (it trained on every row)
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(tmp_path / "one"),
                               dataset_train_split="train[:2]")]) == 0
    assert [r["prompt"] for r in fake[-1].kwargs["train_dataset"]] == [r["prompt"] for r in _rows(8)[:2]]
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(saved), eval_strategy="steps",
                               dataset_test_split="validation[-1:]", dataset_train_split="train[50%:]")]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == 4 and len(fake[-1].kwargs["eval_dataset"]) == 1
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(tmp_path / "one"),
                               dataset_train_split="validation")]) == 2
    assert "one split ('train'): it has no split 'validation'" in capsys.readouterr().err
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(saved), dataset_train_split="train[:x]")]) == 2
    assert "has no split 'train[:x]' (splits: ['train', 'validation']" in capsys.readouterr().err
    odd = tmp_path / "odd"  # a split name the split syntax cannot spell, read by its name as before
    datasets.DatasetDict({"my-split": datasets.Dataset.from_list(_rows(3))}).save_to_disk(str(odd))
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(odd), dataset_train_split="my-split")]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == 3


@pytest.mark.parametrize("name, text, message", [
    ("blank.jsonl", "\n\n", "has no rows"),
    ("bad.jsonl", '{"prompt": "a"}\nnot json\n', r"bad\.jsonl': line 2 is not valid JSON \(Expecting value"),
    ("prompts.txt", "a\n", r"unsupported file type '.txt'"),
    ("header.csv", "prompt,letter\n", "has no rows"),
])
def test_unreadable_dataset_files_are_one_line_exit_2(tmp_path, model_dir, capsys, fake, name, text, message):
    (tmp_path / name).write_text(text)
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=str(tmp_path / name))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("groupwise: configuration error: dataset_name=") and \
        __import__("re").search(message, err[-1]), err


def test_prompts_the_tokenizer_cannot_template_are_named_before_the_model_loads(tokenizer):
    conv = [{"prompt": [{"role": "user", "content": "plain"}]},
            {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}]
    data = PromptData(conv, "train_dataset")
    limits = dict(max_prompt_length=None, max_completion_length=4, truncate_prompt="left", max_positions=None)
    with pytest.raises(ConfigError, match="train_dataset row 0 is a conversation .* the tokenizer has no chat template"):
        data.check_lengths(tokenizer, **limits)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ConfigError, match=r"train_dataset row 1: the tokenizer's chat template fails on it "
                                          r"\(TemplateError: System role not supported\)"):
        data.check_lengths(tokenizer, **limits)


def test_dataset_objects_and_missing_prompts(tmp_path, tokenizer):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows())})
    with pytest.raises(ConfigError, match=r"train_dataset is a DatasetDict with the splits \['train'\]: pass one "
                                          r"split, e.g. train_dataset=dataset\['train'\]"):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [lambda completions, **_: [0.0]],
                    args=small_args(tmp_path), train_dataset=dd, processing_class=tokenizer)
    with pytest.raises(ConfigError, match=r"train_dataset row 1 has no prompt \(None\)"):
        PromptData(datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": None}]), "train_dataset")


def test_yaml_types_a_trl_user_writes():
    """Names YAML reads as numbers stay names; 'None' is None where a field takes no text; 1e-3 in a list of
    numbers is a number (YAML 1.1 reads it as text). Unquoted 1e-7 is a number in a config file, in a mapping too
    (groupwise's YAML loader, as YAML 1.2); quoted text inside a mapping stays text: a revision "2e45607" became
    inf, a stop string "1e3" 1000.0 (any string of that form was turned into a float)."""
    from groupwise.config_base import read_yaml

    c = GRPOConfig(run_name=2024, hub_model_id=7, max_prompt_length="None", reward_weights=["1e-1", 2],
                   num_completions_to_print="none", lr_scheduler_type="cosine_with_min_lr",
                   lr_scheduler_kwargs=read_yaml("{min_lr: 1e-7}"), lora_modules_to_save="lm_head")
    assert c.run_name == "2024" and c.hub_model_id == "7" and c.max_prompt_length is None
    assert c.reward_weights == [0.1, 2] and c.num_completions_to_print is None
    assert c.lr_scheduler_kwargs == {"min_lr": 1e-7} and c.lora_modules_to_save == ["lm_head"]
    values = read_yaml('model_init_kwargs: {revision: "2e45607", attn_implementation: sdpa}\n'
                       'generation_kwargs: {stop_strings: "1e3", top_k: 5e1}\ngeneration_backend: transformers\n'
                       "learning_rate: 3e-6\nmodel_revision: 2e45607")
    c = GRPOConfig(**{k: v for k, v in values.items() if k != "model_revision"})
    assert c.model_init_kwargs == {"revision": "2e45607", "attn_implementation": "sdpa"}
    assert c.generation_kwargs == {"stop_strings": "1e3", "top_k": 50.0} and c.learning_rate == 3e-6
    assert values["model_revision"] == "2e45607"  # unquoted, an exponent of 5 digits: text (a commit id)
    # a text field given a number in exponent form gets it as written, not as the float's repr (12345000000.0)
    c = GRPOConfig(**read_yaml("run_name: 3e10\nhub_revision: 12345e6\nlearning_rate: 1e-6"))
    assert (c.run_name, c.hub_revision, c.learning_rate) == ("3e10", "12345e6", 1e-6)
    # from_pretrained's text arguments inside a mapping too (the commit 12345e6 was the number 1.2345e10)
    c = GRPOConfig(**read_yaml("model_init_kwargs: {revision: 12345e6, dtype: float32}\n"
                               "lr_scheduler_kwargs: {min_lr: 1e-7}\nlr_scheduler_type: cosine_with_min_lr"))
    assert c.model_init_kwargs == {"revision": "12345e6", "dtype": "float32"}
    assert type(c.model_init_kwargs["revision"]) is str and c.lr_scheduler_kwargs == {"min_lr": 1e-7}
    assert type(c.learning_rate) is float
    with pytest.raises(ConfigError, match=r"reward_weights must be a list of finite numbers, got \['x'\]"):
        GRPOConfig(reward_weights=["x"])
    # `eval_strategy: no` (YAML 1.1's false): TRL's "no"; the choices still apply to what it becomes
    c = GRPOConfig(**yaml.safe_load("eval_strategy: no\nsave_strategy: no\nlogging_strategy: no"))
    assert (c.eval_strategy, c.save_strategy, c.logging_strategy) == ("no", "no", "no")
    with pytest.raises(ConfigError, match="lr_scheduler_type='no' is not one of"):
        GRPOConfig(lr_scheduler_type=False)


def test_a_tokenizer_without_pad_or_eos_is_a_configuration_error(tmp_path, tokenizer):
    from groupwise.loading import load_tokenizer

    tokenizer.pad_token = tokenizer.eos_token = None
    with pytest.raises(ConfigError, match="neither a pad token nor an EOS token"):
        load_tokenizer(toy.build_model(toy.build_tokenizer(), seed=0, hidden_size=32), tokenizer, GRPOConfig())


def test_a_built_in_task_can_be_split_and_mixed(fake, tmp_path, model_dir):
    from groupwise.demo import POLICY_DIR

    common = ["train", "--model_name_or_path", str(POLICY_DIR), "--output_dir", str(tmp_path / "run")]
    assert main([*common, "--datasets", "builtin:arithmetic", "--test_split_size", "0.1", "--eval_strategy",
                 "steps", "--reward_funcs", "groupwise.tasks.arithmetic:accuracy"]) == 0
    assert (len(fake[-1].kwargs["train_dataset"]), len(fake[-1].kwargs["eval_dataset"])) == (1800, 200)
    assert main([*common, "--datasets", "[{path: 'builtin:toy'}, {path: 'builtin:toy'}]", "--reward_funcs",
                 "groupwise.tasks.toy:letter_reward"]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == 2 * len(toy.dataset())


def test_a_yaml_key_that_is_not_text_is_named(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("max_steps: 1\nno: 3\n")  # YAML 1.1 reads `no` as False
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    assert ("c.yaml: a key that YAML reads as False (on / off / yes / no / true / false, unquoted) is not a field "
            "name; quote it") in capsys.readouterr().err
    (tmp_path / "c.yaml").write_text("max_steps: 1\n1: 3\n")
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    assert "c.yaml: 1 is not a field name (a YAML key that is not text; quote it)" in capsys.readouterr().err


def test_a_model_folder_without_a_tokenizer_is_named_before_the_weights_load(tmp_path, tokenizer):
    folder = tmp_path / "weights-only"
    toy.build_model(tokenizer, seed=0, hidden_size=32).save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"model '.*weights-only': cannot load its tokenizer \(save it there"):
        GRPOTrainer(str(folder), [lambda completions, **_: [0.0] * len(completions)], args=small_args(tmp_path),
                    train_dataset=_rows())


def test_a_hub_id_neither_cached_nor_reachable_says_how_to_get_it(tmp_path, monkeypatch):
    """Offline and not in the cache: the error says to download it or pass a folder, and that HF_HUB_OFFLINE=1 stops
    the hub's retries (without it a machine with no network spends ~25 s retrying first). HF_HUB_OFFLINE makes the
    test fast and network-free; the cache is an empty folder."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"model 'groupwise-test/not-cached': cannot load its config \(not in the "
                       r"Hugging Face cache.*`hf download groupwise-test/not-cached`.*HF_HUB_OFFLINE=1"):
        GRPOTrainer("groupwise-test/not-cached", [lambda completions, **_: [0.0] * len(completions)],
                    args=small_args(tmp_path), train_dataset=_rows())


def test_every_field_of_trl_grpo_script_is_a_run_field_with_trl_default():
    """`trl grpo` reads GRPOScriptArguments (ScriptArguments), GRPOConfig, ModelConfig and DatasetMixtureConfig: every
    field of the three script dataclasses is a run field with TRL's default, a GRPOConfig field (the LoRA ones), or
    a bitsandbytes field refused at any value but TRL's default."""
    pytest.importorskip("trl")
    import dataclasses

    from trl import DatasetMixtureConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    from groupwise.quantization import QUANTIZATION
    from groupwise.script_args import RUN_FIELDS

    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    for cls in (GRPOScriptArguments, ModelConfig, DatasetMixtureConfig):
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if f.name in RUN_FIELDS:
                assert RUN_FIELDS[f.name][1] == (None if default == [] else default), f.name  # datasets: [] → None
            elif f.name in QUANTIZATION:
                assert QUANTIZATION[f.name] == default, f.name
            else:
                assert f.name in ours, f.name


def test_an_adapter_folder_as_model_name_or_path_is_one_line_exit_2(tmp_path, model_dir, capsys, fake):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "org/base"}')
    assert main(["train", _cfg(tmp_path, model_dir, model_name_or_path=str(adapter))]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "holds a PEFT adapter" in err and "from_pretrained('org/base')" in err
    assert not fake


def test_cli_review_fixes(tmp_path, model_dir, capsys, fake):
    """From the CLI review: `dataset_name: builtin:toy` (listed in the README) was refused because dataset_split takes
    dataset_train_split's default 'train'; a mistyped reward name was looked up on the hub after the policy loaded
    (a traceback, exit 1), where `trl grpo` names its registry; with reward_model_name_or_path the reward_funcs
    index in errors was one too high; a quoted YAML boolean word ("yes", "1") was refused where TRL's parser reads
    it; trainer.log() with a numpy scalar crashed writing metrics.jsonl."""
    import numpy as np

    assert main(["train", _cfg(tmp_path, model_dir, dataset_name="builtin:toy")]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == len(toy.dataset())
    assert main(["train", _cfg(tmp_path, model_dir, reward_funcs=["accuracy_rewrd"])]) == 2
    assert "reward_funcs[0]='accuracy_rewrd' is not one of `trl grpo`'s reward functions" in capsys.readouterr().err
    assert main(["train", _cfg(tmp_path, model_dir, reward_model_name_or_path=model_dir,
                               reward_funcs=["nosuch.mod:fn"])]) == 2
    assert "reward_funcs[0]='nosuch.mod:fn'" in capsys.readouterr().err
    c = GRPOConfig(**yaml.safe_load('log_completions: "yes"\nuse_peft: "1"\nbf16: "no"'))
    assert (c.log_completions, c.use_peft, c.bf16) == (True, True, False)
    from groupwise.logging import MetricsLogger

    logger = MetricsLogger(str(tmp_path / "m"), [], enabled=True, config={}, model=None)
    logger.log(1, {"custom": np.float32(0.5), "n": np.int64(3), "t": torch.tensor(0.25),
                   "inf": torch.tensor(float("inf"))})
    logger.close(False)
    assert '"custom": 0.5, "n": 3, "t": 0.25, "inf": null' in (tmp_path / "m" / "metrics.jsonl").read_text()
    from groupwise.script_args import reward_specs  # a bare name far from the registry stays a hub id ("gpt2")

    assert reward_specs({"reward_model_name_or_path": None, "reward_funcs": ["gpt2"]}) == ["gpt2"]

"""`groupwise train` read as `trl grpo` reads its command line and config (TRL 1.16: TrlParser, HfArgumentParser,
ScriptArguments, ModelConfig, DatasetMixtureConfig, get_quantization_config): the config's env: section, values read
by the field's type, test_split_size on a mixture only, the command line winning over an alias in the file, the
bitsandbytes fields typed and checked, a leftover dataset_name beside a mixture, a data file's one split, --config's
one path, and a negative max_grad_norm."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import pytest
import torch
import yaml

from groupwise.cli import build_run, main, parse_overrides
from groupwise.config import GRPOConfig
from groupwise.config_base import ConfigError
from tests.test_cli_audit import FakeTrainer, _cfg, _jsonl, _rows


@pytest.fixture
def fake(monkeypatch):
    """GRPOTrainer replaced by test_cli_audit's FakeTrainer: what the command line passes, nothing trained."""
    import groupwise.trainer

    FakeTrainer.made = []
    monkeypatch.setattr(groupwise.trainer, "GRPOTrainer", FakeTrainer)
    return FakeTrainer.made


def _one_line_error(capsys, pattern):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("groupwise: configuration error:"), err
    assert re.search(pattern, err), err


def _run(values):
    return build_run({"model_name_or_path": "m", **values})


# ---- 1. env: -------------------------------------------------------------------------------------------------------

def test_config_env_section_sets_variables_before_anything_reads_them(tmp_path, model_dir, monkeypatch, fake):
    """TrlParser sets each env: key as an environment variable (str(value)) before the rest is read: here a reward
    module reads it at import time."""
    for name in ("GW_ENV_A", "GW_ENV_B"):
        monkeypatch.setenv(name, "unset")  # restored by monkeypatch
        monkeypatch.delenv(name)
    (tmp_path / "env_reward.py").write_text("import os\nSEEN = os.environ['GW_ENV_A']\n"
                                            "def zero(completions, **_):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory is added to it, as in TRL
    monkeypatch.delitem(sys.modules, "env_reward", raising=False)
    cfg = _cfg(tmp_path, model_dir, reward_funcs=["env_reward:zero"], env={"GW_ENV_A": 7, "GW_ENV_B": True})
    assert main(["train", cfg]) == 0
    assert os.environ["GW_ENV_A"] == "7" and os.environ["GW_ENV_B"] == "True"  # TRL: str(value)
    assert __import__("env_reward").SEEN == "7"


def test_a_config_env_that_is_not_a_mapping_is_one_line(tmp_path, model_dir, capsys, fake):
    assert main(["train", _cfg(tmp_path, model_dir, env=["A=1"])]) == 2
    _one_line_error(capsys, r"env must be a mapping of VARIABLE: value \(as in TRL\), got list")
    assert not fake


# ---- 2. command-line values by the field's type ------------------------------------------------------------------

def test_command_line_text_stays_text():
    """YAML would read these as 'exp', 202401, an octal int, True, None: TRL's parser keeps the text."""
    run, args = _run(parse_overrides(["--run_name", "exp #1", "--dataset_config", "2024_01", "--model_revision",
                                      "0123456", "--hub_model_id", "on", "--attn_implementation", "None"]))
    assert args.run_name == "exp #1" and args.hub_model_id == "on"
    assert run["dataset_config"] == "2024_01" and run["model_revision"] == "0123456"
    assert run["attn_implementation"] == "None"  # HfArgumentParser: an Optional[str] takes the text 'None'
    run, args = _run(parse_overrides(["--run_name", "on", "--dataset_config", "null"]))
    assert args.run_name == "on" and run["dataset_config"] == "null"


@pytest.mark.parametrize("word, value", [(w, True) for w in ("1", "y", "t", "yes", "true", "Y", "TRUE", "Yes")] +
                         [(w, False) for w in ("0", "n", "f", "no", "false", "N", "False", "NO")])
def test_booleans_take_trls_words(word, value):
    run, args = _run(parse_overrides(["--shuffle_dataset", word, "--dataset_streaming", word]))
    assert args.shuffle_dataset is value and run["dataset_streaming"] is value


def test_a_word_that_is_not_a_boolean_is_one_line(capsys):
    assert main(["train", "--model_name_or_path", "m", "--shuffle_dataset", "maybe"]) == 2
    _one_line_error(capsys, r"--shuffle_dataset='maybe' is not a boolean: give true/false, yes/no, t/f, y/n or 1/0")


def test_command_line_values_match_trls_parser(tmp_path):
    """The same argument vector through TRL's own `trl grpo` parser and through groupwise's."""
    pytest.importorskip("trl")
    from trl.scripts.grpo import make_parser

    argv = ["--model_name_or_path", "m", "--run_name", "exp #1", "--dataset_config", "2024_01", "--model_revision",
            "0123456", "--shuffle_dataset", "N", "--dataset_streaming", "Yes", "--attn_implementation", "None",
            "--reward_funcs", "a.b", "c.d", "--lora_target_modules", "q_proj", "v_proj", "--reward_weights", "1e-1",
            "2", "--learning_rate", "1e-3", "--max_steps", "0012", "--dataset_train_split", "007"]
    script, trl_args, model, _ = make_parser().parse_args_and_config(
        args=[*argv, "--bf16", "false", "--use_cpu", "true", "--output_dir", str(tmp_path)], fail_with_unknown_args=False)
    run, args = _run(parse_overrides(argv))
    for ours, theirs in ((args.run_name, trl_args.run_name), (run["dataset_config"], script.dataset_config),
                         (run["model_revision"], model.model_revision), (args.shuffle_dataset, trl_args.shuffle_dataset),
                         (run["dataset_streaming"], script.dataset_streaming),
                         (run["attn_implementation"], model.attn_implementation),
                         (run["reward_funcs"], script.reward_funcs), (args.lora_target_modules, model.lora_target_modules),
                         (args.reward_weights, trl_args.reward_weights), (args.learning_rate, trl_args.learning_rate),
                         (args.max_steps, trl_args.max_steps), (run["dataset_split"], script.dataset_train_split)):
        assert ours == theirs and type(ours) is type(theirs), (ours, theirs)


def test_datasets_on_the_command_line_are_paths_as_in_trl():
    assert parse_overrides(["--datasets", "a.jsonl", "org/b"]) == {"datasets": [{"path": "a.jsonl"}, {"path": "org/b"}]}


# ---- 3. test_split_size: a mixture only ---------------------------------------------------------------------------

def test_test_split_size_without_a_mixture_has_no_effect_and_says_so(tmp_path, model_dir, fake):
    with pytest.warns(UserWarning, match=r"test_split_size=2.0 has no effect without a datasets: mixture \(as in TRL\)"
                                         r".*dataset_test_split / eval_split"):
        assert main(["train", _cfg(tmp_path, model_dir, test_split_size=2)]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == 8 and fake[-1].kwargs["eval_dataset"] is None


# ---- 4. the command line wins over the file's alias ---------------------------------------------------------------

@pytest.mark.parametrize("in_file, on_line", [("torch_dtype", "dtype"), ("dtype", "torch_dtype"),
                                              ("dataset_train_split", "dataset_split")])
def test_the_command_line_wins_over_the_other_name_in_the_file(tmp_path, model_dir, fake, in_file, on_line):
    value, wanted = ("bfloat16", "float16") if "dtype" in in_file else ("test", "train")
    assert main(["train", _cfg(tmp_path, model_dir, **{in_file: value}), f"--{on_line}", wanted]) == 0
    if "dtype" in in_file:
        assert fake[-1].kwargs["args"].model_init_kwargs["dtype"] == wanted
    else:
        assert len(fake[-1].kwargs["train_dataset"]) == 8


# ---- 5. and 8. the bitsandbytes fields ----------------------------------------------------------------------------

def test_4bit_and_8bit_together_are_refused_as_in_trl(tmp_path, model_dir, capsys, fake):
    with pytest.raises(ConfigError, match="8-bit and 4-bit precision cannot be used at the same time"):
        _run({"load_in_4bit": True, "load_in_8bit": True})
    assert main(["train", _cfg(tmp_path, model_dir, load_in_4bit=True), "--load_in_8bit"]) == 2
    _one_line_error(capsys, r"load_in_4bit=True and load_in_8bit=True")


def test_quantization_fields_are_typed_and_checked(tmp_path, model_dir, capsys, fake):
    run, _ = _run({"load_in_4bit": "false", "load_in_8bit": "False"})  # quoted YAML: the word, not a truthy string
    assert run["quantization_config"] is None
    run, _ = _run(parse_overrides(["--no_load_in_4bit", "--no_use_bnb_nested_quant"]))
    assert run["quantization_config"] is None
    for argv, message in ((["--bnb_4bit_quant_type"], r"--bnb_4bit_quant_type needs a value"),
                          (["--bnb_4bit_quant_storage", "float17"], r"bnb_4bit_quant_storage='float17' is not one of "
                                                                    r"\['float16', 'float32'"),
                          (["--load_in_4bit", "--bnb_4bit_quant_type", "int4"], r"bnb_4bit_quant_type='int4' is not "
                                                                                r"one of \['fp4', 'nf4'\]"),
                          (["--load_in_8bit", "sure"], r"--load_in_8bit='sure' is not a boolean")):
        assert main(["train", _cfg(tmp_path, model_dir), *argv]) == 2, argv
        _one_line_error(capsys, message)
    with pytest.raises(ConfigError, match="use_bnb_nested_quant=3 must be of type bool"):
        _run({"use_bnb_nested_quant": 3})
    assert main(["train", "--load_in_4bit"]) == 2  # a run field without a model, not a demo's GRPOConfig field
    _one_line_error(capsys, "load_in_4bit is set but model_name_or_path is not")
    assert not fake


def test_quantization_fields_are_listed_in_help_and_fields(capsys):
    assert main(["train", "--help"]) == 0
    train_help = capsys.readouterr().out
    assert main(["fields"]) == 0
    fields = capsys.readouterr().out
    for name in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"):
        assert re.search(rf"^\s*{name}\s", train_help, re.M) and re.search(rf"^{name}\s", fields, re.M), name


# ---- 6. a leftover dataset_name beside a mixture ------------------------------------------------------------------

def test_a_leftover_dataset_name_beside_a_mixture_is_ignored_with_a_warning(tmp_path, model_dir, fake):
    mixture = [{"path": _jsonl(tmp_path / "m.jsonl", _rows(4))}]
    cfg = _cfg(tmp_path, model_dir, datasets=mixture)
    cfg_values = yaml.safe_load(open(cfg))
    cfg_values["dataset_name"] = str(tmp_path / "gone.jsonl")  # not there: TRL never reads it
    open(cfg, "w").write(yaml.safe_dump(cfg_values))
    with pytest.warns(UserWarning, match="the datasets mixture is used and dataset_name is ignored"):
        assert main(["train", cfg]) == 0
    assert len(fake[-1].kwargs["train_dataset"]) == 4


# ---- 7. a data file has one split, 'train' ------------------------------------------------------------------------

def test_a_data_file_has_only_the_train_split(tmp_path, model_dir, capsys, fake):
    assert main(["train", _cfg(tmp_path, model_dir), "--dataset_train_split", "validation"]) == 2
    _one_line_error(capsys, r"dataset_name='.*p.jsonl' .* no split 'validation' \(a data file's one split is 'train'")
    assert main(["train", _cfg(tmp_path, model_dir, datasets=[{"path": str(tmp_path / "p.jsonl"), "split": "test"}],
                               dataset_name=None)]) == 2
    _one_line_error(capsys, r"datasets\[0\].path=.* no split 'test'")
    assert not fake
    assert main(["train", _cfg(tmp_path, model_dir), "--dataset_train_split", "train[:4]"]) == 0  # as datasets
    assert len(fake[-1].kwargs["train_dataset"]) == 4
    # an evaluation file named on its own (eval_split unset, whose default 'test' is a built-in task's) is read whole
    assert main(["train", _cfg(tmp_path, model_dir), "--eval_dataset_name", str(tmp_path / "p.jsonl"),
                 "--eval_strategy", "steps"]) == 0
    assert len(fake[-1].kwargs["eval_dataset"]) == len(fake[-1].kwargs["train_dataset"])


# ---- 9. --config takes one path -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, got", [(["--config"], "none"), (["--config", "a.yaml", "b.yaml"], "'a.yaml', 'b.yaml'"),
                                       (["--config="], "''")])
def test_config_takes_one_path(capsys, argv, got):
    assert main(["train", *argv]) == 2
    _one_line_error(capsys, rf"--config takes one path \(got \[?{got}\]?\): groupwise train --config CONFIG.yaml")


# ---- 10. max_grad_norm ≤ 0: no clipping, as transformers ----------------------------------------------------------

def test_a_negative_max_grad_norm_means_no_clipping():
    assert GRPOConfig(max_grad_norm=-1.0).max_grad_norm == -1.0
    _, args = _run(parse_overrides(["--max_grad_norm", "-1"]))
    assert args.max_grad_norm == -1.0
    from groupwise.distributed import Distributed

    dist = Distributed()
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert float(dist.clip_grad_norm([p], args.max_grad_norm)) == pytest.approx(5.0)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]))  # untouched, as transformers skips clipping


def test_fields_help_and_a_closed_pipe(capsys):
    """`groupwise fields --help` says what the command prints (it printed every field); `groupwise fields | head`
    ends quietly when the reader leaves (it was a BrokenPipeError traceback)."""
    import subprocess
    import sys

    assert main(["fields", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: groupwise fields") and "num_generations" not in out
    with pytest.raises(SystemExit) as e:
        main(["fields", "x"])
    assert e.value.code == 2 and "groupwise fields takes no arguments, got ['x']" in capsys.readouterr().err
    proc = subprocess.run(f"{sys.executable} -m groupwise fields | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("model_name_or_path") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run(f"{sys.executable} -m groupwise prm train --help | head -1", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("usage: groupwise prm train") and "Traceback" not in proc.stderr, proc.stderr


def test_debug_prints_the_traceback_and_keeps_the_exit_code(tmp_path, capsys):
    # it re-raised: exit 1, as a run's own error, for a configuration error
    assert main(["train", "--max_steps", "-3", "--model_name_or_path", str(tmp_path), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith(
        "groupwise: configuration error: ")
    # TRL's `--debug underflow_overflow` (transformers' debug modes): named, not "unexpected argument"
    assert main(["train", "--debug", "underflow_overflow"]) == 2
    assert "--debug 'underflow_overflow': --debug takes no value here" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_steps: -3\n")
    assert main(["train", "--debug", str(cfg)]) == 2  # a config path after --debug is the config
    assert "max_steps must be ≥ -1, got -3" in capsys.readouterr().err


def test_trls_own_parsers_build_a_groupwise_grpo_config(tmp_path):
    """A TRL script switched by its import: `TrlParser((ScriptArguments, GRPOConfig, ModelConfig))` and
    `HfArgumentParser((GRPOConfig,))` failed to build ('Only Union[X, NoneType] …' at logging_steps; argparse
    refusing the rules in the fields' metadata; --lora_r twice, from GRPOConfig and ModelConfig; scale_rewards read
    as a boolean). Each field's annotation is now one these parsers read, the LoRA fields are left to ModelConfig,
    and the config they build equals GRPOConfig(**the same values)."""
    from transformers import HfArgumentParser
    from trl import ModelConfig, ScriptArguments, TrlParser

    argv = ["--output_dir", str(tmp_path / "out"), "--logging_steps", "5", "--save_steps", "0.5",
            "--eval_strategy", "steps", "--eval_steps", "10", "--scale_rewards", "batch", "--report_to", "none",
            "--resume_from_checkpoint", str(tmp_path / "ckpt"), "--learning_rate", "1e-5", "--bf16", "false",
            "--fsdp", "full_shard", "--pad_to_multiple_of", "8", "--beta", "0.04", "--log_level", "detail"]
    (parsed,) = HfArgumentParser((GRPOConfig,)).parse_args_into_dataclasses(argv)
    expected = GRPOConfig(output_dir=str(tmp_path / "out"), logging_steps=5, save_steps=0.5, eval_strategy="steps",
                          eval_steps=10, scale_rewards="batch", report_to="none",
                          resume_from_checkpoint=str(tmp_path / "ckpt"), learning_rate=1e-5, bf16=False,
                          fsdp="full_shard", pad_to_multiple_of=8, beta=0.04, log_level="detail",  # transformers
                          include_num_input_tokens_seen=False)  # the parser reads the default 'no' as a bool, as TRL's
    assert isinstance(parsed, GRPOConfig) and parsed.to_dict() == expected.to_dict()
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": "m", "dataset_name": "d", "use_peft": True, "lora_r": 8,
                                      "output_dir": str(tmp_path / "out"), "num_generations": 4, "bf16": False}))
    script, args, model = TrlParser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(config), "--max_completion_length", "64"])
    assert isinstance(args, GRPOConfig) and (args.num_generations, args.max_completion_length) == (4, 64)
    assert (model.use_peft, model.lora_r, script.dataset_name) == (True, 8, "d")  # TRL's ModelConfig holds LoRA
    assert not args.use_peft  # groupwise's own copy of those fields stays unset: TRL passes peft_config
    # TRL's fields groupwise does not support are parser fields too: set in a config file or on the command line,
    # refused by name (TRL's script drops an unknown argument silently: a DeepSpeed config would have been ignored)
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "deepspeed": "ds.json", "bf16": False}))
    with pytest.raises(ConfigError, match="TRL field deepspeed='ds.json' is not supported by groupwise: DeepSpeed"):
        TrlParser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(["--config", str(config)],
                                                                                    fail_with_unknown_args=False)
    with pytest.raises(ConfigError, match="TRL field use_cpu=True is not supported"):
        HfArgumentParser((GRPOConfig,)).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "1"])
    # the parsers rewrote the fields' types in place (transformers does); groupwise still reads what they accept
    after = GRPOConfig(resume_from_checkpoint=True, fsdp=["full_shard", "offload"], scale_rewards=False,
                       report_to=["none"], use_peft=True, lora_r=4)
    assert (after.resume_from_checkpoint, after.fsdp, after.scale_rewards, after.lora_r) == \
        (True, ["full_shard", "offload"], "none", 4)
    assert GRPOConfig.from_dict(after.to_dict()).lora_r == 4
    with pytest.raises(ConfigError, match="logging_steps='x' must be of type float"):
        GRPOConfig(logging_steps="x")
    # TRL's dict fields are `dict | str | None`: JSON text from the parser is a mapping (argparse refused it); 'all'
    _, args, _ = TrlParser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(
        ["--output_dir", str(tmp_path / "out"), "--model_init_kwargs", '{"dtype": "float32"}', "--report_to", "all",
         "--chat_template_kwargs", '{"enable_thinking": false}'])
    assert args.model_init_kwargs == {"dtype": "float32"} and args.chat_template_kwargs == {"enable_thinking": False}
    assert args.report_to == GRPOConfig(report_to="all").report_to
    with pytest.raises(ConfigError, match=r"model_init_kwargs='\{dtype' is not valid JSON"):
        GRPOConfig(model_init_kwargs="{dtype")
    with pytest.raises(ConfigError, match="generation_kwargs='\[1\]' must be a mapping"):
        GRPOConfig(generation_kwargs="[1]")


def test_dataclasses_replace_keeps_the_fields_kept_out_of_the_parsers(tmp_path):
    """The LoRA fields are init=False (so that TRL's parsers leave them to ModelConfig): dataclasses.replace built
    its copy without them, silently a full fine-tune; the copy takes them from the config it copies."""
    import copy
    import dataclasses
    import pickle

    cfg = GRPOConfig(output_dir=str(tmp_path), use_peft=True, lora_r=8, lora_target_modules=["q_proj"])
    for twin in (dataclasses.replace(cfg, learning_rate=1e-5), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg)),
                 GRPOConfig.from_dict(cfg.to_dict())):
        assert (twin.use_peft, twin.lora_r, twin.lora_target_modules) == (True, 8, ["q_proj"])
    twin = dataclasses.replace(cfg, learning_rate=1e-5)
    assert twin.learning_rate == 1e-5 and twin.lora_target_modules is not cfg.lora_target_modules  # a copy
    assert GRPOConfig(output_dir=str(tmp_path)).lora_r == 16  # a new config: the default, not the last copy's


def test_a_subclass_with_fields_of_its_own_goes_through_the_parsers(tmp_path):
    """transformers rewrites field.type in place (int | None → int); the annotations are read as written in the
    class, so a user subclass's `int | None` field still takes None after a parser ran."""
    from transformers import HfArgumentParser

    @dataclasses.dataclass
    class MyConfig(GRPOConfig):
        my_opt: int | None = None
        my_flag: bool = False

    (parsed,) = HfArgumentParser((MyConfig,)).parse_args_into_dataclasses(["--output_dir", str(tmp_path),
                                                                           "--my_opt", "5"])
    assert isinstance(parsed, MyConfig) and (parsed.my_opt, parsed.my_flag) == (5, False)
    (parsed,) = HfArgumentParser((MyConfig,)).parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert parsed.my_opt is None and MyConfig(output_dir=str(tmp_path)).my_opt is None
    with pytest.raises(ConfigError, match="my_opt='x' must be of type int"):
        MyConfig(output_dir=str(tmp_path), my_opt="x")


def test_a_data_file_without_a_prompt_column_is_named_by_its_field(tmp_path, model_dir, fake, capsys):
    """A command-line user has no `train_dataset`: the message named the trainer's argument; it names the field
    and file now (the trainer is not built)."""
    rows = [{"question": "repeat a:", "letter": "a"}] * 8
    data = _jsonl(tmp_path / "q.jsonl", rows)
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=data)]) == 2
    err = capsys.readouterr().err
    assert f"dataset_name={data!r} has no 'prompt' column (columns: ['question', 'letter'])" in err and not fake
    good = _jsonl(tmp_path / "p2.jsonl", _rows())
    assert main(["train", _cfg(tmp_path, model_dir, dataset_name=good, eval_dataset_name=data, eval_strategy="steps",
                      eval_steps=1, overwrite_output_dir=True)]) == 2
    assert f"eval_dataset_name={data!r} has no 'prompt' column" in capsys.readouterr().err

"""Every TRL 1.16 GRPOConfig field and GRPOTrainer argument is either taken with TRL's meaning or refused with a
reason that names what to use instead: never "unknown field". The list of TRL's fields is kept in
tests/trl_1_16_fields.py (TRL is not a dependency); when TRL is installed, the list is checked against it."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import warnings

import pytest

import groupwise.config_trl
from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config import TRL_NOT_SUPPORTED
from groupwise.config_base import ConfigError, rules_of
from tests.trl_1_16_fields import GRPO_CONFIG_DEFAULTS, GRPO_TRAINER_ARGUMENTS, TRANSFORMERS_VERSIONS, TRL_VERSION

OURS = {f.name: f for f in dataclasses.fields(GRPOConfig)}
# TRL defaults that are not valid values here, each for a stated reason (docs/trl_compat.md)
OWN_DEFAULT = {
    "output_dir": "None in TRL (then 'trainer_output'); groupwise needs a folder name: 'outputs/groupwise'",
    "bf16": "None in TRL (then True on GPUs); groupwise takes a boolean, False by default",
}


def _other_value(default):
    """A value that is not TRL's default, of the same kind."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 7
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, list):
        return ["x"]
    return "something"


def test_the_kept_list_matches_trl_when_trl_is_installed():
    """On any transformers: GRPOConfig inherits TrainingArguments, so a transformers release that adds or renames a
    field (which a TRL user's config may then carry) fails here, naming it, rather than being skipped."""
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (it is not a dependency); the kept list is used as it is")
    import trl

    import transformers

    if trl.__version__ != TRL_VERSION:
        pytest.skip(f"TRL {trl.__version__} is installed; the kept list is TRL {TRL_VERSION}'s")
    fields = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    where = (f"TRL {TRL_VERSION}'s GRPOConfig on transformers {transformers.__version__} (the kept list was checked on "
             f"{', '.join(TRANSFORMERS_VERSIONS)}): update tests/trl_1_16_fields.py and groupwise's config")
    assert set(fields) == set(GRPO_CONFIG_DEFAULTS), f"{where}: new {sorted(set(fields) - set(GRPO_CONFIG_DEFAULTS))}, " \
        f"gone {sorted(set(GRPO_CONFIG_DEFAULTS) - set(fields))}"
    assert list(fields) == list(GRPO_CONFIG_DEFAULTS), where
    for name, f in fields.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert default == GRPO_CONFIG_DEFAULTS[name], f"{where}: {name} defaults to {default!r}"
    assert list(inspect.signature(trl.GRPOTrainer.__init__).parameters)[1:] == list(GRPO_TRAINER_ARGUMENTS)


def test_every_trl_field_is_supported_or_refused_with_a_reason():
    assert len(GRPO_CONFIG_DEFAULTS) == 191
    for name in GRPO_CONFIG_DEFAULTS:  # every one a field (TRL's parsers see it); the unsupported ones refused
        assert name in OURS, name
        assert (name in TRL_NOT_SUPPORTED) == (name in groupwise.config_trl.TRLFields.__dataclass_fields__), name
    # the not-supported table names only TRL fields: GRPOConfig 1.16's, and one older TRL configs still carry
    # (use_liger_loss, GRPOConfig before 1.0)
    assert set(TRL_NOT_SUPPORTED) - set(GRPO_CONFIG_DEFAULTS) == {"use_liger_loss"}


@pytest.mark.parametrize("name", [n for n in GRPO_CONFIG_DEFAULTS if n in TRL_NOT_SUPPORTED])
def test_a_refused_field_loads_at_trl_default_and_names_the_alternative_otherwise(name):
    default = GRPO_CONFIG_DEFAULTS[name]
    entry = TRL_NOT_SUPPORTED[name]
    assert entry.default == default, f"{name}: TRL's default is {default!r}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = GRPOConfig(**{name: default})  # a dumped TRL config loads
    assert getattr(cfg, name) == default  # kept, doing nothing
    values = {name: _other_value(default)}
    with pytest.raises(ConfigError, match=rf"TRL field {name}=.* is not supported by groupwise: .+"):
        GRPOConfig(**values)


@pytest.mark.parametrize("name", [n for n in GRPO_CONFIG_DEFAULTS if n in OURS and n not in OWN_DEFAULT])
def test_a_supported_field_accepts_trl_default(name):
    default = GRPO_CONFIG_DEFAULTS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TRL's default of an inert field is our default too: no warning
        cfg = GRPOConfig(**{name: default})
    normalised = ("pad_to_multiple_of", "eval_steps", "report_to", "scale_rewards", "warmup_steps",
                  "activation_checkpointing", "activation_checkpointing_kwargs",
                  "steps_per_generation", "generation_batch_size", "disable_tqdm")  # resolved as TRL resolves them
    if name not in normalised:
        assert getattr(cfg, name) == default  # the value is kept as given


def test_inert_fields_warn_with_their_reason():
    with pytest.warns(UserWarning, match="dataloader_num_workers=4 has no effect in groupwise: prompt rows are read"):
        GRPOConfig(dataloader_num_workers=4)
    inert = [n for n, f in OURS.items() if "inert" in rules_of(f)]
    assert {"dataloader_num_workers", "use_cache", "log_multimodal"} <= set(inert)


def test_a_refused_field_names_the_alternative():
    with pytest.raises(ConfigError, match="use_liger_kernel=True is not supported"):
        GRPOConfig(use_liger_kernel=True)


def test_every_trl_trainer_argument_is_taken():
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert ours[1:len(GRPO_TRAINER_ARGUMENTS) + 1] == list(GRPO_TRAINER_ARGUMENTS)  # TRL's order: positional use works


def test_unknown_names_still_get_a_close_match():
    with pytest.raises(ConfigError, match=r"unknown field 'optim_arg'; did you mean 'optim_args'"):
        GRPOConfig(optim_arg="x")


def test_trls_unsupported_fields_as_the_command_line_and_yaml_give_them(tmp_path):
    """They are GRPOConfig fields (TRLFields, so that TRL's parsers refuse them by name): keyword-only, so
    GRPOConfig("out") is still output_dir; their text values (groupwise train's command line) and nulls read by
    type before the check (TRL's default given as text was refused); a subclass's own field of one of their names is
    its own (a wandb `project`)."""
    from groupwise.cli import build_run, parse_overrides
    from groupwise.config_base import read_yaml

    assert GRPOConfig(str(tmp_path)).output_dir == str(tmp_path)  # the first positional argument
    for argv in (["--include_num_input_tokens_seen", "true"], ["--label_smoothing_factor", "0"],
                 ["--liger_kernel_config", "null"], ["--optim_target_modules", "None"], ["--use_cpu", "false"]):
        _, args = build_run({"model_name_or_path": "m", "output_dir": str(tmp_path), **parse_overrides(argv)})
    assert args.use_cpu is False and args.liger_kernel_config is None
    for text in ("use_cpu: null", "debug: null", "label_smoothing_factor: null", "include_for_metrics: null"):
        cfg = GRPOConfig(output_dir=str(tmp_path), **read_yaml(text))
        name = text.split(":")[0]
        assert getattr(cfg, name) == GRPO_CONFIG_DEFAULTS[name]  # null: TRL's default
    import json

    from groupwise.config_trl import ACCELERATOR_CONFIG_DEFAULTS

    # the mapping TRL's to_json_string() writes, given as JSON text (the parser's form), as the mapping is accepted
    assert GRPOConfig(accelerator_config=json.dumps(ACCELERATOR_CONFIG_DEFAULTS)).accelerator_config == \
        ACCELERATOR_CONFIG_DEFAULTS
    with pytest.raises(ConfigError, match="TRL field label_smoothing_factor=0.1 is not supported"):
        build_run({"model_name_or_path": "m", **parse_overrides(["--label_smoothing_factor", "0.1"])})

    @dataclasses.dataclass
    class Mine(GRPOConfig):
        project: str = "my-wandb-project"

    assert Mine(output_dir=str(tmp_path)).project == "my-wandb-project"

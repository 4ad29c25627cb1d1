"""The command line and config file of `groupwise train` / `eval`, read as TRL's TrlParser reads them: each value by
its field's type (field_types), a config's `env:` mapping set first, `--config CONFIG.yaml` or CONFIG.yaml first."""

from __future__ import annotations

import os
from typing import Any

import yaml

from groupwise.config import ConfigError, GRPOConfig, load_yaml
from groupwise.config_base import FALSE_WORDS, TRUE_WORDS, read_yaml
from groupwise.quantization import QUANTIZATION_FIELDS
from groupwise.script_args import RUN_FIELDS


def field_types() -> dict[str, str]:
    """The annotation of every `groupwise train` field: GRPOConfig's, the run fields', the bitsandbytes ones'."""
    types = GRPOConfig.field_types()
    types.update({name: ann for name, (ann, _, _) in {**RUN_FIELDS, **QUANTIZATION_FIELDS}.items()})
    return types


def parse_overrides(tokens: list[str], types: dict[str, str] | None = None) -> dict[str, Any]:
    """`--key value`, `--key=value`, bare `--flag` (= true), `--no_<flag>` (= false), `--key v1 v2 …` (a list, as
    TRL's parser reads list fields); each value read by its field's annotation in `types` (default: field_types())."""
    types = field_types() if types is None else types
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}: fields are given as --name value")
        key, eq, value = tok[2:].partition("=")
        values = [value] if eq else []
        while not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            values.append(tokens[i + 1])
            i += 1
        key = key.replace("-", "_")
        if key.startswith("no_") and key not in types and "bool" in types.get(key[3:], ""):
            if values:  # TRL's parser: a store_false flag
                raise ConfigError(f"--{key} takes no value (it sets {key[3:]} to false): write --{key} alone, or "
                                  f"--{key[3:]} false")
            out[key[3:]] = False
        else:
            out[key] = typed_value(key, values, types.get(key))
        i += 1
    return out


def typed_value(key: str, values: list[str], annotation: str | None) -> Any:
    """One field's command-line value(s), read as TRL's parser reads the field's type: text stays text (`exp #1`,
    `2024_01`, `0123456`, `on`, `null`); a boolean takes transformers' string_to_bool words; numbers, 'None' for a
    field that takes no text, and JSON for a dict field are left to the field's check (config_base.coerce); a list
    takes several values (or one YAML flow list `[a, b]`). A name that is no field keeps the YAML reading (it is
    refused or checked against TRL's default later)."""
    if key == "config":
        if len(values) != 1 or not values[0].strip():
            raise ConfigError(f"--config takes one path (got {values or 'none'}): groupwise train --config CONFIG.yaml")
        return values[0]
    if annotation is None:
        parsed = [_scalar(v) for v in values] or [True]
        return parsed[0] if len(parsed) == 1 else parsed
    allowed = [a.strip() for a in annotation.split("|")]
    listed = next((a for a in allowed if a.startswith("list")), None)
    if not values:
        if "bool" in allowed:
            return True
        raise ConfigError(f"--{key} needs a value (of type {annotation}): --{key} VALUE")
    if listed is None and len(values) > 1:
        raise ConfigError(f"--{key} takes one value, got {len(values)} ({values}): quote a value that has spaces")
    if listed is not None:
        if len(values) == 1 and values[0].lstrip().startswith("["):
            return _scalar(values[0])  # a YAML flow list, as in a config file
        items = [_scalar(v) if listed == "list" and v.lstrip().startswith("{") else v for v in values]
        if key == "datasets":  # TRL's parser: each value is a DatasetConfig's path
            items = [v if isinstance(v, dict) else {"path": v} for v in items]
        return items[0] if len(items) == 1 and key != "datasets" else items
    text = values[0]
    if set(allowed) <= {"bool", "None"}:
        if text.strip().lower() in TRUE_WORDS + FALSE_WORDS:
            return text.strip().lower() in TRUE_WORDS
        if not ("None" in allowed and text.strip().lower() in ("none", "null")):
            raise ConfigError(f"--{key}={text!r} is not a boolean: give true/false, yes/no, t/f, y/n or 1/0 (as TRL)")
    return text


def _scalar(text: str) -> Any:
    try:
        return read_yaml(text)
    except yaml.YAMLError:  # not a YAML scalar or list (e.g. a control character): the plain string
        return text


def set_env(env: Any, config_path: str) -> None:
    """TRL's TrlParser: a config's `env:` mapping becomes environment variables (values as text) before the other
    fields are read."""
    if not isinstance(env, dict):
        raise ConfigError(f"{config_path}: env must be a mapping of VARIABLE: value (as in TRL), got "
                          f"{type(env).__name__}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ConfigError(f"{config_path}: env key {key!r} is not a variable name: write it as text, without '='")
        os.environ[key] = getattr(value, "text", None) or str(value)  # 1e3 as written (config_base.YamlFloat)


def read_config(argv: list[str], types: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`[CONFIG.yaml | --config CONFIG.yaml] [--field value …]` as TRL's parser reads it: the file's values (its
    `env:` mapping set as environment variables first) and the command line's, each read by `types`."""
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = parse_overrides(argv[1:] if config_path else argv, types)
    if "config" in overrides:  # TRL's spelling: trl grpo --config CONFIG.yaml
        if config_path is not None:
            raise ConfigError(f"two configs: {config_path!r} and --config {overrides['config']!r}; give one")
        config_path = overrides.pop("config")
    values = load_yaml(config_path) if config_path else {}
    if "env" in values:  # set before anything reads the environment
        set_env(values.pop("env"), config_path)
    return values, overrides

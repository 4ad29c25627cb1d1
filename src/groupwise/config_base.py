"""The strict dataclass config that GRPOConfig and PRMTrainConfig share.

Each field is declared with `option(help, default, …constraints)`: a one-line help text (printed by
`groupwise fields`) and the rules its value must follow — a range (`ge`, `gt`, `le`, `lt`) or a set of `choices`
(a registry dict: its keys are the choices, so every list of choices has one source). On construction:
unknown field names are errors (with a "did you mean"), every value is checked against its annotation (YAML and
command-line strings such as '1e-3' become numbers), floats must be finite, and the declared constraints hold;
then the class's own `validate()` checks rules that span several fields. Every failure is a ConfigError naming
the field and what is allowed.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import types
import typing
import warnings
from collections.abc import Iterable
from dataclasses import field
from typing import Any, ClassVar

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


_MISSING = dataclasses.MISSING


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the user's line: the first caller outside groupwise's modules (a dataclass's generated __init__ runs
    in its class's module, so it is passed too), so `GRPOConfig(...)` in a script, a notebook cell or `python -c` is
    the line shown, not the groupwise line that found the problem."""
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_globals.get("__name__") or "").split(".")[0] == "groupwise":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def option(help: str, default: Any = _MISSING, *, choices: Iterable | None = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None, default_factory: Any = _MISSING,
           inert: str | None = None, accepts: str | None = None, parsed: bool = True, json_text: bool = False,
           unsupported: Any = None):
    """A documented config field with its constraints (checked by StrictConfig on construction). `inert` marks a
    field kept for configs written for another trainer that has no effect here: a value other than the default
    warns, with this reason.

    The annotation is the one transformers' HfArgumentParser / TRL's TrlParser can read (one type, or X | None, or
    a union with str), so that a GRPOConfig goes through TRL's parser as TRL's does; `accepts` names the other
    types groupwise takes as well (e.g. 'bool' for resume_from_checkpoint=True). `parsed=False` keeps a field out
    of those parsers (init=False; still a constructor keyword, through StrictConfig): ModelConfig's LoRA fields,
    which TRL's scripts parse from their ModelConfig (dataclasses.replace carries them over). `json_text`: a dict field
    whose text value is a JSON mapping (TRL's `dict | str | None` fields, parsed as TrainingArguments does).
    `unsupported`: a field kept only to be refused unless at a value this NotSupported entry accepts
    (groupwise.config_trl)."""
    rules = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt), ("inert", inert),
                               ("accepts", accepts), ("json_text", json_text or None),
                               ("unsupported", unsupported)) if v is not None}
    kw = {"default": default} if default_factory is _MISSING else {"default_factory": default_factory}
    # the metadata holds what argparse's add_argument takes (those parsers pass it on as keywords); the other rules
    # are kept beside it
    f = field(metadata={"help": help, **({} if choices is None else {"choices": choices})}, init=parsed, **kw)
    _RULES[f] = rules
    return f


_RULES: dict[dataclasses.Field, dict[str, Any]] = {}  # option()'s rules besides choices, by field
_LATE: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("_LATE", default={})  # init=False values


def rules_of(f: dataclasses.Field) -> dict[str, Any]:
    """A field's rules: choices, ge / gt / le / lt, inert, accepts, json_text, unsupported."""
    return {**f.metadata, **_RULES.get(f, {})}


def _default_of(f: dataclasses.Field) -> Any:
    return f.default if f.default is not _MISSING else f.default_factory()


def _not_supported(owner: str, name: str, value: Any, entry) -> ConfigError:
    """Another trainer's field set to a value groupwise cannot honour (entry: a NotSupported, groupwise.config_trl)."""
    return ConfigError(f"{owner}: TRL field {name}={value!r} is not supported by groupwise: {entry.reason} "
                       "(docs/trl_compat.md)")


def annotation_of(f: dataclasses.Field, owner: type | None = None) -> str:
    """The types a field takes: its annotation as written in its class (`owner` or a base; transformers'
    HfArgumentParser rewrites `field.type` in place, to the one type it parses) and what it `accepts` besides."""
    annotation = f.type
    for klass in (owner.__mro__ if owner is not None else ()):
        written = klass.__dict__.get("__annotations__", {})
        if f.name in written:
            annotation = written[f.name]
            break
    rules = _RULES.get(f, {})
    annotation = _type_text(annotation)
    return annotation if "accepts" not in rules else f"{annotation} | {rules['accepts']}"


def _type_text(annotation: Any) -> str:
    """An annotation as text, as `from __future__ import annotations` keeps it ('int | None', 'list[str]')."""
    if isinstance(annotation, str):
        return annotation
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(annotation))
    return str(annotation).replace("typing.", "")


# dataclasses.replace(config, …) builds the copy from its init fields only: the fields kept out of argument parsers
# (init=False) are taken from the config it copies, which the constructor finds in its caller's frame
_REPLACE_CODES = {getattr(dataclasses, name).__code__ for name in ("replace", "_replace") if hasattr(dataclasses, name)}


def _replaced(frame) -> Any:
    """The config dataclasses.replace is copying, when `frame` is that call; else None."""
    if frame is None or frame.f_code not in _REPLACE_CODES:
        return None
    return frame.f_locals.get("obj", frame.f_locals.get("self"))


class _Screened(type):
    """Construction screens the keyword arguments first (`StrictConfig.screen`): names that are not fields are
    dropped when harmless or are errors, before the dataclass __init__ sees them."""

    def __call__(cls, *args, **kwargs):
        kwargs = cls.screen(kwargs)
        # fields kept out of argument parsers (option(parsed=False): init=False) are set before __post_init__
        hidden = [f.name for f in dataclasses.fields(cls) if not f.init]
        source = _replaced(sys._getframe(1)) if hidden else None
        late = {name: copy.deepcopy(getattr(source, name)) for name in hidden if hasattr(source, name)}
        late.update({name: kwargs.pop(name) for name in hidden if name in kwargs})
        token = _LATE.set(late)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _LATE.reset(token)


class StrictConfig(metaclass=_Screened):
    """Base of the config dataclasses (subclasses are `@dataclass`es whose fields use `option`)."""

    # names that are not fields but are known (another trainer's fields), each an object with `.reason` and
    # `.accepts(value, all_values)`: an accepted value is dropped, any other is a ConfigError with the reason
    UNSUPPORTED: ClassVar[dict[str, Any]] = {}

    @classmethod
    def screen(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in kwargs.items():
            entry = cls.UNSUPPORTED.get(key)
            if key not in known and entry is not None and not entry.accepts(value, kwargs):
                raise _not_supported(cls.__name__, key, value, entry)
        kwargs = {k: v for k, v in kwargs.items() if k in known or k not in cls.UNSUPPORTED}
        reject_unknown(kwargs, known, owner=cls.__name__)
        return kwargs

    def __post_init__(self) -> None:
        for name, value in _LATE.get().items():
            setattr(self, name, value)
        _LATE.set({})  # this object's only (a config built inside validate() gets its own)
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "unsupported" in _RULES.get(f, {}):  # another trainer's field, kept at its default (TRLFields)
                self._refuse_unsupported(f, value, given)
                continue
            if _RULES.get(f, {}).get("json_text") and isinstance(value, str):  # dict fields: JSON text, as TRL reads it
                value = None if value.strip().lower() in ("none", "null") else _json_mapping(f.name, value)
            if isinstance(value, dict) and any(isinstance(value.get(k), YamlFloat) for k in TEXT_KWARGS):
                value = {k: v.text if k in TEXT_KWARGS and isinstance(v, YamlFloat) else v for k, v in value.items()}
            value = coerce(f.name, annotation_of(f, type(self)), value)
            rules = rules_of(f)
            check_rules(f.name, value, rules)
            setattr(self, f.name, value)
            if "inert" in rules and value != _default_of(f):
                warn_user(f"{f.name}={value!r} has no effect in groupwise: {rules['inert']}")
        self.validate()

    def _refuse_unsupported(self, f: dataclasses.Field, value: Any, given: dict[str, Any]) -> None:
        """A field kept only so that a config setting it is refused by name (option(unsupported=…)): its value,
        read by its type (command-line text too), must be one its NotSupported entry accepts; it is kept as read
        (None: the field's default)."""
        entry = _RULES[f]["unsupported"]
        if isinstance(value, str) and value.strip().lower() in ("none", "null"):  # the parsers' word for None
            value = None
        annotation = annotation_of(f, type(self))
        try:
            if isinstance(value, str) and "dict" in annotation and value.lstrip().startswith("{"):
                value = _json_mapping(f.name, value)  # JSON text of a mapping, as TrainingArguments reads it
            read = coerce(f.name, annotation, value) if value is not None else None
        except ConfigError:
            read = value
        if not (entry.accepts(read, given) or entry.accepts(value, given)):
            raise _not_supported(type(self).__name__, f.name, read, entry)
        setattr(self, f.name, read if read is not None else _default_of(f))

    def validate(self) -> None:
        """Rules that span several fields (subclasses override)."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str):
        return cls.from_dict(load_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_types(cls) -> dict[str, str]:
        """Each field's types (annotation_of), as the command line reads its values."""
        return {f.name: annotation_of(f, cls) for f in dataclasses.fields(cls)}

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, list[str]]]:
        """(name, help, default, choices) of every field, in declaration order; a choice from a registry whose
        entries carry a `summary` is shown as "name: summary"."""
        out = []
        for f in dataclasses.fields(cls):
            if "unsupported" in _RULES.get(f, {}):  # TRL's fields kept only to be refused (docs/trl_compat.md)
                continue
            registry = f.metadata.get("choices", ())
            choices = [f"{k}: {registry[k].summary}" if hasattr(registry, "get") and hasattr(registry[k], "summary")
                       else str(k) for k in registry]
            out.append((f.name, f.metadata.get("help", ""),
                        f.default if f.default is not _MISSING else f.default_factory(), choices))
        return out


def check_rules(name: str, value: Any, rules: dict) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if isinstance(value, (int, float)):
        lo_key = "ge" if "ge" in rules else "gt" if "gt" in rules else None
        hi_key = "le" if "le" in rules else "lt" if "lt" in rules else None
        lo_ok = lo_key is None or (value >= rules[lo_key] if lo_key == "ge" else value > rules[lo_key])
        hi_ok = hi_key is None or (value <= rules[hi_key] if hi_key == "le" else value < rules[hi_key])
        if not (lo_ok and hi_ok):
            if lo_key and hi_key:  # e.g. "in (0, 1]"
                allowed = (f"in {'[' if lo_key == 'ge' else '('}{rules[lo_key]}, "
                           f"{rules[hi_key]}{']' if hi_key == 'le' else ')'}")
            else:
                key = lo_key or hi_key
                allowed = f"{dict(ge='≥', gt='>', le='≤', lt='<')[key]} {rules[key]}"
            raise ConfigError(f"{name} must be {allowed}, got {value}")
    if "choices" in rules:
        choices = list(rules["choices"])
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v not in choices:
                raise ConfigError(f"{name}={v!r} is not one of {choices}")


# a hub repository id: `name` or `org/name`, letters, digits, '.', '_', '-' (what the hub accepts)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow", ".yaml", ".yml", ".safetensors", ".bin", ".txt")


def check_location(value: str, field: str) -> str:
    """"local" when `value` exists on disk; "hub" when it is a hub id (`name` or `org/name`); otherwise a
    ConfigError: a value that looks local (starts with '.', '/' or '~', has two or more path separators, or a
    file extension) must exist, and is never sent to the hub."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConfigError(f"{field}={value!r} is not a usable path or hub id")
    if os.path.exists(os.path.expanduser(value)):
        return "local"
    looks_local = (value.startswith((".", "/", "~")) or sum(value.count(sep) for sep in {"/", os.sep}) >= 2
                   or value.lower().endswith(LOCAL_SUFFIXES))
    if looks_local or not HUB_ID.match(value):
        raise ConfigError(f"{field}={value!r} does not exist (a local path is checked before anything loads; only "
                          "a bare 'name' or 'org/name' is looked up on the hub)")
    return "hub"


def check_model_location(value: str, field: str, *, policy: bool = False) -> str:
    """check_location for a model: a local folder must also hold a saved model (config.json, a PEFT adapter's
    adapter_config.json, or a .gguf file), so that a wrong folder is named before anything loads. A `policy` may not
    be an adapter folder alone: transformers cannot read its config (TRL fails there with "Unrecognized model")."""
    where = check_location(value, field)
    folder = os.path.expanduser(value)
    if where == "local" and os.path.isfile(folder) and not folder.endswith(".gguf"):
        raise ConfigError(f"{field}={value!r} is a file, not a model folder: give a folder holding config.json and "
                          "the weights (model.save_pretrained(folder)), or a hub id")
    if where == "local" and os.path.isdir(folder):
        names = set(os.listdir(folder))
        if not ({"config.json", "adapter_config.json"} & names or any(n.endswith(".gguf") for n in names)):
            steps = [int(n.split("-")[1]) for n in names if re.fullmatch(r"checkpoint-\d+", n)]
            if steps:  # a run's output_dir whose final model is only in its checkpoints (save_strategy, the demo)
                raise ConfigError(f"{field}={value!r} is a run's folder without a final model (config.json), only "
                                  f"checkpoints: give its newest, {os.path.join(value, f'checkpoint-{max(steps)}')!r}")
            raise ConfigError(f"{field}={value!r} is a folder without config.json: not a saved model (write one "
                              "with model.save_pretrained(folder), or give a checkpoint folder of a run)")
        if policy and "adapter_config.json" in names and "config.json" not in names:
            try:
                with open(os.path.join(folder, "adapter_config.json")) as f:
                    base = json.load(f).get("base_model_name_or_path") or "<base model>"
            except (OSError, ValueError, AttributeError):
                base = "<base model>"
            raise ConfigError(
                f"{field}={value!r} holds a PEFT adapter (adapter_config.json), not a model: to train the adapter "
                f"further pass PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {value!r}, "
                f"is_trainable=True) as the model; to train a new adapter give {base!r} with a peft_config")
        from groupwise.model_files import check_weights

        check_weights(value, field, folder, names)
    return where


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1), reading unquoted 1e-7 / 5E3 as numbers as YAML 1.2 does (1.1 wants a '.'
    and a sign: it read them as text, which TRL's parser then turns into numbers for its float fields). Such a
    number remembers its text (YamlFloat): a field that takes text gets it as written (a commit id 12345e6, a
    run_name 3e10). A quoted "1e-7" stays text, and so does an exponent of 3 digits or more (2e45607: inf).
    A key given twice in one mapping is an error (PyYAML keeps the last one silently); a merge (<<) may override."""

    def flatten_mapping(self, node):
        # each mapping's own keys, before a merge (<<) puts another's in front of them: PyYAML flattens a merged
        # mapping in place, before it is built itself when a shallower mapping merges it
        checked = self.__dict__.setdefault("_checked_mappings", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: dict[str, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key_node.value!r} is given twice (lines {seen[key_node.value] + 1} "
                                    f"and {key_node.start_mark.line + 1}): keep one", key_node.start_mark)
                seen[key_node.value] = key_node.start_mark.line
        super().flatten_mapping(node)


# from_pretrained arguments that are always text: an unquoted `revision: 12345e6` in a YAML mapping is that text
TEXT_KWARGS = ("revision", "code_revision", "subfolder", "attn_implementation", "gguf_file", "cache_dir")


class YamlFloat(float):
    """A number YAML 1.1 would have read as text, with that text (`.text`)."""

    text: str

    def __new__(cls, text: str) -> "YamlFloat":
        number = super().__new__(cls, text)
        number.text = text
        return number


YAML_EXPONENT_TAG = "tag:groupwise,2026:exponent-float"
YamlLoader.add_implicit_resolver(YAML_EXPONENT_TAG, re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d{1,2}$"),
                                 list("-+0123456789."))
YamlLoader.add_constructor(YAML_EXPONENT_TAG, lambda loader, node: YamlFloat(loader.construct_scalar(node)))


def read_yaml(text) -> Any:
    """yaml.safe_load with YamlLoader (a str or an open file)."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 — a SafeLoader subclass


def load_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path) as f:
            values = read_yaml(f) or {}
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(values).__name__}")
    for key in values:
        if isinstance(key, bool):  # `on:` / `no:` / `yes:` …, which YAML 1.1 reads as booleans
            raise ConfigError(f"{path}: a key that YAML reads as {key} (on / off / yes / no / true / false, "
                              "unquoted) is not a field name; quote it")
        if not isinstance(key, str):  # `1: x`
            raise ConfigError(f"{path}: {key!r} is not a field name (a YAML key that is not text; quote it)")
    return values


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}
# transformers' string_to_bool words, as TRL's parser reads booleans (command line, and a config's values)
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


def coerce(name: str, annotation: str, value: Any) -> Any:
    """Check a value against the field's annotation (e.g. 'float | None'); YAML/CLI strings such as '1e-3'
    become numbers. A mismatch is a ConfigError naming the field."""
    allowed = [a.strip() for a in annotation.split("|")]
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("none", "null") and "None" in allowed and "str" not in allowed:
        value = None  # TRL's parser reads 'None' as None for such fields
    if value is None:
        if "None" in allowed:
            return None
        raise ConfigError(f"{name} must not be None")
    if "bool" in allowed and text in (("true", "false") if "str" in allowed else TRUE_WORDS + FALSE_WORDS):
        # 'True' from a quoted YAML value or a script's argument parser; a field that takes only a boolean also
        # reads transformers' string_to_bool words ("yes", "1", "y", …), as TRL's parser reads a config's values
        return text in TRUE_WORDS
    for a in allowed:
        t = _SCALARS.get(a)
        if t is bool and isinstance(value, bool):
            return value
        if t in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            if t is int and (not math.isfinite(value) or float(value) != int(value)):
                continue
            return t(value)
        if t is str and isinstance(value, str):
            return value
        if a.startswith("list") and isinstance(value, (list, tuple)):
            if a == "list[float]":  # numbers given as text ('1e-1' from the command line)
                return [_number(v) if isinstance(v, str) else v for v in value]
            return list(value)
        if a.startswith("dict") and isinstance(value, dict):  # as given: its values are the callee's to read
            return dict(value)
    if isinstance(value, str):  # '1e-3' from YAML 1.1 or the command line; a dict as JSON text (TRL parses it)
        if any(a.startswith("dict") for a in allowed) and value.lstrip().startswith("{"):
            return _json_mapping(name, value)
        for a in allowed:
            if a in ("float", "int"):
                try:
                    number = float(value)
                except ValueError:
                    continue
                if a == "float" or number.is_integer():
                    return _SCALARS[a](number)
    if "str" in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        # `run_name: 2024`, `--output_dir 123`: a name that YAML read as a number; 12345e6 as written
        return value.text if isinstance(value, YamlFloat) else str(value)
    if "str" in allowed and "bool" not in allowed and value is False:
        return "no"  # `eval_strategy: no`: YAML 1.1 reads the word as false; the field's choices still apply
    listed = next((a for a in allowed if a.startswith("list")), None)
    if listed and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return coerce(name, listed, [value])  # `--lora_modules_to_save lm_head`: a list of one, as TRL's parser
    raise ConfigError(f"{name}={value!r} must be of type {annotation}")


def _json_mapping(name: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}={text!r} is not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={text!r} must be a mapping (JSON text of an object: '{{\"key\": value}}')")
    return value


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def reject_unknown(kwargs: dict[str, Any], known: set[str], owner: str) -> None:
    """A name that is not a field is an error, with a close match when there is one."""
    for key in kwargs:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=3)
        family = [c for c in close if c.split("_")[0] == str(key).split("_")[0]]  # lora_rank: lora_r, not local_rank
        close = family or close
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{owner}: unknown field {key!r}{hint}")

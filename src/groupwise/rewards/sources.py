"""Outcome reward sources: TRL-compatible callables and sequence-classification reward models.

A reward function is `fn(prompts=…, completions=…, completion_ids=…, **dataset_columns, **trainer_kwargs) ->
list[float | None]`, one value per completion (TRL's protocol; `trainer_kwargs` are TRL's `trainer_state`,
`log_metric` and `log_extra` when a trainer calls it). `async def` functions run concurrently with each other on
one event loop kept in a daemon thread; None means "cannot score this one" (NaN downstream, left out of the statistics).
A value is a real number (int, float, bool as 0/1, a 0-d tensor or numpy scalar) or None (`reward_value`).
±inf is treated as unscored (NaN) and counted with the function's errors, as is every row of a call that overruns
`reward_timeout` seconds (the stuck call is left behind in a daemon thread and cannot keep the process alive).
Bad output is an error naming the function; an exception stops the run with the function and the row, or, with
on_reward_error="nan", scores the failing rows NaN and counts them.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from groupwise.config_base import ConfigError, check_location
from groupwise.rewards.calls import MachineError, RewardTimeout, call_with_timeout, is_async, run_async, run_concurrently
from groupwise.text import ensure_pad_token, is_conversational


# GRPOConfig.on_reward_error: what an exception in a reward function does (call_isolating_rows)
ON_REWARD_ERROR = {"raise": "stop, naming the function and the first failing row",
                   "nan": "score the failing rows NaN (unscored) and count them in rewards/<func>/errors"}


class RewardFunctionError(RuntimeError):
    """A reward function misbehaved; the message names it and the row."""


def drop_infinite(rows: list, name: str, kind: str = "reward function") -> int:
    """Replace ±inf values (in a list of floats, or of lists of floats) by NaN in place; return how many rows had
    one, warning once with the function's name."""
    bad = 0
    for i, row in enumerate(rows):
        if isinstance(row, list):
            if any(math.isinf(v) for v in row):
                rows[i] = [math.nan if math.isinf(v) else v for v in row]
                bad += 1
        elif math.isinf(row):
            rows[i] = math.nan
            bad += 1
    if bad:
        warnings.warn(f"{kind} {name!r} returned ±inf for {bad} row(s): scored as unscored (NaN) and counted in its "
                      "errors", RuntimeWarning, stacklevel=3)
    return bad


@dataclass
class RewardSource:
    name: str
    fn: Callable[..., Any] | None = None  # a plain callable …
    model: torch.nn.Module | None = None  # … or an AutoModelForSequenceClassification (score = logits[:, 0])
    tokenizer: Any = None
    chat_template_kwargs: dict | None = None  # GRPOConfig.chat_template_kwargs, for a model's conversational texts
    # a step-reward function that also takes `dropped_last` (per completion: was its last step, cut by the length
    # budget, left out of `steps`? score_truncated_step=False); an environment's get_step_rewards counts every turn
    takes_dropped_last: bool = False


_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
SPEC_FORMS = "'package.module:function' (or TRL's 'package.module.function'), a local reward-model folder, or a hub id 'org/name'"


def resolve_spec(spec: Any, where: str) -> Any:
    """A reward spec as given in a config: 'package.module:function' or TRL's 'package.module.function' (a dotted
    name that is not a local path) → the imported object; a local folder or a hub id → the string; anything else (a
    callable, a model) unchanged. Checked strictly, before any model loads."""
    if not isinstance(spec, str):
        if not (callable(spec) or isinstance(spec, torch.nn.Module)):  # None, a number, a list (a nested list)
            raise ConfigError(f"{where} is {spec!r:.80}, a {type(spec).__name__}: give a function, a loaded reward "
                              f"model, {SPEC_FORMS}")
        return spec
    dotted = _DOTTED.match(spec) and not os.path.exists(spec)  # TRL's `my_lib.rewards.custom_reward`
    if _MODULE_PATH.match(spec) or dotted:
        module, _, attr = spec.rpartition(".") if dotted else spec.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{where}={spec!r}: cannot import it ({type(e).__name__}: {e})") from None
        return obj
    try:
        check_location(spec, where)
    except ConfigError as e:
        raise ConfigError(f"{e} (accepted: {SPEC_FORMS})") from None
    if os.path.isfile(os.path.join(os.path.expanduser(spec), "groupwise_prm.json")):  # rewards.prm.PRM_CONFIG
        raise ConfigError(f"{where}={spec!r} is a process reward model (trained by `groupwise prm train`), which "
                          "scores steps, not completions: list it under process_reward_funcs, with supervision "
                          "process or both")
    return spec


# what every reward function may receive besides the dataset's columns: TRL's keywords, and `environments` when
# the rollout used tools or environments
REWARD_KEYWORDS = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
                   "environments"}


NEVER_PASSED = ("prompt", "completion", "completion_ids")  # dataset columns no reward function gets (TRL)


def _called(fn) -> str:
    """A reward function's name in messages (a partial: its function's)."""
    return getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__)


def check_reward_columns(reward_funcs: list, columns: list[str] | None, remove_unused_columns: bool,
                         dataset: str = "train_dataset", *, keywords: frozenset[str] | set[str] = REWARD_KEYWORDS,
                         field: str = "reward_funcs", environments: bool = False) -> None:
    """Before the model loads: a reward function with a required parameter that no call will fill (not one of
    `keywords`, not a column of `dataset`) would fail at the first scoring; a column named as one of `keywords`
    (but `environments`, which the trainer sets) would collide with it at every call (TRL: "got multiple values for
    keyword argument"; here it would be blamed on the function, or score every row NaN). columns None: not known (a
    stream). `environments`: the run has environments, so every call also passes `environments`. Whatever the
    columns: a function with required positional-only parameters, which no call (all by keyword) can fill."""
    for i, fn in enumerate(reward_funcs):
        try:
            params = [] if isinstance(fn, (str, torch.nn.Module)) or not callable(fn) else \
                inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            params = []
        positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY
                      and p.default is inspect.Parameter.empty]
        if positional:
            raise ConfigError(f"{field}[{i}] {_called(fn)!r} has positional-only parameters ({', '.join(positional)}), but "
                              "reward functions are called by keyword (as in TRL): remove the '/' from its signature")
    if columns is None:
        return
    passed = set() if remove_unused_columns else {c for c in columns if c not in NEVER_PASSED}  # rollout.py
    called = [fn for fn in reward_funcs if callable(fn) and not isinstance(fn, (str, torch.nn.Module))]
    if called and (clash := sorted(passed & (set(keywords) - {"environments"}))):  # models take no columns
        raise ConfigError(f"{dataset} has a column {clash[0]!r}, which is also a keyword every {field} function "
                          f"receives: rename the column (e.g. dataset.rename_column({clash[0]!r}, "
                          f"'reference_{clash[0]}')), or set remove_unused_columns=True if no reward function "
                          "reads the dataset's columns")
    given = set(keywords) | passed
    for i, fn in enumerate(reward_funcs):
        if isinstance(fn, (str, torch.nn.Module)) or not callable(fn):
            continue
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        need = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                and p.name not in given]
        name = _called(fn)
        if need:
            if need[0] in NEVER_PASSED:  # TRL passes these columns to no reward function either
                plural = {"prompt": "prompts", "completion": "completions"}.get(need[0])
                why = (f"the {need[0]!r} column is never passed to reward functions (as in TRL)"
                       + (f"; read {plural!r}, the keyword every call gets, or rename the column"
                          if plural else "; rename the column"))
            elif remove_unused_columns and need[0] in columns:
                why = "remove_unused_columns=True passes only the prompt: set it False"
            else:
                why = f"{dataset} has no column {need[0]!r} (columns: {sorted(columns)})"
                close = difflib.get_close_matches(need[0], sorted(keywords), n=1, cutoff=0.8)
                if close:  # TRL's docs spell one `completions_ids`
                    why += f"; did you mean the keyword {close[0]!r}, which every call gets?"
            raise ConfigError(f"{field}[{i}] {name!r} needs the keyword {need[0]!r}: {why}")
        # every call passes the protocol's keywords and the dataset's columns: a signature without **kwargs must
        # name them all (TRL's functions end with **kwargs), else every call fails with a TypeError
        params = list(inspect.signature(fn, follow_wrapped=False).parameters.values())  # a decorator's own
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            always = set(keywords) - {"dropped_last"} - (set() if environments else {"environments"})
            missing = sorted((always | passed) - {p.name for p in params})
            if missing:
                raise ConfigError(f"{field}[{i}] {name!r} takes no **kwargs, but every call passes the keywords "
                                  f"{missing}: add **kwargs to its signature (as TRL's reward functions, e.g. "
                                  "def reward(completions, **kwargs))")


def load_reward_sources(reward_funcs, reward_processing_classes=None, *, trust_remote_code=False, device=None,
                        model_init_kwargs: dict | None = None,
                        chat_template_kwargs: dict | None = None) -> list[RewardSource]:
    """Accepts a callable, a `"package.module:function"` path, a reward-model path or a loaded model (or a list).
    A reward model given as a path loads with `model_init_kwargs` (TRL: the policy's, dtype / revision /
    attn_implementation …; its tokenizer from the same revision); a model renders conversations with its tokenizer's
    chat template and `chat_template_kwargs` (TRL: GRPOConfig.chat_template_kwargs)."""
    if not isinstance(reward_funcs, (list, tuple)):
        reward_funcs = [reward_funcs]
    if not reward_funcs:
        raise ValueError("reward_funcs is empty: pass at least one reward function or reward model")
    classes = reward_processing_classes
    if classes is not None and not isinstance(classes, (list, tuple)):
        classes = [classes]
    if classes is not None and len(classes) != len(reward_funcs):
        raise ValueError(f"reward_processing_classes has {len(classes)} entries for {len(reward_funcs)} reward_funcs: "
                         "give one per reward function (None for those that are not models), in the same order")
    sources = []
    for i, spec in enumerate(reward_funcs):
        tok = classes[i] if classes is not None else None
        spec = resolve_spec(spec, f"reward_funcs[{i}]")
        if isinstance(spec, str):  # a reward model on disk or the hub
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            # the policy's kwargs, but not the name of its GGUF file (a reward model is in a folder of its own)
            kwargs = {"trust_remote_code": trust_remote_code,
                      **{k: v for k, v in (model_init_kwargs or {}).items() if k != "gguf_file"}}
            model, info = AutoModelForSequenceClassification.from_pretrained(spec, num_labels=1,
                                                                             output_loading_info=True, **kwargs)
            if info["missing_keys"]:  # a score head initialised at random scores noise (transformers only logs it)
                missing = sorted(info["missing_keys"])
                raise ConfigError(f"reward_funcs[{i}]={spec!r} has no trained score head: its checkpoint lacks "
                                  f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}, which "
                                  "AutoModelForSequenceClassification would initialise at random (it is a causal LM, "
                                  "or another kind of model). Give a sequence-classification reward model, or a "
                                  "'module:function' reward")
            revision = {"revision": kwargs["revision"]} if kwargs.get("revision") else {}
            tok = tok or AutoTokenizer.from_pretrained(spec, trust_remote_code=kwargs["trust_remote_code"], **revision)
            sources.append(_model_source(spec.rstrip("/").split("/")[-1], model, tok, device, chat_template_kwargs))
        elif isinstance(spec, torch.nn.Module):
            name = getattr(getattr(spec, "config", None), "_name_or_path", "") or ""
            if tok is None:  # TRL loads the tokenizer the model was saved with
                if not name:
                    raise ValueError(f"reward_funcs[{i}] is a model without config._name_or_path: pass its "
                                     f"tokenizer in reward_processing_classes[{i}]")
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            sources.append(_model_source((name or type(spec).__name__).rstrip("/").split("/")[-1], spec, tok, device,
                                         chat_template_kwargs))
        elif callable(spec):
            fn = spec
            while isinstance(fn, functools.partial):  # TRL names a partial after the function it wraps
                fn = fn.func
            sources.append(RewardSource(name=getattr(fn, "__name__", type(fn).__name__), fn=spec))
        else:
            raise TypeError(f"reward_funcs[{i}] must be a callable, a 'module:function' path or a model, got {spec!r}")
    seen: dict[str, int] = {}
    for src in sources:  # metric names must be unique: the second 'accuracy' becomes 'accuracy_1'
        k = seen.get(src.name, 0)
        seen[src.name] = k + 1
        if k:
            src.name = f"{src.name}_{k}"
    return sources


def _model_source(name, model, tok, device, chat_template_kwargs=None) -> RewardSource:
    model.eval().requires_grad_(False)
    if device is not None and getattr(model, "hf_device_map", None) is None:  # a device_map placed it already
        model.to(device)
    ensure_pad_token(tok, f"the tokenizer of reward model {name!r}")
    # the model scores the last token that is not its config's pad token: that must be the tokenizer's pad token,
    # which pads the batch, or a shorter text is scored on its padding (TRL sets it whatever the config said)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.pad_token_id = tok.pad_token_id
    return RewardSource(name=name, model=model, tokenizer=tok, chat_template_kwargs=dict(chat_template_kwargs or {}))


@torch.inference_mode()
def _score_with_model(src: RewardSource, prompts, completions, batch_size: int = 16) -> list[float]:
    if is_conversational(prompts[0]):
        texts = [src.tokenizer.apply_chat_template(p + c, tokenize=False, **(src.chat_template_kwargs or {}))
                 for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    device = next(src.model.parameters()).device
    out = []
    for start in range(0, len(texts), batch_size):
        enc = src.tokenizer(text=texts[start:start + batch_size], return_tensors="pt", padding=True,
                            padding_side="right", add_special_tokens=False).to(device)
        out.extend(src.model(**enc).logits[:, 0].float().tolist())
    return out


def reward_value(v: Any) -> float:
    """One reward value as a float: None → NaN; int, float, bool (as 0/1), 0-d tensors and numpy scalars → float.
    Anything else raises TypeError (the caller names the function and the row). Used for outcome and step rewards."""
    if v is None:
        return math.nan
    if isinstance(v, numbers.Real) or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
        return float(v)
    raise TypeError(f"{v!r} ({type(v).__name__})")


def _validate(name: str, values: Any, n: int) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    elif isinstance(values, Iterator):  # a generator: TRL reads whatever iterates
        values = list(values)
    if not hasattr(values, "__len__") or isinstance(values, (str, bytes, dict)):
        raise RewardFunctionError(f"reward function {name!r} must return a list with one value per completion, "
                                  f"got {type(values).__name__}")
    if len(values) != n:
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for {n} completions "
                                  "(one float or None per completion expected)")
    out = []
    for row, v in enumerate(values):
        try:
            out.append(reward_value(v))
        except TypeError as e:
            raise RewardFunctionError(f"reward function {name!r} returned a non-numeric value for row {row}: "
                                      f"{e}; expected a float or None") from None
    return out


class CallLogs:
    """The `log_extra` / `log_metric` calls (TRL's reward keywords, in `extra`) of one reward call, held until that
    call's values are kept: a batch call that fails and is retried row by row, or that overruns its timeout, logs
    nothing (its columns had one value per row twice over, and were dropped; its metrics counted twice)."""

    def __init__(self, extra: dict[str, Any] | None):
        self.extra = extra or {}
        self.columns: dict[str, list] = {}
        self.metrics: list[tuple[str, float]] = []

    def kwargs(self) -> dict[str, Any]:
        """`extra` with the two logging keywords pointing here."""
        out = dict(self.extra)
        if "log_extra" in out:
            out["log_extra"] = lambda column, values: self.columns.setdefault(column, []).extend(values)
        if "log_metric" in out:  # the value read at the call, so that a bad one fails inside the reward function
            out["log_metric"] = lambda name, value: self.metrics.append((name, float(value)))
        return out

    def commit(self) -> None:
        for column, values in self.columns.items():
            self.extra["log_extra"](column, values)
        for name, value in self.metrics:
            self.extra["log_metric"](name, value)

    @classmethod
    def of_rows(cls, extra: dict[str, Any] | None, rows: list[CallLogs | None]) -> CallLogs:
        """The row-by-row calls' logs as one batch's: each column one value per row (None for a row that failed,
        or that did not log it), the metrics of the rows that succeeded."""
        merged = cls(extra)
        names = list(dict.fromkeys(c for logs in rows if logs is not None for c in logs.columns))
        for logs in rows:
            for c in names:
                merged.columns.setdefault(c, []).extend(logs.columns.get(c, [None]) if logs is not None else [None])
        merged.metrics = [m for logs in rows if logs is not None for m in logs.metrics]
        return merged


def call_isolating_rows(kind: str, name: str, call: Callable[[int, int, dict], list], n: int, *, on_error: str,
                        failed_row: Callable[[int], Any], describe: Callable[[int], str],
                        timeout: float | None = None, extra: dict[str, Any] | None = None,
                        batch_logs: CallLogs | None = None, reasons: dict[int, str] | None = None) -> tuple[list, int]:
    """Call `call(0, n, kwargs)` for the whole batch (`kwargs`: the trainer keywords `extra`, their logging held in
    a CallLogs, or `batch_logs` when the batch call was already made with those); if it raises (anything but a
    RewardFunctionError, which is the caller's contract being broken), call it row by row to find the failing rows.
    on_error="raise": stop naming the function and the first failing row; "nan": those rows get `failed_row(i)` and
    are counted. A call that overruns `timeout` scores every row of the batch `failed_row` and counts them, whatever
    on_error says. ±inf values are unscored and counted too (`drop_infinite`). Only the kept calls' logs reach
    `extra`'s log_extra / log_metric. `reasons`, when given, receives why each failed row is unscored (its
    exception, or the timeout), for the caller's messages; under "nan" a warning names the function's first
    exception of the call (shown once per distinct exception)."""
    reasons = {} if reasons is None else reasons
    logs = batch_logs or CallLogs(extra)
    try:
        rows = call_with_timeout(lambda: call(0, n, logs.kwargs()), timeout, f"{kind} {name!r}")
        logs.commit()
        return rows, drop_infinite(rows, name, kind)
    except (RewardFunctionError, MachineError):
        raise
    except RewardTimeout as e:
        warnings.warn(f"{e}: its {n} rows are scored NaN (unscored) and counted in its errors", RuntimeWarning,
                      stacklevel=2)
        reasons.update(dict.fromkeys(range(n), f"{name!r} timed out"))
        return [failed_row(i) for i in range(n)], n
    except Exception as batch_exc:
        rows, failures, row_logs, first = [], 0, [], None
        for i in range(n):
            one = CallLogs(extra)
            try:
                rows.append(call_with_timeout(lambda i=i: call(i, i + 1, one.kwargs()), timeout, f"{kind} {name!r}")[0])
                row_logs.append(one)
            except (RewardFunctionError, MachineError):
                raise
            except Exception as exc:
                if isinstance(exc, RewardTimeout):
                    warnings.warn(f"{exc}: row {i} is scored NaN (unscored) and counted in its errors", RuntimeWarning,
                                  stacklevel=2)
                    reasons[i] = f"{name!r} timed out"
                elif on_error == "raise":
                    raise RewardFunctionError(
                        f"{kind} {name!r} raised {type(exc).__name__}: {exc} on row {i}: {describe(i)} "
                        "(set on_reward_error='nan' to score such rows NaN and go on)") from exc
                else:
                    reasons[i] = f"{name!r} raised {type(exc).__name__}: {exc!s:.200}"
                    first = first or (i, exc)
                failures += 1
                rows.append(failed_row(i))
                row_logs.append(None)
        if failures == 0:  # every row alone succeeded: the batch call itself is at fault
            raise RewardFunctionError(f"{kind} {name!r} raised {type(batch_exc).__name__}: {batch_exc} on the "
                                      "batch, but on no single row") from batch_exc
        if first is not None:  # the same text each time the same error recurs: Python shows it once
            exc = first[1]
            warnings.warn(f"{kind} {name!r} raised {type(exc).__name__}: {exc!s:.200} (on_reward_error='nan': the "
                          "rows it raises on are scored NaN and counted in its errors metric)", RuntimeWarning,
                          stacklevel=2)
        CallLogs.of_rows(extra, row_logs).commit()
        return rows, failures + drop_infinite(rows, name, kind)


def compute_rewards(
    sources: list[RewardSource],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    *,
    on_error: str = "raise",
    timeout: float | None = None,
    extra: dict[str, Any] | None = None,  # passed to every function: TRL's trainer_state, log_metric, log_extra
) -> tuple[torch.Tensor, torch.Tensor]:  # (N, F) float64 rewards with NaN, (F,) error counts
    n = len(prompts)
    extra = extra or {}

    def kwargs(lo: int, hi: int, trainer: dict[str, Any]) -> dict[str, Any]:
        return dict(prompts=prompts[lo:hi], completions=completions[lo:hi], completion_ids=completion_ids[lo:hi],
                    **{k: v[lo:hi] for k, v in columns.items()}, **trainer)

    rewards = torch.full((n, len(sources)), math.nan, dtype=torch.float64)  # 1e30 must not overflow downstream
    errors = torch.zeros(len(sources))
    concurrent_ = [f for f, src in enumerate(sources) if src.fn is not None and is_async(src.fn)]
    first_calls: dict[int, Any] = {}
    first_logs = {f: CallLogs(extra) for f in concurrent_}
    reasons: list[dict[int, str]] = [{} for _ in sources]  # why a row is unscored, per function (its error)

    def score(f: int) -> None:
        src = sources[f]
        if src.model is not None:
            scores = _score_with_model(src, prompts, completions)
            errors[f] = drop_infinite(scores, src.name, "reward model")
            rewards[:, f] = torch.tensor(scores, dtype=torch.float64)
            return

        def call(lo, hi, trainer):
            if (lo, hi) == (0, n) and f in first_calls:  # made concurrently, with first_logs[f]
                out = first_calls.pop(f)
                if isinstance(out, BaseException):
                    raise out
            elif is_async(src.fn):
                out = run_async(src.fn(**kwargs(lo, hi, trainer)), timeout, f"reward function {src.name!r}")
            else:
                out = src.fn(**kwargs(lo, hi, trainer))
            return _validate(src.name, out, hi - lo)

        values, errors[f] = call_isolating_rows(
            "reward function", src.name, call, n, on_error=on_error, failed_row=lambda i: math.nan,
            describe=lambda i: f"prompt={prompts[i]!r:.200} completion={completions[i]!r:.200}", timeout=timeout,
            extra=extra, batch_logs=first_logs.get(f), reasons=reasons[f])
        rewards[:, f] = torch.tensor(values, dtype=torch.float64)

    # as TRL: the sync functions and reward models in list order, then the async functions' whole-batch calls
    # concurrently (an async judge may read what a sync function computed); a failed one is retried row by row
    for f in range(len(sources)):
        if f not in first_logs:
            score(f)
    if concurrent_:
        first_calls = dict(zip(concurrent_, run_concurrently(
            [lambda f=f: sources[f].fn(**kwargs(0, n, first_logs[f].kwargs())) for f in concurrent_], timeout,
            [f"reward function {sources[f].name!r}" for f in concurrent_])))
    for f in concurrent_:
        score(f)
    all_none = torch.isnan(rewards).all(-1)
    if all_none.any():
        i = int(all_none.nonzero()[0])
        row = {"prompt": prompts[i], "completion": completions[i], **{k: v[i] for k, v in columns.items()}}
        why = [r[i] for r in reasons if i in r]
        if not why:
            warnings.warn(f"every reward function returned None for row {i}: {row!r:.500}; it gets advantage 0",
                          stacklevel=2)
        else:  # an error (on_reward_error='nan') or a timeout: say which, not "returned None"
            others = len(sources) - len(why)
            why += [f"{others} other(s) returned None or NaN"] if others else []
            warnings.warn(f"no reward function scored row {i} ({'; '.join(why)}): {row!r:.500}; it gets advantage 0",
                          stacklevel=2)
    return rewards, errors

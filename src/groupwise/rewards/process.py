"""Process reward sources: per completion, one reward per reasoning step (DeepSeekMath §4.1.3).

A process reward function is `fn(prompts=…, completions=…, steps=…, **dataset_columns)` where `steps[i]` is the
list of step texts of completion i; it returns, per completion, a list with one float (or None) per step.
Several functions are combined step by step as a weighted sum (NaN terms skipped; NaN when every term is NaN).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import torch

from groupwise.config_base import ConfigError, check_location, reject_unknown, warn_user
from groupwise.rewards.combine import weighted_nansum
from groupwise.rewards.calls import run_async
from groupwise.rewards.sources import (RewardFunctionError, RewardSource, call_isolating_rows, load_reward_sources,
                                       resolve_spec, reward_value)


# what every process reward function may receive besides the dataset's columns (compute_step_rewards): TRL's
# trainer keywords as outcome functions get them, the step texts, and `dropped_last` where it takes it
PROCESS_REWARD_KEYWORDS = frozenset({"prompts", "completions", "steps", "dropped_last", "trainer_state",
                                     "log_metric", "log_extra", "environments"})


def load_process_reward_sources(funcs, *, trust_remote_code: bool = False, device=None) -> list[RewardSource]:
    """Callables, `"package.module:function"` paths, loaded PRMs (groupwise.rewards.prm) or PRM specs
    `{"path": …, "kind": "token_classification" | "step_tag" | "prefix_classification", **options}`."""
    from groupwise.rewards.prm import load_prm

    resolved = []
    for i, spec in enumerate(funcs):
        spec = resolve_process_spec(spec, f"process_reward_funcs[{i}]")
        if isinstance(spec, dict):
            spec = dict(spec)
            trust = spec.pop("trust_remote_code", trust_remote_code)  # the spec's own, or the run's
            spec = load_prm(spec.pop("path"), spec.pop("kind", None), trust_remote_code=trust, **spec)
        if hasattr(spec, "model") and hasattr(spec, "to") and device is not None:
            spec.to(device)
        resolved.append(spec)
    sources = load_reward_sources(resolved)
    for s in sources:
        if s.fn is None:
            raise TypeError(f"process reward source {s.name!r} is a bare model: wrap it in one of "
                            "groupwise.rewards.prm's PRM classes (token classification, step tag, prefix)")
        s.takes_dropped_last = takes_keyword(s.fn, "dropped_last")
    return sources


def takes_keyword(fn, name: str) -> bool:
    """Does `fn` accept the keyword `name` (a parameter so named, or **kwargs)? A decorator's own signature, not the
    wrapped function's (its wrapper receives the call); a partial that binds `name` keeps its value."""
    if name in (getattr(fn, "keywords", None) or {}):  # functools.partial(f, dropped_last=…)
        return False
    try:
        params = inspect.signature(fn, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: only the protocol's keywords
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)) for p in params)


def resolve_process_spec(spec: Any, where: str) -> Any:
    """A step-reward spec checked before any model loads: 'package.module:function' → the function; a PRM spec
    {"path": …, "kind": …} needs a path that exists locally or is a hub id; a folder written by `groupwise prm
    train` (it holds groupwise_prm.json) given as a plain string → {"path": folder}; anything else unchanged."""
    from groupwise.rewards.prm import PRM_CONFIG, check_prm_folder

    if isinstance(spec, dict):
        if "path" not in spec:
            raise ConfigError(f"{where}: a PRM spec needs 'path': {spec!r}")
        check_location(spec["path"], f"{where}.path")
        check_prm_options(spec, where)
        check_prm_folder(spec["path"], f"{where}.path", spec.get("kind"))
        return spec
    if isinstance(spec, str) and os.path.isdir(os.path.expanduser(spec)):
        if os.path.isfile(os.path.join(os.path.expanduser(spec), PRM_CONFIG)):
            check_prm_folder(spec, where)
            return {"path": spec}  # kind, separator, positive label, max_length recorded there
        raise ConfigError(f"{where}={spec!r} is a folder without {PRM_CONFIG}: give a PRM as {{path: {spec}, kind: "
                          "token_classification | step_tag | prefix_classification}")
    resolved = resolve_spec(spec, where)
    if isinstance(resolved, str):  # a hub id or a file: read as an outcome reward model, it loaded, then failed
        raise ConfigError(f"{where}={spec!r} is not a step-reward function: give a function as "
                          f"'module:function' (or 'package.module.function'), or a PRM as {{path: {spec}, kind: "
                          "token_classification | step_tag | prefix_classification}")
    return resolved


def check_prm_separator(spec: Any, args, where: str) -> None:
    """A PRM trained by `groupwise prm train` (token_classification) reads steps joined by the separator its
    groupwise_prm.json records; under step_split='delimiter' the policy's completions are split at step_delimiter
    and rejoined with that separator. When the two differ the steps it scores may not be the steps it learnt (a
    '\n\n' PRM over '\n'-split lines), though they may be (paragraph steps written apart by '\n\n' and trained
    joined by '\n'): a warning before any model loads, unless the spec gives `separator` itself (a choice made)."""
    from groupwise.rewards.prm import PRM_CONFIG, read_prm_record

    if not isinstance(spec, dict) or "separator" in spec or args.step_split != "delimiter":
        return
    record = read_prm_record(spec["path"], f"{where}.path", spec.get("kind"))
    trained = record.get("separator")
    kind = spec.get("kind") or record.get("kind")
    if kind == "token_classification" and trained is not None and trained != args.step_delimiter:
        warn_user(f"{where}: the PRM {spec['path']} was trained on steps joined by {trained!r} ({PRM_CONFIG}), and "
                  f"step_delimiter={args.step_delimiter!r} splits the policy's completions into the steps it scores, "
                  f"rejoined by {trained!r}: if its training steps were split at {trained!r}, set step_delimiter: "
                  f"{trained!r}; if they are the policy's {args.step_delimiter!r}-steps, give the spec "
                  f"separator: {trained!r} to say so (and silence this)")


def check_prm_options(spec: dict, where: str) -> None:
    """A PRM spec's keys, before the model loads: load_prm's and the kind's options (without `kind`: the kind the
    folder's groupwise_prm.json records, else every kind's); a key none of them takes is named, with a close
    match."""
    import difflib

    from groupwise.rewards.prm import PRM_CONFIG, PRM_KINDS, load_prm, read_prm_record

    kind, recorded = spec.get("kind"), ""
    if kind is None and (record := read_prm_record(spec.get("path", ""), f"{where}.path")):
        kind, recorded = record["kind"], f", as its {PRM_CONFIG} records"  # a `prm train` folder: its kind's options
    if kind is not None and kind not in PRM_KINDS:
        close = difflib.get_close_matches(str(kind), sorted(PRM_KINDS), n=1)
        raise ConfigError(f"{where}.kind={kind!r} is not a PRM kind"
                          f"{f' (did you mean {close[0]!r}?)' if close else ''}: one of {sorted(PRM_KINDS)}")
    classes = [PRM_KINDS[kind]] if kind is not None else list(PRM_KINDS.values())
    known = {"path", "kind", "trust_remote_code", "name"} | set(inspect.signature(load_prm).parameters)
    for cls in classes:
        for klass in cls.__mro__[:-1]:  # the kind's own keywords and the base class's
            if "__init__" in vars(klass):
                known |= set(inspect.signature(klass.__init__).parameters)
    known -= {"self", "model", "tokenizer", "kw", "options"}
    reject_unknown(spec, known, f"{where} (a PRM spec of {'a ' + kind if kind is not None else 'any'} PRM"
                                f"{recorded}, whose options are {sorted(known)})")


def _as_list(values: Any) -> Any:
    """A tensor or numpy array (1-d: one completion's step rewards; 2-d: every completion's) as nested lists, as an
    outcome reward function's tensor is read; anything else unchanged."""
    return values.tolist() if hasattr(values, "tolist") and getattr(values, "ndim", 0) in (1, 2) else values


def _validate(name: str, out: Any, steps: list[list[str]]) -> list[list[float]]:
    out = _as_list(out)
    if isinstance(out, (list, tuple)):
        out = [_as_list(v) for v in out]
    if not isinstance(out, (list, tuple)) or len(out) != len(steps):
        got = len(out) if hasattr(out, "__len__") else type(out).__name__
        raise RewardFunctionError(f"process reward function {name!r} returned {got} entries for {len(steps)} "
                                  "completions (one list of step rewards per completion expected)")
    rows = []
    for i, (values, row_steps) in enumerate(zip(out, steps)):
        if not isinstance(values, (list, tuple)):
            raise RewardFunctionError(f"process reward function {name!r} returned {values!r:.60} for completion {i} "
                                      f"where a list of {len(row_steps)} step rewards is expected: return one list "
                                      "per completion, one value per step (None for a step it cannot score)")
        if len(values) != len(row_steps):
            raise RewardFunctionError(f"process reward function {name!r} returned {len(values)} rewards for row {i}, "
                                      f"which has {len(row_steps)} steps: {row_steps!r:.300}")
        try:
            rows.append([reward_value(v) for v in values])
        except TypeError as e:
            raise RewardFunctionError(f"process reward function {name!r} returned a non-numeric step reward "
                                      f"for row {i}: {e}") from None
    return rows


def compute_step_rewards(
    sources: list[RewardSource],
    weights: torch.Tensor,  # (F,)
    prompts: list[Any],
    completions: list[Any],
    steps: list[list[str]],  # (N) step texts per completion
    columns: dict[str, list[Any]],
    *,
    on_error: str = "raise",
    timeout: float | None = None,
    extra: dict[str, Any] | None = None,  # passed to every function, as for outcome rewards
    dropped_last: list[bool] | None = None,  # (N) to the sources that take it (RewardSource.takes_dropped_last)
) -> tuple[list[list[float]], torch.Tensor, torch.Tensor]:
    """(N)[K_i] the step rewards combined over functions (NaN = unscored), (F,) each function's errors, (F, 2) each
    function's sum and count of the step rewards it gave (None / NaN left out: process/<f>/mean)."""
    n = len(prompts)
    per_func: list[list[list[float]]] = []
    errors = torch.zeros(len(sources))
    totals = torch.zeros(len(sources), 2, dtype=torch.float64)
    for f, src in enumerate(sources):
        def call(lo, hi, trainer, src=src):
            dropped = {"dropped_last": (dropped_last or [False] * n)[lo:hi]} if src.takes_dropped_last else {}
            out = src.fn(prompts=prompts[lo:hi], completions=completions[lo:hi], steps=steps[lo:hi],
                         **{k: v[lo:hi] for k, v in columns.items()}, **trainer, **dropped)
            if inspect.isawaitable(out):  # an async step-reward function
                out = run_async(out, timeout, f"process reward function {src.name!r}")
            return _validate(src.name, out, steps[lo:hi])

        rows, errors[f] = call_isolating_rows(
            "process reward function", src.name, call, n, on_error=on_error,
            failed_row=lambda i: [math.nan] * len(steps[i]), describe=lambda i: f"completion={completions[i]!r:.200}",
            timeout=timeout, extra=extra)
        per_func.append(rows)
        scored = [v for row in rows for v in row if v is not None and v == v]
        totals[f] = torch.tensor([math.fsum(scored), len(scored)], dtype=torch.float64)
    # one weighted NaN-skipping sum per step, as for outcome rewards (groupwise.rewards.combine)
    combined = [weighted_nansum(torch.tensor([[per_func[f][i][j] for f in range(len(sources))]
                                              for j in range(len(steps[i]))], dtype=torch.float64).view(-1, len(sources)),
                                weights.double()).tolist() for i in range(n)]
    return combined, errors, totals

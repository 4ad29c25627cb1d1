"""TRL's `rollout_func` (`GRPOTrainer(rollout_func=…)`, experimental in TRL 1.16): the user's function samples the
completions itself (its own agent loop, an environment, a remote engine) and groupwise scores and trains on what it
returns exactly as on its own samples. GRPO only asks that each question's G outputs be sampled from the old policy
(DeepSeekMath §4.1); which code samples them is the user's choice.

    rollout_func(prompts, trainer) -> {
        "prompt_ids":     [[int, …], …]          one row per prompt: the tokens the completion follows
        "completion_ids": [[int, …], …]          one row per prompt, kept whole (an EOS inside a row does not end it)
        "logprobs":       [[float | None, …], …] the sampler's log-prob of each completion token, or None when nothing
                                                 needs them (the importance-sampling correction does; the off-policy
                                                 mask reads them whenever given, as TRL, else π_θold; None entries
                                                 count as unknown: no correction, no KL evidence there)
        "env_mask":       [[0 | 1, …], …]        optional: 1 on tokens the model generated, 0 on environment tokens
                                                 (context, never trained on); each run of 1s is one assistant turn
        <any other key>:  [value, …] or value    passed to the reward functions as a keyword: one value per row,
                                                 or one value for every row ('prompt' and 'completion' are left
                                                 out, as TRL; the trainer's own keywords, e.g. 'completions',
                                                 are refused)
    }

`prompts` are this process's rows as the dataset gives them (text or chat messages), each prompt repeated
num_generations times with a group's rows contiguous (num_generations_eval times, or once, in evaluation), deep-copied;
`trainer` is the GRPOTrainer. The rows' token lists may be Python lists or 1-D tensors.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

from groupwise.agents.parsing import as_completions
from groupwise.config_base import ConfigError
from groupwise.rewards.process import PROCESS_REWARD_KEYWORDS
from groupwise.rewards.sources import REWARD_KEYWORDS
from groupwise.text import is_conversational, pad_rows
from groupwise.types import Completions

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")  # TRL's required keys
TAKEN = frozenset(REWARD_KEYWORDS | PROCESS_REWARD_KEYWORDS)  # what the trainer passes reward functions itself


def check_rollout_func(rollout_func, *, tools: bool) -> None:
    """Before any model loads: a callable, and not beside tools / environments (the function runs the whole
    rollout; TRL would run its tool loop on the function's output as if it were one model turn)."""
    if rollout_func is None:
        return
    if not callable(rollout_func):
        raise TypeError(f"rollout_func must be a function (prompts, trainer) -> dict, got {type(rollout_func).__name__}")
    if tools:
        raise ConfigError("rollout_func runs the whole rollout, so tools= / environment_factory= would not be called: "
                          "call your tools or environment inside rollout_func (mark their tokens with env_mask), or "
                          "drop rollout_func")


def rollout_completions(rollout_func: Callable[[list], Any], rows: list[dict[str, Any]], *, tokenizer,
                        eos_token_ids: list[int], max_completion_length: int, logprobs: bool,
                        device: torch.device, keep_logprobs: bool = False,
                        vocab_size: int | None = None, reserved: frozenset[str] = TAKEN) -> Completions:
    """Call `rollout_func` on the rows' prompts and check its output (one-line errors naming the key and the row),
    as a Completions record: prompts left-padded, completions right-padded with their mask over every returned
    token, `truncated` where a completion does not end with an EOS (or pad) token (TRL's rule), tool_mask and
    turn_ends from env_mask, the sampler's log-probs when `logprobs` (required: the importance correction; None
    entries → NaN) or, when `keep_logprobs` (the off-policy mask, which TRL feeds the function's log-probs whenever
    it returns them, else π_θold), when given, the other keys as reward-function columns. Token ids must lie in
    [0, vocab_size) (the model's embedding rows); `reserved`: the reward keywords the trainer passes itself (the
    process ones only when the run has process reward functions)."""
    prompts = [r["prompt"] for r in rows]
    out = rollout_func(copy.deepcopy(prompts))
    n = len(prompts)
    if not isinstance(out, Mapping):
        raise TypeError(f"rollout_func must return a dict with keys {list(REQUIRED)}, got {type(out).__name__}")
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict (besides env_mask and any "
                         "reward-function columns); 'logprobs' may be None when nothing reads the sampler's log-probs")
    prompt_ids = _rows(out["prompt_ids"], "prompt_ids", n, _int)
    completion_ids = _rows(out["completion_ids"], "completion_ids", n, _int)
    lengths = [len(r) for r in completion_ids]
    for key, rows_ids in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        for i, r in enumerate(rows_ids):
            if r and (min(r) < 0 or (vocab_size is not None and max(r) >= vocab_size)):
                bad = min(r) if min(r) < 0 else max(r)
                raise ValueError(f"rollout_func's {key!r} row {i} holds token id {bad}, outside the model's "
                                 f"vocabulary [0, {vocab_size if vocab_size is not None else 'V'}): return ids of "
                                 "the policy's tokenizer")
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if not p:
            raise ValueError(f"rollout_func returned an empty prompt_ids row {i}: give the tokens the completion "
                             "follows (the chat-templated prompt)")
        if len(c) > max_completion_length:
            raise ValueError(f"rollout_func returned {len(c)} completion tokens in row {i}, more than "
                             f"max_completion_length={max_completion_length}: stop generating at "
                             "max_completion_length tokens (environment tokens included), or raise it")
    pad = tokenizer.pad_token_id
    width = max(1, max(lengths))
    completion, mask = pad_rows(completion_ids, pad, side="right", width=width)
    prompt, prompt_mask = pad_rows(prompt_ids, pad, side="left")
    ends = set(eos_token_ids) | {pad}
    truncated = torch.tensor([not c or c[-1] not in ends for c in completion_ids])
    sampling = None
    if out["logprobs"] is not None:
        rows_lp = _rows(out["logprobs"], "logprobs", n, _logprob, lengths)
        if logprobs or keep_logprobs:  # 0 on padding, NaN where the sampler gave none
            sampling, _ = pad_rows(rows_lp, 0.0, side="right", width=width, dtype=torch.float)
    elif logprobs:
        raise ValueError("rollout_func returned logprobs=None, but the importance-sampling correction reads the "
                         "sampler's log-probs: return one log-prob per completion token, or set "
                         "vllm_importance_sampling_correction=False")
    tool_mask = turn_ends = None
    if out.get("env_mask") is not None:
        env = _rows(out["env_mask"], "env_mask", n, _bit, lengths)
        tool_mask, _ = pad_rows(env, 0, side="right", width=width)  # env's values; 0 on padding
        turn_ends = [[j for j, b in enumerate(row) if b and (j + 1 == len(row) or not row[j + 1])] for row in env]
    columns = {}
    for key, value in out.items():
        if key in REQUIRED or key in ("env_mask", "prompt", "completion"):  # TRL leaves the last two out too
            continue
        if key in reserved:
            raise ValueError(f"rollout_func returned a key {key!r}, which is a reward-function argument the trainer "
                             "passes itself: rename it (the other keys reach the reward functions as keywords)")
        if isinstance(value, list):
            if len(value) != n:
                raise ValueError(f"rollout_func's {key!r} has {len(value)} values for {n} prompts: give one per "
                                 "prompt, or a single non-list value for all")
            columns[key] = value
        else:
            columns[key] = [value] * n
    completions = as_completions(tokenizer, completion_ids, prompt_ids, is_conversational(prompts[0]))
    return Completions(prompt.to(device), prompt_mask.to(device), completion.to(device), mask.to(device),
                       truncated.to(device), prompts, completions, columns,
                       None if sampling is None else sampling.to(device),
                       None if tool_mask is None else tool_mask.to(device), turn_ends)


def _rows(value, key: str, n: int, item: Callable[[Any, str], Any], lengths: list[int] | None = None) -> list[list]:
    """`value` as n lists (a row may be a list, tuple or 1-D tensor), each item converted by `item`; with `lengths`,
    row i must hold lengths[i] items (one per completion token)."""
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        value = list(value)
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{len(value)} rows" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"rollout_func's {key!r} must hold one row per prompt ({n}), got {got}")
    rows = []
    for i, row in enumerate(value):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"rollout_func's {key!r} row {i} must be a list, got {type(row).__name__}")
        if lengths is not None and len(row) != lengths[i]:
            raise ValueError(f"rollout_func's {key!r} row {i} has {len(row)} values for {lengths[i]} completion "
                             "tokens: give one per completion token")
        fast = _FAST[item](row)  # a whole row checked at once; item by item only to name what is wrong
        rows.append(fast if fast is not None else [item(x, f"rollout_func's {key!r} row {i}") for x in row])
    return rows


def _int(x, where: str) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{where} holds {x!r}: token ids are integers")
    return int(x)


def _logprob(x, where: str) -> float:
    if x is None:  # vLLM's unknown log-prob (TRL maps it to NaN: no correction on that token)
        return float("nan")
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{where} holds {x!r}: log-probs are numbers (or None when unknown)")
    return float(x)


def _bit(x, where: str) -> int:
    if x not in (0, 1):
        raise ValueError(f"{where} holds {x!r}: env_mask is 1 on model tokens and 0 on environment tokens")
    return int(x)


def _as_tensor(row) -> torch.Tensor | None:
    try:
        t = torch.as_tensor(row)
    except (TypeError, ValueError, RuntimeError):  # None, strings, ragged: checked item by item
        return None
    return t if t.dim() == 1 and t.numel() else None


def _fast_ints(row) -> list[int] | None:
    t = _as_tensor(row)
    return t.tolist() if t is not None and not t.is_floating_point() and t.dtype != torch.bool else None


def _fast_logprobs(row) -> list[float] | None:
    t = _as_tensor(row)
    return t.double().tolist() if t is not None and t.dtype != torch.bool else None


def _fast_bits(row) -> list[int] | None:
    t = _as_tensor(row)
    return t.long().tolist() if t is not None and bool(((t == 0) | (t == 1)).all()) else None


_FAST = {_int: _fast_ints, _logprob: _fast_logprobs, _bit: _fast_bits}

"""TRL's `accuracy_reward` and `reasoning_accuracy_reward` under the same names and protocol, so TRL scripts that
import them switch with the import.

The completion's answer (a \\boxed{…} first, then any LaTeX) is checked against the `solution` column with
math_verify (`pip install groupwise[math]`): 1.0 when equivalent, 0.0 when not, None (unscored) when the solution
itself cannot be parsed. `reasoning_accuracy_reward` first keeps only the text after the reasoning (after the last
`</think>`), and scores 0.0 a completion whose reasoning never ends. math_verify is a parser of model-generated text,
not an evaluator of it: nothing the model writes is executed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any


def _text(completion: Any) -> str:
    """A completion's text: a string, or TRL's conversational form (a list with one assistant message)."""
    if isinstance(completion, str):
        return completion
    return completion[0]["content"]


def _verifier(name: str) -> Callable[[str, str], tuple[float | None, str, str]]:
    """check(solution, answer_text) -> (reward, parsed solution, parsed answer) with TRL's math_verify settings;
    reward None when the solution cannot be parsed. `name` is the reward function, for the missing-package error."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError(f"{name} needs math_verify: `pip install groupwise[math]`") from None
    # math_verify bounds its work with signal.alarm, which only the main thread may use (reward_timeout runs
    # reward functions in a thread): elsewhere it runs without its own timeouts
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if main else (None, None)
    if not main:
        for logger in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(logger).setLevel(logging.ERROR)
    answer_config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                           boxed_match_priority=0, try_extract_without_anchor=False)]

    def check(sol: str, text: str) -> tuple[float | None, str, str]:
        gold = parse(sol, parsing_timeout=parse_timeout)
        if not gold:
            return None, "[unparseable]", "[skipped]"
        answer = parse(text, extraction_config=answer_config, extraction_mode="first_match",
                       parsing_timeout=parse_timeout)
        return float(verify(gold, answer, timeout_seconds=verify_timeout)), str(gold), \
            str(answer) if answer else "[unparseable]"

    return check


def _log(log_extra: Callable[[str, list], None] | None, solution: list[str], golds: list, answers: list) -> None:
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)


def accuracy_reward(completions: list, solution: list[str], log_extra: Callable[[str, list], None] | None = None,
                    **kwargs) -> list[float | None]:
    """1.0 if the completion's answer equals the row's `solution` (math_verify), 0.0 if not, None when the
    solution cannot be parsed. With `log_extra` (passed by the trainer), the parsed solution and answer become
    columns of completions.jsonl, as in TRL."""
    check = _verifier("accuracy_reward")
    rows = [check(sol, _text(c)) for c, sol in zip(completions, solution, strict=True)]
    _log(log_extra, solution, [r[1] for r in rows], [r[2] for r in rows])
    return [r[0] for r in rows]


def reasoning_accuracy_reward(completions: list, solution: list[str], reasoning_delimiters: list[str] | None = None,
                              log_extra: Callable[[str, list], None] | None = None, **kwargs) -> list[float | None]:
    """accuracy_reward on the final answer only: the text after the last occurrence of the first of
    `reasoning_delimiters` (default ["</think>"]) that the completion contains. A completion containing none
    (unfinished reasoning) scores 0.0, not None, whatever its solution; otherwise 1.0 / 0.0 / None as
    accuracy_reward (a \\boxed{} inside the reasoning does not count). log_extra columns as accuracy_reward's, with
    "[incomplete reasoning]" for rows without a delimiter."""
    check = _verifier("reasoning_accuracy_reward")
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    rows = []
    for completion, sol in zip(completions, solution, strict=True):
        text = _text(completion)
        delim = next((d for d in delimiters if d in text), None)
        if delim is None:
            rows.append((0.0, "[incomplete reasoning]", "[incomplete reasoning]"))
        else:
            rows.append(check(sol, text.split(delim)[-1]))
    _log(log_extra, solution, [r[1] for r in rows], [r[2] for r in rows])
    return [r[0] for r in rows]

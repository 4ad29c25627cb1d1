"""TRL's `accuracy_reward` under the same name and protocol, so TRL scripts that import it switch with the import.

The completion's answer (a \\boxed{…} first, then any LaTeX) is checked against the `solution` column with
math_verify (`pip install groupwise[math]`): 1.0 when equivalent, 0.0 when not, None (unscored) when the solution
itself cannot be parsed. math_verify is a parser of model-generated text, not an evaluator of it: nothing the model
writes is executed.
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


def accuracy_reward(completions: list, solution: list[str], log_extra: Callable[[str, list], None] | None = None,
                    **kwargs) -> list[float | None]:
    """1.0 if the completion's answer equals the row's `solution` (math_verify), 0.0 if not, None when the
    solution cannot be parsed. With `log_extra` (passed by the trainer), the parsed solution and answer become
    columns of completions.jsonl, as in TRL."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError("accuracy_reward needs math_verify: `pip install groupwise[math]`") from None
    # math_verify bounds its work with signal.alarm, which only the main thread may use (reward_timeout runs
    # reward functions in a thread): elsewhere it runs without its own timeouts
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if main else (None, None)
    if not main:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    answer_config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                           boxed_match_priority=0, try_extract_without_anchor=False)]
    rewards: list[float | None] = []
    golds, answers = [], []
    for completion, sol in zip(completions, solution, strict=True):
        gold = parse(sol, parsing_timeout=parse_timeout)
        if not gold:
            rewards.append(None)
            golds.append("[unparseable]")
            answers.append("[skipped]")
            continue
        answer = parse(_text(completion), extraction_config=answer_config, extraction_mode="first_match",
                       parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold, answer, timeout_seconds=verify_timeout)))
        golds.append(str(gold))
        answers.append(str(answer) if answer else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards

"""Arithmetic in chat form, for SmolLM2-135M-Instruct: "What is 16 - 7?" → a completion whose last number is the
answer. Single operations are small enough that a 135M instruct model gets some of them right (about 1 in 8 sampled
completions before training), which gives GRPO groups with a spread to learn from (§4.1.2). Two operations
("What is 12 + 7 - 5?", `rows(..., operations=2)`) it almost never gets right; there `solution_steps` (or
`equations_right`, arithmetic only) scores each step (sentence or line) of the working (DeepSeekMath §4.1.3's process
supervision, examples/smollm2/process.py).

    python examples/smollm2/task.py outputs/smollm2-data   # writes train.jsonl and test.jsonl there (eval.yaml reads them)
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from groupwise.tasks.splits import draw_problems

MAX_OPERAND = 25
_NUMBER = re.compile(r"-?\d+")


# a chain of equal sides, each side an integer or a sum / difference of integers: "20 + 23 = 43", "5 + 9 + 16 = 14 +
# 16 = 30"; at least one "=" (a number alone is not an equation). Not part of a longer expression: not inside a word
# ("x20"), a decimal ("43.5"), a thousands-separated number ("1,000"), a product ("2 × 10 + 3"), parentheses
# ("(20 + 23) - 9") or after an operator ("x + 9 = 43" is no "9 = 43"): such text is no equation here, rather than a
# wrong one. After "=" ("Total = 20 + 23 = 43") or a list marker ("1) 20 + 23 = 43") an equation may start.
_SIDE = r"-?\d+(?:\s*[+-]\s*-?\d+)*"
_EQUATION = re.compile(rf"(?<![\w.×*/^()+\-])(?<![×*/^+\-]\s)(?<!\d,){_SIDE}(?:\s*=\s*{_SIDE})+"
                       rf"(?![\w×*/^()]|[.,]\d|\s*[×*/^])")
_PARENTHESES = re.compile(r"\(\s*-?\d+\s*[-+×*/]")  # "(20 + 23) - 9": the step is not read (a list's "(1)" is)
_BULLET = re.compile(r"(^|\n)\s*[-*+•]\s+")
_TERM = re.compile(r"(^|[+-])\s*(-?\d+)")  # a side's terms: (operator before it, the integer as written)


def make_problem(rng: random.Random, operations: int = 1) -> str:
    return " ".join([str(rng.randint(1, MAX_OPERAND))]
                    + [f"{rng.choice('+-')} {rng.randint(1, MAX_OPERAND)}" for _ in range(operations)])


def terms(side: str) -> list[tuple[str, int]]:
    """The terms of a sum / difference as written, each with the operator before it: "43 - 9" → [("", 43), ("-", 9)];
    "5 - -3" → [("", 5), ("-", -3)]."""
    return [(op, int(number)) for op, number in _TERM.findall(side.strip())]


def evaluate(expression: str) -> int:
    """The value of a sum / difference of integers, left to right ("25 - 16 - 7" → 2), without eval()."""
    return sum(-number if op == "-" else number for op, number in terms(expression))


def rows(n: int, split: str, seed: int = 0, operations: int = 1) -> list[dict]:
    """n distinct problems of the split ('train' or 'test': disjoint by a hash of the problem text), each a
    conversational prompt (TRL's format) with the problem and its answer; `operations` per problem (1: "16 - 7",
    2: "12 + 7 - 5")."""
    stream = "smollm2" if operations == 1 else f"smollm2-{operations}ops"
    problems = draw_problems(lambda rng: make_problem(rng, operations), n, split=split, seed=seed, stream=stream)
    return [{"prompt": [{"role": "user", "content": f"What is {p}?"}], "problem": p, "answer": evaluate(p)}
            for p in problems]


def correct(completions, answer, **_) -> list[float]:
    """Outcome reward: 1.0 when the last integer in the completion equals the answer, else 0.0."""
    out = []
    for completion, want in zip(completions, answer):
        numbers = _NUMBER.findall(completion[-1]["content"] if isinstance(completion, list) else completion)
        out.append(float(bool(numbers) and int(numbers[-1]) == int(want)))
    return out


def equations_right(steps, problem, **_) -> list[list[float | None]]:
    """Step reward (one per step of the working, DeepSeekMath §4.1.3), a rule-based process reward model. It checks
    arithmetic, not the plan: an equation that holds and starts from numbers in play is right, whether or not it is a
    step of the solution ("23 - 20 = 3" for 20 + 23 - 9 is right, and so is "4 + 6 = 10" for 4 - 6 - 1: the
    problem's numbers are taken without their signs). `solution_steps` checks the plan too.
    - 1.0 for a step whose equations all hold ("20 + 23 = 43"; in a chain "22 + 14 + 17 = 36 + 17 = 53" every side)
      and each start from known numbers (the terms of its first side with an operation: "43 = 20 + 23" starts from
      20 and 23): the problem's, or results of earlier right equations, in this step or before (signed: after
      "4 - 15 = -11", "-11 - 3" starts from one, "11 - 3" does not; a number restated, "25 = 25", is no result);
    - 0.0 for a step with an equation that does not hold ("25 - 16 - 7 = 25 + 16 + 7 = 42") or that starts from a
      number found neither in the problem nor in the working before it ("2 + 1 = 3" for 22 + 19 + 1);
    - None (unscored) for a step without an equation that has an operation ("First, we add 20 and 23:", "34 = 34"),
      and for text that is not a sum or difference of integers: products, decimals, numbers with thousands
      separators, a sum that follows an operator ("x + 9 = 43"), and any step with a parenthesised operation.
    The "−" sign counts as "-"; markdown bold ("**") and a list bullet starting the step ("- ", "* ", "+ ", "• ") are
    ignored (so "- 1 - 1 = 0" reads as "1 - 1 = 0")."""
    return [_score(row, question, plan=False) for row, question in zip(steps, problem)]


def solution_steps(steps, problem, **_) -> list[list[float | None]]:
    """Step reward that checks the plan as well as the arithmetic: as `equations_right`, and each equation's result
    must be one of the left-to-right solution's: the first operation's, then the answer ("20 + 23 = 43" and
    "43 - 9 = 34", or "20 + 23 - 9 = 34", for 20 + 23 - 9). A true equation with another result scores 0.0:
    "23 - 20 = 3", "4 + 6 = 10" for 4 - 6 - 1 (whose results are -2 and -3), the first step of a reordering ("23 - 9
    = 14"; then "20 + 14 = 34" starts from 14, which no right equation gave). It checks the result, not the
    operation: "20 - 9 + 23 = 34" is right, and so is "1 - 4 = -3" for 4 - 6 - 1."""
    return [_score(row, question, plan=True) for row, question in zip(steps, problem)]


def _score(row: list[str], question: str, plan: bool) -> list[float | None]:
    """One completion's step scores (equations_right's rules; with `plan`, solution_steps')."""
    signed = terms(question)
    known = {number for _, number in signed}
    path = {evaluate(" ".join(f"{op} {n}" for op, n in signed[:k])) for k in range(2, len(signed) + 1)}
    scores = []
    for step in row:
        # a minus sign; markdown bold ("**20 + 23 = 43**"); a list bullet ("- 20 + 23 = 43") is no operator
        text = _BULLET.sub(r"\1", step.replace("−", "-").replace("**", " "))
        chains = [] if _PARENTHESES.search(text) else [m.group(0).split("=") for m in _EQUATION.finditer(text)]
        if not any(len(terms(side)) > 1 for sides in chains for side in sides):
            scores.append(None)
            continue
        right = True
        for sides in chains:  # in order: a later equation may start from an earlier right one's result
            start = next((side for side in sides if len(terms(side)) > 1), None)  # None: "34 = 34"
            ok = len({evaluate(side) for side in sides}) == 1 and (start is None or (
                {number for _, number in terms(start)} <= known and (not plan or evaluate(sides[0]) in path)))
            right = right and ok
            if ok and start is not None:  # a number restated ("25 = 25") is no result
                known.add(evaluate(sides[0]))
        scores.append(float(right))
    return scores


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 600), ("test", 100)):
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows(n, split))
    print(f"wrote {out / 'train.jsonl'} and {out / 'test.jsonl'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/smollm2-data")

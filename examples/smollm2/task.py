"""Single-operation arithmetic in chat form, for SmolLM2-135M-Instruct: "What is 16 - 7?" → a completion whose
last number is the answer. Small enough that a 135M instruct model gets some of them right (about 1 in 8 sampled
completions before training), which gives GRPO groups with a spread to learn from (§4.1.2).

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


def make_problem(rng: random.Random) -> str:
    return f"{rng.randint(1, MAX_OPERAND)} {rng.choice('+-')} {rng.randint(1, MAX_OPERAND)}"


def answer(problem: str) -> int:
    a, op, b = problem.split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def rows(n: int, split: str, seed: int = 0) -> list[dict]:
    """n distinct problems of the split ('train' or 'test': disjoint by a hash of the problem text), each a
    conversational prompt (TRL's format) with its answer."""
    problems = draw_problems(make_problem, n, split=split, seed=seed, stream="smollm2")
    return [{"prompt": [{"role": "user", "content": f"What is {p}?"}], "answer": answer(p)} for p in problems]


def correct(completions, answer, **_) -> list[float]:
    """Outcome reward: 1.0 when the last integer in the completion equals the answer, else 0.0."""
    out = []
    for completion, want in zip(completions, answer):
        numbers = _NUMBER.findall(completion[-1]["content"] if isinstance(completion, list) else completion)
        out.append(float(bool(numbers) and int(numbers[-1]) == int(want)))
    return out


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 600), ("test", 100)):
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows(n, split))
    print(f"wrote {out / 'train.jsonl'} and {out / 'test.jsonl'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/smollm2-data")

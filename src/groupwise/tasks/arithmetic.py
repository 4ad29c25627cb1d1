"""Multi-step arithmetic: the demo task. A problem is a chain of additions and subtractions read left to right,
solved one operation per line:

    prompt      "Q: 7+5-3+8\\n"
    solution    "7+5=12\\n12-3=9\\n9+8=17\\nA: 17"  (then EOS)

Outcome reward `accuracy`: 1 when the final line is "A: <the answer>", else 0.
Process reward `step_correct` (a rule-based process reward model): one reward per line, 1 when the line is the
correct next line of the solution — "x op y=z" with x the true running total, op y the problem's next operation and
z the true new total, or the final "A: <answer>" after all operations — else 0. After a wrong line the following
lines are judged against the true solution, so a slip is located where it happens.

The held-out split is decided by a hash of the problem text (groupwise.tasks.splits), so no held-out problem is ever
generated for training.
"""

from __future__ import annotations

import random
import re

from groupwise.tasks.splits import draw_problems

MIN_OPS, MAX_OPS = 2, 3  # operations per problem
MAX_OPERAND = 30
_LINE = re.compile(r"^\s*(-?\d+)\s*([+-])\s*(\d+)\s*=\s*(-?\d+)\s*$")
_ANSWER = re.compile(r"^\s*A:\s*(-?\d+)\s*$")


def parse(problem: str) -> tuple[int, list[tuple[str, int]]]:
    tokens = re.findall(r"\d+|[+-]", problem)
    first, rest = int(tokens[0]), tokens[1:]
    return first, [(rest[i], int(rest[i + 1])) for i in range(0, len(rest), 2)]


def solution_lines(problem: str) -> list[str]:
    total, ops = parse(problem)
    lines = []
    for op, y in ops:
        new = total + y if op == "+" else total - y
        lines.append(f"{total}{op}{y}={new}")
        total = new
    return lines + [f"A: {total}"]


def answer(problem: str) -> int:
    return int(solution_lines(problem)[-1][3:])


def make_problem(rng: random.Random) -> str:
    n_ops = rng.randint(MIN_OPS, MAX_OPS)
    s = str(rng.randint(1, MAX_OPERAND))
    for _ in range(n_ops):
        s += rng.choice("+-") + str(rng.randint(1, MAX_OPERAND))
    return s


def prompt_of(problem: str) -> str:
    return f"Q: {problem}\n"


def problems(n: int, *, split: str = "train", seed: int = 0) -> list[str]:
    """n distinct problems of the split ('train' or 'test'), seeded."""
    return draw_problems(make_problem, n, split=split, seed=seed, stream="")


def dataset(n: int = 2000, *, split: str = "train", seed: int = 0) -> list[dict[str, str]]:
    return [{"prompt": prompt_of(p), "problem": p} for p in problems(n, split=split, seed=seed)]


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def accuracy(completions, problem, **_) -> list[float]:
    """Outcome reward: 1.0 when the last non-empty line is 'A: <correct answer>'."""
    out = []
    for c, p in zip(completions, problem):
        lines = [ln for ln in _text(c).strip().split("\n") if ln.strip()]
        m = _ANSWER.match(lines[-1]) if lines else None
        out.append(float(m is not None and int(m.group(1)) == answer(p)))
    return out


def judge_steps(problem: str, steps: list[str]) -> list[float]:
    """1.0 for each step equal (up to spaces) to the true solution's line at that position, else 0.0."""
    truth = solution_lines(problem)
    out = []
    for j, step in enumerate(steps):
        if j >= len(truth):
            out.append(0.0)  # lines after the answer are wrong by definition
            continue
        want = truth[j]
        m = _LINE.match(step) if not want.startswith("A:") else _ANSWER.match(step)
        out.append(float(m is not None and step.replace(" ", "") == want.replace(" ", "")))
    return out


def step_correct(completions, steps, problem, **_) -> list[list[float]]:
    """Process reward: one 0/1 per step (see judge_steps)."""
    return [judge_steps(p, s) for p, s in zip(problem, steps)]


REWARD_FUNCS = [accuracy]
PROCESS_REWARD_FUNCS = [step_correct]


def build_tokenizer():
    """Character-level tokenizer over the task's alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("0123456789+-=:AQ \n")
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<bos>"] + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")

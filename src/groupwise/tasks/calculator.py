"""Arithmetic with a calculator tool: the built-in task for process supervision over tool-calling turns
(`groupwise train builtin:calculator`, docs/calculator.md).

A problem is an integer expression with 2 or 3 binary operations (+, -, *), written with the usual precedence and
only the parentheses it needs: "7 + 5 * 3", "(7 + 5) * 3", "(4 - 9) * (2 + 6)". Its solution is its expression tree:
every operation is one call of the `calculate` tool, on integers that are in the problem or results of earlier
calls. The policy talks to a `CalculatorEnv` (TRL's `environment_factory` protocol) in turns:

    user        What is 7 + 5 * 3?
    assistant   <tool_call>{"name": "calculate", "arguments": {"expression": "5 * 3"}}</tool_call>
    tool        15
    assistant   <tool_call>{"name": "calculate", "arguments": {"expression": "7 + 15"}}</tool_call>
    tool        22
    assistant   <tool_call>{"name": "answer", "arguments": {"value": 22}}</tool_call>
    tool        ok
    assistant   (nothing: the closing turn, no call, ends the conversation)

The final answer goes through the `answer` tool because an environment only sees its tool calls (TRL: "the
environment owns the reward ... from its internal state"); its rewards need nothing else:

- `get_reward()` (the outcome): 1.0 when the first `answer` call gave the right value, else 0.0.
- `get_step_rewards()` (one per assistant turn, in order; read by supervision process/both with
  step_split="turn"): a call of `calculate` is right when its expression is a correct next operation — an
  operation of the solution tree whose operands are available (numbers of the problem, or results of earlier
  correct calls) and not yet done, operands in order (either order for + and *) — and wrong otherwise (a malformed
  expression, a wrong operation, one whose operand was never computed, a repeat); a call of `answer` is right when
  it is the first answer and the value is right. A turn gets 1.0 when it made calls and all were right — those that
  never reached the environment count as wrong: start_turn(tool_calls) says how many the turn made —, else 0.0;
  the last turn, when no call of it reached the environment (the closing turn), gets the outcome; an earlier turn
  whose calls never reached it (an unknown tool, bad arguments) gets 0.0.
  Turns are known from groupwise's `start_turn()`, called before each assistant turn's calls run, so every value
  belongs to its turn whatever the turn did. Without it (another trainer) each call counts as a turn, then the
  closing turn: a transcript of n calls has n + 1 turns.

`ENVIRONMENT_FACTORY` (CalculatorEnv) is what the task passes as `environment_factory`, whatever the supervision.

The tool never evaluates model text: `parse_expression` accepts exactly `int op int` (a strict regex, at most 6
digits per operand) and the arithmetic is done on the parsed integers. The held-out split is decided by a hash of
the problem text (groupwise.tasks.splits), so no held-out problem is ever trained on.

The shipped policy (data/calculator_policy, made by scripts/make_calculator_policy.py) uses `build_tokenizer()`:
groupwise.tasks.toy's byte-level tool tokenizer plus a few literal strings the transcripts repeat (a tool call's
JSON up to its argument, the tool list) as single tokens, so a 3-operation conversation is ~80 tokens.
"""

from __future__ import annotations

import random
import re
from typing import Any, Union

from groupwise.tasks import toy
from groupwise.tasks.splits import draw_problems

MIN_OPS, MAX_OPS = 2, 3  # operations per problem
MAX_OPERAND = 20  # the problem's numbers are 1..MAX_OPERAND
MAX_VALUE = 999  # every intermediate result has |value| <= MAX_VALUE (problems are redrawn otherwise)
OPS = ("+", "-", "*")
PRECEDENCE = {"+": 1, "-": 1, "*": 2}
MAX_TOOL_CALLING_ITERATIONS = 5  # 3 operations + the answer, and one spare round
ANSWER_RECEIVED = "ok"  # what the answer tool returns

Tree = Union[int, tuple[str, "Tree", "Tree"]]  # a number, or (op, left, right)


# ---- problems ---------------------------------------------------------------------------------------------------
def apply(a: int, op: str, b: int) -> int:
    """a op b for op in OPS, on integers (never eval)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def value(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    return apply(value(left), op, value(right))


def render(tree: Tree) -> str:
    """The expression with only the parentheses it needs ("*" binds tighter; equal precedence groups to the left,
    so a right operand of equal precedence keeps its parentheses: "7 - (5 + 3)")."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    lhs, rhs = render(left), render(right)
    if not isinstance(left, int) and PRECEDENCE[left[0]] < PRECEDENCE[op]:
        lhs = f"({lhs})"
    if not isinstance(right, int) and PRECEDENCE[right[0]] <= PRECEDENCE[op]:
        rhs = f"({rhs})"
    return f"{lhs} {op} {rhs}"


_TOKEN = re.compile(r"\s*([0-9]+|[-+*()])")


def parse_problem(problem: str) -> Tree:
    """The tree of a problem written by `render` (non-negative integers, + - *, parentheses; precedence climbing).
    A ValueError for anything else."""
    tokens, pos = [], 0
    text = problem.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected character at {pos} in {problem!r}")
        tokens.append(m.group(1))
        pos = m.end()
    i = 0

    def primary() -> Tree:
        nonlocal i
        if i >= len(tokens):
            raise ValueError(f"{problem!r} ends early")
        tok = tokens[i]
        i += 1
        if tok == "(":
            tree = expression(1)
            if i >= len(tokens) or tokens[i] != ")":
                raise ValueError(f"unbalanced parentheses in {problem!r}")
            i += 1
            return tree
        if tok.isdigit():
            return int(tok)
        raise ValueError(f"unexpected {tok!r} in {problem!r}")

    def expression(min_prec: int) -> Tree:
        nonlocal i
        left = primary()
        while i < len(tokens) and tokens[i] in PRECEDENCE and PRECEDENCE[tokens[i]] >= min_prec:
            op = tokens[i]
            i += 1
            left = (op, left, expression(PRECEDENCE[op] + 1))
        return left

    tree = expression(1)
    if i != len(tokens):
        raise ValueError(f"unexpected {tokens[i]!r} in {problem!r}")
    return tree


def operations(tree: Tree) -> list[tuple[int, str, int, int]]:
    """The canonical solution: every operation (x, op, y, result) in post-order, left operand first."""
    if isinstance(tree, int):
        return []
    op, left, right = tree
    return operations(left) + operations(right) + [(value(left), op, value(right), value(tree))]


def solution(problem: str) -> list[tuple[int, str, int, int]]:
    return operations(parse_problem(problem))


def answer(problem: str) -> int:
    return value(parse_problem(problem))


def _random_tree(rng: random.Random, n_ops: int) -> Tree:
    if n_ops == 0:
        return rng.randint(1, MAX_OPERAND)
    n_left = rng.randint(0, n_ops - 1)
    return (rng.choice(OPS), _random_tree(rng, n_left), _random_tree(rng, n_ops - 1 - n_left))


def make_problem(rng: random.Random) -> str:
    while True:
        tree = _random_tree(rng, rng.randint(MIN_OPS, MAX_OPS))
        if all(abs(r) <= MAX_VALUE for *_, r in operations(tree)):
            return render(tree)


def problems(n: int, *, split: str = "train", seed: int = 0) -> list[str]:
    """n distinct problems of the split ('train' or 'test'), seeded."""
    return draw_problems(make_problem, n, split=split, seed=seed, stream="calculator-")


def prompt_of(problem: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {problem}?"}]


def dataset(n: int = 2000, *, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """Conversational rows: `prompt` (one user message) and `problem` (what CalculatorEnv.reset reads)."""
    return rows_of(problems(n, split=split, seed=seed))


def rows_of(problems_: list[str]) -> list[dict[str, Any]]:
    return [{"prompt": prompt_of(p), "problem": p} for p in problems_]


# ---- the tool -------------------------------------------------------------------------------------------------
_EXPRESSION = re.compile(r" *(-?[0-9]{1,6}) *([-+*]) *(-?[0-9]{1,6}) *")


def parse_expression(expression: Any) -> tuple[int, str, int]:
    """(a, op, b) from exactly `int op int` (optional spaces, op one of + - *, at most 6 digits per integer, a
    leading minus allowed); a ValueError for anything else. Nothing of the text is ever evaluated."""
    # the messages are short: they become the tool message, which counts against max_completion_length
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    m = _EXPRESSION.fullmatch(expression)
    if m is None:
        raise ValueError("expected: int op int")
    return int(m.group(1)), m.group(2), int(m.group(3))


class CalculatorEnv:
    """One rollout's calculator (TRL's environment protocol; see the module docstring for the rewards).

    State: the problem's solution tree, which of its operations correct calls have done, the verdicts of the calls
    of each assistant turn (turns from start_turn, or one per call without it) and the answer given.
    """

    def __init__(self) -> None:
        self.problem: str | None = None
        self._tree: Tree = 0
        self._nodes: list[tuple[str, Any, Any]] = []
        self._done: list[bool] = []
        self.turns: list[list[float]] = []  # per assistant turn, the verdict of each call that reached us
        self.made: list[int] = []  # per assistant turn, the calls it made (start_turn's tool_calls), reached or not
        self.told_turns = False  # does the trainer call start_turn (groupwise)? Otherwise a call is a turn
        self.answered: int | None = None  # the first answer given
        self.target: int | None = None

    def reset(self, **row) -> None:
        """Start a rollout on the row's `problem` (the prompt already states it, so nothing is appended)."""
        if "problem" not in row:
            raise ValueError("CalculatorEnv needs a 'problem' column (groupwise.tasks.calculator.dataset)")
        self.problem = row["problem"]
        self._tree = parse_problem(self.problem)
        self.target = value(self._tree)
        self._nodes, self._done = [], []
        self._index(self._tree)
        self._done = [False] * len(self._nodes)
        self.turns, self.made, self.told_turns, self.answered = [], [], False, None

    def start_turn(self, tool_calls: list | None = None) -> None:
        """groupwise calls this once per assistant turn, before the turn's tool calls run, with the calls the turn
        made: a call that never reaches the environment (an unknown tool, a wrong argument name) is wrong too."""
        self.told_turns = True
        self.turns.append([])
        self.made.append(len(tool_calls or []))

    def _record(self, verdict: float) -> None:
        if not self.told_turns:
            self.turns.append([])  # no start_turn: each call is its own turn
        self.turns[-1].append(verdict)

    def _index(self, tree: Tree) -> tuple[str, int]:
        """A reference to `tree`: ("leaf", number) or ("node", index into _nodes, post-order)."""
        if isinstance(tree, int):
            return ("leaf", tree)
        op, left, right = tree
        refs = (op, self._index(left), self._index(right))
        self._nodes.append(refs)
        return ("node", len(self._nodes) - 1)

    def _available(self, ref) -> int | None:
        kind, x = ref
        if kind == "leaf":
            return x
        return value(self._subtree(x)) if self._done[x] else None

    def _subtree(self, k: int) -> Tree:
        def build(ref):
            return ref[1] if ref[0] == "leaf" else self._subtree(ref[1])
        op, left, right = self._nodes[k]
        return (op, build(left), build(right))

    def _judge(self, a: int, op: str, b: int) -> float:
        """1.0 (and the operation marked done) when a op b is an operation of the tree not done yet whose operands
        are available, in order (either order for + and *); else 0.0."""
        if self.answered is not None:
            return 0.0  # after the answer nothing counts
        for k, (node_op, left, right) in enumerate(self._nodes):
            if self._done[k] or node_op != op:
                continue
            x, y = self._available(left), self._available(right)
            if x is None or y is None:
                continue
            if (a, b) == (x, y) or (op in "+*" and (a, b) == (y, x)):
                self._done[k] = True
                return 1.0
        return 0.0

    def calculate(self, expression: str) -> str:
        """
        Computes one operation on two integers.

        Args:
            expression: Two integers and an operator, e.g. "12 * 3".

        Returns:
            The result.
        """
        try:
            a, op, b = parse_expression(expression)
        except ValueError:
            self._record(0.0)
            raise
        self._record(self._judge(a, op, b))
        return str(apply(a, op, b))

    def answer(self, value: int) -> str:
        """
        Gives the final answer.

        Args:
            value: The answer.

        Returns:
            A confirmation.
        """
        if type(value) is not int:  # noqa: E721 — bool is not an answer
            self._record(0.0)
            raise ValueError("value must be an integer")
        if self.answered is not None:
            self._record(0.0)
            raise ValueError("already answered")
        self.answered = value
        self._record(float(value == self.target))
        return ANSWER_RECEIVED

    def get_reward(self) -> float:
        """The outcome: 1.0 when the first answer is right."""
        return float(self.answered is not None and self.answered == self.target)

    def get_step_rewards(self) -> list[float]:
        """One reward per assistant turn, in order (see the module docstring); groupwise reserves the name, so it is
        not a tool."""
        made = self.made if self.told_turns else [len(calls) for calls in self.turns]  # without: a call, a turn
        rewards = [float(bool(calls) and len(calls) == n and all(v == 1.0 for v in calls))
                   for calls, n in zip(self.turns, made)]
        if not self.told_turns:
            return [*rewards, self.get_reward()]  # each call was a turn; then the closing turn
        if self.turns and not self.turns[-1]:
            rewards[-1] = self.get_reward()  # the closing turn
        return rewards


REWARD_FUNCS: list = []  # the environment owns the rewards (CalculatorEnv.get_reward, get_step_rewards)
ENVIRONMENT_FACTORY = CalculatorEnv


# ---- the policy's tokenizer -------------------------------------------------------------------------------------
# groupwise.tasks.toy's tool chat template (Qwen's <tool_call>{json}</tool_call> format) with the tools listed
# compactly, as signatures: "Tools: answer(value: integer); calculate(expression: string)".
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{% set f = t.function if t.function is defined "
    "else t %}{{ f.name }}({% for k, v in f.parameters.properties.items() %}{{ k }}: {{ v.type }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}; {% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}" + toy.TOOL_TURNS_TEMPLATE
)
CALL_OPEN = '<tool_call>{"name": "calculate", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
ANSWER_OPEN = '<tool_call>{"name": "answer", "arguments": {"value": '
ANSWER_CLOSE = "}}</tool_call>"
TOOL_LIST = "Tools: answer(value: integer); calculate(expression: string)"
# literal strings every transcript repeats, one token each (plain added tokens: matched anywhere, decoded as text)
WORDS = [CALL_OPEN, CALL_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, TOOL_LIST, "What is ", " + ", " - ", " * ",
         "system\n", "user\n", "assistant\n", "tool\n"]


def build_tokenizer():
    """groupwise.tasks.toy's byte-level tool tokenizer (<|im_end|> the EOS, the end of every turn; <|endoftext|> pad;
    the response template) with CHAT_TEMPLATE and the WORDS as single tokens; save_pretrained keeps all of it."""
    return toy.build_tool_tokenizer(CHAT_TEMPLATE, words=WORDS)


def call_text(expression: str) -> str:
    """A calculate call as the chat template renders it (and as the policy writes it)."""
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def answer_text(value: int) -> str:
    return f"{ANSWER_OPEN}{value}{ANSWER_CLOSE}"


def transcript(problem: str, order: list[int] | None = None) -> list[dict]:
    """The assistant and tool messages of a worked solution (TRL's completion messages), operations in the
    canonical order or in `order` (indices into solution(problem))."""
    ops = solution(problem)
    messages: list[dict] = []
    for k in (range(len(ops)) if order is None else order):
        x, op, y, r = ops[k]
        messages += [{"role": "assistant", "content": "", "tool_calls": [
                         {"type": "function", "function": {"name": "calculate",
                                                           "arguments": {"expression": f"{x} {op} {y}"}}}]},
                     {"role": "tool", "name": "calculate", "content": str(r)}]
    messages += [{"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "answer", "arguments": {"value": answer(problem)}}}]},
                 {"role": "tool", "name": "answer", "content": ANSWER_RECEIVED},
                 {"role": "assistant", "content": ""}]
    return messages


# ---- evaluation: held-out greedy accuracy through groupwise's tool loop ---------------------------------------------
def tool_loop(tokenizer, max_completion_length: int = 160):
    """(Toolbox, Agent): groupwise's tool loop with CalculatorEnv, as the trainer builds it for this task."""
    from groupwise.agents import Agent, Toolbox
    from groupwise.agents.parsing import prepare_tokenizer

    toolbox = Toolbox(environment_factory=CalculatorEnv)
    return toolbox, Agent(toolbox, tokenizer, max_completion_length=max_completion_length,
                          max_tool_calling_iterations=MAX_TOOL_CALLING_ITERATIONS,
                          chat_template=prepare_tokenizer(tokenizer))


def evaluate_policy(model, tokenizer, problems_: list[str], *, batch_size: int = 200,
                    max_completion_length: int = 160) -> dict[str, float]:
    """Greedy rollouts of the policy with CalculatorEnv (groupwise.agents' tool loop, model.generate as the
    sampler): accuracy (share of right first answers), calls per rollout, share of rollouts with a call, share of
    failed calls, mean per-turn reward."""
    import torch

    from groupwise.generation import Generated
    from groupwise.modeling import eval_mode

    _, agent = tool_loop(tokenizer, max_completion_length)

    def sample(ids, mask, max_new_tokens: int = max_completion_length):  # later turns: what the budget leaves
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        return Generated(out[:, ids.size(1):])

    right = calls = with_call = failures = 0
    turn_means = []
    with torch.no_grad(), eval_mode(model):
        for lo in range(0, len(problems_), batch_size):
            rows = rows_of(problems_[lo:lo + batch_size])
            turns = agent.rollout(model, rows, sample, [tokenizer.eos_token_id])
            for env, n_calls, n_failed in zip(turns.environments, turns.tool_calls, turns.tool_failures):
                right += env.get_reward()
                calls += n_calls
                with_call += n_calls > 0
                failures += n_failed
                steps = env.get_step_rewards()
                turn_means.append(sum(steps) / len(steps))
    n = len(problems_)
    return {"accuracy": right / n, "calls_per_rollout": calls / n, "rollouts_with_call": with_call / n,
            "failure_frequency": failures / calls if calls else 0.0, "turn_reward_mean": sum(turn_means) / n}

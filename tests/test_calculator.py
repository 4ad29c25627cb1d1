"""The built-in calculator task (groupwise.tasks.calculator): problems and split, the strict tool parser, the per-turn
rewards worked by hand, the shipped tool-calling policy, and short training runs with CalculatorEnv."""

from __future__ import annotations

import builtins
import dataclasses
import json

import pytest

from groupwise.tasks import calculator as C
from tests.conftest import training_lines


# ---- problems -----------------------------------------------------------------------------------------------------
def test_solutions_by_hand():
    # 7 + 5 * 3: the product first (precedence), then the sum
    assert C.solution("7 + 5 * 3") == [(5, "*", 3, 15), (7, "+", 15, 22)]
    assert C.answer("7 + 5 * 3") == 22
    # (7 + 5) * 3: the parentheses first
    assert C.solution("(7 + 5) * 3") == [(7, "+", 5, 12), (12, "*", 3, 36)]
    # 3 operations, two independent subtrees: left one first in the canonical order
    assert C.solution("(4 - 9) * (2 + 6)") == [(4, "-", 9, -5), (2, "+", 6, 8), (-5, "*", 8, -40)]
    assert C.answer("20 - 3 - 4") == 13  # left to right
    assert C.parse_problem("7 - (5 + 3)") == ("-", 7, ("+", 5, 3))
    assert C.prompt_of("7 + 5 * 3") == [{"role": "user", "content": "What is 7 + 5 * 3?"}]
    for bad in ("7 + ", "(7 + 5", "7 / 5", "7 + 5)", "import os"):
        with pytest.raises(ValueError):
            C.parse_problem(bad)


def test_problems_and_split_are_deterministic():
    from groupwise.tasks.splits import is_held_out

    train = C.problems(2000, split="train", seed=0)
    test = C.problems(200, split="test")
    assert not set(train) & set(test)
    assert all(is_held_out(p) for p in test) and not any(is_held_out(p) for p in train)
    assert C.problems(50, seed=3) == C.problems(50, seed=3) != C.problems(50, seed=4)
    assert C.problems(200, split="test") == test
    for p in train[:500] + test:
        tree = C.parse_problem(p)
        assert C.render(tree) == p  # the text is the tree, with only the parentheses it needs
        ops = C.solution(p)
        assert C.MIN_OPS <= len(ops) <= C.MAX_OPS and all(abs(r) <= C.MAX_VALUE for *_, r in ops)
        assert ops[-1][3] == C.answer(p) == C.value(tree)
    rows = C.dataset(3, split="test")
    assert rows[0] == {"prompt": C.prompt_of(test[0]), "problem": test[0]}
    with pytest.raises(ValueError, match="split"):
        C.problems(1, split="dev")


# ---- the tool ------------------------------------------------------------------------------------------------------
def test_tool_parser_accepts_only_int_op_int(monkeypatch, tmp_path):
    assert C.parse_expression("12 * 3") == (12, "*", 3)
    assert C.parse_expression("-5 + 2") == (-5, "+", 2)
    assert C.parse_expression("3--5") == (3, "-", -5)
    assert C.parse_expression(" 7+5 ") == (7, "+", 5)
    marker = tmp_path / "pwned"
    refused = ["1 + 2 + 3", "2 ** 8", "7 / 2", "7 % 2", "(1 + 2)", "1e3 * 2", "1.5 * 2", "", "12", "1234567 * 2",
               "１２ + 3", "1 + 2\n", "0x10 + 1", "- 5 + 1", "True + 1",
               f"__import__('pathlib').Path({str(marker)!r}).touch()", "exec('1') + 1"]
    for text in refused:
        with pytest.raises(ValueError):
            C.parse_expression(text)
    for not_text in (12, None, ["1 + 2"], {"a": 1}):
        with pytest.raises(ValueError, match="string"):
            C.parse_expression(not_text)
    assert not marker.exists()

    def forbidden(*args, **kwargs):
        raise AssertionError("the calculator must not evaluate model text")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    env = C.CalculatorEnv()
    env.reset(problem="7 + 5 * 3")
    assert env.calculate("5 * 3") == "15" and env.calculate("-7 - -8") == "1"


def test_environment_protocol():
    """TRL's protocol as groupwise reads it: reset, get_reward, the tools (answer, calculate) with schemas; the
    per-turn rewards are not a tool."""
    from groupwise.agents import Toolbox

    box = Toolbox(environment_factory=C.ENVIRONMENT_FACTORY)
    assert [s["function"]["name"] for s in box.schemas[None]] == ["answer", "calculate"]
    assert [s.name for s in box.reward_sources] == ["CalculatorEnv"]
    assert [s.name for s in box.process_sources] == ["CalculatorEnv.get_step_rewards"]
    env = C.CalculatorEnv()
    assert env.reset(prompt=C.prompt_of("1 + 2 * 3"), problem="1 + 2 * 3") is None
    assert callable(env.get_step_rewards) and env.get_step_rewards() == [0.0]  # only the closing turn, no answer
    with pytest.raises(ValueError, match="problem"):
        env.reset(prompt=[])


# ---- per-turn rewards, by hand -------------------------------------------------------------------------------------
def test_step_rewards_by_hand():
    env = C.CalculatorEnv()
    # 7 + 5 * 3 = 22. Turn 1 ignores precedence (7 + 5 is no operation of the tree): 0. Turns 2-3 are the
    # solution: 1, 1. Turn 4 answers 22: 1. The closing turn gets the outcome: 1.
    env.reset(problem="7 + 5 * 3")
    assert env.calculate("7 + 5") == "12"  # the tool still computes it
    assert env.calculate("5 * 3") == "15"
    assert env.calculate("7 + 15") == "22"
    assert env.answer(22) == C.ANSWER_RECEIVED
    assert env.get_step_rewards() == [0.0, 1.0, 1.0, 1.0, 1.0] and env.get_reward() == 1.0

    # (7 + 5) * 3 = 36. 12 * 3 before 12 was computed: 0 (an operand not available yet). 5 + 7: 1 (+ commutes).
    # 3 * 12: 1. The same operation again: 0 (already done). A wrong answer: 0, and the outcome 0.
    env.reset(problem="(7 + 5) * 3")
    env.calculate("12 * 3")
    env.calculate("5 + 7")
    env.calculate("3 * 12")
    env.calculate("3 * 12")
    env.answer(35)
    assert env.get_step_rewards() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0] and env.get_reward() == 0.0

    # 7 - (5 + 3) = -1: - does not commute; a malformed call is a failed call (it raises: the tool message is the
    # error) worth 0; a second answer is refused and worth 0; only the first answer counts.
    env.reset(problem="7 - (5 + 3)")
    env.calculate("3 + 5")
    env.calculate("8 - 7")
    with pytest.raises(ValueError):
        env.calculate("7 - 5 - 3")
    env.calculate("7 - 8")
    env.answer(-1)
    with pytest.raises(ValueError, match="already"):
        env.answer(-1)
    assert env.get_step_rewards() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0] and env.get_reward() == 1.0

    # two independent subtrees in either order; no answer at all: the closing turn gets 0
    env.reset(problem="(4 - 9) * (2 + 6)")
    env.calculate("2 + 6")
    env.calculate("4 - 9")
    env.calculate("-5 * 8")
    assert env.get_step_rewards() == [1.0, 1.0, 1.0, 0.0] and env.get_reward() == 0.0

    # a call after the answer counts for nothing; an answer that is not an integer is refused
    env.reset(problem="1 + 2 * 3")
    with pytest.raises(ValueError, match="integer"):
        env.answer("7")
    env.answer(7)
    env.calculate("2 * 3")
    assert env.get_step_rewards() == [0.0, 1.0, 0.0, 1.0]


def test_worked_transcript_renders_and_scores():
    """The transcript the policy is trained on: one call per turn, the chat template renders it, and replaying its
    calls in an environment scores every turn 1."""
    tok = C.build_tokenizer()
    problem = "(4 - 9) * (2 + 6)"
    messages = C.transcript(problem)
    text = tok.apply_chat_template(C.prompt_of(problem) + messages, tokenize=False)
    assert C.call_text("4 - 9") in text and C.answer_text(-40) in text
    assert text.endswith("<|im_start|>assistant\n<|im_end|>\n")  # the closing turn: nothing to say
    env = C.CalculatorEnv()
    env.reset(problem=problem)
    for m in messages:
        for call in m.get("tool_calls") or []:
            getattr(env, call["function"]["name"])(**call["function"]["arguments"])
    turns = sum(m["role"] == "assistant" for m in messages)
    assert env.get_step_rewards() == [1.0] * turns


def test_per_turn_rewards_through_the_tool_loop_stay_with_their_turns():
    """Scripted turns through groupwise's tool loop (Agent.rollout, which calls start_turn before each turn's calls).
    Row 1, 7 + 5 * 3 = 22: a call of an unknown tool and a call with a wrong argument name never reach the
    environment (0, 0); 5 * 3 with a second call of a wrong argument name in the same turn (0: start_turn is told
    the turn's two calls, one never reached it); two calls in one turn, 7 + 15 and answer(22), both right (1); the
    closing turn gets the outcome (1). Row 2, (7 + 5) * 3 = 36, at most 4 tool rounds: 12 * 3 before 12 exists (0), 7 + 5 (1),
    12 * 3 (1), 36 - 0 (not an operation of the tree: 0), then an answer call the round limit leaves unexecuted:
    the last turn, none of whose calls reached the environment, gets the outcome (no answer: 0)."""
    from groupwise import rollout as R
    from groupwise.agents import Toolbox
    from groupwise.rewards.steps import StepSplitter
    from tests.agents_support import call, context, user

    def calc(expression):
        return call("calculate", expression=expression)

    first = [call("calc", expression="5 * 3"), call("calculate", expr="5 * 3"),
             calc("5 * 3") + call("calculate", expr="1 + 1"), calc("7 + 15") + call("answer", value=22)]
    second = [calc("12 * 3"), calc("7 + 5"), calc("12 * 3"), calc("36 - 0"), call("answer", value=36)]
    def reply(prompt):
        k = prompt.count("<|im_start|>tool")  # tool messages so far: one per call
        if "7 + 5 * 3" in prompt:
            return ({0: first[0], 1: first[1], 2: first[2], 4: first[3]}.get(k, "done")) + "<|im_end|>"
        return second[k] + "<|im_end|>"

    ctx, _ = context(reply, tools=(), environment_factory=C.CalculatorEnv, supervision="process", step_split="turn",
                     max_tool_calling_iterations=4, max_completion_length=2000)
    toolbox = Toolbox([], C.CalculatorEnv)
    ctx = dataclasses.replace(ctx, process_sources=toolbox.process_sources, splitter=StepSplitter("turn"))
    rows = [{"prompt": user("What is 7 + 5 * 3?"), "problem": "7 + 5 * 3"},
            {"prompt": user("What is (7 + 5) * 3?"), "problem": "(7 + 5) * 3"}]
    comp = R.generate(ctx, None, rows)
    assert [len(e) for e in comp.turn_ends] == [5, 5]
    assert R.score_steps(ctx, comp).rewards == [[[0.0, 0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0]]]


# ---- the shipped policy ----------------------------------------------------------------------------------------------
def test_shipped_policy_writes_a_tool_call():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.agents import Toolbox
    from groupwise.agents.parsing import parse_response, prepare_tokenizer
    from groupwise.demo import CALCULATOR_POLICY_DIR

    size = sum(f.stat().st_size for f in CALCULATOR_POLICY_DIR.iterdir())
    assert size < 5_000_000
    provenance = json.loads((CALCULATOR_POLICY_DIR / "provenance.json").read_text())
    assert 0.3 <= provenance["held_out_greedy"]["accuracy"] <= 0.6
    tok = AutoTokenizer.from_pretrained(CALCULATOR_POLICY_DIR)
    assert prepare_tokenizer(tok) is None  # tool template, response template, prefix-preserving
    model = AutoModelForCausalLM.from_pretrained(CALCULATOR_POLICY_DIR)
    schemas = Toolbox(environment_factory=C.CalculatorEnv).schemas[None]
    problem = C.problems(1, split="test")[0]
    ids = tok.apply_chat_template(C.prompt_of(problem), tools=schemas, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert len(ids) < 40  # the tool list is one token: the prompt the policy was trained on
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=40,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    message = parse_response(tok, out, ids, schemas)
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "calculate"
    C.parse_expression(call["arguments"]["expression"])  # int op int


# ---- training --------------------------------------------------------------------------------------------------------
SMALL = dict(max_steps=2, num_generations=4, per_device_train_batch_size=8, logging_steps=1, eval_strategy="no",
             eval_on_start=False, save_strategy="no")


@pytest.mark.slow
def test_two_training_steps_with_the_environment(tmp_path):
    """The demo's trainer (shipped policy, CalculatorEnv): the policy's generations are parsed into calls that run."""
    from groupwise.demo import calculator_trainer

    trainer = calculator_trainer({**SMALL, "output_dir": str(tmp_path / "out")})
    trainer.train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "out" / "metrics.jsonl")]
    train = [x for x in lines if "tools/call_frequency" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["tools/call_frequency"] > 0.5 and x["tools/failure_frequency"] < 0.5 for x in train)
    assert all("rewards/CalculatorEnv/mean" in x for x in train)


@pytest.mark.slow
def test_cli_runs_the_builtin_demo(tmp_path, capsys):
    from groupwise.cli import main

    out = tmp_path / "demo"
    assert main(["train", "builtin:calculator", "--max_steps", "1", "--num_generations", "4",
                 "--per_device_train_batch_size", "8", "--output_dir", str(out)]) == 0
    lines = [json.loads(x) for x in training_lines(out / "metrics.jsonl")]
    assert [x["step"] for x in lines if "eval_rewards/CalculatorEnv/mean" in x] == [0, 1]
    assert "builtin:calculator" in capsys.readouterr().out
    assert main(["train", "builtin:nope"]) == 2
    assert main(["train", "builtin:calculator", "--model_name_or_path", "x"]) == 2
    assert main(["train", "builtin:calculator", "--load_in_4bit"]) == 2  # a script field, not the demo's to take
    assert "load_in_4bit cannot be set for 'builtin:calculator'" in capsys.readouterr().err


@pytest.mark.slow
def test_per_turn_process_supervision(tmp_path):
    """supervision process over turns: the environment's get_step_rewards, one reward per assistant turn (the calls
    and the closing turn), matched to the turns without errors."""
    from groupwise.demo import calculator_trainer

    # outcome supervision reads the environment's get_reward only, not its step rewards
    outcome = calculator_trainer({**SMALL, "supervision": "outcome", "output_dir": str(tmp_path / "outcome")})
    assert outcome.process_sources == [] and [s.name for s in outcome.reward_sources] == ["CalculatorEnv"]
    trainer = calculator_trainer({**SMALL, "max_steps": 1, "supervision": "process", "output_dir": str(tmp_path)})
    assert trainer.args.step_split == "turn"
    assert [s.name for s in trainer.process_sources] == ["CalculatorEnv.get_step_rewards"]
    trainer.train()
    line = [json.loads(x) for x in training_lines(tmp_path / "metrics.jsonl")][-1]
    assert line["process/steps_per_completion"] > 2 and line["process/CalculatorEnv.get_step_rewards/errors"] == 0


def test_evaluate_policy_reproduces_the_shipped_policys_recorded_accuracy():
    """calculator.evaluate_policy (what scripts/make_calculator_policy.py stops training on) crashed at every
    rollout's second turn: the tool loop asks its sampler for what the budget leaves (max_new_tokens), which its
    sampler did not take. Greedy over the 200 held-out problems it now gives the numbers provenance.json recorded
    when the shipped policy was made (accuracy 0.42, 3.4 calls per rollout, …)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(C.__file__).parent / "data" / "calculator_policy"
    recorded = json.loads((folder / "provenance.json").read_text())["held_out_greedy"]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    got = C.evaluate_policy(model, tokenizer, C.problems(200, split="test"))
    assert {k: round(v, 4) for k, v in got.items()} == recorded

"""Tool execution and parsing edge cases of the tool loop (groupwise.agents.execution / parsing / tools): where tools
run (one thread per environment instance with a timeout, the caller's thread without), what a result becomes, what
a broken result or call becomes, and model output that cannot be parsed."""

from __future__ import annotations

import dataclasses
import pickle
import signal
import sqlite3
import threading
import time

import pytest

from groupwise import GRPOConfig
from groupwise import rollout as R
from groupwise.agents import Toolbox, default_train_dataset
from groupwise.agents.execution import run_tool_calls
from groupwise.agents.parsing import parse_response
from groupwise.config_base import ConfigError
from groupwise.data import PromptData, StreamData, is_stream
from groupwise.tasks import toy
from tests.agents_support import TOKENIZER, Scripted, call, context, multiply, user

TOOL = "<|im_start|>tool"


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def one_call(name: str, **arguments):
    """The model's turns: one call of `name`, then "done"."""
    return lambda p: "done<|im_end|>" if TOOL in p else call(name, **arguments) + "<|im_end|>"


def tool(result):
    """A documented tool `t(x)` that returns `result`, or raises it when it is an exception."""
    def t(x: int) -> str:
        """
        A tool.

        Args:
            x: A number.
        """
        if isinstance(result, BaseException):
            raise result
        return result
    return t


def run_one(fn, arguments=None, timeout=30.0):
    return run_tool_calls([{"type": "function", "function": {"name": fn.__name__, "arguments": arguments or {"x": 1}}}],
                          {fn.__name__: fn}, timeout)


# ---- parsing ---------------------------------------------------------------------------------------------------------
PROMPT = ids("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_tool_call_nested_too_deep_is_text():
    deep = "<tool_call>" + '{"a":' * 3000 + "</tool_call><|im_end|>"  # RecursionError in the JSON decoder
    message = parse_response(TOKENIZER, ids(deep), PROMPT)
    assert "tool_calls" not in message and message["content"].startswith('<tool_call>{"a":{"a":')
    ctx, _ = context(lambda p: "<tool_call>" + "[" * 1200 + "</tool_call><|im_end|>", max_completion_length=2000)
    comp = R.generate(ctx, None, [{"prompt": user("hi")}])  # the run goes on
    assert comp.tool_calls.tolist() == [0] and comp.completions[0][0]["content"].startswith("<tool_call>[[")


def test_an_empty_turn_is_an_empty_message():
    assert parse_response(TOKENIZER, [], PROMPT) == {"role": "assistant", "content": ""}
    ctx, _ = context(lambda p: "", max_completion_length=50)  # the model's first turn has no tokens at all
    comp = R.generate(ctx, None, [{"prompt": user("hi")}])
    assert comp.completions == [[{"role": "assistant", "content": ""}]] and comp.turn_ends == [[]]


# ---- where tools run -------------------------------------------------------------------------------------------------
class SqlEnv:
    """Thread-bound state made in reset(): a sqlite3 connection may only be used on the thread that made it."""

    def reset(self, **row) -> None:
        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table t(x int)")
        self.db.execute("insert into t values (42)")
        self.turns = 0

    def query(self, sql: str) -> str:
        """
        Runs a SQL query.

        Args:
            sql: The query.
        """
        return str(self.db.execute(sql).fetchall())

    def nap(self, seconds: float) -> str:
        """
        Sleeps.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "awake"

    def start_turn(self) -> None:
        self.db.execute("select 1")
        self.turns += 1

    def get_reward(self) -> float:
        return float(self.db.execute("select x from t").fetchone()[0])


def test_with_a_timeout_reset_tools_and_rewards_of_an_instance_share_one_thread():
    ctx, _ = context(one_call("query", sql="select x from t"), tools=(), environment_factory=SqlEnv)
    assert ctx.args.tool_timeout == 30.0  # the default: tools run on a worker thread
    comp = R.generate(ctx, None, [{"prompt": user("q")}, {"prompt": user("q")}])
    assert [c[1]["content"] for c in comp.completions] == ["[(42,)]"] * 2
    assert comp.tool_failures.tolist() == [0, 0]
    envs = comp.columns["environments"]
    assert [e.turns for e in envs] == [2, 2]  # start_turn used the connection too
    assert ctx.agent.toolbox.reward_sources[0].fn(environments=envs) == [42.0, 42.0]


class NappingSqlEnv(SqlEnv):
    def start_turn(self) -> None:
        self.turns += 1


def test_a_timed_out_tool_leaves_its_thread_and_the_next_rollout_gets_a_new_instance():
    ctx, _ = context(one_call("nap", seconds=3), tools=(), environment_factory=NappingSqlEnv, tool_timeout=0.3)
    comp = R.generate(ctx, None, [{"prompt": user("q")}])
    assert comp.tool_timeouts.tolist() == [1]
    napping = comp.columns["environments"][0]
    # its rollout is unscored: get_reward is not called (on a new thread it raised sqlite3's ProgrammingError)
    with pytest.warns(RuntimeWarning, match="a rollout whose tool call timed out is left unscored"):
        assert ctx.agent.toolbox.reward_sources[0].fn(environments=comp.columns["environments"]) == [None]
    ctx = dataclasses.replace(ctx, generator=Scripted(one_call("query", sql="select x from t")))
    start = time.perf_counter()
    comp = R.generate(ctx, None, [{"prompt": user("q")}])  # while the nap still runs on the old instance
    assert time.perf_counter() - start < 2.0
    assert comp.completions[0][1]["content"] == "[(42,)]" and comp.tool_failures.tolist() == [0]
    assert comp.columns["environments"][0] is not napping and ctx.agent.toolbox.replaced == 1


class LateScore:
    """A tool that overruns the timeout and changes the instance after its caller gave up."""

    def reset(self, **row) -> None:
        self.score = 0

    def slow_step(self, n: int) -> str:
        """
        A step that is sometimes slow.

        Args:
            n: A number.
        """
        time.sleep(0.6)
        self.score += 100  # lands after the caller gave up
        return "ok"

    def get_reward(self) -> float:
        return float(self.score)


def test_a_call_given_up_on_does_not_change_the_next_rollout():
    """A timed-out tool runs on in its abandoned thread. Its instance was reset and reused by the next batch, so the
    late `score += 100` landed in a rollout that never called the tool: reward 100 instead of 0. The instance is now
    left to that call and a new one made in its place."""
    from groupwise.agents import Toolbox
    from groupwise.agents.execution import run_tool_calls

    box = Toolbox([], LateScore)
    (first,), _, _ = box.start([{"prompt": user("a")}], threaded=True)
    call = [{"type": "function", "function": {"name": "slow_step", "arguments": {"n": 1}}}]
    assert run_tool_calls(call, box.tools_of(first), 0.2, box.threads_of(first)).timeouts == 1
    (second,), _, _ = box.start([{"prompt": user("b")}], threaded=True)  # the next batch, while the call runs on
    assert second is not first and box.replaced == 1
    time.sleep(0.8)  # the late write lands (in the old instance)
    assert box.call_on(second, second.get_reward) == 0.0 and first.score == 100
    (third,), _, _ = box.start([{"prompt": user("c")}], threaded=True)  # nothing runs any more: pooled as usual
    assert third is second and box.replaced == 1


def checked_eval(expr: str) -> str:
    """
    Adds numbers under a one-second alarm (signal.alarm: the main thread only).

    Args:
        expr: Numbers joined by '+'.
    """
    signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(1)
    try:
        return f"{sum(int(x) for x in expr.split('+'))} on {threading.current_thread().name}"
    finally:
        signal.alarm(0)


def test_without_a_timeout_tools_run_on_the_main_thread_as_in_trl():
    ctx, _ = context(one_call("checked_eval", expr="1+2"), tools=(checked_eval,), tool_timeout=None)
    comp = R.generate(ctx, None, [{"prompt": user("q")}])
    assert comp.completions[0][1]["content"] == "3 on MainThread"
    ctx, _ = context(one_call("checked_eval", expr="1+2"), tools=(checked_eval,))  # with one: a worker thread
    comp = R.generate(ctx, None, [{"prompt": user("q")}])
    assert "main thread" in comp.completions[0][1]["content"] and comp.tool_failures.tolist() == [1]


# ---- what a result or a call becomes --------------------------------------------------------------------------------
def test_only_content_blocks_pass_as_a_list_other_lists_become_text():
    blocks = [{"type": "text", "text": "hi"}]
    assert run_one(tool(blocks)).messages[0]["content"] == blocks
    assert run_one(tool(["a", "b"])).messages[0]["content"] == "['a', 'b']"  # not dropped by the template
    assert run_one(tool([{"x": 1}])).messages[0]["content"] == "[{'x': 1}]"
    assert run_one(tool([])).messages[0]["content"] == "[]"
    ctx, _ = context(one_call("t", x=1), tools=(tool(["result one", "result two"]),))
    comp = R.generate(ctx, None, [{"prompt": user("q")}])
    assert "result one" in TOKENIZER.decode(comp.completion_ids[0].tolist())  # the model sees the result


def test_a_non_text_content_block_from_a_tool_or_reset_is_refused_naming_it():
    """A tool returning {"type": "image"} blocks, sync or async, or an environment's reset() observation with one,
    reached the chat template, which rendered the text alone: the image was dropped silently."""
    from groupwise.agents.tools import with_observation

    image = [{"type": "image", "image": None}, {"type": "text", "text": "a cat"}]
    with pytest.raises(ConfigError, match=r"^tool 't' returned a content block of type 'image': groupwise trains "
                                          r"text-only .*return text"):
        run_one(tool(image))

    async def a(x: int):
        """
        An async tool.

        Args:
            x: a number
        """
        return image

    with pytest.raises(ConfigError, match=r"^tool 'a' returned a content block of type 'image'"):
        run_one(a)
    with pytest.raises(ConfigError, match=r"^an environment's reset\(\) returned a content block of type 'image'"):
        with_observation([{"role": "user", "content": "look:"}], image)
    with pytest.raises(ConfigError, match=r"returned a content block of type '\(none\)'"):  # an untyped item first
        with_observation([{"role": "user", "content": "look:"}], [{"text": "caption"}, image[0]])
    assert with_observation([{"role": "user", "content": "look:"}], [{"type": "text", "text": " here"}]) == [
        {"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "text", "text": " here"}]}]


class Unprintable:
    def __str__(self):
        raise RuntimeError("no str")


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no str")


@pytest.mark.parametrize("timeout", [30.0, None])
def test_a_result_or_error_that_cannot_be_text_is_a_failure_naming_the_tool(timeout):
    out = run_one(tool(Unprintable()), timeout=timeout)
    assert out.messages[0]["content"] == str({"error": "tool 't' returned a Unprintable that cannot be turned into "
                                                      "text (its __str__ raised); return a string"})
    assert out.failures == 1
    out = run_one(tool(UnprintableError()), timeout=timeout)
    assert out.messages[0]["content"] == str({"error": "tool 't' raised UnprintableError, whose message cannot be "
                                                      "turned into text"})
    assert out.failures == 1
    ctx, _ = context(one_call("t", x=1), tools=(tool(Unprintable()),), tool_timeout=timeout)
    comp = R.generate(ctx, None, [{"prompt": user("q")}])  # the run goes on
    assert comp.completions[0][-1]["content"] == "done" and comp.tool_failures.tolist() == [1]


def test_arguments_that_are_not_a_mapping_are_trls_type_error():
    with pytest.raises(TypeError) as e:
        multiply(*(), **[1, 2])  # what TRL's sync_tool_dict[name](**arguments) raises, and catches
    for timeout in (30.0, None):
        out = run_tool_calls([{"type": "function", "function": {"name": "multiply", "arguments": [1, 2]}}],
                             {"multiply": multiply}, timeout)
        assert out.messages[0]["content"] == str({"error": str(e.value)}) and out.failures == 1
    assert "multiply() argument after ** must be a mapping, not list" in str(e.value)


# ---- environments: reward sources, rows without a prompt ------------------------------------------------------------
def test_two_environment_classes_with_one_name_keep_their_own_reward_sources():
    def make(value):
        class Env:
            def reset(self, **row):
                pass

            def get_reward(self):
                return value

            def get_step_rewards(self):
                return [value]
        return Env

    A, B = make(1.0), make(2.0)
    toolbox = Toolbox(environment_factory={"a": A, "b": B, "again": A})
    assert [s.name for s in toolbox.reward_sources] == ["Env", "Env_2"]
    assert [s.name for s in toolbox.process_sources] == ["Env.get_step_rewards", "Env_2.get_step_rewards"]
    envs = [A(), B()]
    assert [s.fn(environments=envs) for s in toolbox.reward_sources] == [[1.0, None], [None, 2.0]]
    assert all(s.takes_dropped_last for s in toolbox.process_sources)
    assert [s.fn(environments=envs, steps=[["t"], ["t"]], dropped_last=[False, False])
            for s in toolbox.process_sources] == [[[1.0], [None]], [[None], [2.0]]]


class Problems:
    """An environment that owns the prompt: reset() returns it."""

    def reset(self, **row) -> str:
        self.row = row
        return f"What is {row['problem']}?"

    def answer(self, value: int) -> str:
        """
        Gives the answer.

        Args:
            value: The answer.
        """
        return "ok"


def test_with_an_environment_rows_may_lack_a_prompt_as_in_trl():
    from datasets import Dataset

    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=100)
    toolbox = Toolbox(environment_factory=Problems)
    rows = [{"problem": "1 + 2"}, {"problem": "3 + 4"}]
    data = PromptData(default_train_dataset(rows, toolbox, args, 1), "train_dataset")
    row = data[0]
    assert row["prompt"] == [{"role": "user", "content": ""}] and row["problem"] == "1 + 2"
    ds = PromptData(default_train_dataset(Dataset.from_list(rows), toolbox, args, 1), "train_dataset")
    assert ds[1]["prompt"] == [{"role": "user", "content": ""}] and list(ds._prompts())[1] == row["prompt"]

    class Stream:
        def __iter__(self):
            return iter(rows)

    marked = default_train_dataset(Stream(), toolbox, args, 1)
    assert is_stream(marked) and StreamData(marked, "train_dataset")[1]["prompt"] == row["prompt"]
    assert pickle.loads(pickle.dumps(row))["prompt"] == row["prompt"]  # gathered across processes
    ctx, gen = context(lambda p: "3<|im_end|>", tools=(), environment_factory=Problems)
    comp = R.generate(ctx, None, [data[0], data[1]])
    assert comp.columns["environments"][0].row == {"problem": "1 + 2"}  # TRL: the default prompt is not passed
    assert comp.prompts[0] == user("What is 1 + 2?")
    assert gen.prompts[0][0].endswith("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="row 0 has no 'prompt' column"):  # without an environment: refused
        PromptData(default_train_dataset(rows, Toolbox([multiply]), args, 1), "train_dataset")


def test_the_trainer_takes_rows_without_a_prompt_with_an_environment(tmp_path):
    from groupwise import GRPOTrainer

    class Scored(Problems):
        def get_reward(self) -> float:
            return 1.0

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2)
    with pytest.raises(Exception) as e:  # the dataset passes; the model path that does not exist stops it
        GRPOTrainer("no/such/model", args=args, train_dataset=[{"problem": "1 + 2"}], environment_factory=Scored)
    assert "no/such/model" in str(e.value) and "prompt" not in str(e.value)


def test_parse_response_passes_tools_only_where_transformers_takes_it(monkeypatch):
    """transformers 5.13 / 5.14's parse_response has no `tools` keyword (TRL passes it from 5.15 on): the call must
    still be parsed, not fall back to plain text; before 5.13 (no `prefix`) tools are refused at build time."""
    real = type(TOKENIZER).parse_response
    seen = []

    def without_tools(self, ids, prefix=None):
        seen.append(prefix)
        return real(self, ids, prefix=prefix)

    monkeypatch.setattr(type(TOKENIZER), "parse_response", without_tools)
    text = call("multiply", a=3, b=4) + "<|im_end|>"
    message = parse_response(TOKENIZER, ids(text), PROMPT, tools=[multiply])
    assert message["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    assert seen == [PROMPT]

    from groupwise.agents.parsing import prepare_tokenizer

    monkeypatch.setattr(type(TOKENIZER), "parse_response", lambda self, ids: {"role": "assistant", "content": ""})
    with pytest.raises(ConfigError, match=r"needs transformers ≥ 5.13 \(tokenizer.parse_response with prefix=\)"):
        prepare_tokenizer(TOKENIZER)


def test_chat_completions_without_tools_are_parsed_as_trl_parses_them():
    """TRL's _generate parses every chat completion with parse_response when the tokenizer has a response_template,
    tools or not: a plain rollout's reward functions see the parsed message (here a tool call the model wrote
    although no tools were given), and a tokenizer without one gives the text."""
    ctx, _ = context(lambda p: call("multiply", a=3, b=4) + "<|im_end|>", tools=())
    ctx = dataclasses.replace(ctx, agent=None)  # the single-turn path
    comp = R.generate(ctx, None, [{"prompt": user("hi")}] * 2)
    message = comp.completions[0][0]
    assert message["role"] == "assistant" and message["tool_calls"][0]["function"]["name"] == "multiply"
    from groupwise.agents.parsing import as_completions

    plain = toy.build_chat_tokenizer()  # no response_template: the text, as TRL's batch_decode
    ids = plain("ab", add_special_tokens=False)["input_ids"]
    assert as_completions(plain, [ids], [[1]], True) == [[{"role": "assistant", "content": "ab"}]]
    assert as_completions(plain, [ids], [[1]], False) == ["ab"]


class _Counter:
    """An environment whose slow tool times out: it runs on after the model is told it failed."""

    def reset(self, **row):
        self.counter = 0

    def get_reward(self) -> float:
        return float(self.counter)

    def slow_inc(self, n: int) -> str:
        """
        Adds n, slowly.

        Args:
            n: how much.
        """
        time.sleep(1.2)
        self.counter += n
        return str(self.counter)

    def inc(self, n: int) -> str:
        """
        Adds n.

        Args:
            n: how much.
        """
        self.counter += n
        return str(self.counter)


def test_a_rollout_whose_tool_call_timed_out_is_left_unscored_by_its_environment():
    """The model was told "tool 'slow_inc' timed out", yet the abandoned call ran on and get_reward counted it
    (reward 1 for a call that failed). Now such a rollout's environment rewards are None (unscored), with a
    warning; the other rollout of the batch is scored as usual (its inc(2): reward 2)."""
    def reply(prompt):
        if "<|im_start|>tool" in prompt:
            return "done<|im_end|>"
        return (call("slow_inc", n=1) if "first row" in prompt else call("inc", n=2)) + "<|im_end|>"

    ctx, _ = context(reply, tools=(), environment_factory=_Counter, tool_timeout=0.3)
    comp = R.generate(ctx, None, [{"prompt": user("first row")}, {"prompt": user("second row")}])
    assert comp.tool_timeouts.tolist() == [1, 0]
    [source] = ctx.agent.toolbox.reward_sources
    time.sleep(1.2)  # the abandoned call has now changed the first instance
    with pytest.warns(RuntimeWarning, match=r"_Counter: a rollout whose tool call timed out is left unscored"):
        assert source.fn(environments=comp.columns["environments"]) == [None, 2.0]
    ctx.agent.toolbox.start([{"prompt": user("again")}])  # a new rollout: nothing timed out in it yet
    assert not ctx.agent.toolbox.timed_out


def test_a_standalone_tools_timeout_leaves_the_environments_reward_scored():
    """Only a timed-out call of the environment's own methods leaves its rollout unscored: a standalone tool (a web
    search) that times out cannot touch the environment's state, and the rollout's inc(2) is rewarded 2."""
    def web_search(query: str) -> str:
        """
        Searches, slowly.

        Args:
            query: What.
        """
        time.sleep(1.0)
        return "nothing"

    def reply(prompt):
        if prompt.count("<|im_start|>tool") >= 2:
            return "done<|im_end|>"
        if "<|im_start|>tool" in prompt:
            return call("inc", n=2) + "<|im_end|>"
        return call("web_search", query="x") + "<|im_end|>"

    ctx, _ = context(reply, tools=(web_search,), environment_factory=_Counter, tool_timeout=0.3)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert comp.tool_timeouts.tolist() == [1] and comp.tool_calls.tolist() == [2]
    [source] = ctx.agent.toolbox.reward_sources
    assert source.fn(environments=comp.columns["environments"]) == [2.0]

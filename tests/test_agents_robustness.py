"""Model output and environment values that used to stop the run or reorder TRL's tool messages (groupwise.agents):
JSON escapes that decode to unencodable strings, async calls whose arguments do not bind, reset() values that are
not text, and eval rows without a prompt."""

from __future__ import annotations

import pytest

from groupwise import rollout as R
from groupwise.agents import Toolbox, environment_prompts
from groupwise.agents.execution import run_tool_calls
from groupwise.agents.parsing import parse_response
from groupwise.config_base import ConfigError
from groupwise.data import PromptData
from tests.agents_support import TOKENIZER, add, context, multiply, user

TOOL = "<|im_start|>tool"
PROMPT = TOKENIZER("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def echo(text: str) -> str:
    """
    Repeats its text.

    Args:
        text: The text.
    """
    return text


def raw(name_json: str, arguments_json: str) -> str:
    """A tool call written with JSON escapes as they are (json.dumps would escape the backslash)."""
    return f'<tool_call>{{"name": {name_json}, "arguments": {arguments_json}}}</tool_call><|im_end|>'


@pytest.mark.parametrize("turn, tool_message", [
    (raw('"echo"', '{"text": "a\\ud800b"}'), "a\\ud800b"),  # a tool that repeats its argument
    (raw('"multiply"', '{"\\udfff": 1}'), "unexpected keyword argument"),  # a TypeError naming the argument
    (raw('"\\ud800"', "{}"), "Tool \\\\ud800 not found."),  # an unknown tool whose name is a lone surrogate
])
def test_a_lone_surrogate_in_a_tool_call_does_not_stop_the_run(turn, tool_message):
    # json.loads("\"\\ud800\"") is a str the tokenizer cannot encode; rendering a tool message (or the dummy call's
    # name) that carries it raised TypeError in apply_chat_template and stopped the run (as it stops TRL's)
    ctx, _ = context(lambda p: "done<|im_end|>" if TOOL in p else turn, tools=(echo, multiply))
    comp = R.generate(ctx, None, [{"prompt": user("hi")}] * 2)
    messages = comp.completions[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"] and messages[-1]["content"] == "done"
    assert tool_message in messages[1]["content"]
    for m in messages:  # every string of the conversation can be encoded (logged, rendered, tokenized)
        str(m).encode("utf-8")
        m.get("tool_calls") and str(m["tool_calls"]).encode("utf-8")


def test_a_lone_surrogate_is_kept_as_its_escape_in_the_parsed_call():
    ids = TOKENIZER(raw('"echo"', '{"text": "\\ud83d"}'), add_special_tokens=False)["input_ids"]
    message = parse_response(TOKENIZER, ids, PROMPT)
    assert message["tool_calls"][0]["function"] == {"name": "echo", "arguments": {"text": "\\ud83d"}}
    ok = TOKENIZER(raw('"echo"', '{"text": "\\ud83d\\ude00"}'), add_special_tokens=False)["input_ids"]  # a valid pair
    assert parse_response(TOKENIZER, ok, PROMPT)["tool_calls"][0]["function"]["arguments"] == {"text": "\U0001F600"}


def test_a_tool_that_returns_a_lone_surrogate_is_text_the_tokenizer_can_encode():
    out = run_tool_calls([{"type": "function", "function": {"name": "echo", "arguments": {"text": "x\udc80"}}}],
                         {"echo": echo}, 30.0)
    assert out.messages[0]["content"] == "x\\udc80" and out.failures == 0


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@pytest.mark.parametrize("timeout", [30.0, None])
def test_an_async_call_whose_arguments_do_not_bind_is_an_error_in_call_order_as_in_trl(timeout):
    # TRL calls async_tool_dict[name](**arguments) in the call loop: a TypeError there is appended in call order,
    # before the sync results that follow it; only the coroutines' own results come after the sync ones
    calls = [{"type": "function", "function": {"name": "async_add", "arguments": {"a": 1}}},
             {"type": "function", "function": {"name": "async_add", "arguments": {"a": 1, "b": 2}}},
             {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}},
             {"type": "function", "function": {"name": "async_add", "arguments": [1]}}]
    out = run_tool_calls(calls, {"async_add": async_add, "multiply": multiply}, timeout)
    contents = [m["content"] for m in out.messages]
    assert contents[0] == str({"error": "async_add() missing 1 required positional argument: 'b'"})
    assert contents[1] == "12"
    assert contents[2].startswith("{'error': ") and "argument after ** must be a mapping, not list" in contents[2]
    assert contents[3] == "3"
    assert (out.calls, out.failures) == (4, 2)


class Numbered:
    def reset(self, **row):
        return 7  # not text

    def noop(self) -> str:
        """
        Does nothing.
        """
        return ""


def test_reset_returning_something_else_than_text_is_an_error_naming_the_class():
    toolbox = Toolbox(environment_factory=Numbered)
    with pytest.raises(TypeError, match=r"Numbered.reset\(\) returned a int: return None, or a string"):
        toolbox.start([{"prompt": user("hi")}])


def test_eval_rows_may_lack_a_prompt_with_an_environment():
    toolbox = Toolbox(environment_factory=Numbered)
    data = PromptData(environment_prompts([{"problem": "1 + 2"}], toolbox), "eval_dataset")
    assert data[0]["prompt"] == [{"role": "user", "content": ""}]


async def cancelled_fetch(url: str) -> str:
    """
    Awaits a task that gets cancelled: asyncio's CancelledError, a BaseException, leaves the tool.

    Args:
        url: Where.
    """
    import asyncio

    task = asyncio.ensure_future(asyncio.sleep(10))
    task.cancel()
    await task
    return url


def cancelling_sync(n: int) -> str:
    """
    Raises CancelledError from a sync tool.

    Args:
        n: A number.
    """
    import asyncio

    raise asyncio.CancelledError("gave up")


@pytest.mark.parametrize("timeout", [30.0, None])
def test_a_tool_raising_cancelled_error_is_its_error_message_not_the_run_s_end(timeout):
    """CancelledError is a BaseException: it left run_tool_calls and stopped training, where TRL's
    gather(return_exceptions=True) keeps it as the call's result (message str(e): '' or its text)."""
    calls = [{"type": "function", "function": {"name": "cancelled_fetch", "arguments": {"url": "u"}}},
             {"type": "function", "function": {"name": "cancelling_sync", "arguments": {"n": 1}}}]
    out = run_tool_calls(calls, {"cancelled_fetch": cancelled_fetch, "cancelling_sync": cancelling_sync}, timeout)
    assert [m["content"] for m in out.messages] == [str({"error": "gave up"}), str({"error": ""})]
    assert (out.calls, out.failures, out.timeouts) == (2, 2, 0)


def test_a_prompt_cut_by_max_prompt_length_with_tools_is_refused_or_warned():
    """The dataset's length check measures prompts without the tools' schemas, which the chat template writes
    first; the tool loop then kept the last max_prompt_length tokens, cutting the tool descriptions away even under
    truncate_prompt='error'. Now: a max_prompt_length the schemas alone fill is refused when the agent is built;
    a prompt over it is an error under 'error', and cut with one warning under 'left'."""
    import warnings

    from groupwise.agents import Agent

    schemas = Toolbox([multiply, add]).schemas[None]
    alone = len(TOKENIZER.apply_chat_template([{"role": "user", "content": ""}], tools=schemas,
                                              add_generation_prompt=True, tokenize=True, return_dict=False))
    with pytest.raises(ConfigError, match=rf"^max_prompt_length={alone} leaves no room for a prompt: the chat template "
                                          rf"writes the tools' schemas in {alone} tokens before it.*above {alone}"):
        context(lambda p: "", max_prompt_length=alone)
    long_prompt = user("word " * 40)
    full = TOKENIZER.apply_chat_template(long_prompt, tools=schemas, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    limit = alone + 10  # room for the schemas, not for this prompt
    assert len(full) > limit
    ctx, _ = context(lambda p: "", max_prompt_length=limit, truncate_prompt="error")
    with pytest.raises(ConfigError, match=rf"a prompt rendered with its tools' schemas is {len(full)} tokens, over "
                                          rf"max_prompt_length={limit} .*truncate_prompt='error'"):
        ctx.agent.render_prompt(long_prompt, schemas)
    ctx, _ = context(lambda p: "", max_prompt_length=limit)  # truncate_prompt='left', the default
    with pytest.warns(UserWarning, match=rf"its first {len(full) - limit} tokens are cut, where the chat template "
                                         r"writes the tools' descriptions"):
        assert ctx.agent.render_prompt(long_prompt, schemas) == full[-limit:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run
        ctx.agent.render_prompt(long_prompt, schemas)
    assert isinstance(ctx.agent, Agent)


def test_a_tool_result_too_long_for_the_budget_is_dropped_without_rendering_it():
    """A 5 MB result against a 400-token budget was rendered through the chat template and tokenized in full (10 MB:
    12 s and 2 GB) before the overlong check dropped it. Now its characters alone show it cannot fit (more than the
    budget × the longest token's text): the row leaves the loop at once, as an overlong one (its call counted, its
    tool message dropped, TRL's rollback), without tool_suffix_ids ever seeing it."""
    import time

    from tests.agents_support import call

    def huge(n: int) -> str:
        """
        Returns n characters.

        Args:
            n: How many.
        """
        return "x" * n

    replies = [call("huge", n=5_000_000) + "<|im_end|>", "done<|im_end|>"]
    ctx, _ = context(lambda p: replies[min(p.count("<|im_start|>tool"), 1)], tools=(huge,), max_completion_length=400)
    rendered = []
    original = ctx.agent.tool_suffix_ids
    ctx.agent.tool_suffix_ids = lambda messages: rendered.append(len(str(messages))) or original(messages)
    start = time.perf_counter()
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert time.perf_counter() - start < 2.0 and rendered == []
    assert comp.tool_calls.tolist() == [1] and [m["role"] for m in comp.completions[0]] == ["assistant"]
    longest = ctx.agent._longest_token  # room × the longest token's text: could still fit; one character more cannot
    assert not ctx.agent._cannot_fit([{"content": "x" * 400 * longest}], 400)
    assert ctx.agent._cannot_fit([{"content": "x" * (400 * longest + 1)}], 400)
    assert ctx.agent._cannot_fit([{"content": [{"type": "text", "text": "x" * 3}, {"type": "text", "text": "y"}]}], 0)

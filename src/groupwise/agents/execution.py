"""Running the tool calls of one assistant turn, as TRL 1.16's `_tool_call_loop` does, with a per-call timeout.

Each call runs through `call_with_timeout` (below): in this process, in a worker thread, waiting at
most `timeout` seconds (GRPOConfig.tool_timeout; None: no limit). Tools are trusted user code; model-generated code
is never executed here (a tool that runs code must hand it to `sandbox.run_python`).

As in TRL: the sync calls run in call order, then the `async def` ones of the turn run concurrently and their results
follow the sync ones; a result becomes the message `{"role": "tool", "name": name, "content": str(result)}` (a list is
passed through as is: content blocks); an unknown tool, an unsupported call type or an exception becomes
`str({"error": message})` (for an exception `str(e)`) and counts as a failure. groupwise's addition: a call that
overruns the timeout becomes `str({"error": "tool 'name' timed out after T s"})`, counts as a failure and as a timeout,
and is abandoned (a Python thread cannot be stopped: it runs on, as a daemon thread, with whatever it does).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from groupwise.rewards.sources import RewardTimeout, is_async
from groupwise.rewards.sources import call_with_timeout as timed_call


@dataclass(frozen=True)
class ToolResults:
    """The tool messages of one turn (in TRL's order) and how many calls failed / timed out."""

    messages: list[dict[str, Any]]
    calls: int
    failures: int
    timeouts: int


def call_tool(fn: Callable, name: str, arguments: Any, timeout: float | None) -> tuple[Any, str | None]:
    """fn(**arguments) within `timeout` seconds: (what it returned, None), or ({"error": message}, "exception" |
    "timeout"). Never raises."""
    box: dict[str, Any] = {}

    def run(**kwargs):  # keeps the raw value (TRL formats it with str()) and the exception itself (str(e))
        try:
            value = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 — reported as the tool's error
            box["error"] = e
            raise
        if not inspect.isawaitable(value):
            box["value"] = value
            return value

        async def finish():
            try:
                box["value"] = await value
            except BaseException as e:  # noqa: BLE001
                box["error"] = e
                raise
            return box["value"]
        return finish()

    run.__name__ = name  # named in the worker thread and in the timeout message
    if not isinstance(arguments, Mapping):
        error = f"{name}() arguments must be a mapping of names to values, got {arguments!r:.100}"
        return {"error": error}, "exception"
    outcome = call_with_timeout(run, arguments, timeout)
    if outcome.ok:
        return box["value"], None
    if outcome.error == "timeout":
        return {"error": outcome.content}, "timeout"
    error = box.get("error")
    return {"error": str(error) if error is not None else outcome.content}, "exception"


def run_tool_calls(calls: list[dict[str, Any]], tools: dict[str, Callable], timeout: float | None) -> ToolResults:
    """Execute one assistant message's tool calls (see the module docstring)."""
    done: list[tuple[str, Any]] = []  # (name, result): sync calls and errors, in call order
    pending: list[tuple[str, Callable, Any]] = []  # async calls, run together afterwards
    failures = timeouts = 0
    for call in calls:
        if call.get("type", "function") != "function":  # a flat {"name", "arguments"} call has no type
            failures += 1
            done.append((call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}))
            continue
        function = call.get("function", call)
        name, arguments = function["name"], function.get("arguments", {})
        fn = tools.get(name)
        if fn is None:
            failures += 1
            done.append((name, {"error": f"Tool {name} not found."}))
        elif is_async(fn):
            pending.append((name, fn, arguments))
        else:
            result, error = call_tool(fn, name, arguments, timeout)
            failures += error is not None
            timeouts += error == "timeout"
            done.append((name, result))
    if pending:
        with ThreadPoolExecutor(max_workers=len(pending), thread_name_prefix="groupwise async tools") as pool:
            outcomes = list(pool.map(lambda job: call_tool(job[1], job[0], job[2], timeout), pending))
        for (name, _, _), (result, error) in zip(pending, outcomes):
            failures += error is not None
            timeouts += error == "timeout"
            done.append((name, result))
    messages = [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                for name, result in done]
    return ToolResults(messages, len(calls), failures, timeouts)


# ---- a trusted tool with a timeout ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolOutcome:
    """The result of a tool call. ok: it returned; content: what it returned, as text (str as is, None as "", other
    JSON-serialisable values as JSON, anything else by str()), or the error's description; error: None, "timeout"
    or "exception"."""

    ok: bool
    content: str
    error: str | None = None
    duration_s: float = 0.0


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def call_with_timeout(fn: Callable[..., Any], kwargs: Mapping[str, Any] | None = None,
                      timeout_s: float | None = 30.0) -> ToolOutcome:
    """Call a *trusted* tool `fn(**kwargs)` in this process, in a worker thread, waiting at most `timeout_s` seconds
    (None: no limit) — the thread-with-timeout of reward functions (groupwise.rewards.sources.call_with_timeout). An
    `async def` tool (or one returning an awaitable) is run to completion on its own event loop in that thread.

    Timeout: returns ToolOutcome(ok=False, error="timeout") after ~timeout_s. The call itself cannot be stopped: the
    thread is abandoned (a daemon thread, so it does not keep the process alive) and runs on in the background, with
    whatever side effects it has. This is for Python functions the user wrote; code written by a model must be run
    with `groupwise.agents.sandbox.run_python`, which can be stopped. Exception (SystemExit included): returns
    ok=False, error="exception", content "TypeName: message".
    """
    name = getattr(fn, "__name__", type(fn).__name__)

    def call() -> Any:
        value = fn(**(kwargs or {}))
        return asyncio.run(_await(value)) if inspect.isawaitable(value) else value

    t0 = time.monotonic()
    try:
        value = timed_call(call, timeout_s, f"tool {name!r}")
    except RewardTimeout:
        return ToolOutcome(False, f"tool {name!r} timed out after {timeout_s:g} s", "timeout", time.monotonic() - t0)
    except (Exception, SystemExit) as e:  # reported to the model as the tool's message, never raised
        return ToolOutcome(False, f"{type(e).__name__}: {e}", "exception", time.monotonic() - t0)
    return ToolOutcome(True, _as_text(value), None, time.monotonic() - t0)


async def _await(awaitable: Any) -> Any:
    return await awaitable

"""Running the tool calls of one assistant turn, as TRL 1.16's `_tool_call_loop` does, with a per-call timeout.

With a timeout (GRPOConfig.tool_timeout, 30 s by default) the sync calls run on a `ToolThread` (below): one persistent
worker thread per environment instance, on which that instance's reset() (and get_reward, get_step_rewards,
start_turn) run too, and one for the standalone tools; so what reset() makes for its thread (a sqlite3 connection,
…) works in the tools. The caller waits at most `timeout` seconds. With `tool_timeout=None` every sync call runs on
the caller's thread, the main thread (as in TRL). Tools are trusted user code; model-generated code is never executed
here (a tool that runs code must hand it to `sandbox.run_python`).

As in TRL: the sync calls run in call order, then the `async def` ones of the turn run concurrently (on the one
event loop of async user code, kept in a daemon thread, as TRL's async loop; each within the timeout, after which it
is cancelled) and their results follow the sync ones (an async call whose arguments do not
bind is an error in call order, as in TRL, which makes each coroutine there); a call is `fn(**arguments)` (arguments
that are not a mapping are Python's TypeError, as in TRL); a result becomes the message `{"role": "tool", "name":
name, "content": str(result)}`; an unknown tool, an unsupported call type or an exception becomes
`str({"error": message})` (for an exception `str(e)`) and counts as a failure. groupwise's differences: a list is
passed through as is (content blocks) only when every item is a dict with a "type" (TRL passes any list); a result or
an exception that cannot be made text is a failure naming the tool; a call that overruns the timeout becomes
`str({"error": "tool 'name' timed out after T s"})`, counts as a failure and as a timeout, and is abandoned with its
thread (a Python thread cannot be stopped: it runs on, as a daemon thread, with whatever it does; the next call
starts a fresh thread).
"""

from __future__ import annotations

import inspect
import json
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from groupwise.agents.parsing import encodable
from groupwise.config_base import ConfigError
from groupwise.data import NON_TEXT, non_text_block
from groupwise.rewards.calls import (MachineError, RewardTimeout, UserExit, is_async, on_event_loop, run_async,
                                     run_concurrently)
from groupwise.rewards.calls import call_with_timeout as timed_call


@dataclass(frozen=True)
class ToolResults:
    """The tool messages of one turn (in TRL's order) and how many calls failed / timed out."""

    messages: list[dict[str, Any]]
    calls: int
    failures: int
    timeouts: int
    timed_out: tuple[Callable, ...] = ()  # the tools whose calls timed out (an environment's methods among them)


class ToolThread:
    """One persistent daemon thread that runs calls one after another (started on the first call). A call that
    overruns its timeout keeps the thread: the thread is abandoned (it ends if the call ever returns) and the next
    call starts a fresh one."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue | None = None
        self._last: threading.Event | None = None  # set when the last call submitted has returned
        self._left: list[threading.Event] = []  # the last calls of abandoned threads, while they run

    @property
    def stale(self) -> bool:
        """Does a call still run that this thread's caller gave up on: on the thread (its caller's own timeout), or
        on a thread it abandoned (a timed-out tool)? What that call does to its instance lands later, in whatever
        rollout uses the instance next."""
        with self._lock:
            self._left = [e for e in self._left if not e.is_set()]
            return bool(self._left) or (self._last is not None and not self._last.is_set())

    def abandon(self, jobs: queue.SimpleQueue | None = None) -> None:
        """Leave the current thread to its call (when it is still the one serving `jobs`); the next call starts a
        fresh thread."""
        with self._lock:
            if self._jobs is not None and (jobs is None or jobs is self._jobs):
                self._jobs.put(None)
                if self._last is not None and not self._last.is_set():
                    self._left.append(self._last)
                self._jobs, self._last = None, None

    def call(self, fn: Callable[[], Any], timeout: float | None, what: str) -> Any:
        """fn() on this thread, waiting at most `timeout` seconds (None: as long as it takes). Its exception is
        raised here; an overrun raises RewardTimeout after abandoning the thread."""
        done, box = threading.Event(), {}

        def job():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 — re-raised in the caller's thread
                box["error"] = e
            finally:
                done.set()

        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self._jobs,), daemon=True, name=self.name).start()
                weakref.finalize(self, self._jobs.put, None)  # an idle thread ends with its ToolThread
            jobs, self._last = self._jobs, done
            jobs.put(job)
        if not done.wait(timeout):
            self.abandon(jobs)
            raise RewardTimeout(f"{what} did not return within {timeout} s")
        if "error" in box:
            raise box.pop("error")
        return box["value"]


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job()


def _text(value: Any) -> str | None:
    """str(value), or None when that raises."""
    try:
        return str(value)
    except Exception:  # noqa: BLE001 — a broken __str__ / __repr__ of the tool's value
        return None


def _error_text(name: str, error: BaseException) -> str:
    """str(error) (TRL), or a message naming the tool when that raises."""
    text = _text(error)
    if text is None:
        return f"tool {name!r} raised {type(error).__name__}, whose message cannot be turned into text"
    return text


def tool_content(name: str, value: Any) -> tuple[str | list, str | None]:
    """A tool's result as message content: a list of content blocks (each a dict with a "type") as is, anything
    else str(value), lone surrogates kept as their escapes (a tool that repeats a model-written "\\ud800"; the
    tokenizer could not encode it). (content, None), or (an error message naming the tool, "exception") when str()
    fails."""
    if isinstance(value, list) and value and all(isinstance(b, dict) and "type" in b for b in value):
        if (other := non_text_block(value)) is not None:  # refused, not dropped by the chat template
            raise ConfigError(f"tool {name!r} returned {NON_TEXT.format(other)}: return text (a string, or text "
                              "blocks)")
        return value, None
    text = _text(value)
    if text is None:
        return str({"error": f"tool {name!r} returned a {type(value).__name__} that cannot be turned into text "
                             "(its __str__ raised); return a string"}), "exception"
    return encodable(text), None


def call_tool(fn: Callable, name: str, arguments: Any, timeout: float | None,
              thread: ToolThread | None = None) -> tuple[str | list, str | None]:
    """fn(**arguments) within `timeout` seconds (on `thread` when given, else on a thread of its own; None: on this
    thread, no limit): (the message content, None), or (str({"error": message}), "exception" | "timeout"). Never
    raises but KeyboardInterrupt (asyncio's CancelledError, a BaseException, is the tool's error, as TRL's gather
    returns it)."""
    def run():
        value = fn(**arguments)  # a non-mapping is TRL's TypeError ("argument after ** must be a mapping")
        return run_async(value, timeout, f"tool {name!r}") if inspect.isawaitable(value) else value

    try:
        if timeout is None:
            value = run()
        elif thread is not None:
            value = thread.call(run, timeout, f"tool {name!r}")
        else:
            value = timed_call(run, timeout, f"tool {name!r}")
    except (KeyboardInterrupt, MachineError):  # the machine's problem, not the model's: the run stops
        raise
    except BaseException as e:  # noqa: BLE001 — TRL: str(e); reported to the model, never raised (SystemExit,
        return awaited_content(name, e, timeout)  # asyncio's CancelledError: TRL's gather keeps them)
    return tool_content(name, value)


def awaited_content(name: str, outcome: Any, timeout: float | None) -> tuple[str | list, str | None]:
    """A call's value or error (an async call's outcome from run_concurrently) as (content, None | "exception" |
    "timeout")."""
    if isinstance(outcome, MachineError):  # the machine's problem, not the model's: the run stops
        raise outcome
    if isinstance(outcome, RewardTimeout):
        return str({"error": f"tool {name!r} timed out after {timeout:g} s"}), "timeout"
    if isinstance(outcome, BaseException):
        return str({"error": _error_text(name, outcome.error if isinstance(outcome, UserExit) else outcome)}), \
            "exception"
    return tool_content(name, outcome)


def run_tool_calls(calls: list[dict[str, Any]], tools: dict[str, Callable], timeout: float | None,
                   threads: Mapping[str, ToolThread] | None = None) -> ToolResults:
    """Execute one assistant message's tool calls (see the module docstring); a sync tool runs on threads[name]
    when given (with a timeout), otherwise on a thread of its own."""
    done: list[tuple[str, Any]] = []  # (name, content): sync calls and errors, in call order
    pending: list[tuple[str, Any]] = []  # (name, coroutine): async calls, run together afterwards
    failures = timeouts = 0
    timed_out: list[Callable] = []
    for call in calls:
        if call.get("type", "function") != "function":  # a flat {"name", "arguments"} call has no type
            failures += 1
            done.append((call.get("name", "unknown"),
                         str({"error": f"Unsupported tool call type: {call.get('type')}"})))
            continue
        function = call.get("function", call)
        name, arguments = function["name"], function.get("arguments", {})
        fn = tools.get(name)
        if fn is None:
            failures += 1
            done.append((name, str({"error": f"Tool {name} not found."})))
        elif is_async(fn):
            try:  # TRL makes the coroutine here: bad arguments are an error in call order, before the async results
                coroutine = fn(**arguments)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 — reported to the model, as in TRL
                failures += 1
                done.append((name, str({"error": _error_text(name, e)})))
            else:
                pending.append((name, coroutine))
        else:
            content, error = call_tool(fn, name, arguments, timeout, (threads or {}).get(name))
            failures += error is not None
            timeouts += error == "timeout"
            timed_out += [fn] if error == "timeout" else []
            done.append((name, content))
    if pending:  # on the shared event loop, as TRL's gather on its async loop: clients bound to it live on
        outcomes = run_concurrently([lambda c=coroutine: c for _, coroutine in pending], timeout,
                                    [f"tool {name!r}" for name, _ in pending], "tool_timeout")
        for (name, _), outcome in zip(pending, outcomes):
            content, error = awaited_content(name, outcome, timeout)
            failures += error is not None
            timeouts += error == "timeout"
            timed_out += [tools[name]] if error == "timeout" else []
            done.append((name, content))
    messages = [{"role": "tool", "name": name, "content": content} for name, content in done]
    return ToolResults(messages, len(calls), failures, timeouts, tuple(timed_out))


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
    (None: no limit) — the thread-with-timeout of reward functions (groupwise.rewards.calls.call_with_timeout). An
    `async def` tool (or one returning an awaitable) is run to completion on the shared event loop of async user code
    (groupwise.rewards.calls.event_loop).

    Timeout: returns ToolOutcome(ok=False, error="timeout") after ~timeout_s. The call itself cannot be stopped: the
    thread is abandoned (a daemon thread, so it does not keep the process alive) and runs on in the background, with
    whatever side effects it has. This is for Python functions the user wrote; code written by a model must be run
    with `groupwise.agents.sandbox.run_python`, which can be stopped. Exception (SystemExit included): returns
    ok=False, error="exception", content "TypeName: message". A MachineError (the sandbox cannot be set up here:
    `SandboxUnavailable`) is raised, as the tool loop raises it: it is the machine's problem, not the model's.
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    if is_async(fn) and on_event_loop():  # its worker would wait on the loop this caller blocks
        return ToolOutcome(False, f"RuntimeError: tool {name!r}: called from async code on the shared event loop, "
                                  "where waiting for it would block the loop; await it instead", "exception")

    def call() -> Any:
        value = fn(**(kwargs or {}))
        return run_async(value, timeout_s, f"tool {name!r}") if inspect.isawaitable(value) else value

    t0 = time.monotonic()
    try:
        value = timed_call(call, timeout_s, f"tool {name!r}")
    except RewardTimeout:
        return ToolOutcome(False, f"tool {name!r} timed out after {timeout_s:g} s", "timeout", time.monotonic() - t0)
    except (KeyboardInterrupt, MachineError):
        raise
    except BaseException as e:  # noqa: BLE001 — reported to the model as the tool's message, never raised
        e = e.error if isinstance(e, UserExit) else e
        return ToolOutcome(False, f"{type(e).__name__}: {e}", "exception", time.monotonic() - t0)
    return ToolOutcome(True, _as_text(value), None, time.monotonic() - t0)


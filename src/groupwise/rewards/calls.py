"""User code called with limits: the one event loop of async reward functions, tools and environment methods (as
TRL's GRPOTrainer-AsyncLoop), and calls bounded by a timeout (reward_timeout, tool_timeout). A call that overruns
raises RewardTimeout; a sync one is left behind in a daemon thread (it cannot keep the process alive), an async one
is cancelled."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
import warnings
import weakref
from typing import Any, Callable


class RewardTimeout(TimeoutError):
    """A reward call overran reward_timeout; its rows are scored NaN and counted, the run goes on."""


class MachineError(RuntimeError):
    """Raised by user code when this machine cannot do what it asks (groupwise.agents.sandbox.SandboxUnavailable): not
    a failure of the rollout or the row, so it is never reported to the model or scored NaN: it stops the run."""


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_THREAD: threading.Thread | None = None
_LOOP_LOCK = threading.RLock()  # held while a call is submitted and while a loop is abandoned (see abandon_if_blocked)
_ABANDONED: weakref.WeakSet = weakref.WeakSet()  # the loops left to a blocking call


def is_async(fn: Any) -> bool:
    """TRL's is_async_callable: calling `fn` gives a coroutine — an `async def` function, an instance whose
    `__call__` is one, or a functools.partial (nested too) of either."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def event_loop() -> asyncio.AbstractEventLoop:
    """The one event loop of async user code (reward functions, tools, environment methods), as TRL's
    GRPOTrainer-AsyncLoop: started on first use in a daemon thread, so clients bound to it (HTTP sessions) live
    across steps and calls; a fresh one when the last one's thread has ended."""
    global _LOOP, _LOOP_THREAD
    with _LOOP_LOCK:
        if _LOOP_THREAD is None or not _LOOP_THREAD.is_alive():
            _LOOP = asyncio.new_event_loop()
            _LOOP_THREAD = threading.Thread(target=_serve_loop, args=(_LOOP,), daemon=True, name="groupwise async loop")
            _LOOP_THREAD.start()
        return _LOOP


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The shared loop's thread: runs it until it is stopped (an abandoned loop, once its blocking call returns:
    abandon_if_blocked), then closes it (its selector's file descriptors)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _wind_down() -> None:
    """Scheduled on an abandoned loop (after every call submitted to it: submissions and the abandonment hold
    _LOOP_LOCK, and the loop runs its callbacks in order): runs once the call blocking it returns, lets every other
    call on it finish (a caller still waits on each; none is cancelled), then stops the loop, whose thread closes
    it."""
    while len(asyncio.all_tasks()) > 1:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0)  # the done-callbacks of the last ones (their callers' futures)
    asyncio.get_running_loop().stop()


class UserExit(Exception):
    """SystemExit or KeyboardInterrupt raised by async user code, carried to the caller as an ordinary error:
    raised in a task, asyncio lets them out of the event loop itself, which would stop the shared loop and leave
    every later call waiting."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


async def guarded(awaitable) -> Any:
    """Await user code on the shared loop (see UserExit)."""
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as e:
        raise UserExit(e) from e


def on_event_loop() -> bool:
    """Is this code running on the shared event loop's thread (async user code calling back)?"""
    return threading.current_thread() is _LOOP_THREAD


def run_async(awaitable, timeout: float | None = None, what: str = "async reward functions") -> Any:
    """Run a coroutine on the shared event loop (event_loop()); wait at most `timeout` seconds."""
    if on_event_loop():  # waiting here would block the loop the coroutine needs
        if inspect.iscoroutine(awaitable):
            awaitable.close()
        raise RuntimeError(f"{what}: called from async code on the shared event loop, where waiting for it would "
                           "block the loop; await it instead")
    with _LOOP_LOCK:  # not onto a loop being abandoned after its wind-down was scheduled
        loop = event_loop()
        future = asyncio.run_coroutine_threadsafe(guarded(awaitable), loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        if future.done():  # the coroutine's own TimeoutError (an HTTP call of its own timed out): its error
            raise
        future.cancel()
        abandon_if_blocked(loop, what)
        raise RewardTimeout(f"{what} did not return within reward_timeout={timeout} s") from None


def abandon_if_blocked(loop: asyncio.AbstractEventLoop, what: str, wait: float = 1.0) -> bool:
    """After an overrun: when the shared loop does not run a trivial callback within `wait` seconds, a call blocked
    it (time.sleep or a busy loop inside async code), and every later async call would queue behind it for ever. The
    loop is then left to its thread and the next event_loop() starts a new one, with a warning naming `what`."""
    with _LOOP_LOCK:
        if loop in _ABANDONED:  # another overrun on it found it blocked first (it may be closed since)
            return True
    ran = threading.Event()
    loop.call_soon_threadsafe(ran.set)
    if ran.wait(wait):
        return False
    global _LOOP_THREAD
    with _LOOP_LOCK:
        if loop in _ABANDONED:
            return True
        _ABANDONED.add(loop)
        if _LOOP is loop:
            _LOOP_THREAD = None
        asyncio.run_coroutine_threadsafe(_wind_down(), loop)  # its thread ends once its calls have returned
    warnings.warn(f"{what}: a call blocked the shared event loop (a blocking call inside async code: time.sleep, "
                  "requests, a busy loop): it is left to finish in its thread, and async reward functions, tools and "
                  "environment methods go on on a new event loop (a client bound to the old one, such as an aiohttp "
                  "session, must be made again). Await non-blocking calls instead, or make the function sync (it "
                  "then runs in a thread within its timeout)", RuntimeWarning, stacklevel=3)
    return True


def run_concurrently(starts: list[Callable[[], Any]], timeout: float | None, what: list[str],
                     setting: str = "reward_timeout") -> list[Any]:
    """Await `start()` for each of `starts` concurrently on the shared loop, each within `timeout` seconds: the results
    in order, an exception in place of a failed one (a RewardTimeout, naming what[i] and `setting`, for an overrun;
    a TimeoutError the awaitable raises itself is its own error). `start` is called on the loop, so an error in
    making the awaitable (arguments that do not bind) is that one's error too. The outer limit only fires when one
    blocks the event loop itself (all of them then stall)."""
    async def limited(start, name):
        task = asyncio.ensure_future(guarded(start()))
        try:
            finished, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:  # the outer limit fired (the loop was blocked): stop this one too
            task.cancel()
            raise
        if not finished:
            task.cancel()
            raise RewardTimeout(f"{name} did not return within {setting}={timeout} s")
        return task.result()

    async def gather():
        return await asyncio.gather(*(limited(s, w) for s, w in zip(starts, what)), return_exceptions=True)

    try:
        return run_async(gather(), None if timeout is None else timeout + 5, " and ".join(what))
    except RewardTimeout:  # a call blocked the event loop itself: every call of the batch stalled with it
        return [RewardTimeout(f"{w} did not return within {setting}={timeout} s (the event loop was blocked)")
                for w in what]


def call_with_timeout(fn: Callable[[], Any], timeout: float | None, what: str) -> Any:
    """fn() in a daemon thread, waiting at most `timeout` seconds (None: call it here, no limit). An overrun raises
    RewardTimeout; the thread is abandoned (daemon threads never keep the process from exiting)."""
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 — re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name=f"groupwise {what}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RewardTimeout(f"{what} did not return within reward_timeout={timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]

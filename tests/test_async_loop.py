"""The one event loop of async user code (groupwise.rewards.calls.event_loop): async tools, environment methods
and reward functions all run on it, as on TRL's GRPOTrainer-AsyncLoop, so a client bound to the loop in one call
(an aiohttp session) works in the next. Each test here failed when every async call ran on an event loop of its own
(asyncio.run per call): the client's loop was closed by the second call."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from groupwise.agents import Toolbox
from groupwise.agents.execution import call_with_timeout, run_tool_calls
from groupwise.rewards.calls import event_loop, run_async
from groupwise.rewards.sources import RewardSource, compute_rewards


class LoopClient:
    """Stands in for an aiohttp.ClientSession: bound to the loop it was made on, unusable from another one (aiohttp
    raises 'Event loop is closed' / 'attached to a different loop' there)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.calls = 0

    async def get(self, value):
        if asyncio.get_running_loop() is not self.loop or self.loop.is_closed():
            raise RuntimeError("Event loop is closed")
        await asyncio.sleep(0)
        self.calls += 1
        return value


CLIENT: dict[str, LoopClient] = {}


async def fetch(value: str) -> str:
    """
    Fetches a value with a client kept across calls.

    Args:
        value: The value.
    """
    if "client" not in CLIENT:
        CLIENT["client"] = LoopClient()
    return await CLIENT["client"].get(value)


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("timeout", [30.0, None])
def test_an_async_tool_keeps_its_client_across_turns(timeout):
    CLIENT.clear()
    first = run_tool_calls([call("fetch", value="a"), call("fetch", value="b")], {"fetch": fetch}, timeout)
    second = run_tool_calls([call("fetch", value="c")], {"fetch": fetch}, timeout)
    assert [m["content"] for m in first.messages + second.messages] == ["a", "b", "c"]
    assert (first.failures, second.failures) == (0, 0) and CLIENT["client"].calls == 3
    assert call_with_timeout(fetch, {"value": "d"}, 5.0).content == "d"  # the public one-call helper too


class Shop:
    """An environment with async reset, an async tool method and async step rewards, all on one client made by
    reset (TRL calls a tool method of an environment made by environment_factory; reset may be async here)."""

    async def reset(self, **row) -> None:
        self.client = LoopClient()
        self.bought: list[str] = []

    async def buy(self, item: str) -> str:
        """
        Buys an item.

        Args:
            item: The item.
        """
        self.bought.append(await self.client.get(item))
        return f"bought {item}"

    async def get_step_rewards(self) -> list[float]:
        return [float(await self.client.get(len(self.bought)))]


@pytest.mark.parametrize("threaded", [False, True], ids=["here", "on-the-instance-thread"])
def test_an_async_environment_uses_the_client_its_reset_made(threaded):
    toolbox = Toolbox(environment_factory=Shop)
    envs, _, _ = toolbox.start([{"prompt": "hi"}], threaded=threaded)
    tools = toolbox.tools_of(envs[0])
    out = run_tool_calls([call("buy", item="milk"), call("buy", item="eggs")], tools, 30.0 if threaded else None,
                         toolbox.threads_of(envs[0]))
    assert [m["content"] for m in out.messages] == ["bought milk", "bought eggs"] and out.failures == 0
    assert toolbox.call_on(envs[0], envs[0].get_step_rewards) == [2.0]


def test_an_async_tool_over_the_timeout_is_cancelled_and_the_others_return():
    cancelled = []

    async def slow(x: int) -> str:
        """
        Sleeps.

        Args:
            x: A number.
        """
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(x)
            raise
        return "late"

    start = time.monotonic()
    out = run_tool_calls([call("slow", x=1), call("fetch", value="quick")], {"slow": slow, "fetch": fetch}, 0.5)
    assert [m["content"] for m in out.messages] == [str({"error": "tool 'slow' timed out after 0.5 s"}), "quick"]
    assert (out.failures, out.timeouts) == (1, 1) and time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while not cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cancelled == [1]  # stopped, not left running (a thread cannot be stopped: an event-loop task can)


def test_system_exit_in_async_user_code_is_its_error_and_the_loop_lives_on():
    """Raised in a task, SystemExit leaves asyncio's run_forever: the shared loop would stop and every later async
    call would wait forever. It comes back as the call's error instead."""
    async def quit_tool(code: int) -> str:
        """
        Exits.

        Args:
            code: The code.
        """
        raise SystemExit(code)

    loop = event_loop()
    out = run_tool_calls([call("quit_tool", code=3)], {"quit_tool": quit_tool}, 5.0)
    assert out.messages[0]["content"] == str({"error": "3"}) and out.failures == 1  # str(SystemExit(3)), as TRL
    assert call_with_timeout(quit_tool, {"code": 4}, 5.0).content == "SystemExit: 4"

    async def quitting_reward(completions, **_):
        raise SystemExit("bye")

    async def length(completions, **_):
        return [float(len(c)) for c in completions]

    sources = [RewardSource("quitting_reward", quitting_reward), RewardSource("length", length)]
    rewards, errors = compute_rewards(sources, ["p", "q"], ["ab", "c"], [[1], [2]], {}, on_error="nan", timeout=5.0)
    assert torch.isnan(rewards[:, 0]).all() and rewards[:, 1].tolist() == [2.0, 1.0]
    assert errors.tolist() == [2.0, 0.0]
    assert event_loop() is loop and loop.is_running()  # the same loop, still serving
    assert run_async(asyncio.sleep(0, result="alive"), 5.0) == "alive"


def test_a_loop_whose_thread_ended_is_replaced():
    from groupwise.rewards import calls

    loop = event_loop()
    loop.call_soon_threadsafe(loop.stop)
    calls._LOOP_THREAD.join(5)  # run_forever returned: the loop's thread has ended
    assert not calls._LOOP_THREAD.is_alive()
    assert run_async(asyncio.sleep(0, result="fresh"), 5.0) == "fresh"  # was: queued on the stopped loop forever
    assert event_loop() is not loop


def test_waiting_for_async_code_from_the_loop_s_own_thread_is_an_error_not_a_deadlock():
    """An async tool calling the blocking helper (call_with_timeout) on an async tool: the helper waited on the loop
    its caller was blocking (a timeout; with no limit, forever)."""
    async def inner(x: int) -> str:
        """
        Inner.

        Args:
            x: A number.
        """
        return str(x)

    async def outer(x: int) -> str:
        """
        Calls the blocking helper from async code.

        Args:
            x: A number.
        """
        return call_with_timeout(inner, {"x": x}, timeout).content

    for timeout in (None, 3.0):
        start = time.monotonic()
        out = run_tool_calls([call("outer", x=1)], {"outer": outer}, 5.0)
        assert "called from async code on the shared event loop" in out.messages[0]["content"], out.messages
        assert time.monotonic() - start < 2


def test_the_outer_limit_cancels_every_call_of_a_blocked_loop():
    """One async tool blocks the loop (time.sleep): the turn's outer limit (timeout + 5 s) reports every call as a
    timeout naming tool_timeout, and cancels the ones that were waiting (they ran on to their end)."""
    finished = []

    async def blocking(x: int) -> str:
        """
        Blocks the loop.

        Args:
            x: A number.
        """
        time.sleep(6)
        finished.append("blocking")
        return "late"

    async def waiting(x: int) -> str:
        """
        Waits politely.

        Args:
            x: A number.
        """
        await asyncio.sleep(8)
        finished.append("waiting")
        return "late"

    out = run_tool_calls([call("blocking", x=1), call("waiting", x=2)], {"blocking": blocking, "waiting": waiting}, 0.5)
    assert [m["content"] for m in out.messages] == [str({"error": "tool 'blocking' timed out after 0.5 s"}),
                                                    str({"error": "tool 'waiting' timed out after 0.5 s"})]
    assert out.timeouts == 2
    time.sleep(3.5)  # past the blocking call's end and the waiting one's 8 s: a cancelled task never finishes
    assert finished == ["blocking"]


def test_a_call_that_blocks_the_loop_is_left_behind_and_later_calls_get_a_new_loop():
    """An async function that blocks the shared loop (time.sleep inside async code) overran its limit and every
    later async call (a reward function with no reward_timeout) queued behind it for ever. Now the overrun finds the
    loop blocked (a trivial callback does not run within a second), warns naming the call, and the next call runs on
    a new loop; the old one is stopped and closed once the blocking call returns (each leaked a thread and 3 file
    descriptors). A call that is merely slow (it awaits) leaves the loop in place."""
    from groupwise.rewards.calls import RewardTimeout

    async def slow():
        await asyncio.sleep(5)

    loop = event_loop()
    with pytest.raises(RewardTimeout):
        run_async(slow(), 0.2, "the slow tool")
    assert event_loop() is loop  # it awaited: the loop ran on

    async def blocking():
        time.sleep(3)

    async def answer():
        return 42

    started = time.monotonic()
    from groupwise.rewards import calls

    thread = calls._LOOP_THREAD
    with pytest.warns(RuntimeWarning, match=r"the blocking tool: a call blocked the shared event loop .* a new event "
                                            r"loop"):
        with pytest.raises(RewardTimeout):
            run_async(blocking(), 0.2, "the blocking tool")
    assert event_loop() is not loop
    assert run_async(answer(), None) == 42 and time.monotonic() - started < 2.5  # not behind the 3 s sleep
    # once the blocking call returns, the abandoned loop stops and is closed (its thread and descriptors freed)
    thread.join(5)
    assert not thread.is_alive() and loop.is_closed()


def test_a_call_sent_to_a_loop_while_it_is_found_blocked_finishes_there():
    """Between an overrun and the probe's verdict (1 s) the blocked loop is still the shared one, and a call sent
    then (a process reward function retried on a thread, another trainer's call) lands on it. The first wind-down
    cancelled such calls (their callers got CancelledError, or waited for ever with no timeout); now the abandoned
    loop lets every call on it finish, then stops and closes."""
    import threading

    from groupwise.rewards import calls
    from groupwise.rewards.calls import RewardTimeout

    async def blocking():
        time.sleep(2)

    async def answer():
        await asyncio.sleep(0.01)
        return 42

    event_loop()
    loop, thread = calls._LOOP, calls._LOOP_THREAD
    outcome = {}

    def overrun():
        try:
            run_async(blocking(), 0.2, "the blocking tool")
        except RewardTimeout as e:
            outcome["first"] = e

    with pytest.warns(RuntimeWarning, match="a call blocked the shared event loop"):
        first = threading.Thread(target=overrun)
        first.start()
        time.sleep(0.5)  # overrun, the probe under way: the loop is still the shared one
        assert run_async(answer(), None) == 42  # ran once the block ended; not cancelled, no hang
        first.join()
    assert isinstance(outcome["first"], RewardTimeout)
    thread.join(5)
    assert not thread.is_alive() and loop.is_closed() and event_loop() is not loop

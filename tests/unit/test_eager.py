""":func:`vllm_nnrp_plugin.core.eager.start_now`: a coroutine runs in the caller's stack up to its first real wait;
what it returns, raises or waits for afterwards behaves as in a task."""

from __future__ import annotations

import asyncio

import pytest

from vllm_nnrp_plugin.core.eager import start_now


def test_a_coroutine_that_never_waits_is_done_before_start_now_returns():
    steps: list[str] = []

    async def quick(sent: asyncio.Future[int]) -> int:
        steps.append("ran")
        return await sent  # done already, as pyzmq's send future is when the socket had room: no suspension

    async def scenario():
        sent = asyncio.get_running_loop().create_future()
        sent.set_result(7)
        future = start_now(quick(sent))
        assert steps == ["ran"] and future.done()  # no loop iteration passed
        return await future

    assert asyncio.run(scenario()) == 7


def test_what_it_raises_at_once_is_in_the_future():
    async def broken() -> None:
        raise ValueError("no engine")

    async def scenario():
        future = start_now(broken())
        assert future.done()
        with pytest.raises(ValueError, match="no engine"):
            await future

    asyncio.run(scenario())


def test_a_coroutine_that_waits_finishes_in_a_task_with_the_awaited_results():
    async def waits(gate: asyncio.Future[int]) -> int:
        first = await gate  # a real wait
        await asyncio.sleep(0)  # a bare yield
        return first + 1

    async def scenario():
        gate = asyncio.get_running_loop().create_future()
        future = start_now(waits(gate))
        assert not future.done()
        gate.set_result(41)
        return await future

    assert asyncio.run(scenario()) == 42


def test_a_failure_of_the_awaited_future_reaches_the_coroutine():
    async def waits(gate: asyncio.Future[int]) -> str:
        try:
            await gate
        except KeyError:
            return "handled"
        return "not reached"

    async def scenario():
        gate = asyncio.get_running_loop().create_future()
        future = start_now(waits(gate))
        gate.set_exception(KeyError("x"))
        return await future

    assert asyncio.run(scenario()) == "handled"


@pytest.mark.parametrize("gate_done", [False, True], ids=["waiting", "gate-already-done"])
def test_cancelling_the_rest_cancels_the_coroutine_where_it_waits(gate_done):
    seen: list[str] = []

    async def waits(gate: asyncio.Future[None]) -> None:
        try:
            await gate
            await asyncio.sleep(3600)  # waits until cancelled
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def scenario():
        gate = asyncio.get_running_loop().create_future()
        future = start_now(waits(gate))
        if gate_done:
            gate.set_result(None)  # done, but the task has not run on yet: the cancel must not be lost
        future.cancel()
        with pytest.raises(asyncio.CancelledError):
            await future

    asyncio.run(scenario())
    assert seen == ["cancelled"]

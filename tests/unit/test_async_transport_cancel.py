"""Cancelling the asyncio task that awaits or iterates an :class:`AsyncNNRPTransport` call, in every loop iteration
around an event's arrival or while it waits for a session: the task raises ``CancelledError`` and the operation
gets its FRAME_CANCEL (or is never submitted).

No NNRP session: the transport's pool is a stand-in whose one session makes a real client
:class:`~vllm_nnrp_plugin.client.aio.connection.Operation` that the test feeds as the connection would, so the test
decides in which loop iteration each event reaches the transport and in which one ``task.cancel()`` runs.
(Before Python 3.12, ``asyncio.wait_for`` returns the awaited result instead of raising when the cancel comes in
the iterations between that result being ready and the waiting task resuming, CPython gh-86296.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx
import orjson
import pytest

from vllm_nnrp_plugin.client import Operation
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport
from vllm_nnrp_plugin.nnrp_wire import events as ev

CHAT = "http://nnrp.invalid/v1/chat/completions"
BODY = {"model": "example-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
#: how many loop iterations after an event's delivery the cancel may come: wider than the hops (the operation's
#: waiter, the waiting task's wake-up) between a delivery and the task running on
ITERATIONS = range(8)


def delta(text: str) -> bytes:
    return orjson.dumps({"type": "response.output_text.delta", "index": 0, "delta": text})


class _Core:
    """The wire core's calls an :class:`Operation` makes: FRAME_CANCELs recorded."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def frame_cancel(self, session_id: int, frame_id: int) -> None:
        self.cancelled.append(frame_id)


class HeldPool:
    """Stands in for the transport's session pool: :meth:`acquire` gives one lane (at once, or once
    :attr:`gate` is set) whose session's ``submit`` makes a real :class:`Operation` the test feeds
    (:meth:`deliver`, :meth:`complete`) as the connection would; :attr:`cancelled` lists the frames sent a
    FRAME_CANCEL, :attr:`released` counts slots given back."""

    def __init__(self, gate: asyncio.Future | None = None) -> None:
        self.loop = self._loop = asyncio.get_running_loop()
        self.gate = gate
        self._core = _Core()
        self._error = None
        self.op: Operation | None = None
        self.released = 0
        self.session_id = 1
        self.conn = self

    @property
    def cancelled(self) -> list[int]:
        return self._core.cancelled

    def _flush(self) -> None:
        pass

    async def acquire(self, timeout_s=None, connect_timeout_s=None):
        if self.gate is not None:
            await self.gate
        return self

    @property
    def session(self):
        return self

    def submit(self, envelope, trace=None) -> Operation:
        self.op = Operation(self, 1, 1)
        return self.op

    def release(self, lane) -> None:
        self.released += 1

    def deliver(self, body: bytes) -> None:
        self.op._partial(body)

    def complete(self) -> None:
        self.op._terminal(ev.ResultDropped(1, 1, 1))


def held(transport: AsyncNNRPTransport, pool: HeldPool) -> None:
    transport._pool_here = lambda _api_key: pool


def after_iterations(n: int, callback: Callable[[], None]) -> None:
    """Run ``callback`` now (``n`` 0) or ``n`` loop iterations from now."""
    if n == 0:
        callback()
    else:
        asyncio.get_running_loop().call_soon(after_iterations, n - 1, callback)


async def until(predicate: Callable[[], bool]) -> None:
    """Wait (at most 2 s) for ``predicate``."""
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


async def cancel_race(phase: str, n: int) -> tuple[bool, list[int], int]:
    """One call whose task is cancelled ``n`` iterations after an event is delivered: the first event (the task
    awaits the response) or, ``phase`` ``"stream"``, the second (it iterates the body). Returns (the task raised
    ``CancelledError``, the frames cancelled, the slots given back once the drop arrived)."""
    pool = HeldPool()
    transport = AsyncNNRPTransport("tcp://127.0.0.1:9")
    held(transport, pool)
    chunks: list[bytes] = []
    async with httpx.AsyncClient(transport=transport) as http:

        async def call() -> None:
            async with http.stream("POST", CHAT, json=BODY, timeout=30) as response:
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)

        task = asyncio.create_task(call())
        await until(lambda: pool.op is not None)
        if phase == "stream":
            pool.deliver(delta("a"))
            await until(lambda: len(chunks) == 1)
            for _ in range(5):  # the task is waiting for the next event again
                await asyncio.sleep(0)
        pool.deliver(delta("b"))
        after_iterations(n, task.cancel)
        with contextlib.suppress(AssertionError):  # (not for a task that lost its cancel: it waits on)
            await until(lambda: pool.cancelled or task.done())  # the cancel came: the task sent its FRAME_CANCEL
        pool.complete()  # the server's drop; a task that lost its cancel reads on to this end
        try:
            await task
        except asyncio.CancelledError:
            return True, pool.cancelled, pool.released
        return False, pool.cancelled, pool.released


@pytest.mark.parametrize("phase", ["first", "stream"])
def test_a_cancel_in_any_iteration_around_an_events_arrival_raises_and_cancels_the_operation(phase):
    for n in ITERATIONS:
        raised, cancelled, released = asyncio.run(cancel_race(phase, n))
        assert (n, raised, cancelled, released) == (n, True, [1], 1)


def test_a_cancel_while_the_call_waits_for_a_session_raises_and_submits_nothing():
    """The call waits for a slot (the pool is full): cancelling its task raises ``CancelledError`` there, and no
    operation is ever submitted, also when the slot comes free in the same iteration."""

    async def main() -> tuple[bool, Operation | None]:
        gate = asyncio.get_running_loop().create_future()
        pool = HeldPool(gate)
        transport = AsyncNNRPTransport("tcp://127.0.0.1:9")
        held(transport, pool)
        http = httpx.AsyncClient(transport=transport)
        task = asyncio.create_task(http.post(CHAT, json=BODY, timeout=30))
        for _ in range(5):
            await asyncio.sleep(0)
        gate.set_result(None)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True, pool.op
        return False, pool.op

    assert asyncio.run(main()) == (True, None)

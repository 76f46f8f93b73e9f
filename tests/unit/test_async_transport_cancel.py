"""Cancelling the asyncio task that awaits or iterates an :class:`AsyncNNRPTransport` call, in every loop iteration
around an event's arrival or during the submit: the task raises ``CancelledError`` and the operation gets its
FRAME_CANCEL.

No NNRP session: the transport's dispatcher is a stand-in that hands the test the submit's event sink, so the
test decides in which loop iteration each event reaches the transport and in which one ``task.cancel()`` runs.
(Before Python 3.12, ``asyncio.wait_for`` returns the awaited result instead of raising when the cancel comes in
the iterations between that result being ready and the waiting task resuming, CPython gh-86296.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import httpx
import pytest

from vllm_nnrp_plugin.client import ClientEvent
from vllm_nnrp_plugin.openai_transport import AsyncNNRPTransport

CHAT = "http://nnrp.invalid/v1/chat/completions"
BODY = {"model": "example-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
#: how many loop iterations after an event's delivery the cancel may come: wider than the hops (thread-safe
#: callback, queue getter, the waiting task's wake-up) between a delivery and the task running on
ITERATIONS = range(8)


def delta(text: str) -> ClientEvent:
    return ClientEvent("partial_result", {"type": "response.output_text.delta", "index": 0, "delta": text})


COMPLETED = ClientEvent("result_push", {"type": "response.completed", "body": {"choices": []}}, status=200)


class HeldDispatcher:
    """Stands in for the transport's dispatcher: :attr:`sink` is the one submit's event sink (events go to the
    caller's loop as the real dispatcher's do); :attr:`cancelled` lists the operations sent a FRAME_CANCEL."""

    failed = False

    def __init__(self) -> None:
        self.sink: Callable[[object], None] | None = None
        self.cancelled: list[str] = []

    def submit(self, envelope, sink, traced) -> str:
        self.sink = sink
        return "op-1"

    def cancel(self, op: str) -> None:
        self.cancelled.append(op)


def after_iterations(n: int, callback: Callable[[], None]) -> None:
    """Run ``callback`` now (``n`` 0) or ``n`` loop iterations from now."""
    if n == 0:
        callback()
    else:
        asyncio.get_running_loop().call_soon(after_iterations, n - 1, callback)


async def until(predicate: Callable[[], bool]) -> None:
    """Wait (at most 2 s) for ``predicate``: the submit runs on a worker thread."""
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


async def cancel_race(phase: str, n: int) -> tuple[bool, list[str]]:
    """One call whose task is cancelled ``n`` iterations after an event is delivered: the first event (the task
    awaits the response) or, ``phase`` ``"stream"``, the second (it iterates the body). Returns (the task raised
    ``CancelledError``, the operations cancelled)."""
    dispatcher = HeldDispatcher()
    transport = AsyncNNRPTransport("tcp://127.0.0.1:9")
    transport._sync._connected = lambda request, traced: dispatcher
    chunks: list[bytes] = []
    async with httpx.AsyncClient(transport=transport) as http:

        async def call() -> None:
            async with http.stream("POST", CHAT, json=BODY, timeout=30) as response:
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)

        task = asyncio.create_task(call())
        await until(lambda: dispatcher.sink is not None)
        if phase == "stream":
            dispatcher.sink(delta("a"))
            await until(lambda: len(chunks) == 1)
            for _ in range(5):  # the task is waiting for the next event again
                await asyncio.sleep(0)
        dispatcher.sink(delta("b"))
        after_iterations(n, task.cancel)
        await asyncio.sleep(0.01)
        dispatcher.sink(COMPLETED)  # a task that lost its cancel reads on to this end
        try:
            await task
        except asyncio.CancelledError:
            return True, dispatcher.cancelled
        return False, dispatcher.cancelled


@pytest.mark.parametrize("phase", ["first", "stream"])
def test_a_cancel_in_any_iteration_around_an_events_arrival_raises_and_cancels_the_operation(phase):
    for n in ITERATIONS:
        raised, cancelled = asyncio.run(cancel_race(phase, n))
        assert (n, raised, cancelled) == (n, True, ["op-1"])


class BlockedSubmit(HeldDispatcher):
    """A dispatcher whose submit blocks its worker thread until :attr:`release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def submit(self, envelope, sink, traced) -> str:
        self.entered.set()
        self.release.wait(5)
        return super().submit(envelope, sink, traced)


@pytest.mark.parametrize("loop_ends", [False, True])
def test_a_cancel_during_the_submit_raises_and_cancels_the_operation_the_submit_makes(loop_ends):
    """The submit runs on a worker thread and cannot be stopped: the operation it makes gets its FRAME_CANCEL
    once it exists, also when the event loop ends first (``asyncio.run`` cancels the tasks left)."""
    dispatcher = BlockedSubmit()

    async def main() -> bool:
        transport = AsyncNNRPTransport("tcp://127.0.0.1:9")
        transport._sync._connected = lambda request, traced: dispatcher
        http = httpx.AsyncClient(transport=transport)
        task = asyncio.create_task(http.post(CHAT, json=BODY, timeout=30))
        await asyncio.to_thread(dispatcher.entered.wait, 5)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            raised = True
        else:
            raised = False
        if loop_ends:  # the submit ends while asyncio.run shuts the loop down
            threading.Timer(0.05, dispatcher.release.set).start()
        else:
            dispatcher.release.set()
            await until(lambda: dispatcher.cancelled)
        return raised

    assert asyncio.run(main()) is True
    assert dispatcher.cancelled == ["op-1"]

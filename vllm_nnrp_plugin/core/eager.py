"""Start a coroutine in the caller's own stack, as Python 3.12's ``asyncio.eager_task_factory`` does.

``asyncio.create_task`` only queues a task's first step behind everything already on the loop's ready queue;
under hundreds of active streams that queue holds one round of per-stream work. :func:`start_now` runs the
coroutine at once, up to its first suspension that really waits (a future not yet done); what is left, if
anything, runs as a task. vLLM's abort (``AsyncLLM.abort`` in ``vllm/v1/engine/async_llm.py``: the output
processor's bookkeeping, then a ZMQ send that completes without waiting while the socket has room) therefore
leaves the API server in the very callback that decided it.

The rule this follows: a coroutine that awaits a not-yet-done ``asyncio.Future`` yields that future; it is
resumed (``send(None)``) once the future is done and then reads the future's result itself
(``Future.__await__`` in CPython's ``Lib/asyncio/futures.py``); a bare ``yield`` (``asyncio.sleep(0)``) yields
``None`` and asks for one loop iteration.
"""

from __future__ import annotations

import asyncio
import collections.abc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["start_now"]


def start_now(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Run ``coro`` now, on the running loop's thread, until it finishes or waits; returns a future of its result:
    already done when it finished at once, else the task that runs the rest (a cancel of it reaches ``coro``
    where it waits, as with any task). Exceptions, ``CancelledError`` included, end up in that future."""
    loop = asyncio.get_running_loop()
    try:
        waiting = coro.send(None)
    except StopIteration as stop:
        done = loop.create_future()
        done.set_result(stop.value)
        return done
    except BaseException as exc:  # noqa: BLE001 - handed to the future, as a task would
        failed = loop.create_future()
        if isinstance(exc, asyncio.CancelledError):
            failed.cancel()
        else:
            failed.set_exception(exc)
        return failed
    return loop.create_task(_Started(coro, waiting))


class _Started(collections.abc.Coroutine):
    """A coroutine :func:`start_now` already ran up to a suspension at which it yielded ``waiting``; a task drives
    it on: its first step gets ``waiting`` back (so the task waits for it, or, for ``None``, one iteration),
    every later step goes straight to the coroutine. A cancel before that first step is thrown into the
    coroutine, at the point it waits."""

    __slots__ = ("_coro", "_waiting", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self._coro, self._waiting, self._first = coro, waiting, True

    def send(self, value: Any) -> Any:
        if self._first:
            self._first = False
            return self._waiting
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._first = False
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        raise TypeError("driven by its task only")

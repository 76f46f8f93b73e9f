"""One openai SDK call over NNRP, on the pool's event loop: the one implementation of the exchange that both
transports of :mod:`vllm_nnrp_plugin.client.openai.transport` run (the async one in the caller's loop, the sync one in
its private loop thread), as httpcore's sync and async pools are shells around one core.

::

    exchange = Exchange(pool, call, trace_of_caller())
    response = await exchange.respond(make_stream)   # submitted; the answer, or a stream's first event
    items = await exchange.items()                   # a stream's next events (at least one)
    exchange.abandon()                               # the caller stopped listening: FRAME_CANCEL

* **Submit**: a slot of a pooled session (:meth:`vllm_nnrp_plugin.client.aio.pool.Pool.acquire`, waiting at most the
  request's pool timeout: ``PoolTimeout``), then FRAME_SUBMIT, and for a traced call its own TRACE_CONTEXT in the
  same write. The server reads both in one ``data_received`` and dispatches the operation to vLLM in a task that
  runs in a later loop iteration (:mod:`vllm_nnrp_plugin.nnrp_binding.connection`, ``_on_submit`` →
  :meth:`vllm_nnrp_plugin.service.NNRPService.on_submit`), so the operation's context is applied before its
  dispatch and traced and untraced calls share sessions. (An envelope over asyncio's read size, 256 KiB, may
  arrive in two reads; its context can then come after the dispatch.)
* **Refused**: a ``too_many_requests`` answer as the first event was refused at admission and never reached vLLM
  (the process limit taken by other clients): the call waits and submits again, up to :data:`REFUSAL_RETRIES`
  times, :data:`REFUSAL_BACKOFF_S` doubling each time (at most 1 s), within the pool timeout; then the 429 is
  the answer (``RateLimitError``).
* **Slots** are given back when the operation's terminal arrives, read or not (a cancelled call's slot when
  the server's drop arrives), so the pool's credit is the server's.
* **Unauthorized**: the server refused the sessions for want of a valid API key (``auth_failed``) → vLLM's
  401 ``{"error": "Unauthorized"}``, which the SDK raises as ``AuthenticationError``.
* **Failures**: no session (cannot connect within the request's connect timeout) → ``ConnectError``; the
  connection lost later → ``ReadError``; no event for the request's read timeout (``Call.timeout_s``: the
  silence between two events, the first included, as httpx's read timeout bounds each read over HTTP; a stream
  that keeps producing is never cut) → ``ReadTimeout``, after a FRAME_CANCEL (the server aborts the vLLM
  request) — each of the request's library (``httpx`` or ``httpx2``), which the SDK raises as
  ``APIConnectionError`` / ``APITimeoutError``.
* **Cancelling** the task that awaits :meth:`respond` or :meth:`items` raises ``CancelledError`` in it and sends
  FRAME_CANCEL (the wait is the operation's own, :meth:`vllm_nnrp_plugin.client.aio.connection.Operation.batch`; the
  timeout is ``asyncio.timeout``, which never swallows a cancel as 3.11's ``asyncio.wait_for`` can, CPython
  gh-86296).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry import trace as otel_trace

from vllm_nnrp_plugin.client.aio.connection import Operation
from vllm_nnrp_plugin.client.aio.pool import Pool
from vllm_nnrp_plugin.client.errors import AuthenticationFailed, ClientError
from vllm_nnrp_plugin.client.events import operation_event
from vllm_nnrp_plugin.client.openai.calls import RESUBMIT, Call, Item

__all__ = ["REFUSAL_RETRIES", "Exchange", "trace_of_caller"]

#: how many times a call refused at admission is submitted again
REFUSAL_RETRIES = 8
#: the first wait before submitting a refused call again, s (the server's BACKPRESSURE retry_after: 100 ms)
REFUSAL_BACKOFF_S = 0.1
_LOW_64 = (1 << 64) - 1


def trace_of_caller() -> tuple[int, int, int] | None:
    """(low 64 bits of the trace id, span id, flags bit 0) of the caller's active valid OpenTelemetry span, else
    None (NNRP trace ids are 64-bit; the server zero-extends, :mod:`vllm_nnrp_plugin.profile.trace`)."""
    context = otel_trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return context.trace_id & _LOW_64, context.span_id, int(context.trace_flags) & 1


class _Unauthorized(Exception):
    """Internal: the server refused the pool's sessions for want of a valid API key."""


class Exchange:
    """One call (module docstring); every method runs on ``pool.loop``."""

    def __init__(self, pool: Pool, call: Call, trace: tuple[int, int, int] | None) -> None:
        self.pool = pool
        self.call = call
        self.trace = trace
        self.op: Operation | None = None
        self._ready: collections.deque[Item] = collections.deque()

    async def respond(self, stream: Callable[[Item], Any]) -> Any:
        """Submit :attr:`call`'s envelope and read until its response is decided: the answer, or for a stream
        the 200 response whose body ``stream(first item)`` makes. Raises the request library's transport errors."""
        call, refusals = self.call, 0
        while True:
            try:
                await self._submit()
            except _Unauthorized:
                return call.unauthorized()
            item = await self._next()
            if call.refused(item) and refusals < REFUSAL_RETRIES:
                await asyncio.sleep(min(1.0, REFUSAL_BACKOFF_S * 2**refusals))
                refusals += 1
                continue
            while (response := call.respond(item, stream)) is None:
                item = await self._next()
            if response is not RESUBMIT:
                return response

    async def items(self) -> list[Item]:
        """A stream's next items: every one that arrived (at least one; waits for the next)."""
        first = await self._next()
        out = [first]
        while self._ready:
            out.append(self._ready.popleft())
        return out

    def render(self, items: list[Item]) -> Iterator[bytes]:
        """A stream's SSE bytes for ``items`` (up to the terminal; :attr:`call` ``.ended`` after it). Raises the
        request library's transport errors for a failure or a drop."""
        for item in items:
            chunk = self.call.render(item)
            if chunk:
                yield chunk
            if self.call.ended:
                return

    def abandon(self) -> None:
        """The caller stopped listening before the terminal: FRAME_CANCEL (the server aborts the vLLM request)."""
        if not self.call.ended and self.op is not None:
            self.call.ended = True
            self.op.cancel()

    async def _submit(self) -> None:
        call, pool = self.call, self.pool
        try:
            lane = await pool.acquire(call.pool_timeout_s, connect_timeout_s=call.connect_timeout_s)
        except TimeoutError:
            call.ended = True
            raise call.lib.PoolTimeout("no NNRP session free in time", request=call.request) from None
        except AuthenticationFailed:
            raise _Unauthorized from None
        except ClientError as exc:
            call.ended = True
            raise call.lib.ConnectError(f"NNRP: {exc}", request=call.request) from exc
        assert call.envelope is not None  # planned without an answer: there is an envelope to submit
        try:
            self.op = lane.session.submit(call.envelope, trace=self.trace)
        except ClientError as exc:  # the connection was lost just now
            pool.release(lane)
            raise call.failure(exc) from exc
        self.op.when_done(lambda: pool.release(lane))
        self._ready.clear()

    async def _next(self) -> Item:
        if not self._ready:
            op, call = self.op, self.call
            assert op is not None  # _submit ran first
            try:
                async with asyncio.timeout(call.timeout_s):
                    events = await op.batch()
            except TimeoutError:
                self.abandon()
                raise call.failure(None) from None
            except ClientError as exc:
                return exc
            if not events:  # read to its end already
                raise call.failure(ClientError("the operation has ended"))
            last = len(events) - 1 if op.finished else -1
            for n, event in enumerate(events):
                self._ready.append(operation_event(op, event, terminal=n == last))
        return self._ready.popleft()

"""The official ``openai`` SDK over NNRP: ``httpx`` transports that answer the SDK's requests as vLLM's HTTP server would.

::

    client = OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused",
                    http_client=httpx.Client(transport=NNRPTransport("tcp://127.0.0.1:9400")))

(``AsyncNNRPTransport`` with ``httpx.AsyncClient`` and ``AsyncOpenAI``.) The host in ``base_url`` is never
contacted; the transport speaks to the NNRP endpoint given (any URI of
:mod:`vllm_nnrp_plugin.nnrp_binding.endpoints`; TLS ones need ``trusted_cert_der``).

* ``POST …/chat/completions``, ``POST …/responses``, ``POST …/embeddings`` → one ``chat.completions.create``,
  ``responses.create``, ``embeddings.create`` submit; streamed answers flow as the events arrive
  (:mod:`vllm_nnrp_plugin.openai_sse` and :mod:`vllm_nnrp_plugin.openai_responses_sse` make the bytes),
  non-streamed ones are the ``response.completed`` body. ``GET …/models`` → ``models.list`` (the capability
  document on a server without it). Anything else → FastAPI's 404/405. The routing and the answers are
  :mod:`vllm_nnrp_plugin.openai_calls`; this module does the I/O.
* ``response.error`` → its HTTP status and vLLM's error body (so the SDK raises ``NotFoundError``,
  ``BadRequestError``, ``RateLimitError``, ``InternalServerError``, …), except ``request_timeout``, which is
  ``httpx.ReadTimeout`` (the SDK's ``APITimeoutError``), as when the SDK's own timeout fires over HTTP.
* A drop the caller did not ask for or an NNRP failure is ``httpx.ConnectError`` (connect) or
  ``httpx.ReadError`` (later): the SDK's ``APIConnectionError``.
* Closing the response (``stream.close()``, leaving ``with``, a cancelled asyncio task) before its terminal sends
  a FRAME_CANCEL, so the server aborts the vLLM request. Cancelling the task that awaits or iterates a call
  always raises ``CancelledError`` in it, however the cancel falls relative to arriving events; a cancel during
  the submit sends the FRAME_CANCEL once the submit made the operation.
* The request's read timeout (``extensions["timeout"]``, what the SDK's ``timeout`` sets) becomes
  ``nnrp.timeout_ms``: a bound on the whole operation, not on the gap between chunks as over HTTP.
* An active valid OpenTelemetry span of the caller becomes TRACE_CONTEXT: NNRP trace ids are 64-bit, so the
  low 64 bits of the span's 128-bit trace id go, and vLLM's span joins trace ``0…0<low 64 bits>`` (the server
  zero-extends, :mod:`vllm_nnrp_plugin.profile.trace`), not the caller's own trace id.

Connections: traced calls go over their own session, because the server takes an operation's context at
dispatch (:mod:`vllm_nnrp_plugin.nnrp_binding.session`): a session-scope context before the submit and the
operation's own right after it, under the submit lock, so the operation dispatches with its caller's context
whichever the server reads first; a session default cannot be cleared (zero ids are ignored), so calls without
a span use a second session that never gets one. Each session (one NNRP connection each) is opened at its
first call and reused, a new one after a failure. :class:`ProfileClient` is not thread-safe, so one dispatcher
thread per session polls it with short waits and routes each operation's events to its caller, while submits
and cancels take one lock: calls from many threads (sync) or tasks (async) share the transport safely.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
from opentelemetry import trace as otel_trace

from vllm_nnrp_plugin.client import ClientError, ClientEvent, ProfileClient
from vllm_nnrp_plugin.openai_calls import RESUBMIT, Call, Item

__all__ = ["AsyncNNRPTransport", "NNRPTransport"]

#: the dispatcher's poll wait, ms: nnrp-py holds the session while a poll waits, so submits and cancels wait
#: at most this long
POLL_MS = 5
_LOW_64 = (1 << 64) - 1


class _Dispatcher:
    """One :class:`ProfileClient` and the thread that polls it; ``submit`` routes an operation's events to
    ``sink`` (called on the dispatcher thread, events in order, ending with the terminal or a ``ClientError``)."""

    def __init__(self, uri: str, trusted_cert_der: bytes | None) -> None:
        # on a thread of its own: the caller's thread may be running an event loop (a sync client in async code)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            connecting = pool.submit(asyncio.run, ProfileClient.connect(uri, trusted_cert_der=trusted_cert_der))
            self.client = connecting.result()  # ClientError
        self.failed = False
        self._lock = threading.Lock()  # submits and cancels
        self._routes_lock = threading.Lock()
        self._routes: dict[int, Callable[[Item], None]] = {}
        self._early: dict[int, list[ClientEvent]] = {}  # polled between a submit and its registration
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nnrp-openai-dispatcher", daemon=True)
        self._thread.start()

    def submit(self, envelope: dict[str, Any], sink: Callable[[Item], None], traced: tuple[int, int, int] | None) -> Any:
        """Submit ``envelope``; returns the native operation. Raises :class:`ClientError`."""
        with self._lock:
            if self.failed:
                raise ClientError("the NNRP session failed")
            if traced is not None:
                self.client.trace_context(traced[0], traced[1], flags=traced[2])
            op = self.client.submit(envelope)
            with self._routes_lock:  # held while the early events go, so later ones follow them
                early = self._early.pop(op.operation_id, [])
                if not (early and early[-1].terminal):
                    self._routes[op.operation_id] = sink
                for event in early:
                    sink(event)
            if traced is not None:
                with contextlib.suppress(ClientError):  # finished already: nothing left to trace
                    self.client.trace_context(traced[0], traced[1], flags=traced[2], op=op)
        return op

    def cancel(self, op: Any) -> None:
        """FRAME_CANCEL for ``op``; an operation that already ended is left alone."""
        with self._lock, contextlib.suppress(ClientError):
            self.client.cancel(op)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                polled = self.client.poll(POLL_MS)
            except ClientError as exc:
                self._fail(exc)
                return
            for operation_id, event in polled:
                with self._routes_lock:
                    sink = self._routes.pop(operation_id, None) if event.terminal else self._routes.get(operation_id)
                    if sink is None:
                        self._early.setdefault(operation_id, []).append(event)
                if sink is not None:
                    sink(event)

    def _fail(self, exc: ClientError) -> None:
        self.failed = True
        with self._routes_lock:
            sinks, self._routes = list(self._routes.values()), {}
        for sink in sinks:
            sink(exc)

    def close(self) -> None:
        """Stop polling, end every waiting call with a ``ClientError``, close the session and connection."""
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            self.failed = True
        self._fail(ClientError("the NNRP transport was closed"))
        self.client.close()


def _trace_of_caller() -> tuple[int, int, int] | None:
    """(low 64 bits of the trace id, span id, flags) of the caller's active valid span, else None."""
    context = otel_trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return context.trace_id & _LOW_64, context.span_id, int(context.trace_flags) & 1


class NNRPTransport(httpx.BaseTransport):
    """A sync ``httpx`` transport to an NNRP endpoint (see the module docstring). ``trusted_cert_der``: the
    server certificate (or its CA), DER, for TLS URIs. Thread-safe."""

    def __init__(self, uri: str, *, trusted_cert_der: bytes | None = None) -> None:
        self._uri, self._cert = uri, trusted_cert_der
        self._lock = threading.Lock()
        self._dispatchers: dict[bool, _Dispatcher] = {}  # by "carries trace contexts"

    def _connected(self, request: httpx.Request, traced: bool) -> _Dispatcher:
        with self._lock:
            dispatcher = self._dispatchers.get(traced)
            if dispatcher is None or dispatcher.failed:
                if dispatcher is not None:
                    dispatcher.close()
                try:
                    dispatcher = self._dispatchers[traced] = _Dispatcher(self._uri, self._cert)
                except ClientError as exc:
                    raise httpx.ConnectError(f"NNRP: {exc}", request=request) from exc
            return dispatcher

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        call = Call(request)
        response = call.plan()
        traced = _trace_of_caller()
        while response is None or response is RESUBMIT:
            response = self._exchange(call, traced)
        return response

    def _exchange(self, call: Call, traced: tuple[int, int, int] | None) -> httpx.Response:
        """Submit ``call.envelope`` and wait for the answer (a stream's: its first event)."""
        call.dispatcher = self._connected(call.request, traced is not None)
        inbox: queue.SimpleQueue[Item] = queue.SimpleQueue()
        try:
            call.op = call.dispatcher.submit(call.envelope, inbox.put, traced)
        except ClientError as exc:
            raise call.failure(exc) from exc

        def next_item() -> Item:
            try:
                return inbox.get(timeout=call.timeout_s)
            except queue.Empty:
                call.abandon()
                raise call.failure(None) from None

        while (response := call.respond(next_item(), lambda first: _SyncSSE(call, first, next_item))) is None:
            pass
        return response

    def close(self) -> None:
        with self._lock:
            dispatchers, self._dispatchers = list(self._dispatchers.values()), {}
        for dispatcher in dispatchers:
            dispatcher.close()


class _SyncSSE(httpx.SyncByteStream):
    def __init__(self, call: Call, first: Item, next_item: Callable[[], Item]) -> None:
        self._call, self._first, self._next = call, first, next_item

    def __iter__(self) -> Iterator[bytes]:
        item = self._first
        while True:
            chunk = self._call.render(item)
            if chunk:
                yield chunk
            if self._call.ended:
                return
            item = self._next()

    def close(self) -> None:
        self._call.abandon()


class AsyncNNRPTransport(httpx.AsyncBaseTransport):
    """The asyncio ``httpx`` transport to an NNRP endpoint (see the module docstring); events reach the
    caller's event loop through ``loop.call_soon_threadsafe``. Safe for many tasks at once."""

    def __init__(self, uri: str, *, trusted_cert_der: bytes | None = None) -> None:
        self._sync = NNRPTransport(uri, trusted_cert_der=trusted_cert_der)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        call = Call(request)
        response = call.plan()
        traced = _trace_of_caller()
        while response is None or response is RESUBMIT:
            response = await self._exchange(call, traced)
        return response

    async def _exchange(self, call: Call, traced: tuple[int, int, int] | None) -> httpx.Response:
        """Submit ``call.envelope`` and wait for the answer (a stream's: its first event)."""
        call.dispatcher = await asyncio.to_thread(self._sync._connected, call.request, traced is not None)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Item] = asyncio.Queue()

        def deliver(item: Item) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting
                loop.call_soon_threadsafe(inbox.put_nowait, item)

        # a future, not a task: the loop's shutdown (asyncio.run) cancels pending tasks, and a cancelled submit
        # would leave the operation its thread still makes running
        submit = loop.run_in_executor(None, call.dispatcher.submit, call.envelope, deliver, traced)
        try:
            call.op = await asyncio.shield(submit)
        except ClientError as exc:
            raise call.failure(exc) from exc
        except asyncio.CancelledError:  # the submit goes on in its thread: cancel the operation it makes
            submit.add_done_callback(lambda done: done.exception() or call.dispatcher.cancel(done.result()))
            raise

        async def next_item() -> Item:
            # not asyncio.wait_for: before Python 3.12 it returns the result instead of raising when the task
            # is cancelled just as the result is ready, so the cancel would be lost (CPython gh-86296)
            try:
                async with asyncio.timeout(call.timeout_s):
                    return await inbox.get()
            except TimeoutError:
                call.abandon()
                raise call.failure(None) from None

        try:
            while (response := call.respond(await next_item(), lambda first: _AsyncSSE(call, first, next_item))) is None:
                pass
            return response
        except asyncio.CancelledError:
            call.abandon()
            raise

    async def aclose(self) -> None:
        await asyncio.to_thread(self._sync.close)


class _AsyncSSE(httpx.AsyncByteStream):
    def __init__(self, call: Call, first: Item, next_item: Callable[[], Any]) -> None:
        self._call, self._first, self._next = call, first, next_item

    async def __aiter__(self) -> AsyncIterator[bytes]:
        item = self._first
        try:
            while True:
                chunk = self._call.render(item)
                if chunk:
                    yield chunk
                if self._call.ended:
                    return
                item = await self._next()
        finally:
            self._call.abandon()

    async def aclose(self) -> None:
        self._call.abandon()

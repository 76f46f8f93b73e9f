"""The official ``openai`` SDK over NNRP: ``httpx`` / ``httpx2`` transports that answer the SDK's requests as
vLLM's HTTP server would.

::

    client = OpenAI(base_url="http://nnrp.invalid/v1", api_key=os.environ["VLLM_API_KEY"],
                    http_client=httpx2.Client(transport=NNRPTransport("tcp://127.0.0.1:9400")))

(``AsyncNNRPTransport`` with ``httpx2.AsyncClient`` / ``httpx.AsyncClient`` and ``AsyncOpenAI``; ``httpx.Client``
works as well: each answer is made by the library of the request, :func:`vllm_nnrp_plugin.client.openai.calls.library`.)
The ``api_key`` the SDK was given travels as it would over HTTPS: the ``Authorization: Bearer <key>`` header the
SDK builds becomes the connection's authentication block (:mod:`vllm_nnrp_plugin.contract.auth_block`; one pool of
sessions per key), and a server that requires another key answers 401, which the SDK raises as ``AuthenticationError``.
The host in ``base_url`` is never contacted; the transport speaks to the NNRP endpoint given through the project's
asyncio client (:func:`vllm_nnrp_plugin.client.aio.connection.connect`): ``tcp://HOST:PORT``, ``nnrps://HOST:PORT``,
``unix:///PATH``, ``ws://HOST:PORT[/PATH]``, ``wss://HOST:PORT[/PATH]`` or ``quic://HOST:PORT`` (the TLS ones —
``nnrps``, ``wss``, ``quic`` — trust ``trusted_cert_der``, the server certificate or its CA in DER, else
``tls_ca_file``, a PEM file of CA or server certificates, else the system's trust store: the same as
:func:`~vllm_nnrp_plugin.client.aio.connection.connect`).

* ``POST …/chat/completions``, ``POST …/responses``, ``POST …/embeddings`` → one ``chat.completions.create``,
  ``responses.create``, ``embeddings.create`` submit; streamed answers flow as the events arrive
  (:mod:`vllm_nnrp_plugin.client.openai.sse` and :mod:`vllm_nnrp_plugin.client.openai.responses_sse` make the bytes),
  non-streamed ones are the ``response.completed`` body. ``GET …/models`` → ``models.list`` (the capability
  document on a server without it). Anything else → FastAPI's 404/405. The routing and the answers are
  :mod:`vllm_nnrp_plugin.client.openai.calls`; the exchange (submit, refusals, timeouts, cancel) is
  :mod:`vllm_nnrp_plugin.client.openai.exchange`; the sessions it runs on are
  :mod:`vllm_nnrp_plugin.client.aio.pool`.
* ``response.error`` → its HTTP status and vLLM's error body (so the SDK raises ``NotFoundError``,
  ``BadRequestError``, ``RateLimitError``, ``InternalServerError``, …), except ``request_timeout``, which is
  ``ReadTimeout`` (the SDK's ``APITimeoutError``), as when the SDK's own timeout fires over HTTP.
* Fan-out: concurrent calls share the transport's sessions and connections, which grow with the calls by the
  server's credit (``max_connections``, ``max_sessions_per_connection``: :mod:`vllm_nnrp_plugin.client.aio.pool`),
  and calls beyond that wait their turn (the request's pool timeout) instead of being refused.
* A fleet: several endpoints (a list, or one string of comma-separated ones; a list of one for a balancer's
  address or a host name with several addresses) run one pool per replica: each call goes to the replica with
  the most free capacity, a replica that refuses, drains or is lost gets no call until it is back, and a call
  whose replica went away before it produced anything is submitted once more on another; a stream that already
  produced events ends with ``ReadError`` (``APIConnectionError``) as over HTTP
  (:mod:`vllm_nnrp_plugin.client.fleet.pool`).
* Closing the response (``stream.close()``, leaving ``with``, a cancelled asyncio task) before its terminal sends
  a FRAME_CANCEL, so the server aborts the vLLM request. Cancelling the task that awaits or iterates a call
  always raises ``CancelledError`` in it.
* Timeouts as over HTTP (the request's ``extensions["timeout"]``, what the SDK's ``timeout`` sets): ``connect``
  bounds a new connection and its first session, ``pool`` the wait for a free session, and ``read`` the longest
  silence between two events of the operation (the first one included), not the whole operation: a stream that
  keeps producing runs to its end, one silent for longer is cancelled (the server aborts the vLLM request) and
  raises ``APITimeoutError``. A bound on the whole operation only when asked: ``operation_timeout_s`` (every call)
  or a call's ``X-NNRP-Timeout-Ms`` header (``extra_headers={"X-NNRP-Timeout-Ms": "30000"}``), sent as
  ``nnrp.timeout_ms`` (:mod:`vllm_nnrp_plugin.client.openai.calls`).
* Priority: the transport's ``priority_class`` (``"interactive"``, ``"balanced"`` — the default — or
  ``"background"``) is the NNRP priority class every session of its pool opens with (SESSION_OPEN); a call's
  ``X-NNRP-Priority-Class`` header (``extra_headers={"X-NNRP-Priority-Class": "background"}``) becomes that
  operation's ``nnrp.priority_class`` (:mod:`vllm_nnrp_plugin.client.openai.calls`).
* An active valid OpenTelemetry span of the caller becomes the operation's TRACE_CONTEXT (the low 64 bits of its
  trace id, :func:`vllm_nnrp_plugin.client.openai.exchange.trace_of_caller`).

Threads and loops: :class:`AsyncNNRPTransport` runs in the caller's event loop (no thread; its sessions belong
to the loop of its first call, and a call from another loop starts a new pool there). :class:`NNRPTransport`
runs the same exchange in one private event-loop thread per transport, started at its first call; calls from
any thread (also from inside a running event loop) share it. Lifecycle: ``close()`` / ``aclose()`` (what the
clients' ``close()`` and ``with`` call) close every session and connection; a sync transport never closed is
stopped at interpreter exit (``atexit``) without a word, and an async one ends with its loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from types import ModuleType
from typing import Any, TypeVar

from vllm_nnrp_plugin.client.aio.pool import MAX_CONNECTIONS, MAX_SESSIONS_PER_CONNECTION, Pool
from vllm_nnrp_plugin.client.fleet.pool import FleetPool, check_spec, is_fleet
from vllm_nnrp_plugin.client.openai.calls import Call, Item
from vllm_nnrp_plugin.client.openai.exchange import Exchange, trace_of_caller
from vllm_nnrp_plugin.contract.auth_block import AuthBlockError
from vllm_nnrp_plugin.core.controls import priority_class_of

__all__ = ["AsyncNNRPTransport", "NNRPTransport"]

_T = TypeVar("_T")
#: the longest ``close()`` waits for the close handshakes, and interpreter exit for the loop thread to stop, s
CLOSE_WAIT_S = 5.0
EXIT_WAIT_S = 1.0


def _check_uri(uri: str | Sequence[str]) -> None:
    """Raises :class:`~vllm_nnrp_plugin.client.errors.ClientAddressError` (a ``ValueError``) for an endpoint
    :func:`~vllm_nnrp_plugin.client.aio.connection.connect` cannot use, naming the forms it can; several endpoints
    (a list, or one comma-separated string: a fleet, :mod:`vllm_nnrp_plugin.client.fleet.pool`) are each checked."""
    check_spec(uri)


class _Transport:
    """What both transports share: the endpoint and the pool's settings."""

    def __init__(
        self,
        uri: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_sessions_per_connection: int = MAX_SESSIONS_PER_CONNECTION,
        trusted_cert_der: bytes | None = None,
        tls_ca_file: str | os.PathLike[str] | None = None,
        priority_class: str = "balanced",
        operation_timeout_s: float | None = None,
    ) -> None:
        _check_uri(uri)
        priority_class_of(priority_class)
        if tls_ca_file is not None:
            tls_ca_file = os.fspath(tls_ca_file)
            if not os.access(tls_ca_file, os.R_OK):
                raise ValueError(f"tls_ca_file {tls_ca_file!r} is not a readable PEM file")
        if operation_timeout_s is not None and not operation_timeout_s > 0:
            raise ValueError(f"operation_timeout_s {operation_timeout_s!r} must be positive (s) or None")
        self._uri = uri
        #: the bound on every call's whole operation (s; None: only the read timeout's silence bound)
        self.operation_timeout_s = operation_timeout_s
        self._pool_options: dict[str, Any] = {
            "max_connections": max_connections,
            "max_sessions_per_connection": max_sessions_per_connection,
            "trusted_cert_der": trusted_cert_der,
            "tls_ca_file": tls_ca_file,
            "priority_class": priority_class,
        }

    def _new_pool(self, api_key: str | None) -> Pool:
        if is_fleet(self._uri):  # several addresses, or a list: one pool per replica, calls moved when unstarted
            # a FleetPool serves where a Pool does: the same acquire/release/aclose/abort/loop
            return FleetPool(self._uri, api_key=api_key, **self._pool_options)  # type: ignore[return-value]  # duck-typed
        return Pool(self._uri, api_key=api_key, **self._pool_options)


# -- sync ---------------------------------------------------------------------------------------------------


class _LoopThread:
    """One private event loop in a daemon thread: :meth:`run` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="nnrp-openai-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        """Run ``coro`` on the loop; its result or exception. Anything that stops the wait here (a timeout, a
        ``KeyboardInterrupt``) cancels it there."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()
            raise

    def call(self, callback: Any) -> None:
        """``callback()`` on the loop, without waiting."""
        self.loop.call_soon_threadsafe(callback)

    def stop(self) -> None:
        """Stop the loop and its thread (after what is scheduled ran), then close the loop."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(EXIT_WAIT_S)
        if not self._thread.is_alive():
            self.loop.close()


#: sync transports with a running loop thread, stopped at interpreter exit
_RUNNING: weakref.WeakSet[NNRPTransport] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for transport in list(_RUNNING):
        transport._abort()


class NNRPTransport(_Transport):
    """A sync ``httpx.Client`` / ``httpx2.Client`` transport to an NNRP endpoint (module docstring). Thread-safe.
    ``max_connections`` / ``max_sessions_per_connection``: the pool's bounds
    (:mod:`vllm_nnrp_plugin.client.aio.pool`). ``trusted_cert_der`` (DER bytes) or ``tls_ca_file`` (path of a
    PEM file of CA or server certificates, e.g. the ``nnrp.crt`` of docs/operating.md's TLS walk-through): what
    ``nnrps://``, ``wss://`` and ``quic://`` trust instead of the system's store, as for
    :func:`~vllm_nnrp_plugin.client.aio.connection.connect`. ``priority_class``: the NNRP priority class of every
    session (``"interactive"``, ``"balanced"``, ``"background"``). ``operation_timeout_s``: a bound on each
    call's whole operation (s; by default none: the SDK's read timeout bounds the silence between events, as
    over HTTP). Raises ``ValueError`` for an endpoint that is none of
    :data:`vllm_nnrp_plugin.client.aio.connection.FORMS` (a
    :class:`~vllm_nnrp_plugin.client.errors.ClientAddressError`),
    another priority class, or a ``tls_ca_file`` that cannot be read."""

    def __init__(self, uri: str, **pool_options: Any) -> None:
        super().__init__(uri, **pool_options)
        self._lock = threading.Lock()
        self._thread: _LoopThread | None = None
        self._pools: dict[str | None, Pool] = {}  # by API key

    def _started(self, api_key: str | None) -> tuple[_LoopThread, Pool]:
        with self._lock:
            if self._thread is None:
                self._thread = _LoopThread()
                _RUNNING.add(self)
            pool = self._pools.get(api_key)
            if pool is None:
                pool = self._pools[api_key] = self._thread.run(_made(lambda: self._new_pool(api_key)))
            return self._thread, pool

    def handle_request(self, request: Any) -> Any:
        request.read()
        call = Call(request, operation_timeout_s=self.operation_timeout_s)
        planned = call.plan()
        if planned is not None:
            return planned
        try:
            api_key = call.api_key()
        except AuthBlockError:
            return call.unauthorized()
        trace = trace_of_caller()
        thread, pool = self._started(api_key)
        exchange = Exchange(pool, call, trace)
        make = _sync_stream(call.lib)
        return thread.run(exchange.respond(lambda first: make(thread, exchange, first)))

    def close(self) -> None:
        """Close every session and connection (waiting at most :data:`CLOSE_WAIT_S`), stop the loop thread."""
        with self._lock:
            thread, pools, self._thread, self._pools = self._thread, list(self._pools.values()), None, {}
        _RUNNING.discard(self)
        if thread is None:
            return
        try:
            thread.run(_closed(pools), CLOSE_WAIT_S)
        except (concurrent.futures.TimeoutError, TimeoutError):
            thread.run(_aborted(pools), EXIT_WAIT_S)
        finally:
            thread.stop()

    def _abort(self) -> None:
        """Interpreter exit: drop the connections at once and stop the thread, printing nothing."""
        with self._lock:
            thread, pools, self._thread, self._pools = self._thread, list(self._pools.values()), None, {}
        if thread is not None:
            with contextlib.suppress(Exception):
                thread.run(_aborted(pools), EXIT_WAIT_S)
            thread.stop()

    def __enter__(self) -> NNRPTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _made(factory: Any) -> Any:
    return factory()


async def _closed(pools: list[Pool]) -> None:
    await asyncio.gather(*(pool.aclose() for pool in pools))


async def _aborted(pools: list[Pool]) -> None:
    for pool in pools:
        pool.abort()
    await asyncio.sleep(0)  # the aborted transports close their sockets in this iteration


class _SyncStream:
    """A streamed answer's body for a sync client: each batch of events fetched from the loop thread in one hop."""

    def __init__(self, thread: _LoopThread, exchange: Exchange, first: Item) -> None:
        self._thread, self._exchange, self._first = thread, exchange, first

    def __iter__(self) -> Iterator[bytes]:
        exchange, items = self._exchange, [self._first]
        while True:
            yield from exchange.render(items)
            if exchange.call.ended:
                return
            items = self._thread.run(exchange.items())

    def close(self) -> None:
        self._thread.call(self._exchange.abandon)


@functools.cache
def _sync_stream(lib: ModuleType) -> type:
    """:class:`_SyncStream` as a ``SyncByteStream`` of ``lib`` (``httpx`` or ``httpx2``; their clients assert it)."""
    return type("NNRPSyncStream", (_SyncStream, lib.SyncByteStream), {})


# -- async --------------------------------------------------------------------------------------------------


class AsyncNNRPTransport(_Transport):
    """The asyncio ``httpx.AsyncClient`` / ``httpx2.AsyncClient`` transport to an NNRP endpoint (module
    docstring): runs in the caller's event loop; safe for many tasks at once. Options as :class:`NNRPTransport`."""

    def __init__(self, uri: str, **pool_options: Any) -> None:
        super().__init__(uri, **pool_options)
        self._pools: dict[str | None, Pool] = {}  # by API key, all on one loop

    def _pool_here(self, api_key: str | None) -> Pool:
        loop = asyncio.get_running_loop()
        if any(pool.loop is not loop for pool in self._pools.values()):
            self._pools = {}  # a call from another loop: the old loop's pools end with it
        pool = self._pools.get(api_key)
        if pool is None:
            pool = self._pools[api_key] = self._new_pool(api_key)
        return pool

    async def handle_async_request(self, request: Any) -> Any:
        await request.aread()
        call = Call(request, operation_timeout_s=self.operation_timeout_s)
        planned = call.plan()
        if planned is not None:
            return planned
        try:
            api_key = call.api_key()
        except AuthBlockError:
            return call.unauthorized()
        exchange = Exchange(self._pool_here(api_key), call, trace_of_caller())
        make = _async_stream(call.lib)
        try:
            return await exchange.respond(lambda first: make(exchange, first))
        except asyncio.CancelledError:
            exchange.abandon()
            raise

    async def aclose(self) -> None:
        """Close every session and connection of the pools of this loop."""
        pools, self._pools = list(self._pools.values()), {}
        loop = asyncio.get_running_loop()
        await _closed([pool for pool in pools if pool.loop is loop])

    async def __aenter__(self) -> AsyncNNRPTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _AsyncStream:
    """A streamed answer's body for an async client."""

    def __init__(self, exchange: Exchange, first: Item) -> None:
        self._exchange, self._first = exchange, first

    async def __aiter__(self) -> AsyncIterator[bytes]:
        exchange, items = self._exchange, [self._first]
        try:
            while True:
                for chunk in exchange.render(items):
                    yield chunk
                if exchange.call.ended:
                    return
                items = await exchange.items()
        finally:
            exchange.abandon()

    async def aclose(self) -> None:
        self._exchange.abandon()


@functools.cache
def _async_stream(lib: ModuleType) -> type:
    """:class:`_AsyncStream` as an ``AsyncByteStream`` of ``lib``."""
    return type("NNRPAsyncStream", (_AsyncStream, lib.AsyncByteStream), {})

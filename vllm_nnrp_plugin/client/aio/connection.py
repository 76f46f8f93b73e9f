"""The asyncio shell around :class:`~vllm_nnrp_plugin.nnrp_wire.client.ClientConnection`.

::

    conn = await connect("tcp://127.0.0.1:9400", api_key=key)   # or nnrps://, unix://, ws(s)://…/nnrp, quic://
    session = await conn.open_session()
    op = session.submit({"schema_version": "openai-compatible/1", "operation": "chat.completions.create",
                         "body": {...}})
    async for event in op:          # profile events (dicts) in order; the last one is the terminal
        ...
    await session.close()
    await conn.close()

One :class:`Connection` is the ``asyncio.Protocol`` of one transport (TCP with ``TCP_NODELAY``, TLS over TCP,
or a unix socket) or of a carrier that presents itself as one — a WebSocket
(:class:`~vllm_nnrp_plugin.client.websocket.WebSocketCarrier`: one binary message per packet over TCP or TLS) or
the NNRP stream of a QUIC connection (:class:`~vllm_nnrp_plugin.client.quic.QuicCarrier`); :func:`connect`
chooses by the URI's scheme. Everything runs on the event loop's callbacks: bytes read go straight into the wire
core and its events wake the waiting operations; calls queue bytes in the core and one write per loop iteration
(``loop.call_soon``) sends whatever was queued. No threads, no polling; the only timers are the carriers' (aioquic's
loss recovery and idle timeout, the WebSocket close frame's wait). Losing the carrier — TCP, the WebSocket (a
close frame other than 1000 included) or the QUIC connection (the server's CONNECTION_CLOSE, the idle timeout, an
ICMP error) — fails everything pending the same way.

An :class:`Operation` yields each PARTIAL_RESULT body as JSON (``orjson``), then its terminal: the
RESULT_PUSH's typed body (``vllm_nnrp_plugin.wire_mapping.unwrap_typed_body``) or the
RESULT_DROP_REASON's diagnostic (the server's ``response.cancelled``); a drop whose diagnostic is not a JSON
object, or a header-only RESULT_DROP, yields ``{"type": "response.cancelled", "reason": <drop reason name,
e.g. "peer_cancelled">}``. :meth:`Operation.cancel` sends FRAME_CANCEL; the terminal still comes. A task
cancelled while it waits in ``async for`` or :meth:`Operation.result` gets its ``CancelledError`` and the
operation is cancelled (FRAME_CANCEL) on the way out.

Runtime controls (:mod:`vllm_nnrp_plugin.nnrp_wire.client` has their bytes): a session's priority class at
:meth:`Connection.open_session` (SESSION_OPEN ``priority_class``), an operation's in its envelope
(``Session.submit(..., priority_class=…)`` → ``nnrp.priority_class``); on a running operation
:meth:`Operation.update_priority` (PRIORITY_UPDATE), :meth:`Operation.supersede` (SUPERSEDE),
:meth:`Operation.update_budget` (BUDGET_UPDATE), :meth:`Operation.deadline` (DEADLINE) and
:meth:`Operation.expire_at` (EXPIRE_AT). A superseded operation ends with a drop decoded as
``{"type": "response.cancelled", "reason": "superseded"}``, one whose deadline passed before it ran with
``{"type": "response.cancelled", "reason": "deadline_expired"}`` (the server's diagnostic, like any drop).

Errors (:mod:`vllm_nnrp_plugin.client.errors`), all :class:`ClientError`: :class:`ClientConnectionError`
(cannot connect, the connection was lost or ended on a protocol error: every pending open, operation and close
fails with it; an unusable URI is also a :class:`ClientAddressError`), :class:`SessionOpenError` (the server
refused a session; :class:`AuthenticationFailed` when for want of a valid API key), :class:`ClientResponseError` (an
event or terminal that does not decode).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
import urllib.parse
from collections.abc import Callable
from typing import Any

import orjson
from nnrp.core.enums import MessageType
from nnrp.runtime.types import ResultDropReasonCode

from vllm_nnrp_plugin.client.aio.priority import with_priority_class
from vllm_nnrp_plugin.client.errors import (
    AuthenticationFailed,
    ClientConnectionError,
    ClientError,
    ClientResponseError,
    ClientTimeout,
    SessionOpenError,
    _ConnectAddressError,
)
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.contract.auth_block import bearer_block
from vllm_nnrp_plugin.contract.endpoints import (
    ALPN,
    ALPN_WEBSOCKET,
    QUIC_INSTALL,
    Carrier,
    EndpointError,
    parse_endpoint,
    quic_available,
)
from vllm_nnrp_plugin.core.controls import priority_class_of
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.nnrp_wire.codecs import SESSION_ERROR_AUTH_FAILED
from vllm_nnrp_plugin.nnrp_wire.errors import LocalProtocolError
from vllm_nnrp_plugin.nnrp_wire.framing import MAX_PACKET_BYTES
from vllm_nnrp_plugin.profile import errors as profile_errors

__all__ = ["Connection", "Operation", "Session", "connect"]

#: the URI schemes :func:`connect` speaks, and how their addresses are written
SCHEMES = ("tcp", "nnrps", "unix", "ws", "wss", "quic")
FORMS = (
    "tcp://HOST:PORT, nnrps://HOST:PORT, unix:///ABSOLUTE/PATH, ws://HOST:PORT[/PATH], wss://HOST:PORT[/PATH] "
    "or quic://HOST:PORT"
)


async def connect(
    uri: str,
    *,
    api_key: str | None = None,
    trusted_cert_der: bytes | None = None,
    tls_ca_file: str | None = None,
    max_packet_bytes: int = MAX_PACKET_BYTES,
) -> Connection:
    """Connect to an NNRP server; ``uri`` (parsed by :func:`vllm_nnrp_plugin.endpoints.parse_endpoint`) is one of

    * ``tcp://HOST:PORT`` — TCP (``TCP_NODELAY``);
    * ``nnrps://HOST:PORT`` — TLS over TCP, ALPN ``nnrp/1`` offered;
    * ``unix:///ABSOLUTE/PATH`` — a unix socket;
    * ``ws://HOST:PORT/PATH`` / ``wss://HOST:PORT/PATH`` — WebSocket (``wss``: over TLS, ALPN ``http/1.1``),
      ``PATH`` the Upgrade's target, ``/nnrp`` when omitted (:mod:`vllm_nnrp_plugin.client.websocket`);
    * ``quic://HOST:PORT`` — QUIC (always TLS), ALPN ``nnrp/1`` offered (:mod:`vllm_nnrp_plugin.client.quic`).

    Every TLS carrier checks the server's certificate against the host: trusted are ``trusted_cert_der`` (the
    server certificate or its CA, DER), or ``tls_ca_file`` (a PEM file of CA or server certificates), else the
    system's trust store. ``api_key``: vLLM's API key, sent in CLIENT_HELLO's authentication block
    (:mod:`vllm_nnrp_plugin.auth_block`; a server that requires none ignores it), on every carrier.
    ``max_packet_bytes``: the largest packet accepted from the server (bytes). Raises
    :class:`ClientConnectionError` (nothing listens, the TLS or QUIC handshake failed, the WebSocket Upgrade was
    refused — e.g. 404 for a path the server does not serve —, or an unusable URI: then also a
    :class:`ClientAddressError`, a ``ValueError``); ``ValueError`` (an
    :class:`~vllm_nnrp_plugin.auth_block.AuthBlockError`) for a key no authentication block can carry. A wrong
    or missing key shows at :meth:`Connection.open_session` (:class:`AuthenticationFailed`)."""
    block = bearer_block(api_key) if api_key else b""
    carrier, port = address_of(uri)
    loop = asyncio.get_running_loop()
    conn = Connection(max_packet_bytes, auth_block=block)
    host = carrier.host or ""
    try:
        if carrier.transport == "tcp":
            tls = _tls_context(trusted_cert_der, tls_ca_file) if carrier.tls else None
            await loop.create_connection(lambda: conn, host, port, ssl=tls, server_hostname=host if tls else None)
        elif carrier.transport == "ipc":
            await loop.create_unix_connection(lambda: conn, urllib.parse.urlsplit(carrier.provider_uri).path)
        elif carrier.transport == "websocket":  # the carriers' modules load when first used (aioquic is slow to)
            from vllm_nnrp_plugin.client.aio import websocket

            tls = _tls_context(trusted_cert_der, tls_ca_file, alpn=ALPN_WEBSOCKET) if carrier.tls else None
            path = urllib.parse.urlsplit(carrier.provider_uri).path  # parse_endpoint: WEBSOCKET_PATH if none named
            await websocket.open_websocket(conn, host, port, path, ssl=tls)
        else:
            from vllm_nnrp_plugin.client.aio import quic

            await quic.open_quic(
                conn, host, port, trusted_cert_der=trusted_cert_der, tls_ca_file=tls_ca_file, alpn=ALPN
            )
    except ClientConnectionError as exc:  # the carrier's own: the Upgrade refused, the QUIC handshake failed
        raise ClientConnectionError(f"cannot connect to {uri}: {exc}") from exc
    except (OSError, ssl.SSLError, ValueError) as exc:  # ValueError: trusted_cert_der is not a certificate
        raise ClientConnectionError(f"cannot connect to {uri}: {exc}") from exc
    return conn


def address_of(uri: str) -> tuple[Carrier, int]:
    """The carrier of ``uri`` (:func:`vllm_nnrp_plugin.endpoints.parse_endpoint`) and its port (0 for a unix
    socket): what :func:`connect` would connect to, checked without connecting. Raises
    :class:`ClientAddressError` (also a ``ValueError`` and a :class:`ClientConnectionError`) naming the accepted
    forms (:data:`FORMS`)."""
    if urllib.parse.urlsplit(uri.strip()).scheme not in SCHEMES:
        raise _ConnectAddressError(f"{uri!r} is not an NNRP address: use {FORMS}")
    try:
        carrier = parse_endpoint(uri)
    except EndpointError as exc:  # the form's rule it breaks (a host and a port, an absolute path, …)
        raise _ConnectAddressError(str(exc)) from None
    if carrier.transport == "ipc":
        return carrier, 0
    if carrier.transport == "quic" and not quic_available():
        raise _ConnectAddressError(
            f"{uri!r} is a QUIC address, and aioquic (which speaks QUIC) is not installed "
            f"here. Fix: {QUIC_INSTALL}, or use another address of the server"
        )
    port = urllib.parse.urlsplit(carrier.provider_uri).port
    if not port:
        raise _ConnectAddressError(f"{uri!r}: cannot connect to port 0; use {FORMS}")
    return carrier, port


def _tls_context(trusted_cert_der: bytes | None, tls_ca_file: str | None, *, alpn: str = ALPN) -> ssl.SSLContext:
    """A client TLS context trusting ``trusted_cert_der`` (DER), else ``tls_ca_file`` (PEM), else the system's
    store; offering ALPN ``alpn``."""
    if trusted_cert_der is not None:
        context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(trusted_cert_der))
    else:
        context = ssl.create_default_context(cafile=tls_ca_file)
    context.set_alpn_protocols([alpn])
    return context


class Connection(asyncio.Protocol):
    """One NNRP connection (module docstring). Made by :func:`connect`."""

    def __init__(self, max_packet_bytes: int = MAX_PACKET_BYTES, *, auth_block: bytes = b"") -> None:
        self._core = ClientConnection(max_packet_bytes=max_packet_bytes, auth_block=auth_block)
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._flush_pending = False
        self._opens: dict[int, asyncio.Future[Session]] = {}
        self._sessions: dict[int, Session] = {}
        self._error: str | None = None  # why the connection is gone
        self._lost = self._loop.create_future()
        self._handlers = {
            ev.PartialResultReceived: self._on_partial,
            ev.ResultPushed: self._on_terminal,
            ev.ResultDropReasonReceived: self._on_terminal,
            ev.ResultDropped: self._on_terminal,
            ev.SessionOpenAccepted: self._on_open_accepted,
            ev.SessionOpenRejected: self._on_open_rejected,
            ev.SessionCloseAcked: self._on_close_acked,
            ev.PressureReceived: self._on_pressure,
            ev.PacketRejected: self._on_rejected,
            ev.ConnectionEnded: self._on_ended,
        }

    # -- API -----------------------------------------------------------------------------------------------

    async def open_session(
        self, *, max_in_flight_operations: int = 16, requested_session_id: int = 0, priority_class: str = "balanced"
    ) -> Session:
        """Open a session (the first one also sends CLIENT_HELLO). ``priority_class``: ``"interactive"``,
        ``"balanced"`` or ``"background"`` (SESSION_OPEN ``priority_class`` 0 / 1 / 2). Raises
        :class:`SessionOpenError`, :class:`ClientConnectionError`, ``ValueError`` for another class."""
        code = priority_class_of(priority_class)
        self._check()
        token = self._core.open_session(
            requested_session_id=requested_session_id,
            max_in_flight_operations=max_in_flight_operations,
            priority_class=code,
        )
        future = self._opens[token] = self._loop.create_future()
        self._flush()
        return await future

    @property
    def sessions(self) -> list[Session]:
        """The sessions open (or closing) on this connection."""
        return list(self._sessions.values())

    @property
    def lost(self) -> bool:
        """The connection is gone (lost, ended by the server, or closed): nothing more can be sent on it."""
        return self._error is not None or self._transport is None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's ``get_extra_info`` (``peername``, ``sockname``, ``ssl_object``, …; the QUIC carrier
        also has ``alpn_protocol``, the WebSocket carrier ``websocket_path``); ``default`` once it is gone."""
        return default if self._transport is None else self._transport.get_extra_info(name, default)

    def abort(self) -> None:
        """Close the transport at once, without the close handshakes (what is queued may not be sent);
        every pending open, operation and close fails with :class:`ClientConnectionError`."""
        self._fail_all("the connection was aborted by the client")
        if self._transport is not None:
            self._transport.abort()

    async def close(self) -> None:
        """Close every session (SESSION_CLOSE, waiting for each ack), then the transport. A connection that
        is already gone is just released."""
        if self._error is None:
            with contextlib.suppress(ClientError):
                await asyncio.gather(*(s.close() for s in list(self._sessions.values()) if not s.closing))
        if self._transport is not None:
            self._transport.close()
        await asyncio.shield(self._lost)

    # -- asyncio.Protocol ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream protocol gets a Transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        handlers = self._handlers
        for event in self._core.receive_data(data):
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event)

    def eof_received(self) -> bool | None:
        for event in self._core.receive_data(b""):
            self._on_ended(event)  # type: ignore[arg-type]  # the end of stream completes only ConnectionEnded
        return None  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(f"connection lost: {exc}" if exc else "connection closed")
        self._transport = None
        if not self._lost.done():
            self._lost.set_result(None)

    # -- plumbing ------------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise ClientConnectionError(self._error)

    def _flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._write)

    def _write(self) -> None:
        self._flush_pending = False
        data = self._core.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _fail_all(self, reason: str) -> None:
        if self._error is None:
            self._error = reason
        error = ClientConnectionError(self._error)
        for future in self._opens.values():
            if not future.done():
                future.set_exception(error)
        self._opens.clear()
        for session in self._sessions.values():
            session._fail(error)
        self._sessions.clear()

    # -- events --------------------------------------------------------------------------------------------

    def _on_partial(self, event: ev.PartialResultReceived) -> None:
        op = self._sessions[event.session_id]._ops.get(event.frame_id)
        if op is not None:
            op._partial(event.body)

    def _on_terminal(self, event: Any) -> None:
        op = self._sessions[event.session_id]._ops.pop(event.frame_id, None)
        if op is not None:
            op._terminal(event)

    def _on_open_accepted(self, event: ev.SessionOpenAccepted) -> None:
        session = self._sessions[event.session_id] = Session(self, event.session_id, event.max_in_flight_operations)
        future = self._opens.pop(event.request)
        if future.cancelled():  # the caller gave up waiting: nobody will use it
            session._begin_close()
        else:
            future.set_result(session)

    def _on_open_rejected(self, event: ev.SessionOpenRejected) -> None:
        future = self._opens.pop(event.request)
        if not future.done():
            refusal = (
                AuthenticationFailed if event.session_error_code == SESSION_ERROR_AUTH_FAILED else SessionOpenError
            )
            future.set_exception(refusal(event.session_error_code, event.diagnostic))

    def _on_pressure(self, event: ev.PressureReceived) -> None:
        session = self._sessions.get(event.session_id)
        if session is not None and session.on_pressure is not None:
            session.on_pressure(event)

    def _on_close_acked(self, event: ev.SessionCloseAcked) -> None:
        self._sessions.pop(event.session_id)._closed_by_server()

    def _on_rejected(self, event: ev.PacketRejected) -> None:
        if event.msg_type == MessageType.SESSION_CLOSE_ACK:
            session = self._sessions.get(event.session_id)
            if session is not None:
                session._close_failed(event.reason)

    def _on_ended(self, event: ev.ConnectionEnded) -> None:
        self._fail_all(f"connection ended: {event.error}" if event.error else "the server closed the connection")
        if self._transport is not None:
            self._transport.close()


class Session:
    """One NNRP session on a :class:`Connection` (from :meth:`Connection.open_session`).
    ``max_in_flight_operations``: what the server granted (SESSION_OPEN_ACK); ``on_pressure``, when set, is
    called with each BACKPRESSURE / CREDIT_UPDATE of the session (:class:`~.events.PressureReceived`)."""

    def __init__(self, conn: Connection, session_id: int, max_in_flight_operations: int = 0) -> None:
        self.conn = conn
        self.session_id = session_id
        self.max_in_flight_operations = max_in_flight_operations
        self.on_pressure: Callable[[ev.PressureReceived], None] | None = None
        self._ops: dict[int, Operation] = {}  # frame id -> operation waiting for its terminal
        self._close: asyncio.Future[None] | None = None

    @property
    def closing(self) -> bool:
        return self._close is not None

    def submit(
        self,
        envelope: dict[str, Any] | bytes,
        *,
        trace_id: int = 0,
        trace: tuple[int, int, int] | None = None,
        priority_class: str | None = None,
        read_timeout_s: float | None = None,
    ) -> Operation:
        """Queue one operation: ``envelope`` (a dict, or JSON bytes sent as they are) in the profile's typed
        body; ``trace_id`` the header's. ``trace`` (trace id, span id, flags; ids non-zero) queues the
        operation's own TRACE_CONTEXT right behind the FRAME_SUBMIT, in the same write. ``priority_class``
        (``"interactive"`` / ``"balanced"`` / ``"background"``; a dict envelope only) is sent as the envelope's
        ``nnrp.priority_class`` (a copy: the caller's dict is not changed). Sent on the next loop iteration.

        ``read_timeout_s`` (s; None: no bound) is the longest silence between two events (the first one
        included), as an HTTP client's read timeout bounds each read: a stream that keeps producing runs to its
        end, and a wait for an event (``async for``, :meth:`Operation.batch`, :meth:`Operation.result`) that
        lasts longer cancels the operation (FRAME_CANCEL: the server aborts the vLLM request) and raises
        :class:`ClientTimeout` (and again from any later read that would wait). A bound on the whole operation
        is the envelope's ``nnrp.timeout_ms`` (the server ends it with ``response.error`` ``request_timeout``;
        docs/wire-mapping.md "Cancellation and timeouts").

        Raises :class:`ClientConnectionError`, :class:`ClientError` on a closing session, ``ValueError`` for an
        unknown priority class or one given with a bytes envelope, or a ``read_timeout_s`` that is not
        positive."""
        if read_timeout_s is not None and not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s {read_timeout_s!r} must be positive (s) or None")
        conn = self.conn
        conn._check()
        if priority_class is not None:
            if not isinstance(envelope, dict):
                raise ValueError("priority_class needs a dict envelope")
            envelope = with_priority_class(envelope, priority_class)
        payload = envelope if isinstance(envelope, bytes) else orjson.dumps(envelope)
        try:
            body = wire_mapping.typed_body(payload)
            frame_id, operation_id = conn._core.submit(self.session_id, body, trace_id=trace_id)
            if trace is not None:
                conn._core.trace_context(self.session_id, frame_id, trace[0], trace[1], 0, flags=trace[2])
        except LocalProtocolError as exc:
            raise ClientError(str(exc)) from None
        op = self._ops[frame_id] = Operation(self, frame_id, operation_id, read_timeout_s)
        conn._flush()
        return op

    async def close(self) -> None:
        """SESSION_CLOSE, then wait for the server's ack; operations still running get their terminals
        until then. Raises :class:`ClientConnectionError`, :class:`ClientError` when the server rejects
        the close."""
        self.conn._check()
        if self._close is None:
            self._begin_close()
        assert self._close is not None  # _begin_close made it
        await asyncio.shield(self._close)

    def _begin_close(self) -> None:
        self._close = self.conn._loop.create_future()
        self.conn._core.close_session(self.session_id)
        self.conn._flush()

    def _closed_by_server(self) -> None:
        if self._close is not None and not self._close.done():
            self._close.set_result(None)
        self._fail(ClientError(f"session {self.session_id} closed before the operation's terminal"))

    def _close_failed(self, reason: str) -> None:
        close, self._close = self._close, None
        if close is not None and not close.done():
            close.set_exception(ClientError(f"close of session {self.session_id} failed: {reason}"))

    def _fail(self, error: ClientError) -> None:
        if self._close is not None and not self._close.done():
            self._close.set_exception(error)
        ops, self._ops = self._ops, {}
        for op in ops.values():
            op._fail(error)


_END = object()  # the terminal's place in an operation's queue


class Operation:
    """One submitted operation: ``async for event in op`` (module docstring), :meth:`result`,
    :meth:`cancel`. ``frame_id`` / ``operation_id`` are its NNRP ids; after the terminal,
    ``status_code`` (RESULT_PUSH) or ``drop_reason_code`` (a drop) is set."""

    __slots__ = (
        "session",
        "frame_id",
        "operation_id",
        "status_code",
        "drop_reason_code",
        "_queue",
        "_waiters",
        "_terminal_event",
        "_error",
        "_done",
        "_cancel_sent",
        "_on_done",
        "_read_timeout_s",
        "_timed_out",
    )

    def __init__(self, session: Session, frame_id: int, operation_id: int, read_timeout_s: float | None = None) -> None:
        self.session = session
        #: the longest wait for its next event (s; None: unbounded): :meth:`Session.submit`
        self._read_timeout_s = read_timeout_s
        self._timed_out: ClientTimeout | None = None
        self.frame_id = frame_id
        self.operation_id = operation_id
        self.status_code: int | None = None
        self.drop_reason_code: int | None = None
        self._queue: collections.deque[Any] = collections.deque()  # partial bodies (bytes), then _END
        self._waiters: list[asyncio.Future[None]] = []
        self._terminal_event: dict[str, Any] | None = None
        self._error: ClientError | None = None
        self._done = False  # terminal (or failure) read
        self._cancel_sent = False
        self._on_done: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        """The terminal arrived (or the operation failed), read or not."""
        return self._terminal_event is not None or self._error is not None

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the terminal arrived or the operation failed, read or not (at once when
        that happened already); on the loop, from the connection's callbacks."""
        if self.done:
            callback()
        else:
            self._on_done.append(callback)

    @property
    def finished(self) -> bool:
        """The terminal (or the failure) was read: nothing more comes."""
        return self._done

    async def batch(self) -> list[dict[str, Any]]:
        """Every event that arrived and was not read yet, in order: at least one (waits for the next), the
        terminal last when it is among them; [] once the terminal was read. Raises as :meth:`__anext__` (a
        failure discards the events read with it)."""
        try:
            out = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        while self._queue:  # ready: __anext__ does not wait
            out.append(await self.__anext__())
        return out

    def cancel(self) -> None:
        """Send FRAME_CANCEL (once; nothing once the terminal arrived). The server answers with a drop
        terminal; partial results still in flight are dropped by the wire core."""
        if self.done or self._cancel_sent:
            return
        self._cancel_sent = True
        conn = self.session.conn
        if conn._error is None:
            conn._core.frame_cancel(self.session.session_id, self.frame_id)
            conn._flush()

    def update_priority(self, priority_class: str) -> None:
        """Send PRIORITY_UPDATE: ``priority_class`` ``"interactive"`` / ``"balanced"`` / ``"background"``
        (0 / 1 / 2), ``priority_delta`` 0. Raises ``ValueError`` for another class, :class:`ClientError` once the
        operation ended."""
        code = priority_class_of(priority_class)
        self._control(lambda core, sid, fid: core.priority_update(sid, fid, code))

    def supersede(self, new: Operation | None = None) -> None:
        """Send SUPERSEDE for this operation (header frame = its frame; drop reason superseded):
        ``new_operation_id`` is ``new``'s (an operation of the same session) or 0. The terminal still comes,
        usually ``{"type": "response.cancelled", "reason": "superseded"}``. Raises :class:`ClientError` once the
        operation ended or for ``new`` of another session."""
        if new is not None and new.session is not self.session:
            raise ClientError(f"operation {new.operation_id} is not of session {self.session.session_id}")
        new_id = 0 if new is None else new.operation_id
        self._control(lambda core, sid, fid: core.supersede(sid, fid, new_id))

    def update_budget(self, token_budget: int) -> None:
        """Send BUDGET_UPDATE with ``token_budget`` (tokens, 1..2**32-1; the other budgets 0). Raises
        ``ValueError`` for a budget out of range, :class:`ClientError` once the operation ended."""
        if not 0 < token_budget < 1 << 32:
            raise ValueError(f"token_budget {token_budget!r} must be in 1..2**32-1")
        self._control(lambda core, sid, fid: core.budget_update(sid, fid, token_budget))

    def deadline(self, unix_ms: int) -> None:
        """Send DEADLINE: ``unix_ms`` wall clock, ms since the Unix epoch (> 0). Raises ``ValueError`` out of
        range, :class:`ClientError` once the operation ended."""
        _check_unix_ms(unix_ms)
        self._control(lambda core, sid, fid: core.deadline(sid, fid, unix_ms))

    def expire_at(self, unix_ms: int) -> None:
        """Send EXPIRE_AT: ``unix_ms`` wall clock, ms since the Unix epoch (> 0). Raises ``ValueError`` out of
        range, :class:`ClientError` once the operation ended."""
        _check_unix_ms(unix_ms)
        self._control(lambda core, sid, fid: core.expire_at(sid, fid, unix_ms))

    def _control(self, queue: Callable[[ClientConnection, int, int], None]) -> None:
        """Queue one control through the wire core (``queue(core, session_id, frame_id)``) and flush, as
        :meth:`cancel` does."""
        if self.done:
            raise ClientError(f"operation {self.operation_id} already ended")
        conn = self.session.conn
        conn._check()
        try:
            queue(conn._core, self.session.session_id, self.frame_id)
        except LocalProtocolError as exc:
            raise ClientError(str(exc)) from None
        conn._flush()

    def __aiter__(self) -> Operation:
        return self

    async def __anext__(self) -> dict[str, Any]:
        """The next event. Raises ``StopAsyncIteration`` after the terminal, :class:`ClientError` when the
        operation failed, :class:`ClientResponseError` for an event that is not JSON."""
        while not self._queue:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            await self._wait()
        item = self._queue.popleft()
        if item is _END:
            self._done = True
            if self._error is not None:
                raise self._error
            assert self._terminal_event is not None  # _END follows a terminal event or an error
            return self._terminal_event
        try:
            return orjson.loads(item)
        except orjson.JSONDecodeError as exc:
            raise ClientResponseError(f"operation {self.operation_id}: partial result is not JSON: {exc}") from None

    async def result(self) -> dict[str, Any]:
        """Wait for the terminal event (partials not yet read are skipped). Raises as :meth:`__anext__`."""
        while self._terminal_event is None and self._error is None:
            await self._wait()
        self._queue.clear()
        self._done = True
        if self._error is not None:
            raise self._error
        assert self._terminal_event is not None  # the wait ends with a terminal event or an error
        return self._terminal_event

    async def _wait(self) -> None:
        """Wait for the next event (or the end); the read timeout bounds the wait (:meth:`Session.submit`)."""
        if self._timed_out is not None:
            raise self._timed_out
        waiter = self.session.conn._loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._read_timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():  # the event came as the timer fired
                return
            self.cancel()
            self._timed_out = ClientTimeout(
                f"no event of operation {self.operation_id} for {self._read_timeout_s:g} s "
                "(its read timeout); it was cancelled"
            )
            raise self._timed_out from None
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- from the connection -------------------------------------------------------------------------------

    def _partial(self, body: bytes) -> None:
        self._queue.append(body)
        if self._waiters:
            self._wake()

    def _terminal(self, event: Any) -> None:
        try:
            self._terminal_event = self._decode_terminal(event)
        except ClientResponseError as exc:
            self._error = exc
        self._queue.append(_END)
        self._wake()
        self._run_done()

    def _run_done(self) -> None:
        callbacks, self._on_done = self._on_done, []
        for callback in callbacks:
            callback()

    def _decode_terminal(self, event: Any) -> dict[str, Any]:
        if isinstance(event, ev.ResultPushed):
            meta = event.metadata
            self.status_code = meta.status_code
            try:
                kinds, count = int(meta.payload_kind_bitmap), meta.payload_frame_count
                body = wire_mapping.unwrap_typed_body(kinds, count, event.body)
                return orjson.loads(body)
            except (profile_errors.ProfileError, orjson.JSONDecodeError) as exc:
                raise ClientResponseError(f"operation {self.operation_id}: RESULT_PUSH body: {exc}") from None
        code = getattr(event, "drop_reason_code", 0)
        self.drop_reason_code = code
        diagnostic = getattr(event, "diagnostic", b"")
        try:
            decoded = orjson.loads(diagnostic) if diagnostic else None
        except orjson.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            return decoded
        try:
            reason = ResultDropReasonCode(code).name.lower()
        except ValueError:
            reason = f"drop_reason_{code}"
        return {"type": "response.cancelled", "reason": reason}

    def _fail(self, error: ClientError) -> None:
        if self._terminal_event is None and self._error is None:
            self._error = error
            self._queue.append(_END)
            self._wake()
            self._run_done()


def _check_unix_ms(unix_ms: int) -> None:
    if not 0 < unix_ms < 1 << 64:
        raise ValueError(f"unix_ms {unix_ms!r} must be a time after the Unix epoch, ms (u64)")

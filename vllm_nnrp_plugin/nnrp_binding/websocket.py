"""NNRP over WebSocket (``ws://HOST:PORT/PATH``, ``wss://`` with TLS) on vLLM's event loop: the byte-stream
carrier's connection (:class:`.connection.ConnectionProtocol`) with RFC 6455 framing between the transport
and the project's wire core. The WebSocket protocol is ``wsproto``'s (sans-IO: the HTTP/1.1 Upgrade through h11,
frame parsing, unmasking, the close handshake); this module only maps it onto NNRP.

The mapping is nnrp-rs' (``crates/nnrp-transport-websocket/src/lib.rs``: tokio-tungstenite ``connect_async`` /
``accept_async``), checked against nnrp-py 1.0.0rc4.post20's native client and server byte by byte
(``tests/wire/data/captures/ws-*.jsonl``):

* the handshake is a plain RFC 6455 Upgrade, ``GET <path>`` of the client's route (``/nnrp`` unless the address
  names another path, :func:`vllm_nnrp_plugin.endpoints.parse_endpoint`), no ``Sec-WebSocket-Protocol`` and no
  extension (no ``permessage-deflate``); this server answers a request for another path with 404 and selects no
  subprotocol or extension whatever the client offers;
* every NNRP packet travels as exactly one binary message, in both directions (the native peers refuse a message
  that is not exactly one packet: ``packet_from_binary``); this server sends one message per packet and takes a
  message only if it ends on a packet boundary (a client's message holding several whole packets is taken too);
* text messages are not NNRP: the connection is closed with 1003; a message over the packet limit
  (``bounds.max_packet_bytes``, advertised in SERVER_HELLO_ACK) with 1009 as soon as it exceeds it; a message
  that ends inside a packet, or bytes the wire core refuses, with 1002; what ``wsproto`` finds malformed
  (unmasked client frames, reserved bits or opcodes, fragmented or oversized control frames, a continuation
  without a start, invalid close payloads) with the code it names;
* a browser's Upgrade carries an ``Origin`` header; one whose origin :func:`allowed_origins` does not accept
  (``nnrp.ws_allowed_origins``; by default none when no API key is required, so a web page cannot drive a
  keyless server on loopback) is answered with HTTP 403 and counted in ``nnrp_connections_refused_total``
  with reason ``origin``; a client that sends no ``Origin`` (the native client, the project's clients) is not
  refused for it;
* pings are answered with a pong carrying the same payload; pongs are ignored; the native client sends neither;
* a client's close frame (the native client sends one without a status code after its SESSION_CLOSE_ACK) is
  answered with a close frame and the connection ends; this server closes with 1001 when it stops, 1008 when
  no session opened within the handshake timeout or the client kept submitting beyond its credit, 1000 when the
  wire core ended the connection cleanly.

Sending costs one ``transport.write`` per loop iteration, as on TCP: the wire core's output of the iteration is
cut at packet boundaries and each packet gets its 2-, 4- or 10-byte frame header (server frames are not
masked), all joined into one write. Inbound payload reaches the core as ``wsproto`` unmasks it, frame by frame
(a partial frame included), so the core's incomplete packet is the only large buffer and it counts against the
listener's budget as on TCP.
"""

from __future__ import annotations

import logging
import re
import struct

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from vllm_nnrp_plugin.log_safety import loggable
from vllm_nnrp_plugin.nnrp_binding.connection import ConnectionProtocol
from vllm_nnrp_plugin.nnrp_wire.framing import packet_length

logger = logging.getLogger(__name__)

#: the close codes this server sends (RFC 6455 §7.4.1)
CLOSE_NORMAL = int(CloseReason.NORMAL_CLOSURE)  # 1000
CLOSE_GOING_AWAY = int(CloseReason.GOING_AWAY)  # 1001: the server stops
CLOSE_PROTOCOL_ERROR = int(CloseReason.PROTOCOL_ERROR)  # 1002
CLOSE_UNSUPPORTED_DATA = int(CloseReason.UNSUPPORTED_DATA)  # 1003: a text message
CLOSE_POLICY_VIOLATION = int(CloseReason.POLICY_VIOLATION)  # 1008: no session in time
CLOSE_MESSAGE_TOO_BIG = int(CloseReason.MESSAGE_TOO_BIG)  # 1009

#: the end of an HTTP/1.1 request head: an empty line, with CRLF or bare LF line ends (RFC 9112 §2.2, as h11 reads it)
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_pack_u16 = struct.Struct("!H").pack
_pack_u64 = struct.Struct("!Q").pack


def binary_frames(data: bytes) -> bytes:
    """``data``, whole NNRP packets back to back (the wire core's output), as one unmasked, final binary
    WebSocket frame per packet (RFC 6455 §5.2; what ``wsproto``'s server ``send(BytesMessage(...))`` makes)."""
    end = len(data)
    size = packet_length(data)
    if size == end:  # one packet: the usual flush of a streamed token
        return _frame_header(size) + data
    parts: list[bytes] = []
    append = parts.append
    view = memoryview(data)
    pos = 0
    while True:
        append(_frame_header(size))
        append(view[pos : pos + size])
        pos += size
        if pos >= end:
            return b"".join(parts)
        size = packet_length(data, pos)


#: an ``allowed_origins`` entry that accepts every ``Origin``
ANY_ORIGIN = "*"


def allowed_origins(configured: tuple[str, ...] | None, keys_required: bool) -> frozenset[str]:
    """The ``Origin`` values a WebSocket address accepts: the configured ones (``nnrp.ws_allowed_origins``,
    compared without case), else any when the address requires vLLM's API key, else none."""
    if configured is not None:
        return frozenset(origin.lower() for origin in configured)
    return frozenset({ANY_ORIGIN}) if keys_required else frozenset()


def _origin_refused(request: Request, origins: frozenset[str]) -> str | None:
    """The request's ``Origin`` when ``origins`` does not accept it, else ``None`` (no ``Origin``: not a browser)."""
    if ANY_ORIGIN in origins:
        return None
    for name, value in request.extra_headers:
        if name.lower() == b"origin":
            origin = value.decode("latin-1").strip()
            return None if origin.lower() in origins else origin
    return None


_SHORT_HEADERS = [bytes((0x82, n)) for n in range(126)]


def _frame_header(size: int) -> bytes:
    if size <= 125:
        return _SHORT_HEADERS[size]
    if size <= 0xFFFF:
        return b"\x82\x7e" + _pack_u16(size)
    return b"\x82\x7f" + _pack_u64(size)


class WebSocketConnection(ConnectionProtocol):
    """One accepted ``ws`` / ``wss`` connection (``transport_name`` ``websocket``); ``path``: the path the
    Upgrade must request (the listen address's, ``/nnrp`` by default); ``origins``: the ``Origin`` values it
    accepts (:func:`allowed_origins`; default none). Everything else as :class:`.connection.ConnectionProtocol`."""

    def __init__(self, *args, path: str, origins: frozenset[str] = frozenset(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._path = path
        self._origins = origins
        self._ws = WSConnection(ConnectionType.SERVER)
        self._open = False  # the Upgrade was accepted and no close frame went out yet
        self._head: bytearray | None = bytearray()  # bytes received before the Upgrade was answered
        self._message_bytes = 0  # bytes of the binary message being received

    # -- input ------------------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._handshake_timer is not None:
            self._heard_at = self._loop.time()  # type: ignore[union-attr]  # the client's silence: connection.py
        try:
            if self._head is not None:
                self._head += data
            self._ws.receive_data(data)
            events = self._ws.events()
            for event in events:
                kind = type(event)
                if kind is BytesMessage:
                    if not self._on_bytes(event):  # type: ignore[arg-type]
                        return
                elif kind is Request:
                    self._on_request(event)  # type: ignore[arg-type]
                elif kind is Ping:
                    self._send_ws(event.response())  # type: ignore[attr-defined]
                elif kind is CloseConnection:
                    self._on_close(event)  # type: ignore[arg-type]
                    return
                elif kind is TextMessage:
                    self._fail(CLOSE_UNSUPPORTED_DATA, "text messages are not NNRP")
                    return
                # Pong: nothing to do
        except RemoteProtocolError as exc:  # a bad Upgrade request: the HTTP answer wsproto suggests, then close
            self._reject(exc)
            return
        except Exception:  # a bug while handling this client's input: only this connection ends, logged once
            logger.exception("NNRP connection %d on %s: handling its input failed; the connection is closed",
                             self.connection_id, self.transport_name)  # fmt: skip
            self.abort()
            return
        if self._open and self._account():
            self.flush()

    def _on_request(self, request: Request) -> None:
        if request.target.split("?", 1)[0] != self._path:
            logger.debug("NNRP connection %d on %s: Upgrade for %s refused (not %s)", self.connection_id,
                         self.transport_name, loggable(request.target), self._path)  # fmt: skip
            self._head = None
            self._send_ws(RejectConnection(status_code=404))
            self._end_transport(None)
            return
        origin = _origin_refused(request, self._origins)
        if origin is not None:
            logger.info("NNRP connection %d on %s: WebSocket Upgrade from origin %s refused (403; "
                        "nnrp.ws_allowed_origins)", self.connection_id, self.transport_name, loggable(origin))  # fmt: skip
            self._handler.on_connection_refused(self.transport_name, "origin")
            self._head = None
            self._send_ws(RejectConnection(status_code=403))
            self._end_transport(None)
            return
        self._send_ws(AcceptConnection())
        self._open = True
        # what the client sent after its request in the same reads (wsproto's server drops it: 1.3.2
        # ``H11Handshake._accept`` makes its Connection without h11's trailing data)
        head, self._head = self._head, None
        start = len(head) - len(head.lstrip(b"\r\n"))  # an HTTP/1.1 server ignores empty lines before a request
        end = _HEAD_END.search(head, start)  # the first empty line; h11 takes bare LF line ends too
        if end is not None and end.end() < len(head):
            self._ws.receive_data(bytes(head[end.end() :]))

    def _on_bytes(self, message: BytesMessage) -> bool:
        """Feed one piece of a binary message to the wire core; False when the connection ended."""
        data = message.data
        self._message_bytes += len(data)
        if self._message_bytes > self.max_packet_bytes:
            self._fail(CLOSE_MESSAGE_TOO_BIG, f"a message over {self.max_packet_bytes} bytes")
            return False
        if data:
            for event in self._core.receive_data(data):
                if self._ending:  # ended for flooding beyond its credit (connection.py)
                    return False
                self._handle(event)
            if not self._open:
                return False
        if message.message_finished:
            if self._core.buffered or not self._message_bytes:
                self._fail(CLOSE_PROTOCOL_ERROR, "a binary message must carry whole NNRP packets")
                return False
            self._message_bytes = 0
        return True

    def _on_close(self, close: CloseConnection) -> None:
        """The client's close frame (answered), or a framing error ``wsproto`` reports as one (the connection
        is failed with its code): either way the connection ends."""
        if self._ws.state is ConnectionState.REMOTE_CLOSING:
            self.flush()  # the answers to the messages that came before the close frame go first
            self._send_ws(close.response())
            self._open = False
            for event in self._core.receive_data(b""):  # as an end of stream: every operation stops
                self._handle(event)
            self._end_transport(None)
        else:
            self._fail(close.code, close.reason or "malformed frame")

    def _fail(self, code: int, reason: str) -> None:
        """Fail the WebSocket connection (RFC 6455 §7.1.7): a close frame with ``code``, every operation stops,
        the transport closes."""
        logger.info("NNRP connection %d on %s closed (WebSocket %d): %s", self.connection_id, self.transport_name,
                    code, loggable(reason))  # fmt: skip
        self._end_transport(code, reason)
        self._lose_all("client_disconnected")

    def _reject(self, exc: RemoteProtocolError) -> None:
        logger.debug("NNRP connection %d on %s: bad WebSocket Upgrade: %s", self.connection_id, self.transport_name,
                     loggable(str(exc)))  # fmt: skip
        hint = exc.event_hint if isinstance(exc.event_hint, RejectConnection) else RejectConnection(status_code=400)
        try:
            self._send_ws(hint)
        except LocalProtocolError:  # h11 already failed: answer by hand
            self._write_raw(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        self._end_transport(None)

    def eof_received(self) -> bool:
        if self._open:
            self._open = False
            for event in self._core.receive_data(b""):
                self._handle(event)
        return False  # close the transport

    # -- output -----------------------------------------------------------------------------------------------

    def _write(self) -> None:
        data = self._core.data_to_send()
        if data and self._open:
            self._write_raw(binary_frames(data))

    def _send_ws(self, event: object) -> None:
        self._write_raw(self._ws.send(event))  # type: ignore[arg-type]

    def _write_raw(self, data: bytes) -> None:
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _end_transport(self, code: int | None, reason: str = "") -> None:
        """What was queued goes out as binary messages, then a close frame with ``code`` (none when the
        Upgrade did not happen, or when the close handshake already ran), then the transport closes."""
        if self._open:
            self._write()
            self._open = False
            if code is not None and self._ws.state is ConnectionState.OPEN:
                self._send_ws(CloseConnection(code=code, reason=reason[:100]))
        if self._transport is not None:
            self._transport.close()

    def _close_transport(self, cause: str) -> None:
        """The base connection ends the transport (:meth:`.ConnectionProtocol._close_transport`): with 1008 when
        no session opened in time or the client flooded beyond its credit, 1001 when the server stops, 1002
        after bad input, 1000 otherwise."""
        self._end_transport(_CLOSE_CODES.get(cause, CLOSE_NORMAL))


_CLOSE_CODES = {"handshake_timeout": CLOSE_POLICY_VIOLATION, "violation": CLOSE_POLICY_VIOLATION,
                "shutdown": CLOSE_GOING_AWAY, "failed": CLOSE_PROTOCOL_ERROR}  # fmt: skip

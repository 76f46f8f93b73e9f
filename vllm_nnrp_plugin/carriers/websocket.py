"""NNRP over WebSocket (``ws://``, ``wss://``), sans-IO, for either side: RFC 6455 through ``wsproto`` (the
HTTP/1.1 Upgrade through h11, masking, frame parsing, the close handshake) and the NNRP mapping on top of it.
Bytes in, events and bytes out; the asyncio shells (:mod:`vllm_nnrp_plugin.nnrp_binding.websocket` for the
server, :mod:`vllm_nnrp_plugin.client.aio.websocket` for the client) own the socket, the timers and the NNRP
connection the payload goes to.

The mapping is nnrp-rs' (``crates/nnrp-transport-websocket/src/lib.rs``: tokio-tungstenite ``connect_async`` /
``accept_async``, ``packet_from_binary``), checked against nnrp-py 1.0.0rc4.post20's native client and server byte
by byte (``tests/wire/data/captures/ws-*.jsonl``):

* every NNRP packet travels as exactly one binary message, in both directions (§5.6; the native peers refuse a
  message that is not exactly one packet): :meth:`NNRPWebSocket.send_packets` cuts whole packets back to back
  (a wire core's ``data_to_send()``) at their boundaries (:func:`vllm_nnrp_plugin.nnrp_wire.framing.split_packets`)
  and frames each one, unmasked from the server, masked from the client (§5.3);
* a received message is taken only if it ends on a packet boundary (several whole packets are taken too); one that
  ends inside a packet, or is empty, fails the connection with 1002, a text message with 1003, a message over
  ``max_message_bytes`` (the server's packet limit) with 1009 as soon as it exceeds it (§7.4.1); what ``wsproto``
  finds malformed (unmasked client frames, reserved bits or opcodes, fragmented or oversized control frames, a
  continuation without a start, invalid close payloads) with the code it names;
* the payload reaches the shell as ``wsproto`` unmasks it, frame by frame (a partial frame included), so the wire
  core's incomplete packet is the only large buffer;
* pings are answered with a pong carrying the same payload (§5.5.2); pongs are ignored;
* a close frame from the peer is answered (§5.5.1).

Plain data: no sockets, threads or clocks.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator

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
from wsproto.events import Event as WSEvent
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from vllm_nnrp_plugin.nnrp_wire.framing import PacketBoundary, split_packets

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_NO_STATUS",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_UNSUPPORTED_DATA",
    "CloseAnswered",
    "Failed",
    "Malformed",
    "NNRPWebSocket",
    "Payload",
    "PeerClosed",
    "PingAnswered",
    "UpgradeRefused",
    "UpgradeRequested",
    "Upgraded",
    "binary_frames",
]

#: close codes (RFC 6455 §7.4.1)
CLOSE_NORMAL = int(CloseReason.NORMAL_CLOSURE)  # 1000
CLOSE_GOING_AWAY = int(CloseReason.GOING_AWAY)  # 1001: the server stops
CLOSE_PROTOCOL_ERROR = int(CloseReason.PROTOCOL_ERROR)  # 1002
CLOSE_UNSUPPORTED_DATA = int(CloseReason.UNSUPPORTED_DATA)  # 1003: a text message
CLOSE_POLICY_VIOLATION = int(CloseReason.POLICY_VIOLATION)  # 1008: no session in time, submits beyond credit
CLOSE_MESSAGE_TOO_BIG = int(CloseReason.MESSAGE_TOO_BIG)  # 1009
#: 1005: a close frame without a status code (kept wsproto's enum: ``FrameProtocol.close`` knows it by identity and
#: would send a plain 1005 as 1000)
CLOSE_NO_STATUS = CloseReason.NO_STATUS_RCVD

#: the end of an HTTP/1.1 request head: an empty line, with CRLF or bare LF line ends (RFC 9112 §2.2, as h11 reads it)
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_pack_u16 = struct.Struct("!H").pack
_pack_u64 = struct.Struct("!Q").pack
_SHORT_HEADERS = [bytes((0x82, n)) for n in range(126)]

#: how each side words what the other sent wrong (the reason of its close frame)
_REASONS = {
    ConnectionType.SERVER: {
        "text": "text messages are not NNRP",
        "not_whole": "a binary message must carry whole NNRP packets",
        "malformed": "malformed frame",
    },
    ConnectionType.CLIENT: {
        "text": "the server sent a text message (not NNRP)",
        "not_whole": "a binary message from the server does not carry whole NNRP packets",
        "malformed": "malformed WebSocket frame from the server",
    },
}


# -- what the peer's bytes mean ----------------------------------------------------------------------------------


class Payload:
    """NNRP bytes, a piece of a binary message (``data``: ``bytes`` or ``bytearray``, as ``wsproto`` unmasked
    it): the NNRP connection's input, in order."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data


class UpgradeRequested:
    """Server side: the client's Upgrade (``request``: ``wsproto``'s, with ``target`` and ``extra_headers``);
    the shell answers it with :meth:`NNRPWebSocket.accept` or :meth:`NNRPWebSocket.reject`."""

    __slots__ = ("request",)

    def __init__(self, request: Request) -> None:
        self.request = request


class Upgraded:
    """Client side: the server answered the Upgrade with ``101`` (RFC 6455 §4.2.2 checked by ``wsproto``)."""

    __slots__ = ()


class UpgradeRefused:
    """Client side: the server answered the Upgrade with ``status_code`` (not ``101``)."""

    __slots__ = ("status_code",)

    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class PingAnswered:
    """A ping came; ``answer``: the pong to write (``b""`` when the state no longer allows one)."""

    __slots__ = ("answer",)

    def __init__(self, answer: bytes) -> None:
        self.answer = answer


class PeerClosed:
    """The peer's close frame (``code``: 1005 when it carried none; ``reason``); ``answer``: the close frame that
    answers it (§5.5.1), to write once what came before it was answered. The connection ends."""

    __slots__ = ("code", "reason", "answer")

    def __init__(self, code: int, reason: str, answer: bytes) -> None:
        self.code = code
        self.reason = reason
        self.answer = answer


class CloseAnswered:
    """Client side: the server's answer to this side's close frame; the connection ends."""

    __slots__ = ()


class Failed:
    """The peer broke the mapping or RFC 6455: fail the connection (§7.1.7) with close ``code`` and ``reason``
    (:meth:`NNRPWebSocket.close_frame`). Nothing after it is read."""

    __slots__ = ("code", "reason")

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


class Malformed:
    """``wsproto`` refused the peer's bytes (``error``: its ``RemoteProtocolError``): a bad Upgrade request or
    answer, or bad data. Nothing after it is read."""

    __slots__ = ("error",)

    def __init__(self, error: RemoteProtocolError) -> None:
        self.error = error


#: what :meth:`NNRPWebSocket.receive_data` yields
Event = (
    Payload
    | UpgradeRequested
    | Upgraded
    | UpgradeRefused
    | PingAnswered
    | PeerClosed
    | CloseAnswered
    | Failed
    | Malformed
)


# -- one side of a connection ------------------------------------------------------------------------------------


class NNRPWebSocket:
    """One side (``side``: ``wsproto``'s ``ConnectionType``) of a WebSocket connection carrying NNRP.
    ``max_message_bytes``: the largest message taken (bytes; ``None``: no bound but the NNRP connection's own
    packet limit)."""

    __slots__ = ("_ws", "_side", "_reasons", "_max", "_message_bytes", "_boundary", "_head")

    def __init__(self, side: ConnectionType, *, max_message_bytes: int | None = None) -> None:
        self._ws = WSConnection(side)
        self._side = side
        self._reasons = _REASONS[side]
        self._max = max_message_bytes
        self._message_bytes = 0  # bytes of the binary message being received
        self._boundary = PacketBoundary()
        #: server side: the bytes received before the Upgrade was answered
        self._head: bytearray | None = bytearray() if side is ConnectionType.SERVER else None

    @property
    def open(self) -> bool:
        """The Upgrade was accepted and no close frame went out or came yet."""
        return self._ws.state is ConnectionState.OPEN

    # -- input ------------------------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> Iterator[Event]:
        """Feed ``data`` (a read) and yield what it means, in order; lazily, so that what
        the shell does for one event (:meth:`accept`) counts for the next. Stop reading at :class:`Failed` or
        :class:`Malformed`, and when the NNRP connection ended."""
        if self._head is not None:
            self._head += data
        try:
            self._ws.receive_data(data)
            for event in self._ws.events():
                if type(event) is BytesMessage:
                    payload = event.data
                    self._message_bytes += len(payload)
                    if self._max is not None and self._message_bytes > self._max:
                        yield Failed(CLOSE_MESSAGE_TOO_BIG, f"a message over {self._max} bytes")
                        return
                    if payload:
                        self._boundary.feed(payload)
                        yield Payload(payload)
                    if event.message_finished:
                        if not self._boundary.at_boundary or not self._message_bytes:
                            yield Failed(CLOSE_PROTOCOL_ERROR, self._reasons["not_whole"])
                            return
                        self._message_bytes = 0
                elif type(event) is Request:
                    yield UpgradeRequested(event)
                elif type(event) is Ping:
                    yield PingAnswered(self.send(event.response()))
                elif type(event) is CloseConnection:
                    yield self._close_received(event)
                    return
                elif type(event) is TextMessage:
                    yield Failed(CLOSE_UNSUPPORTED_DATA, self._reasons["text"])
                    return
                elif type(event) is AcceptConnection:
                    yield Upgraded()
                elif type(event) is RejectConnection:
                    yield UpgradeRefused(event.status_code)
                    return
                # Pong, RejectData: nothing to do
        except RemoteProtocolError as exc:
            yield Malformed(exc)

    def _close_received(self, close: CloseConnection) -> Event:
        state = self._ws.state
        if state is ConnectionState.REMOTE_CLOSING:
            return PeerClosed(int(close.code), close.reason or "", self.send(close.response()))
        if state is ConnectionState.CLOSED and self._side is ConnectionType.CLIENT:
            return CloseAnswered()
        # wsproto found the peer's frames malformed and names the code to fail with (the server closes its
        # transport behind its own close frame: an answer to it is not waited for)
        return Failed(close.code, close.reason or self._reasons["malformed"])

    # -- output -----------------------------------------------------------------------------------------------

    def send_packets(self, data: bytes) -> bytes:
        """``data``, whole NNRP packets back to back, as one final binary frame per packet: the server's built
        here, unmasked (:func:`binary_frames`), the client's masked by ``wsproto``."""
        if self._side is ConnectionType.SERVER:
            return binary_frames(data)
        send = self._ws.send
        return b"".join([send(BytesMessage(data=packet)) for packet in split_packets(data)])

    def send(self, event: WSEvent) -> bytes:
        """``wsproto``'s bytes of ``event``; ``b""`` when the state no longer allows it (a close frame already
        went out)."""
        try:
            return self._ws.send(event)
        except LocalProtocolError:
            return b""

    def close_frame(self, code: int, reason: str = "") -> bytes:
        """A close frame with ``code`` (:data:`CLOSE_NO_STATUS`: none) and ``reason`` (cut to 100 characters, so
        the frame stays a control frame, §5.5), while the connection is open; else ``b""``."""
        if self._ws.state is not ConnectionState.OPEN:
            return b""
        return self._ws.send(CloseConnection(code=code, reason=reason[:100]))

    def request(self, host: str, path: str) -> bytes:
        """Client side: the Upgrade request (§4.1): ``GET path``, ``Host: host``, no subprotocol, no extension."""
        return self._ws.send(Request(host=host, target=path))

    def accept(self) -> bytes:
        """Server side: the ``101`` answering :class:`UpgradeRequested` (no subprotocol, no extension). What the
        client sent after its request in the same reads is read next (``wsproto`` 1.3.2's server drops it:
        ``H11Handshake._accept`` makes its Connection without h11's trailing data)."""
        answer = self._ws.send(AcceptConnection())
        head, self._head = self._head or bytearray(), None
        start = len(head) - len(head.lstrip(b"\r\n"))  # an HTTP/1.1 server ignores empty lines before a request
        end = _HEAD_END.search(head, start)  # the first empty line; h11 takes bare LF line ends too
        if end is not None and end.end() < len(head):
            self._ws.receive_data(bytes(head[end.end() :]))
        return answer

    def reject(self, status_code: int) -> bytes:
        """Server side: an HTTP answer ``status_code`` to :class:`UpgradeRequested`; the connection ends."""
        self._head = None
        return self._ws.send(RejectConnection(status_code=status_code))

    def reject_malformed(self, error: RemoteProtocolError) -> bytes:
        """Server side: the HTTP answer to a bad Upgrade request (:class:`Malformed`): the one ``wsproto``
        suggests, else 400 (by hand when h11 already failed)."""
        hint = error.event_hint if isinstance(error.event_hint, RejectConnection) else RejectConnection(status_code=400)
        try:
            return self._ws.send(hint)
        except LocalProtocolError:
            return b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def binary_frames(data: bytes) -> bytes:
    """``data``, whole NNRP packets back to back, as one unmasked, final binary WebSocket frame per packet (RFC
    6455 §5.2; what ``wsproto``'s server ``send(BytesMessage(...))`` makes, without its copies)."""
    packets = split_packets(data)
    if len(packets) == 1:  # one packet: the usual flush of a streamed token
        return _frame_header(len(data)) + data
    return b"".join([_frame_header(len(packet)) + packet for packet in packets])


def _frame_header(size: int) -> bytes:
    if size <= 125:
        return _SHORT_HEADERS[size]
    if size <= 0xFFFF:
        return b"\x82\x7e" + _pack_u16(size)
    return b"\x82\x7f" + _pack_u64(size)

"""The asyncio client's WebSocket carrier (``ws://HOST:PORT/PATH``, ``wss://`` with TLS): RFC 6455 framing between
a TCP (or TLS) transport and a :class:`~vllm_nnrp_plugin.client.connection.Connection`, which sees
:class:`WebSocketCarrier` as its transport. The WebSocket protocol is ``wsproto``'s (sans-IO,
``ConnectionType.CLIENT``: the HTTP/1.1 Upgrade through h11, masking, frame parsing, the close handshake); this
module only maps it onto NNRP.

The mapping is the server's (:mod:`vllm_nnrp_plugin.nnrp_binding.websocket`) and nnrp-rs'
(``crates/nnrp-transport-websocket/src/lib.rs``: tokio-tungstenite ``connect_async``, ``packet_from_binary``):

* the handshake is a plain RFC 6455 Upgrade (§4.1): ``GET <path>`` (the address's path, ``/nnrp`` when it names
  none: :func:`vllm_nnrp_plugin.endpoints.parse_endpoint`), ``Host`` the address's authority, no
  ``Sec-WebSocket-Protocol`` and no extension; an answer other than ``101`` (the plugin's server answers 404 for
  another path) or a ``101`` that breaks §4.2.2 (wrong ``Sec-WebSocket-Accept``, a subprotocol or extension that
  was not offered) fails the connect with :class:`~vllm_nnrp_plugin.client.errors.ClientConnectionError`;
* every NNRP packet travels as exactly one binary message (§5.6), in both directions: the wire core's output of
  one loop iteration (whole packets back to back) is cut at the packet boundaries of the 40-byte NNRP common
  header (``meta_len`` and ``body_len``, u32 little-endian at offset 12:
  :func:`vllm_nnrp_plugin.nnrp_wire.framing.split_packets`) and each packet is sent as one masked (§5.3), final
  binary frame; all of them joined into one ``transport.write``. A received message must end on a packet
  boundary (several whole packets are taken too, as the plugin's server takes them); one that ends inside a
  packet, or is empty, fails the connection with close code 1002, a text message with 1003 (§7.4.1), and
  what ``wsproto`` finds malformed with the code it names; each fails every pending open, operation and close
  as a lost TCP connection does;
* pings are answered with a pong carrying the same payload (§5.5.2); pongs are ignored;
* closing (:meth:`WebSocketCarrier.close`, what :meth:`Connection.close` ends with after every session's
  SESSION_CLOSE_ACK) sends a close frame without a status code, as nnrp-py's native client does (tungstenite's
  ``close(None)``), then closes the TCP connection once the server's close frame came (§7.1.2), or after
  :data:`CLOSE_TIMEOUT_S`; a close frame from the server is answered (§5.5.1) and ends the NNRP connection: as
  an end of stream for 1000 (normal) or no status code, as a lost connection naming the code otherwise (the
  plugin's server sends 1001 when it stops, 1008 when no session opened in time).

Inbound payload reaches the wire core as ``wsproto`` unmasks it, frame by frame (a partial frame included), so
the core's incomplete packet (bounded by ``max_packet_bytes``) is the only large buffer. No threads, no polling;
the only timer is the close frame's.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as _ssl
from typing import TYPE_CHECKING, Any

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

from vllm_nnrp_plugin.client.errors import ClientConnectionError
from vllm_nnrp_plugin.nnrp_wire.framing import PacketBoundary, split_packets

if TYPE_CHECKING:
    from vllm_nnrp_plugin.client.connection import Connection

__all__ = ["CLOSE_TIMEOUT_S", "DEFAULT_PATH", "WebSocketCarrier", "open_websocket"]

#: the path of the Upgrade when the address names none (:func:`vllm_nnrp_plugin.endpoints.parse_endpoint`)
DEFAULT_PATH = "/nnrp"
#: seconds the client waits for the server's close frame after sending its own before closing TCP anyway
CLOSE_TIMEOUT_S = 2.0

#: close codes this client sends when it fails the connection (RFC 6455 §7.4.1)
CLOSE_PROTOCOL_ERROR = int(CloseReason.PROTOCOL_ERROR)  # 1002
CLOSE_UNSUPPORTED_DATA = int(CloseReason.UNSUPPORTED_DATA)  # 1003
#: close codes that end the NNRP connection as a clean end of stream, not as a loss
_CLEAN_CLOSES = (int(CloseReason.NORMAL_CLOSURE), int(CloseReason.NO_STATUS_RCVD))

class WebSocketCarrier(asyncio.Protocol):
    """The ``asyncio.Protocol`` of one TCP (or TLS) connection carrying NNRP over WebSocket, and the transport
    its :class:`~vllm_nnrp_plugin.client.connection.Connection` writes to (``write``, ``close``, ``abort``,
    ``is_closing``, ``get_extra_info`` — the TCP transport's extra info). Made by :func:`open_websocket`;
    ``nnrp``: the connection to attach once the Upgrade was accepted; ``host``: the ``Host`` header; ``path``:
    the Upgrade's target."""

    def __init__(self, nnrp: Connection, host: str, path: str) -> None:
        self._nnrp = nnrp
        self._host = host
        self._path = path
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._tcp: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        #: the Upgrade's outcome: the NNRP connection attached, or the ClientConnectionError of the connect
        self.upgraded: asyncio.Future[None] = self._loop.create_future()
        self._attached = False  # the Upgrade was accepted and ``nnrp`` was told connection_made
        self._lost_told = False  # ``nnrp`` was told connection_lost
        self._closing = False  # close() or abort() ran, or the connection ended: nothing more is sent
        self._reason: Exception | None = None  # why the NNRP connection ended, when it was not a clean end
        self._boundary = PacketBoundary()
        self._message_bytes = 0  # bytes of the binary message being received
        self._close_timer: asyncio.TimerHandle | None = None

    # -- the NNRP connection's transport -------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` (whole NNRP packets back to back) as one masked binary message per packet, in one
        write to the TCP transport."""
        if self._closing or self._tcp is None or not data:
            return
        send = self._ws.send
        self._tcp.write(b"".join([send(BytesMessage(data=packet)) for packet in split_packets(bytes(data))]))

    def close(self) -> None:
        """Start the close handshake (a close frame without a status code); TCP closes when the server's close
        frame came, or after :data:`CLOSE_TIMEOUT_S`."""
        if self._closing:
            return
        self._closing = True
        if self._tcp is None:
            return
        if self._ws.state is ConnectionState.OPEN:
            self._send_ws(CloseConnection(code=CloseReason.NO_STATUS_RCVD))
            self._close_timer = self._loop.call_later(CLOSE_TIMEOUT_S, self._close_tcp)
        else:
            self._close_tcp()

    def abort(self) -> None:
        """Close the TCP connection at once (no close frame)."""
        self._closing = True
        if self._tcp is not None:
            self._tcp.abort()

    def is_closing(self) -> bool:
        return self._closing or self._tcp is None or self._tcp.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "websocket_path":
            return self._path
        return default if self._tcp is None else self._tcp.get_extra_info(name, default)

    # -- asyncio.Protocol of the TCP connection ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tcp = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tcp.write(self._ws.send(Request(host=self._host, target=self._path)))

    def data_received(self, data: bytes) -> None:
        try:
            self._ws.receive_data(data)
            for event in self._ws.events():
                kind = type(event)
                if kind is BytesMessage:
                    if not self._on_bytes(event):  # type: ignore[arg-type]
                        return
                elif kind is Ping:
                    self._send_ws(event.response())  # type: ignore[attr-defined]
                elif kind is CloseConnection:
                    self._on_close(event)  # type: ignore[arg-type]
                    return
                elif kind is TextMessage:
                    self._fail(CLOSE_UNSUPPORTED_DATA, "the server sent a text message (not NNRP)")
                    return
                elif kind is AcceptConnection:
                    self._on_accepted(event)  # type: ignore[arg-type]
                elif kind is RejectConnection:
                    self._refused(f"the server refused the WebSocket Upgrade of {self._path}: HTTP "
                                  f"{event.status_code}")  # type: ignore[attr-defined]  # fmt: skip
                    return
                # Pong, RejectData: nothing to do
        except RemoteProtocolError as exc:
            if not self._attached:
                self._refused(f"the server's answer to the WebSocket Upgrade is not RFC 6455's: {exc}")
            else:
                self._fail(CLOSE_PROTOCOL_ERROR, f"malformed WebSocket data from the server: {exc}")

    def eof_received(self) -> bool:
        if not self._attached:
            self._refused("the server closed the connection before answering the WebSocket Upgrade")
        elif not self._lost_told:
            self._closing = True
            self._nnrp.eof_received()  # the server's end of stream without a close frame (1006)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        self._closing = True
        if not self._attached:
            self._refused(f"the connection was lost during the WebSocket Upgrade: {exc}" if exc else
                          "the server closed the connection before answering the WebSocket Upgrade")  # fmt: skip
        self._tell_lost(exc)

    # -- plumbing ------------------------------------------------------------------------------------------

    def _on_accepted(self, _event: AcceptConnection) -> None:
        """The ``101``: attach the NNRP connection now, before the frames that came in the same read."""
        self._attached = True
        self._nnrp.connection_made(self)  # type: ignore[arg-type]
        if not self.upgraded.done():
            self.upgraded.set_result(None)

    def _on_bytes(self, message: BytesMessage) -> bool:
        """Feed one piece of a binary message to the NNRP connection; False when the connection ended."""
        data = message.data
        self._message_bytes += len(data)
        if data:
            self._boundary.feed(data)
            self._nnrp.data_received(bytes(data))
            if self._lost_told or self._tcp is None:
                return False
        if message.message_finished:
            if not self._boundary.at_boundary or not self._message_bytes:
                self._fail(CLOSE_PROTOCOL_ERROR, "a binary message from the server does not carry whole NNRP packets")
                return False
            self._message_bytes = 0
        return True

    def _on_close(self, close: CloseConnection) -> None:
        """The server's close frame (answered, §5.5.1), our own close's answer, or a framing error ``wsproto``
        reports as one: the NNRP connection ends."""
        state = self._ws.state
        if state is ConnectionState.REMOTE_CLOSING:  # the server closes: answer, then end
            self._send_ws(close.response())
            self._closing = True
            code = int(close.code)
            if code in _CLEAN_CLOSES:
                if not self._lost_told:
                    self._nnrp.eof_received()
            else:
                reason = f": {close.reason}" if close.reason else ""
                self._tell_lost(ConnectionError(f"the server closed the WebSocket with {code} "
                                                f"({_close_name(code)}){reason}"))  # fmt: skip
            self._close_tcp()
        elif state is ConnectionState.CLOSED:  # the answer to our close frame
            self._close_tcp()
        else:  # wsproto found the server's frames malformed and tells the code to fail with
            self._fail(int(close.code), close.reason or "malformed WebSocket frame from the server")

    def _fail(self, code: int, reason: str) -> None:
        """Fail the WebSocket connection (RFC 6455 §7.1.7): a close frame with ``code``, the NNRP connection is
        lost with ``reason``, TCP closes."""
        if self._ws.state is ConnectionState.OPEN:
            self._send_ws(CloseConnection(code=code, reason=reason[:100]))
        self._closing = True
        self._tell_lost(ConnectionError(f"WebSocket closed ({code}): {reason}"))
        self._close_tcp()

    def _refused(self, reason: str) -> None:
        """The Upgrade failed: the connect fails with ``reason``, TCP closes."""
        self._closing = True
        if not self.upgraded.done():
            self.upgraded.set_exception(ClientConnectionError(reason))
        if self._tcp is not None:
            self._tcp.close()

    def _tell_lost(self, exc: Exception | None) -> None:
        if self._attached and not self._lost_told:
            self._lost_told = True
            self._nnrp.connection_lost(exc)

    def _send_ws(self, event: Any) -> None:
        try:
            data = self._ws.send(event)
        except LocalProtocolError:  # the state no longer allows it (a close frame already went out)
            return
        if data and self._tcp is not None and not self._tcp.is_closing():
            self._tcp.write(data)

    def _close_tcp(self) -> None:
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        if self._tcp is not None:
            self._tcp.close()


def _close_name(code: int) -> str:
    try:
        return CloseReason(code).name.lower().replace("_", " ")
    except ValueError:
        return "unregistered code"


async def open_websocket(
    nnrp: Connection, host: str, port: int, path: str, *, ssl: _ssl.SSLContext | None = None
) -> WebSocketCarrier:
    """Connect TCP to ``host``:``port`` (TLS with ``ssl``, the server name ``host``), run the Upgrade for
    ``path`` and attach ``nnrp`` (its ``connection_made`` gets the carrier). Returns the carrier. Raises
    ``OSError`` / ``ssl.SSLError`` (nothing listens, the TLS handshake failed) and
    :class:`~vllm_nnrp_plugin.client.errors.ClientConnectionError` (the Upgrade was refused or answered
    wrongly, or the connection closed before the answer). Cancelled, it closes what it opened."""
    loop = asyncio.get_running_loop()
    authority = f"[{host}]" if ":" in host else host
    carrier = WebSocketCarrier(nnrp, f"{authority}:{port}", path)
    await loop.create_connection(lambda: carrier, host, port, ssl=ssl, server_hostname=host if ssl else None)
    try:
        await carrier.upgraded
    except BaseException:
        carrier.abort()
        raise
    return carrier

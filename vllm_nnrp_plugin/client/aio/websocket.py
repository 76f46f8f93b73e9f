"""The asyncio client's WebSocket carrier (``ws://HOST:PORT/PATH``, ``wss://`` with TLS): the asyncio shell of
:class:`vllm_nnrp_plugin.carriers.websocket.NNRPWebSocket` (the mapping of NNRP onto RFC 6455, sans-IO, shared
with the plugin's server) between a TCP (or TLS) transport and a
:class:`~vllm_nnrp_plugin.client.aio.connection.Connection`, which sees :class:`WebSocketCarrier` as its transport.

What the client side adds to the mapping:

* the handshake is a plain RFC 6455 Upgrade (§4.1): ``GET <path>`` (the address's path,
  :data:`vllm_nnrp_plugin.contract.endpoints.WEBSOCKET_PATH` when it names none), ``Host`` the address's authority, no
  ``Sec-WebSocket-Protocol`` and no extension; an answer other than ``101`` (the plugin's server answers 404 for
  another path) or a ``101`` that breaks §4.2.2 (wrong ``Sec-WebSocket-Accept``, a subprotocol or extension that
  was not offered) fails the connect with :class:`~vllm_nnrp_plugin.client.errors.ClientConnectionError`;
* what the wire core queued in one loop iteration goes out in one ``transport.write``, one masked binary
  message per packet; a message the mapping fails (1002, 1003, what ``wsproto`` finds malformed) fails every
  pending open, operation and close as a lost TCP connection does;
* closing (:meth:`WebSocketCarrier.close`, what :meth:`Connection.close` ends with after every session's
  SESSION_CLOSE_ACK) sends a close frame without a status code, as nnrp-py's native client does (tungstenite's
  ``close(None)``), then closes the TCP connection once the server's close frame came (§7.1.2), or after
  :data:`CLOSE_TIMEOUT_S`; a close frame from the server is answered (§5.5.1) and ends the NNRP connection: as
  an end of stream for 1000 (normal) or no status code, as a lost connection naming the code otherwise (the
  plugin's server sends 1001 when it stops, 1008 when no session opened in time).

No threads, no polling; the only timer is the close frame's.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as _ssl
from typing import Any

from wsproto import ConnectionType
from wsproto.frame_protocol import CloseReason

from vllm_nnrp_plugin.carriers import websocket as mapping
from vllm_nnrp_plugin.client.errors import ClientConnectionError

__all__ = ["CLOSE_TIMEOUT_S", "WebSocketCarrier", "open_websocket"]

#: seconds the client waits for the server's close frame after sending its own before closing TCP anyway
CLOSE_TIMEOUT_S = 2.0
#: close codes that end the NNRP connection as a clean end of stream, not as a loss
_CLEAN_CLOSES = (mapping.CLOSE_NORMAL, mapping.CLOSE_NO_STATUS)


class WebSocketCarrier(asyncio.Protocol):
    """The ``asyncio.Protocol`` of one TCP (or TLS) connection carrying NNRP over WebSocket, and the transport
    its NNRP connection (``nnrp``: an ``asyncio.Protocol``, the client's
    :class:`~vllm_nnrp_plugin.client.aio.connection.Connection`) writes to (``write``, ``close``, ``abort``,
    ``is_closing``, ``get_extra_info`` — the TCP transport's extra info). Made by :func:`open_websocket`;
    ``nnrp`` is attached once the Upgrade was accepted; ``host``: the ``Host`` header; ``path``: the Upgrade's
    target."""

    def __init__(self, nnrp: asyncio.Protocol, host: str, path: str) -> None:
        self._nnrp = nnrp
        self._host = host
        self._path = path
        self._ws = mapping.NNRPWebSocket(ConnectionType.CLIENT)
        self._tcp: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        #: the Upgrade's outcome: the NNRP connection attached, or the ClientConnectionError of the connect
        self.upgraded: asyncio.Future[None] = self._loop.create_future()
        self._attached = False  # the Upgrade was accepted and ``nnrp`` was told connection_made
        self._lost_told = False  # ``nnrp`` was told connection_lost
        self._closing = False  # close() or abort() ran, or the connection ended: nothing more is sent
        self._close_timer: asyncio.TimerHandle | None = None

    # -- the NNRP connection's transport -------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` (whole NNRP packets back to back) as one masked binary message per packet, in one
        write to the TCP transport."""
        if self._closing or self._tcp is None or not data:
            return
        self._tcp.write(self._ws.send_packets(bytes(data)))

    def close(self) -> None:
        """Start the close handshake (a close frame without a status code); TCP closes when the server's close
        frame came, or after :data:`CLOSE_TIMEOUT_S`."""
        if self._closing:
            return
        self._closing = True
        if self._tcp is None:
            return
        if self._ws.open:
            self._send(self._ws.close_frame(mapping.CLOSE_NO_STATUS))
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
        self._tcp = transport  # type: ignore[assignment]  # a stream protocol gets a Transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tcp.write(self._ws.request(self._host, self._path))  # type: ignore[union-attr]  # set just above

    def data_received(self, data: bytes) -> None:
        for event in self._ws.receive_data(data):
            if type(event) is mapping.Payload:
                self._nnrp.data_received(bytes(event.data))
                if self._lost_told or self._tcp is None:
                    return
            elif type(event) is mapping.PingAnswered:
                self._send(event.answer)
            elif type(event) is mapping.PeerClosed:
                self._on_close(event)
                return
            elif type(event) is mapping.CloseAnswered:  # the answer to our close frame
                self._close_tcp()
                return
            elif type(event) is mapping.Failed:
                self._fail(event.code, event.reason)
                return
            elif type(event) is mapping.Upgraded:
                self._on_upgraded()
            elif type(event) is mapping.UpgradeRefused:
                self._refused(f"the server refused the WebSocket Upgrade of {self._path}: HTTP {event.status_code}")
                return
            elif type(event) is mapping.Malformed:
                if not self._attached:
                    self._refused(f"the server's answer to the WebSocket Upgrade is not RFC 6455's: {event.error}")
                else:
                    self._fail(mapping.CLOSE_PROTOCOL_ERROR, f"malformed WebSocket data from the server: {event.error}")
                return

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
            self._refused(
                f"the connection was lost during the WebSocket Upgrade: {exc}"
                if exc
                else "the server closed the connection before answering the WebSocket Upgrade"
            )
        self._tell_lost(exc)

    # -- plumbing ------------------------------------------------------------------------------------------

    def _on_upgraded(self) -> None:
        """The ``101``: attach the NNRP connection now, before the frames that came in the same read."""
        self._attached = True
        self._nnrp.connection_made(self)  # type: ignore[arg-type]  # this carrier is the NNRP connection's transport
        if not self.upgraded.done():
            self.upgraded.set_result(None)

    def _on_close(self, close: mapping.PeerClosed) -> None:
        """The server's close frame (answered, §5.5.1): the NNRP connection ends, as an end of stream for 1000 or
        no status code, as a lost connection naming the code otherwise."""
        self._send(close.answer)
        self._closing = True
        if close.code in _CLEAN_CLOSES:
            if not self._lost_told:
                self._nnrp.eof_received()
        else:
            reason = f": {close.reason}" if close.reason else ""
            self._tell_lost(
                ConnectionError(
                    f"the server closed the WebSocket with {close.code} ({_close_name(close.code)}){reason}"
                )
            )
        self._close_tcp()

    def _fail(self, code: int, reason: str) -> None:
        """Fail the WebSocket connection (RFC 6455 §7.1.7): a close frame with ``code``, the NNRP connection is
        lost with ``reason``, TCP closes."""
        self._send(self._ws.close_frame(code, reason))
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

    def _send(self, data: bytes) -> None:
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
    nnrp: asyncio.Protocol, host: str, port: int, path: str, *, ssl: _ssl.SSLContext | None = None
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

"""NNRP over WebSocket (``ws://HOST:PORT/PATH``, ``wss://`` with TLS) on vLLM's event loop: the byte-stream
carrier's shell (:class:`WebSocketConnection`) of an :class:`.connection.NNRPConnection`, with RFC 6455
between the transport and the project's wire core through :class:`vllm_nnrp_plugin.carriers.websocket.NNRPWebSocket`
(the mapping of NNRP onto RFC 6455, sans-IO, shared with the client: one binary message per packet, the close
codes of a text message, of a message over the packet limit or not ending on a packet boundary, pings, the
close handshake).

What the server side adds to the mapping:

* the handshake is a plain RFC 6455 Upgrade, ``GET <path>`` of the client's route (``/nnrp`` unless the address
  names another path, :func:`vllm_nnrp_plugin.contract.endpoints.parse_endpoint`), no ``Sec-WebSocket-Protocol`` and no
  extension (no ``permessage-deflate``); this server answers a request for another path with 404 and selects no
  subprotocol or extension whatever the client offers; a bad request gets the HTTP answer ``wsproto`` suggests;
* a message is taken up to the packet limit (``bounds.max_packet_bytes``, advertised in SERVER_HELLO_ACK);
  bytes the wire core refuses close the connection with 1002;
* a browser's Upgrade carries an ``Origin`` header; one whose origin :func:`allowed_origins` does not accept
  (``nnrp.ws_allowed_origins``; by default none when no API key is required, so a web page cannot drive a
  keyless server on loopback) is answered with HTTP 403 and counted in ``nnrp_connections_refused_total``
  with reason ``origin``; a client that sends no ``Origin`` (the native client, the project's clients) is not
  refused for it;
* a client's close frame (the native client sends one without a status code after its SESSION_CLOSE_ACK) is
  answered after the answers to what came before it, and the connection ends; this server closes with 1001 when
  it stops, 1008 when no session opened within the handshake timeout or the client kept submitting beyond its
  credit, 1000 when the wire core ended the connection cleanly.

Sending costs one ``transport.write`` per loop iteration, as on TCP: the wire core's output of the iteration,
one unmasked binary frame per packet. Inbound payload reaches the core as ``wsproto`` unmasks it, frame by frame
(a partial frame included), so the core's incomplete packet is the only large buffer and it counts against the
listener's budget as on TCP.
"""

from __future__ import annotations

import logging

from wsproto import ConnectionType
from wsproto.events import Request
from wsproto.utilities import RemoteProtocolError

from vllm_nnrp_plugin.carriers import websocket as mapping
from vllm_nnrp_plugin.nnrp_binding.connection import NNRPConnection
from vllm_nnrp_plugin.nnrp_binding.shell import SocketShell
from vllm_nnrp_plugin.observability.log_safety import loggable

logger = logging.getLogger(__name__)


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


class WebSocketConnection(SocketShell):
    """The ``asyncio.Protocol`` of one accepted ``ws`` / ``wss`` connection, and its NNRP connection's
    :class:`.connection.Carrier`. ``nnrp``: the NNRP connection (``transport_name`` ``websocket``); ``path``: the
    path the Upgrade must request (the listen address's, ``/nnrp`` by default); ``origins``: the ``Origin``
    values it accepts (:func:`allowed_origins`; default none); ``first``: bytes the listener read from the socket
    as it accepted it, taken as the first read; ``tcp_nodelay``: set TCP_NODELAY."""

    def __init__(
        self,
        nnrp: NNRPConnection,
        *,
        path: str,
        origins: frozenset[str] = frozenset(),
        first: bytes = b"",
        tcp_nodelay: bool = True,
    ) -> None:
        super().__init__(nnrp, first=first, tcp_nodelay=tcp_nodelay)
        self._path = path
        self._origins = origins
        self._ws = mapping.NNRPWebSocket(ConnectionType.SERVER, max_message_bytes=nnrp.max_packet_bytes)
        self._open = False  # the Upgrade was accepted and no close frame went out yet

    # -- asyncio.Protocol ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        nnrp = self.nnrp
        nnrp.heard()
        try:
            for event in self._ws.receive_data(data):
                if type(event) is mapping.Payload:
                    if not nnrp.feed(event.data) or not self._open:
                        return
                elif type(event) is mapping.UpgradeRequested:
                    self._on_request(event.request)
                elif type(event) is mapping.PingAnswered:
                    self._write_raw(event.answer)
                elif type(event) is mapping.PeerClosed:
                    self._on_close(event)
                    return
                elif type(event) is mapping.Failed:
                    self._fail(event.code, event.reason)
                    return
                elif type(event) is mapping.Malformed:  # a bad Upgrade request: wsproto's HTTP answer, then close
                    self._reject(event.error)
                    return
        except RemoteProtocolError as exc:  # a bad Upgrade request read while answering one
            self._reject(exc)
            return
        except Exception:  # a bug while handling this client's input: only this connection ends, logged once
            nnrp.failed_input()
            return
        if self._open:
            nnrp.read_done()

    def eof_received(self) -> bool:
        if self._open:
            self._open = False
            self.nnrp.end_of_stream()
        return False  # close the transport

    # -- the WebSocket ----------------------------------------------------------------------------------------

    def _on_request(self, request: Request) -> None:
        nnrp = self.nnrp
        if request.target.split("?", 1)[0] != self._path:
            logger.debug(
                "NNRP connection %d on %s: Upgrade for %s refused (not %s)",
                nnrp.connection_id,
                nnrp.transport_name,
                loggable(request.target),
                self._path,
            )
            self._write_raw(self._ws.reject(404))
            self._end_transport(None)
            return
        origin = _origin_refused(request, self._origins)
        if origin is not None:
            logger.info(
                "NNRP connection %d on %s: WebSocket Upgrade from origin %s refused (403; nnrp.ws_allowed_origins)",
                nnrp.connection_id,
                nnrp.transport_name,
                loggable(origin),
            )
            nnrp.refused("origin")
            self._write_raw(self._ws.reject(403))
            self._end_transport(None)
            return
        self._open = True
        self._write_raw(self._ws.accept())

    def _on_close(self, close: mapping.PeerClosed) -> None:
        """The client's close frame: answered, and the connection ends."""
        self.nnrp.flush()  # the answers to the messages that came before the close frame go first
        self._write_raw(close.answer)
        self._open = False
        self.nnrp.end_of_stream()  # every operation stops
        self._end_transport(None)

    def _fail(self, code: int, reason: str) -> None:
        """Fail the WebSocket connection (RFC 6455 §7.1.7): a close frame with ``code``, every operation stops,
        the transport closes."""
        logger.info(
            "NNRP connection %d on %s closed (WebSocket %d): %s",
            self.nnrp.connection_id,
            self.nnrp.transport_name,
            code,
            loggable(reason),
        )
        self._end_transport(code, reason)
        self.nnrp.lose()

    def _reject(self, exc: RemoteProtocolError) -> None:
        logger.debug(
            "NNRP connection %d on %s: bad WebSocket Upgrade: %s",
            self.nnrp.connection_id,
            self.nnrp.transport_name,
            loggable(str(exc)),
        )
        self._write_raw(self._ws.reject_malformed(exc))
        self._end_transport(None)

    def _write_raw(self, data: bytes) -> None:
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _end_transport(self, code: int | None, reason: str = "") -> None:
        """What was queued goes out as binary messages, then a close frame with ``code`` (none when the
        Upgrade did not happen, or when the close handshake already ran), then the transport closes."""
        if self._open:
            self.send(self.nnrp.data_to_send())
            self._open = False
            if code is not None:
                self._write_raw(self._ws.close_frame(code, reason))
        if self._transport is not None:
            self._transport.close()

    # -- the NNRP connection's carrier ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Whole NNRP packets: one binary message each, in one write (nothing before the Upgrade or after the
        close frame)."""
        if data and self._open:
            self._write_raw(self._ws.send_packets(data))

    def end(self, cause: str) -> None:
        """With 1008 when no session opened in time or the client flooded beyond its credit, 1001 when the
        server stops, 1002 after bad input, 1000 otherwise."""
        self._end_transport(_CLOSE_CODES.get(cause, mapping.CLOSE_NORMAL))


_CLOSE_CODES = {
    "handshake_timeout": mapping.CLOSE_POLICY_VIOLATION,
    "violation": mapping.CLOSE_POLICY_VIOLATION,
    "shutdown": mapping.CLOSE_GOING_AWAY,
    "failed": mapping.CLOSE_PROTOCOL_ERROR,
}

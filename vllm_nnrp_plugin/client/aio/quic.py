"""The asyncio client's QUIC carrier (``quic://HOST:PORT``): ``aioquic``'s sans-IO QUIC (TLS 1.3, loss recovery,
flow control; its timers armed on the caller's loop by :class:`aioquic.asyncio.QuicConnectionProtocol`) between a
UDP socket and a :class:`~vllm_nnrp_plugin.client.aio.connection.Connection`, which sees :class:`QuicCarrier` as its
transport. No threads.

The mapping (the NNRP stream, what each QUIC event means for it) is :mod:`vllm_nnrp_plugin.carriers.quic`'s,
shared with the plugin server (:mod:`vllm_nnrp_plugin.nnrp_binding.quic`); nnrp-rs'
(``crates/nnrp-transport-quic/src/lib.rs``: quinn, ``QuicTransport::connect`` / ``open_bi``):

* one QUIC connection carries one NNRP byte stream: the client's first bidirectional stream (stream id 0,
  RFC 9000 §2.1), opened by the first bytes written (the CLIENT_HELLO); NNRP packets flow back to back on it in
  both directions exactly as on TCP. A stream the server opens, or a reset of stream 0, ends the connection
  (PROTOCOL_VIOLATION for the former, RFC 9000 §20.1);
* TLS (QUIC is always TLS, RFC 9001): the server's certificate is verified against ``trusted_cert_der`` (the
  server certificate or its CA, DER), else ``tls_ca_file`` (PEM), else the system's trust store
  (``ssl.get_default_verify_paths()``; aioquic falls back to ``certifi`` when the system has none); the server
  name is the address's host (an IP address is checked against the certificate's IP SANs and sent without SNI);
  ALPN ``nnrp/1`` is offered (NNRP/1-preview1 §5.1; RFC 9001 §8.1) — the plugin's server selects it, and a
  server that refuses it (``no_application_protocol``, 0x178: nnrp-py's native quinn server configures no ALPN)
  is asked once more without ALPN, as nnrp-py's native client always connects;
* a handshake that fails (the certificate is not trusted or does not name the host, ALPN refused, the server
  closes) fails the connect with :class:`~vllm_nnrp_plugin.client.errors.ClientConnectionError` naming aioquic's
  reason; nothing listening shows as an ICMP port unreachable on the connected UDP socket and fails it at once;
  a host that drops every datagram fails it after aioquic's idle timeout (:data:`IDLE_TIMEOUT_S`, RFC 9000
  §10.1) — bound the connect with ``asyncio.timeout`` for less;
* closing (:meth:`QuicCarrier.close`, what :meth:`Connection.close` ends with after every session's
  SESSION_CLOSE_ACK) sends the stream's FIN, then CONNECTION_CLOSE with NO_ERROR (RFC 9000 §10.2), and releases
  the socket at once (no closing period: the socket is this connection's own); :meth:`QuicCarrier.abort` sends
  only the CONNECTION_CLOSE;
* the server's FIN on stream 0 is the NNRP end of stream; its CONNECTION_CLOSE (the plugin's server sends one
  when it stops), the idle timeout, or an ICMP error after the handshake (nothing listens there any more) lose
  the NNRP connection at once — every pending open, operation and close fails with ``ClientConnectionError``,
  as when a TCP connection is lost. An idle connection ends after :data:`IDLE_TIMEOUT_S` of silence, as the
  server's do (the effective timeout is the smaller of the two, RFC 9000 §10.1).

aioquic private members used (aioquic is not pinned exactly: each use is checked by ``tests/test_client_carriers.py``):
``QuicConnection._close_event`` (set as soon as the connection starts closing or draining; aioquic reports
``ConnectionTerminated`` only after the draining period) and ``QuicConnectionProtocol._timer``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode, QuicFrameType
from cryptography import x509

from vllm_nnrp_plugin.carriers.quic import IDLE_TIMEOUT_S, NNRPStream, StreamBroken, StreamData
from vllm_nnrp_plugin.client.errors import ClientConnectionError
from vllm_nnrp_plugin.contract.endpoints import ALPN

__all__ = ["QuicCarrier", "open_quic", "quic_configuration"]

#: CRYPTO_ERROR carrying TLS alert 120 ``no_application_protocol`` (RFC 9001 §4.8, §8.1)
NO_APPLICATION_PROTOCOL = QuicErrorCode.CRYPTO_ERROR + 120


def quic_configuration(
    host: str, *, trusted_cert_der: bytes | None = None, tls_ca_file: str | None = None, alpn: str | None = None
) -> QuicConfiguration:
    """The client's QUIC configuration (module docstring): server name ``host``, ALPN ``alpn`` (none when
    ``None``), the trust anchors, no DATAGRAM frames. Raises ``OSError`` for an unreadable ``tls_ca_file``,
    ``ValueError`` for a ``trusted_cert_der`` that is not a DER certificate."""
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=[alpn] if alpn else None, server_name=host, idle_timeout=IDLE_TIMEOUT_S
    )
    if trusted_cert_der is not None:
        try:  # checked here: aioquic parses it only inside the handshake, where an error stalls the connection
            x509.load_der_x509_certificate(trusted_cert_der)
        except ValueError as exc:
            raise ValueError(f"trusted_cert_der is not a DER certificate: {exc}") from None
        configuration.cadata = ssl.DER_cert_to_PEM_cert(trusted_cert_der).encode("ascii")
    elif tls_ca_file is not None:
        with open(tls_ca_file, "rb"):  # unreadable: the connect fails here, as ssl.create_default_context's
            pass
        configuration.cafile = tls_ca_file
    else:
        paths = ssl.get_default_verify_paths()
        configuration.cafile = paths.cafile if paths.cafile and os.path.isfile(paths.cafile) else None
        configuration.capath = paths.capath if paths.capath and os.path.isdir(paths.capath) else None
    return configuration


class _AlpnRefused(ClientConnectionError):
    """The server refused the offered ALPN protocol (``no_application_protocol``)."""


class _ConnectedDatagrams:
    """The UDP transport as aioquic's protocol sends through it: the socket is connected to the server (so
    ICMP errors are reported), so datagrams go out without an address (asyncio refuses a connected datagram
    transport any address but the very tuple it connected to)."""

    __slots__ = ("_transport",)

    def __init__(self, transport: asyncio.DatagramTransport) -> None:
        self._transport = transport

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self._transport.sendto(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class QuicCarrier(QuicConnectionProtocol):
    """One QUIC connection carrying NNRP: aioquic's datagram protocol, and the transport its
    :class:`~vllm_nnrp_plugin.client.aio.connection.Connection` (an ``asyncio.Protocol``) writes to (``write``,
    ``close``, ``abort``, ``is_closing``, ``get_extra_info`` — ``peername``, ``sockname``, ``alpn_protocol``).
    Made by :func:`open_quic`; ``nnrp``: the connection to attach once the handshake completed."""

    def __init__(self, quic: QuicConnection, nnrp: asyncio.Protocol) -> None:
        super().__init__(quic)
        self._nnrp = nnrp
        self._udp: asyncio.DatagramTransport | None = None
        #: the handshake's outcome: the NNRP connection attached, or the ClientConnectionError of the connect
        self.handshake: asyncio.Future[None] = self._loop.create_future()
        self.alpn_protocol: str | None = None
        #: the QUIC error code of a close that came (the server's, a failed handshake's), else None
        self.close_code: int | None = None
        self._attached = False  # the handshake completed and ``nnrp`` was told connection_made
        self._lost_told = False
        self._closing = False  # close() / abort() ran or the connection ended: nothing more is sent
        self._ended = False  # the UDP socket is being released
        self._stream = NNRPStream(quic, "server")
        self._reason: Exception | None = None  # why the connection ended (None: a clean end)

    # -- the NNRP connection's transport -------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data`` on stream 0 and send what QUIC allows now."""
        if self._closing or not data:
            return
        self._stream.send(bytes(data))
        self.transmit()

    def close(self, error_code: int = QuicErrorCode.NO_ERROR, reason_phrase: str = "") -> None:
        """FIN on stream 0, CONNECTION_CLOSE (NO_ERROR unless ``error_code``), the socket released; the NNRP
        connection is told ``connection_lost(None)`` in a later callback."""
        if self._closing:
            return
        self._closing = True
        if error_code == QuicErrorCode.NO_ERROR:
            self._stream.finish()
            self.transmit()
        self._quic.close(error_code=error_code, reason_phrase=reason_phrase)
        self.transmit()
        self._end(None)

    def abort(self) -> None:
        """CONNECTION_CLOSE at once (NO_ERROR: closed abruptly in the absence of any error, RFC 9000 §20.1), no
        FIN; the socket released."""
        if self._closing:
            return
        self._closing = True
        self._quic.close(error_code=QuicErrorCode.NO_ERROR, reason_phrase="the client aborted the connection")
        self.transmit()
        self._end(None)

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "alpn_protocol":
            return self.alpn_protocol
        if name in ("peername", "sockname") and self._udp is not None:
            return self._udp.get_extra_info(name, default)
        return default

    # -- aioquic -------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._udp = transport  # type: ignore[assignment]  # a datagram protocol gets a DatagramTransport
        super().connection_made(_ConnectedDatagrams(transport))  # type: ignore[arg-type]  # sends like the transport aioquic wants

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        meant = self._stream.event(event)
        if type(meant) is StreamData:
            if self._lost_told:
                return
            if meant.data:
                self._nnrp.data_received(meant.data)
            if meant.end and not self._lost_told:
                self._nnrp.eof_received()  # the Connection closes this carrier in turn
        elif type(meant) is StreamBroken:
            self._fail(meant.code, meant.reason, frame_type=meant.frame_type)
        elif type(meant) is qe.HandshakeCompleted:
            self.alpn_protocol = meant.alpn_protocol
            self._attached = True
            self._nnrp.connection_made(self)  # type: ignore[arg-type]  # this carrier is the NNRP connection's transport
            if not self.handshake.done():
                self.handshake.set_result(None)

    def transmit(self) -> None:
        """aioquic's (datagrams out, timer re-armed), called after every datagram and timer: a connection that
        started closing or draining (the server's CONNECTION_CLOSE, the idle timeout, a failed handshake) ends
        here, not after the draining period."""
        if self._udp is None or self._ended:
            return
        super().transmit()
        close = self._quic._close_event
        if close is not None and not self._closing:
            self._closing = True
            self.close_code = int(close.error_code)
            self._end(ConnectionError(_describe(close)))

    def error_received(self, exc: Exception) -> None:
        """An ICMP error on the connected socket (``ConnectionRefusedError``: nothing listens at the server's
        port): before the handshake the connect fails, after it the connection is lost."""
        if self._ended:
            return
        self._closing = True
        self._end(exc if isinstance(exc, OSError) else ConnectionError(str(exc)))

    def connection_lost(self, exc: Exception | None) -> None:
        """The UDP socket is closed (after :meth:`_end`): tell the NNRP connection, or fail the connect."""
        self._ended = True
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        reason = self._reason or exc
        if not self.handshake.done():
            refusal = _AlpnRefused if self.close_code == NO_APPLICATION_PROTOCOL else ClientConnectionError
            self.handshake.set_exception(
                refusal(
                    f"the QUIC handshake failed: {reason}"
                    if reason
                    else "the QUIC connection closed during its handshake"
                )
            )
        if self._attached and not self._lost_told:
            self._lost_told = True
            self._nnrp.connection_lost(reason)

    # -- plumbing ------------------------------------------------------------------------------------------

    def _fail(self, code: int, reason: str, frame_type: int | None = QuicFrameType.PADDING) -> None:
        """Close the QUIC connection with transport error ``code`` (RFC 9000 §20.1); the NNRP connection is
        lost with ``reason``."""
        if self._closing:
            return
        self._closing = True
        self._quic.close(error_code=code, frame_type=frame_type, reason_phrase=reason)
        super().transmit()
        self._end(ConnectionError(reason))

    def _end(self, reason: Exception | None) -> None:
        """Release the UDP socket (what was sent goes out first); :meth:`connection_lost` follows."""
        if self._ended:
            return
        self._ended = True
        self._reason = reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._udp is not None:
            self._udp.close()


def _describe(close: qe.ConnectionTerminated) -> str:
    """What a QUIC connection's end says: who, the error code and aioquic's reason phrase."""
    if close.reason_phrase == "Idle timeout":
        return f"the QUIC connection was idle for {IDLE_TIMEOUT_S:g} s (RFC 9000 §10.1)"
    code = int(close.error_code)
    reason = f": {close.reason_phrase}" if close.reason_phrase else ""
    if code == QuicErrorCode.NO_ERROR:
        return f"the server closed the QUIC connection{reason}"
    if QuicErrorCode.CRYPTO_ERROR <= code < QuicErrorCode.CRYPTO_ERROR + 0x100:
        return f"TLS alert {code - QuicErrorCode.CRYPTO_ERROR} (QUIC error {code:#x}){reason}"
    return f"QUIC connection closed with error {code:#x}{reason}"


async def open_quic(
    nnrp: asyncio.Protocol,
    host: str,
    port: int,
    *,
    trusted_cert_der: bytes | None = None,
    tls_ca_file: str | None = None,
    alpn: str | None = ALPN,
) -> QuicCarrier:
    """Connect to ``host``:``port`` over QUIC on the running loop, complete the handshake and attach ``nnrp``
    (its ``connection_made`` gets the carrier); with ``alpn`` refused (``no_application_protocol``) once more
    without ALPN (module docstring). Returns the carrier. Raises ``OSError`` (the name does not resolve, no
    socket) and :class:`~vllm_nnrp_plugin.client.errors.ClientConnectionError` (nothing listens, the handshake
    failed). Cancelled, it closes what it opened."""
    try:
        return await _open_quic(nnrp, host, port, trusted_cert_der, tls_ca_file, alpn)
    except _AlpnRefused:
        if alpn is None:
            raise
    return await _open_quic(nnrp, host, port, trusted_cert_der, tls_ca_file, None)


async def _open_quic(
    nnrp: asyncio.Protocol,
    host: str,
    port: int,
    trusted_cert_der: bytes | None,
    tls_ca_file: str | None,
    alpn: str | None,
) -> QuicCarrier:
    loop = asyncio.get_running_loop()
    configuration = quic_configuration(host, trusted_cert_der=trusted_cert_der, tls_ca_file=tls_ca_file, alpn=alpn)
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, address = infos[0]
    quic = QuicConnection(configuration=configuration)
    _, carrier = await loop.create_datagram_endpoint(
        lambda: QuicCarrier(quic, nnrp),
        remote_addr=address,  # type: ignore[arg-type]  # an IP address
        family=family,
    )
    try:
        carrier.connect(address)
        await carrier.handshake
    except BaseException:
        carrier.abort()
        raise
    return carrier

"""NNRP over QUIC (``quic://HOST:PORT``) on vLLM's event loop: ``aioquic``'s sans-IO QUIC (TLS 1.3, loss
recovery, flow control; its timers armed on the loop by :class:`aioquic.asyncio.QuicConnectionProtocol`)
between a UDP socket and the same connection as every other carrier's
(:class:`.connection.NNRPConnection`, the project's wire core), whose carrier :class:`NNRPQuicConnection` is.

The mapping (the NNRP stream, what each QUIC event means for it) is :mod:`vllm_nnrp_plugin.carriers.quic`'s,
shared with the client; nnrp-rs' (``crates/nnrp-transport-quic/src/lib.rs``: quinn, ``QuicTransport``), checked
against nnrp-py 1.0.0rc4.post20's native QUIC client (``tests/test_quic.py``):

* one connection carries one NNRP byte stream: the client's first bidirectional stream (stream id 0, RFC 9000
  §2.1), NNRP packets back to back in both directions exactly as on TCP; the server opens no stream and
  sends no datagram (no ``max_datagram_frame_size``, so a DATAGRAM frame is aioquic's PROTOCOL_VIOLATION);
* any other stream a client opens (a second bidirectional one, a unidirectional one — quinn's server in nnrp-rs
  allows none) ends the connection with PROTOCOL_VIOLATION; a RESET_STREAM or STOP_SENDING on the NNRP stream
  ends it as a lost client does (every operation stops, its vLLM request is aborted);
* ALPN: ``nnrp/1`` (NNRP/1-preview1 §5.1, nnrp-rs ``crates/nnrp-core/src/header.rs``) is selected when the client
  offers it, and a client that offers other protocols only is refused with ``no_application_protocol`` (0x178,
  RFC 9001 §8.1); a client that offers none — nnrp-py's native client and nnrp-rs' quinn transport — is served
  without ALPN (:class:`_AlpnWhenOffered`);
* the certificate and key are ``nnrp.tls_cert_file`` / ``tls_key_file`` (QUIC is always TLS);
* a clean end of the NNRP connection sends the stream's FIN and closes the QUIC connection (NO_ERROR) once the
  client acknowledged everything, or after :data:`CLOSE_GRACE_S`; idle connections end after aioquic's idle
  timeout (:data:`IDLE_TIMEOUT_S`) as quinn's do after its own;
* a client that dies sends nothing more, and UDP tells the server nothing: when packets sent to it wait for an
  acknowledgement and not one packet came from it for :data:`PEER_SILENT_S`, the connection ends as a lost
  client's (every operation stops, its vLLM request is aborted) instead of streaming into the void until the idle
  timeout. A client that merely does not read is not silent: its acknowledgements keep coming, and its flow
  control holds the rest back (then nothing waits for an acknowledgement).

aioquic 1.x internals read here (no public call gives them): beside the NNRP stream's send buffer
(:mod:`vllm_nnrp_plugin.carriers.quic`), the bytes in flight (``QuicConnection._loss.bytes_in_flight``), and the TLS
context made at the first datagram (``QuicConnection._initialize``, :class:`_AlpnWhenOffered`);
``tests/test_quic.py`` exercises each.

Bounds: over ``max_connections`` a new connection is closed with CONNECTION_REFUSED (0x2) right after its first
packet (aioquic has answered the client's Initial by then, so the client may see its handshake complete first;
no NNRP byte is read from it);
the handshake timeout runs from the client's first packet (QUIC handshake and NNRP session open together);
sent data the client has not acknowledged counts as the transport's write buffer (the connection pauses above
its high-water mark, :mod:`.connection`); input that arrives while the connection is paused is held up to the
packet limit, past which the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aioquic import tls
from aioquic.asyncio import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode, QuicFrameType

from vllm_nnrp_plugin.carriers.quic import IDLE_TIMEOUT_S, NNRPStream, StreamBroken, StreamData
from vllm_nnrp_plugin.contract.endpoints import ALPN
from vllm_nnrp_plugin.nnrp_binding.connection import WRITE_HIGH_WATER, WRITE_LOW_WATER, NNRPConnection
from vllm_nnrp_plugin.nnrp_binding.exposure import Exposure, ListenError

logger = logging.getLogger(__name__)

#: seconds a cleanly ended connection waits for the client to acknowledge the last packets and the FIN
CLOSE_GRACE_S = 2.0
#: seconds without a single packet from the client while packets sent to it wait for its acknowledgement, after
#: which it is taken for gone (a killed client sends no CONNECTION_CLOSE, and UDP has no reset); long enough for a
#: live client whose process stalls under load (``docs/benchmarks/README.md``, Carriers)
PEER_SILENT_S = 10.0


def server_configuration(exposure: Exposure) -> QuicConfiguration:
    """The server's QUIC configuration: ALPN ``nnrp/1`` (see the module docstring for clients offering none),
    the PEM certificate chain and key, no datagrams. Raises :class:`ListenError`."""
    configuration = QuicConfiguration(is_client=False, alpn_protocols=[ALPN], idle_timeout=IDLE_TIMEOUT_S)
    assert exposure.tls_cert_file is not None  # load_config refuses a TLS address without a certificate
    try:
        configuration.load_cert_chain(exposure.tls_cert_file, exposure.tls_key_file)
    except (OSError, ValueError, TypeError) as exc:
        raise ListenError(
            f"cannot load the NNRP TLS certificate/key ({exposure.tls_cert_file}, {exposure.tls_key_file}) for "
            f"QUIC: {exc}. Fix: nnrp.tls_cert_file must be a PEM certificate and nnrp.tls_key_file an unencrypted "
            "PEM key."
        ) from None
    return configuration


class _AlpnWhenOffered(tls.Context):
    """aioquic's server TLS context, except that a ClientHello without the ALPN extension is served without
    ALPN instead of refused (aioquic 1.x refuses it whenever the server lists protocols): nnrp-py's native
    QUIC client offers none. A client that offers ALPN still gets ``nnrp/1`` or ``no_application_protocol``."""

    def _server_handle_hello(self, input_buf, initial_buf, handshake_buf, *rest):
        start = input_buf.tell()
        offered = tls.pull_client_hello(input_buf).alpn_protocols
        input_buf.seek(start)
        if offered is None:
            self._alpn_protocols = None
        return super()._server_handle_hello(input_buf, initial_buf, handshake_buf, *rest)


def _alpn_when_offered(quic: QuicConnection) -> None:
    """Make ``quic``'s TLS context, created at its first datagram, an :class:`_AlpnWhenOffered`."""
    initialize = quic._initialize

    def _initialize(peer_cid: bytes) -> None:
        initialize(peer_cid)
        quic.tls.__class__ = _AlpnWhenOffered

    quic._initialize = _initialize  # type: ignore[method-assign]  # aioquic's first-datagram hook


class NNRPQuicConnection(QuicConnectionProtocol):
    """One QUIC connection, made by aioquic's :class:`~aioquic.asyncio.server.QuicServer` for a client's first
    Initial packet, and its NNRP connection's :class:`.connection.Carrier`: ``send`` queues stream data and
    transmits at once (the connection already writes once per loop iteration); the write buffer is what the
    client has not acknowledged; ``hold_input`` holds input. ``attach()``: the listener's factory of the NNRP
    connection (``None``: over ``max_connections``, refused). On the loop only."""

    def __init__(
        self, quic: QuicConnection, *, attach: Callable[[], NNRPConnection | None], stream_handler: Any = None
    ) -> None:
        super().__init__(quic, stream_handler=stream_handler)
        _alpn_when_offered(quic)
        self.paused_reading = False
        self._closing = False  # the NNRP connection ended (cleanly or not): nothing more is sent
        self._paused_writing = False  # the NNRP connection was told pause_writing
        self._held: list[bytes] = []  # input received while paused (at most the packet limit)
        self._held_bytes = 0
        self._ended = False  # the NNRP connection was told it was lost
        self._finishing: asyncio.TimerHandle | None = None
        self._heard_at = self._loop.time()  # loop time of the client's last packet
        #: told once the QUIC connection terminated (the server forgets it)
        self.on_terminated: Callable[[NNRPQuicConnection], None] = lambda connection: None
        self._silence_check: asyncio.TimerHandle | None = None
        self.nnrp_stream = NNRPStream(quic, "client")
        self.nnrp = attach()
        self._refused = self.nnrp is None
        if self.nnrp is not None:
            self.nnrp.attach(self)

    # -- aioquic ----------------------------------------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._heard_at = self._loop.time()
        super().datagram_received(data, addr)
        if self._refused:
            self._refused = False
            self._quic.close(
                error_code=QuicErrorCode.CONNECTION_REFUSED,
                frame_type=QuicFrameType.PADDING,
                reason_phrase="max_connections",
            )
            self.transmit()
            return
        if self._finishing is not None:  # a clean end waits for the acknowledgement of its last packets
            if self.nnrp_stream.sent_everything():
                self._close_now()
        elif self.nnrp is not None and not self._ended:
            self._check_buffer()  # acknowledgements may have drained the write buffer

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        meant = self.nnrp_stream.event(event)
        if type(meant) is StreamData:
            self._on_stream_data(meant.data, meant.end)
        elif type(meant) is StreamBroken:
            self.fail(meant.code, meant.reason, frame_type=meant.frame_type)
        elif type(meant) is qe.ConnectionTerminated:
            self._lose()
            self.on_terminated(self)

    # -- the NNRP stream --------------------------------------------------------------------------------------

    def _on_stream_data(self, data: bytes, end: bool) -> None:
        nnrp = self.nnrp
        if nnrp is None or self._ended or self._closing:
            return
        if self.paused_reading:
            self._held_bytes += len(data)
            if self._held_bytes > nnrp.max_packet_bytes:
                self.fail(
                    QuicErrorCode.NO_ERROR, "input held while the client does not read went over the packet limit"
                )
                return
            self._held.append(data)
            if end:
                self._held.append(b"")  # the end of the stream, in order
            return
        if data:
            nnrp.heard()
            if nnrp.feed(data):
                nnrp.read_done()
        if end and not self._closing:
            nnrp.end_of_stream()
            self.end("ended")

    # -- the NNRP connection's carrier ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self._closing:
            return
        self.nnrp_stream.send(bytes(data))
        self.transmit()
        self.watch_silence()
        self._check_buffer()

    def end(self, cause: str) -> None:
        """The NNRP connection ended (``cause``: :meth:`.connection.Carrier.end`): FIN after what was sent; the
        QUIC connection closes once the client acknowledged it (or after :data:`CLOSE_GRACE_S`)."""
        if not self._closing:
            self._closing = True
            self.finish()

    def abort(self) -> None:
        if not self._closing:
            self.fail(QuicErrorCode.INTERNAL_ERROR, "the NNRP connection was aborted")

    def hold_input(self, held: bool) -> None:
        if held:
            self.paused_reading = True
        else:
            self.resume_reading()

    def is_closing(self) -> bool:
        return self._closing

    def unread_bytes(self) -> int:
        return 0  # datagrams are read as they come; what waits is aioquic's

    def _check_buffer(self) -> None:
        """Tell the NNRP connection to pause above :data:`.connection.WRITE_HIGH_WATER` unacknowledged bytes, to
        resume at or below :data:`.connection.WRITE_LOW_WATER`."""
        if self._closing or self.nnrp is None:
            return
        unacknowledged = self.nnrp_stream.unacknowledged()
        if not self._paused_writing and unacknowledged > WRITE_HIGH_WATER:
            self._paused_writing = True
            self.nnrp.pause_writing()
        elif self._paused_writing and unacknowledged <= WRITE_LOW_WATER:
            self._paused_writing = False
            self.nnrp.resume_writing()

    def resume_reading(self) -> None:
        self.paused_reading = False
        held, self._held, self._held_bytes = self._held, [], 0
        for index, data in enumerate(held):
            if self.paused_reading:  # paused again while feeding: keep the rest
                self._held = held[index:]
                self._held_bytes = sum(map(len, self._held))
                return
            self._on_stream_data(data, not data)

    def watch_silence(self) -> None:
        """After a send: make sure the client's silence is checked :data:`PEER_SILENT_S` from now."""
        if self._silence_check is None and not self._closing:
            self._silence_check = self._loop.call_later(PEER_SILENT_S, self._check_silence)

    def _check_silence(self) -> None:
        self._silence_check = None
        if self._closing or not self._quic._loss.bytes_in_flight:
            return  # nothing waits for the client: an idle client is the idle timeout's
        silent_s = self._loop.time() - self._heard_at
        if silent_s >= PEER_SILENT_S:
            self.fail(
                QuicErrorCode.NO_ERROR,
                f"the client sent nothing for {silent_s:.1f} s while packets waited for "
                "its acknowledgement; taken for gone",
            )
        else:
            self._silence_check = self._loop.call_later(PEER_SILENT_S - silent_s, self._check_silence)

    # -- ending -----------------------------------------------------------------------------------------------

    @property
    def finishing(self) -> bool:
        """The NNRP connection ended cleanly and its last packets wait for the client's acknowledgement."""
        return self._finishing is not None

    def finish(self) -> None:
        """A clean end: FIN on the NNRP stream; the connection closes when it was acknowledged."""
        self.nnrp_stream.finish()
        self.transmit()
        self._finishing = self._loop.call_later(CLOSE_GRACE_S, self._close_now)
        self._lose_soon()

    def _close_now(self) -> None:
        """Everything was acknowledged, or the grace time is up: CONNECTION_CLOSE with NO_ERROR."""
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None
        self._quic.close(error_code=QuicErrorCode.NO_ERROR)
        self.transmit()

    def fail(self, code: int, reason: str, frame_type: int | None = QuicFrameType.PADDING) -> None:
        """Close the QUIC connection with transport error ``code`` (RFC 9000 §20.1); the NNRP connection is
        lost (every operation stops) in the next callback, as an asyncio transport reports it."""
        if self._closing:
            return
        self._closing = True
        logger.info("NNRP connection on quic closed (QUIC error 0x%x): %s", code, reason)
        self._quic.close(error_code=code, frame_type=frame_type, reason_phrase=reason)
        self.transmit()
        self._lose_soon()

    def close(self, error_code: int = QuicErrorCode.NO_ERROR, reason_phrase: str = "") -> None:
        """The server stops (:meth:`NNRPQuicServer.shut_down`): CONNECTION_CLOSE after what is queued; aioquic's
        timers run on until the connection terminated or the UDP socket closed."""
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None
        if self._silence_check is not None:
            self._silence_check.cancel()
            self._silence_check = None
        super().close(error_code=error_code, reason_phrase=reason_phrase)

    def _lose_soon(self) -> None:
        self._loop.call_soon(self._lose)

    def _lose(self) -> None:
        if self._silence_check is not None:
            self._silence_check.cancel()
            self._silence_check = None
        if self._ended or self.nnrp is None:
            self._ended = True
            return
        self._ended = True
        self._held.clear()
        self.nnrp.lost()


class NNRPQuicServer(QuicServer):
    """aioquic's UDP server protocol whose connections are :class:`NNRPQuicConnection` s (no Retry: the
    handshake timeout and ``max_connections`` bound what unvalidated addresses can hold). ``attach``: the
    listener's factory of each connection's NNRP connection (:class:`NNRPQuicConnection`)."""

    def __init__(self, configuration: QuicConfiguration, attach: Callable[[], NNRPConnection | None]) -> None:
        super().__init__(configuration=configuration, create_protocol=self._connection)
        self._attach = attach
        self._live: set[NNRPQuicConnection] = set()  # until their QUIC connection terminated

    def _connection(self, quic: QuicConnection, stream_handler: Any = None) -> NNRPQuicConnection:
        connection = NNRPQuicConnection(quic, attach=self._attach, stream_handler=stream_handler)
        self._live.add(connection)
        connection.on_terminated = self._live.discard
        return connection

    async def shut_down(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """After the NNRP connections were shut down (their last packets and FIN queued,
        :meth:`NNRPQuicConnection.finish`):
        close the connections with nothing to finish at once, give the others up to ``grace_s`` seconds to have
        everything acknowledged and close (aioquic paces its packets: the UDP socket must stay open until they
        went), then close every connection left and the UDP socket."""
        live = list(self._live)
        for connection in live:
            if not connection.finishing:
                connection.close()
        if live:
            waits = [asyncio.ensure_future(connection.wait_closed()) for connection in live]
            _, late = await asyncio.wait(waits, timeout=grace_s)
            for wait in late:  # closed with the socket below; no task is left pending
                wait.cancel()
        super().close()

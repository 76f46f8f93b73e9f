"""NNRP over QUIC (``quic://``), sans-IO, for either side: the NNRP stream of an ``aioquic``
:class:`~aioquic.quic.connection.QuicConnection` (TLS 1.3, loss recovery, flow control) and what its events mean
for it. The asyncio shells (:mod:`vllm_nnrp_plugin.nnrp_binding.quic` for the server,
:mod:`vllm_nnrp_plugin.client.aio.quic` for the client) own the UDP socket, the timers and the NNRP connection.

The mapping is nnrp-rs' (``crates/nnrp-transport-quic/src/lib.rs``: quinn, ``QuicTransport``), checked against
nnrp-py 1.0.0rc4.post20's native client and server (``tests/test_quic.py``, ``tests/test_client_carriers.py``):

* one QUIC connection carries one NNRP byte stream: the client's first bidirectional stream
  (:data:`NNRP_STREAM_ID`, RFC 9000 §2.1), opened by the client's first bytes; NNRP packets flow back to back on
  it in both directions exactly as on TCP; its FIN is the NNRP end of stream;
* any other stream (a second bidirectional one, a unidirectional one, one the server opens) ends the connection
  with PROTOCOL_VIOLATION (RFC 9000 §20.1); a RESET_STREAM or STOP_SENDING on the NNRP stream ends it with
  NO_ERROR, as a lost peer;
* ALPN is :data:`vllm_nnrp_plugin.contract.endpoints.ALPN` (RFC 9001 §8.1); idle connections end after
  :data:`IDLE_TIMEOUT_S` on both sides.

aioquic 1.x internals read here (no public call gives them; ``tests/test_quic.py`` exercises each): a stream's
unacknowledged send buffer and whether its FIN was acknowledged (``QuicConnection._streams``,
``QuicStreamSender._buffer`` / ``is_finished``). Plain data: no sockets, threads or clocks.
"""

from __future__ import annotations

from aioquic.quic import events as qe
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode, QuicFrameType

__all__ = ["IDLE_TIMEOUT_S", "NNRP_STREAM_ID", "NNRPStream", "StreamBroken", "StreamData"]

#: the only stream of an NNRP connection: the client's first bidirectional one (RFC 9000 §2.1)
NNRP_STREAM_ID = 0
#: seconds of silence after which a QUIC connection ends (RFC 9000 §10.1; aioquic's default): the client's and
#: the server's, so the effective timeout is this
IDLE_TIMEOUT_S = 60.0


class StreamData:
    """Bytes of the NNRP stream (``data``, possibly empty) and whether the peer's FIN came with them (``end``)."""

    __slots__ = ("data", "end")

    def __init__(self, data: bytes, end: bool) -> None:
        self.data = data
        self.end = end


class StreamBroken:
    """The peer broke the mapping: close the QUIC connection with transport error ``code`` (RFC 9000 §20.1),
    ``reason`` and ``frame_type`` (the frame that broke it; PADDING when none)."""

    __slots__ = ("code", "reason", "frame_type")

    def __init__(self, code: int, reason: str, frame_type: int = QuicFrameType.PADDING) -> None:
        self.code = code
        self.reason = reason
        self.frame_type = frame_type


class NNRPStream:
    """The NNRP stream of ``quic``; ``peer``: who is at the other end (``"client"`` or ``"server"``, for the
    reasons given)."""

    __slots__ = ("_quic", "_peer")

    def __init__(self, quic: QuicConnection, peer: str) -> None:
        self._quic = quic
        self._peer = peer

    def event(self, event: qe.QuicEvent) -> StreamData | StreamBroken | qe.QuicEvent | None:
        """What ``event`` means for the NNRP stream: :class:`StreamData`, :class:`StreamBroken`, ``None``
        (nothing), or the event itself when it is about the connection, not the stream (the shell's:
        ``HandshakeCompleted``, ``ConnectionTerminated``, …)."""
        if type(event) is qe.StreamDataReceived:
            if event.stream_id != NNRP_STREAM_ID:
                return StreamBroken(
                    QuicErrorCode.PROTOCOL_VIOLATION,
                    "NNRP/1 over QUIC uses one stream, the client's first bidirectional one",
                    QuicFrameType.STREAM_BASE,
                )
            return StreamData(event.data, event.end_stream)
        if type(event) is qe.StreamReset or type(event) is qe.StopSendingReceived:
            if event.stream_id == NNRP_STREAM_ID:
                return StreamBroken(QuicErrorCode.NO_ERROR, f"the {self._peer} reset the NNRP stream")
            return StreamBroken(
                QuicErrorCode.PROTOCOL_VIOLATION, "NNRP/1 over QUIC uses one stream", QuicFrameType.STREAM_BASE
            )
        return event

    def send(self, data: bytes) -> None:
        """Queue ``data`` on the NNRP stream (the client's first bytes open it); ``transmit`` sends it."""
        self._quic.send_stream_data(NNRP_STREAM_ID, data)

    def finish(self) -> None:
        """Queue the NNRP stream's FIN, when the stream was opened."""
        if NNRP_STREAM_ID in self._quic._streams:
            self._quic.send_stream_data(NNRP_STREAM_ID, b"", end_stream=True)

    def unacknowledged(self) -> int:
        """Bytes of the NNRP stream sent or queued and not yet acknowledged by the peer."""
        stream = self._quic._streams.get(NNRP_STREAM_ID)
        return 0 if stream is None else len(stream.sender._buffer)

    def sent_everything(self) -> bool:
        """Everything this side sent on the NNRP stream, its FIN included, was acknowledged (or nothing was)."""
        stream = self._quic._streams.get(NNRP_STREAM_ID)
        return stream is None or stream.sender.is_finished

"""What a client can make the server hold, bounded: the listener's limits on connections and the bytes they
buffer (plain data; the listener and its connections, :mod:`.listener` and :mod:`.connection`, enforce them).

| bound | setting | default | beyond it |
|---|---|---|---|
| time from accept to a first open session (each of: TLS handshake; CLIENT_HELLO + SESSION_OPEN) | ``nnrp.handshake_timeout_ms`` | 10000 ms | the connection is closed (``nnrp_handshake_timeouts_total``) |
| one packet (header + metadata + body), advertised as SERVER_HELLO_ACK ``max_body_bytes`` | derived: :func:`packet_limit` of ``nnrp.max_envelope_bytes`` | 2 MiB | the connection ends as for any oversized packet (NNRP framing: nnrp-rs ``crates/nnrp-runtime/src/transport.rs``) |
| bytes of incomplete packets, over every connection of the process | ``nnrp.max_buffered_bytes`` | 256 MiB | the connection whose read took the total over it ends (oversized) |
| bytes queued for a client that is not reading | the transport's write buffer, 1 MiB high water | — | the connection stops reading until the client read enough (then the protocol's flow control: nothing more is answered) |
| open connections of the process | ``nnrp.max_connections`` | 2048 | a new connection is closed at once (``nnrp_connections_refused_total{reason="max_connections"}``) |
| file descriptors | the process's limit | — | accepting pauses (``ACCEPT_PAUSE_S``) and resumes, logged once per pause (``reason="no_descriptor"``) |
"""

from __future__ import annotations

import attrs

#: headroom of one packet over the largest envelope (the typed payload's framing), bytes
PACKET_HEADROOM = 1 << 20
#: how long accepting pauses after the process ran out of file descriptors, s
ACCEPT_PAUSE_S = 0.5


def packet_limit(max_envelope_bytes: int) -> int:
    """The largest packet a connection may send (bytes): room for an envelope twice the largest one served (a
    slightly larger envelope still gets the typed ``envelope_too_large``), at least ``max_envelope_bytes`` +
    :data:`PACKET_HEADROOM`."""
    return max(2 * max_envelope_bytes, max_envelope_bytes + PACKET_HEADROOM)


@attrs.frozen
class CarrierBounds:
    """A listener's bounds (module table): ``handshake_timeout_s`` (s), ``max_packet_bytes`` (bytes),
    ``max_buffered_bytes`` (bytes, over every connection), ``max_connections``."""

    handshake_timeout_s: float = 10.0
    max_packet_bytes: int = packet_limit(1 << 20)
    max_buffered_bytes: int = 256 << 20
    max_connections: int = 2048


class BufferBudget:
    """The bytes of incomplete packets buffered over every connection of a listener (on the loop only)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def change(self, delta: int) -> bool:
        """A connection's buffered bytes changed by ``delta``; False when the total is now over the limit."""
        self.used += delta
        return self.used <= self.limit

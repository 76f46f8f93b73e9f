"""What a client can make the server hold, bounded: the listener's limits on connections and the bytes they
buffer (plain data; the listener and its connections, :mod:`.listener` and :mod:`.connection`, enforce them).

| bound | setting | default | beyond it |
|---|---|---|---|
| the client's silence before its first session opened (TLS handshake: time to complete it; then :func:`handshake_recheck`: no byte from the client for this long, or a handshake :data:`HANDSHAKE_CAP_FACTOR` times as long, and none waiting unread) | ``nnrp.handshake_timeout_ms`` | 10000 ms | the connection is closed (``nnrp_handshake_timeouts_total``) |
| one packet (header + metadata + body), advertised as SERVER_HELLO_ACK ``max_body_bytes`` | derived: :func:`packet_limit` of ``nnrp.max_envelope_bytes`` (32 MiB) | 64 MiB (the native peers' own packet limit, nnrp-rs ``crates/nnrp-runtime/src/transport.rs``) | the connection ends as for any oversized packet (NNRP framing, same source) |
| bytes of incomplete packets, over every connection of the process | ``nnrp.max_buffered_bytes`` | 256 MiB | the connection whose read took the total over it ends (oversized) |
| bytes queued for a client that is not reading | the transport's write buffer, 1 MiB high water | — | the connection stops reading until the client read enough (then the protocol's flow control: nothing more is answered) |
| open connections of the process | ``nnrp.max_connections`` | 2048 | a new connection is closed at once (``nnrp_connections_refused_total{reason="max_connections"}``) |
| file descriptors | the process's limit | — | accepting pauses (``ACCEPT_PAUSE_S``) and resumes, logged once per pause (``reason="no_descriptor"``) |
| submits beyond a session's granted credit (SESSION_OPEN_ACK ``granted_operation_credit``, the in-flight window) | :class:`ViolationBudget`: :data:`VIOLATION_BURST`, then :data:`VIOLATIONS_PER_S` | 64, then 16/s | the connection ends with ERROR_RECOVERABLE ``LIMIT_EXCEEDED`` (``nnrp_connections_ended_total{reason="credit_violations"}``) |
"""

from __future__ import annotations

import attrs

#: headroom of one packet over the largest envelope (the typed payload's framing), bytes
PACKET_HEADROOM = 1 << 20
#: how long accepting pauses after the process ran out of file descriptors, s
ACCEPT_PAUSE_S = 0.5
#: the longest handshake of a client that keeps sending a little (a byte now and then, never a whole
#: CLIENT_HELLO and SESSION_OPEN), in handshake timeouts
HANDSHAKE_CAP_FACTOR = 3


def handshake_recheck(elapsed_s: float, silent_s: float, waiting_bytes: int, timeout_s: float) -> float | None:
    """What the handshake timer decides when it fires, before the connection's first session opened: ``None``
    to close the connection, else the seconds until it looks again.

    ``elapsed_s``: since the connection started (after TLS); ``silent_s``: since the last bytes read from the
    client (or the start); ``waiting_bytes``: bytes the client sent that the server has not read yet (the
    socket's receive queue, ``FIONREAD``; 0 when the server itself stopped reading a client that does not read);
    ``timeout_s``: ``nnrp.handshake_timeout_ms`` in s.

    The bound measures the client's silence, not the server's: bytes waiting unread mean the server's loop was
    busy (a timer can fire before the read of the same loop iteration: libuv, uvloop's core, runs due timers
    before it polls for I/O, https://docs.libuv.org/en/v1.x/design.html "The I/O loop"), so the connection is
    kept and looked at again after ``timeout_s``. Otherwise it closes once the client was silent for
    ``timeout_s`` (a client that connected and sent nothing, or half a hello), or once its handshake took
    :data:`HANDSHAKE_CAP_FACTOR` × ``timeout_s`` (a client that trickles bytes)."""
    if waiting_bytes > 0:
        return timeout_s
    cap_s = HANDSHAKE_CAP_FACTOR * timeout_s
    if silent_s >= timeout_s or elapsed_s >= cap_s:
        return None
    return min(timeout_s - silent_s, cap_s - elapsed_s)


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
    max_packet_bytes: int = packet_limit(32 << 20)
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


#: submits beyond its sessions' granted credit a connection may make at once before it is ended
VIOLATION_BURST = 64
#: ... and how many more it earns per second of keeping within it
VIOLATIONS_PER_S = 16.0


class ViolationBudget:
    """How many submits beyond their granted credit one connection's sessions may make: a token bucket of
    ``burst`` tokens refilled at ``per_s`` tokens per second (plain data: the caller passes its clock, s).

    NNRP's credit is the server's grant (SESSION_OPEN_ACK ``granted_operation_credit``, then BACKPRESSURE /
    CREDIT_UPDATE; NagareWorks/nnrp-doc ``docs/en/profiles/runtime-control/control-frames.md`` "Pressure
    Metadata"), and a client that keeps the window never spends a token. Each submit beyond it is still answered
    (``too_many_requests``: the client may not have read the BACKPRESSURE yet), but answering costs the server
    a refusal per submit: a client that keeps submitting beyond its credit faster than ``per_s``, more than
    ``burst`` times, is flooding and its connection is ended (:meth:`spend` False)."""

    __slots__ = ("burst", "per_s", "_tokens", "_at")

    def __init__(self, burst: int = VIOLATION_BURST, per_s: float = VIOLATIONS_PER_S) -> None:
        if burst < 1 or per_s < 0:
            raise ValueError("burst must be at least 1 and per_s not negative")
        self.burst = burst
        self.per_s = per_s
        self._tokens = float(burst)
        self._at: float | None = None

    def spend(self, now_s: float) -> bool:
        """One more submit beyond the credit at ``now_s``: True while the budget allows it, False once it is
        spent (and from then on)."""
        if self._at is not None and now_s > self._at:
            self._tokens = min(float(self.burst), self._tokens + (now_s - self._at) * self.per_s)
        self._at = now_s if self._at is None else max(self._at, now_s)
        if self._tokens < 1:
            self._tokens = float("-inf")  # spent for good: the connection ends
            return False
        self._tokens -= 1
        return True

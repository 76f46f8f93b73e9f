"""One NNRP/1 (preview4) server connection, sans-IO: bytes in → typed events out, calls in → bytes out.

:class:`ServerConnection` owns everything the protocol decides on one connection and nothing else: the
handshake, the sessions multiplexed on it, the operations of each session and the runtime control frames. It
reads no socket, starts no thread and reads no clock; the asyncio shell feeds it what it read
(:meth:`~ServerConnection.receive_data`, ``b""`` for end of stream), writes what it queued
(:meth:`~ServerConnection.data_to_send`, once per loop iteration, so many packets go out in one write) and
closes the transport after :class:`~.events.ConnectionEnded`.

The model is the native server of nnrp-py 1.0.0rc4.post20 (nnrp-rs ``crates/nnrp-runtime/src/server.rs``),
byte for byte where a native client can tell, with these deliberate differences:

* resume is never granted and every resume attempt is rejected (``token_ttl_ms`` and ``resume_window_ms`` 0,
  ``session_flags_ack`` 0, ``resume_token_bytes`` 0; a SESSION_OPEN carrying a token gets status rejected,
  code ``resume_rejected``, session 0 in header and metadata, a UTF-8 diagnostic body);
* ``max_concurrent_frames`` (hello), ``granted_operation_credit`` and ``max_in_flight_operations`` (open ack)
  are the connection's ``max_in_flight_per_session`` (the native server sends its 4 / 2 / 4);
* authentication (the block's encoding and ``auth_status`` values are this deployment's,
  :mod:`vllm_nnrp_plugin.auth_block`): the native server neither reads ``auth_bytes`` nor sets ``auth_status``;
  here, with ``authenticate`` set, a session opens only with an accepted key (``auth_failed`` otherwise);
* session ids are unique per connection (the native registry is server-wide), never reused on it;
* a known session's packet that breaks a rule is answered with ERROR_RECOVERABLE (the native server sends
  nothing and only its application sees a poll error);
* a control (FRAME_CANCEL, CANCEL, ABORT, DEADLINE, PRIORITY_UPDATE, EXPIRE_AT, SUPERSEDE, BUDGET_UPDATE,
  TRACE_CONTEXT) for an operation whose terminal this server sent recently is ignored silently: the client cannot
  avoid that race.

Rules and their sources (nnrp-rs paths at the readable commit 784a4a3 unless said otherwise; the behaviour of
the shipped build where it differs, see each method):

* Framing and header errors: :mod:`.framing` (nnrp-rs ``crates/nnrp-core/src/header.rs``,
  ``crates/nnrp-runtime/src/transport.rs``) — each ends the connection.
* Connection start (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` ``accept``/hello handling,
  ``crates/nnrp-core/src/control.rs`` ``ClientHello::validate``): only TRANSPORT_PROBE or CLIENT_HELLO may come
  first; a bad hello closes the connection without a reply.
* After the handshake, session 0 carries only SESSION_OPEN and TRANSPORT_PROBE; any other session-0 packet, a
  second CLIENT_HELLO, a malformed SESSION_OPEN, or a packet for a session id that is not open ends the
  connection (``server.rs``; ``crates/nnrp-runtime/src/multiplex.rs``: unknown session ids are fatal).
* Session-scoped runtime packets (``server.rs`` ``handle_runtime_packet`` arms): the layout rules of
  :mod:`.layouts` (shared with the client core), then operation identity (``crates/nnrp-core/src/operation.rs``).
* Runtime controls a client sends for its operations, each reported as an event (the application decides what
  they change): FRAME_CANCEL / CANCEL / ABORT → :class:`~.events.OperationCancelled`; DEADLINE / EXPIRE_AT →
  :class:`~.events.DeadlineReceived`; PRIORITY_UPDATE → :class:`~.events.PriorityUpdated`; SUPERSEDE →
  :class:`~.events.OperationSuperseded` (cancels the operation as CANCEL does); BUDGET_UPDATE →
  :class:`~.events.BudgetUpdated`; TRACE_CONTEXT → :class:`~.events.TraceContextReceived`.

Answer each :class:`~.events.SessionOpenRequested` before the next :meth:`~ServerConnection.receive_data`: the
session exists from ``accept_session`` on. Packets that came in the same read right behind the SESSION_OPEN are
handled before the application can answer, so a client that used the session without waiting for its ack would
hit the unknown-session rule; the native client always waits for the ack (it needs the id from it).

Errors: a call that is wrong whatever the peer did raises :class:`LocalProtocolError`; a send that lost a race
with the peer (session closed, connection ended, operation already terminal or cancelled by FRAME_CANCEL)
returns False and queues nothing.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from nnrp.core.enums import MessageType
from nnrp.core.header import HEADER_LENGTH, HEADER_MAGIC, HEADER_STRUCT
from nnrp.core.messages.control import (
    ClientHelloMetadata,
    ServerHelloAckMetadata,
    SessionOpenMetadata,
    TransportProbeAckMetadata,
    TransportProbeMetadata,
)
from nnrp.runtime.types import (
    PartialResultMetadata,
    PressureMetadata,
    ProgressMetadata,
    RecoverableErrorMetadata,
    ResultDropReasonMetadata,
)

from . import framing, layouts
from ..auth_block import (
    AUTH_STATUS_ACCEPTED,
    AUTH_STATUS_MISSING,
    AUTH_STATUS_NOT_REQUIRED,
    AUTH_STATUS_REJECTED,
    MAX_AUTH_BYTES,
)
from .codecs import (
    CLOSE_STATUS_CLOSED,
    SESSION_ERROR_AUTH_FAILED,
    SESSION_ERROR_PROFILE_UNSUPPORTED,
    SESSION_ERROR_RESUME_REJECTED,
    SESSION_ERROR_SCHEMA_UNSUPPORTED,
    SESSION_ERROR_SESSION_LIMIT_REACHED,
    SESSION_STATUS_OPENED,
    SESSION_STATUS_REJECTED,
    SessionCloseAckMetadata,
    SessionOpenAckMetadata,
)
from .errors import LocalProtocolError, PacketError
from .events import (
    AuthenticationFailed,
    BudgetUpdated,
    ConnectionEnded,
    DeadlineReceived,
    OperationCancelled,
    OperationSubmitted,
    OperationSuperseded,
    PacketRejected,
    PriorityUpdated,
    SessionClosed,
    SessionDraining,
    SessionOpenRequested,
    TraceContextReceived,
)
from .layouts import ERR_LIMIT, ERR_STATE, message_name

__all__ = ["LEASE_TTL_MS", "ServerConnection"]

#: ``lease_ttl_ms`` of every SESSION_OPEN_ACK: the native server echoes its configured 30000 and enforces nothing
#: (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` session ack; cache/schema leases are not offered here)
LEASE_TTL_MS = 30_000
#: source_role of everything this server sends (nnrp-doc runtime-control value-registries "Role Codes")
ROLE_SERVER = 2
#: longest diagnostic body put into an ERROR_RECOVERABLE (bytes of UTF-8)
MAX_DIAGNOSTIC_BYTES = 512

_T = MessageType
_pack_header = HEADER_STRUCT.pack
# the hot path: header + PARTIAL_RESULT metadata in one pack (same bytes as HEADER_STRUCT + PartialResultMetadata)
_PARTIAL_STRUCT = struct.Struct("<" + HEADER_STRUCT.format.lstrip("<") + PartialResultMetadata.STRUCT.format.lstrip("<"))
_pack_partial = _PARTIAL_STRUCT.pack
_PARTIAL_META_LEN = PartialResultMetadata.STRUCT.size
_PROGRESS_STRUCT = ProgressMetadata.STRUCT
_DROP_REASON_STRUCT = ResultDropReasonMetadata.STRUCT
_PRESSURE_STRUCT = PressureMetadata.STRUCT
_RESULT_PUSH_META_LEN = 64

# ERROR_RECOVERABLE sent (nnrp-doc runtime-control ``control-frames.md`` "Recoverable Error Metadata"): error_code
# from the common error registry (:class:`~.errors.PacketError`), recovery_action from the reason_code registry.
_RECOVERY_UNSPECIFIED = 0  # reason_code "unspecified" (value-registries "Reason And Stage Codes")
_IN_FLIGHT_DRAIN = 0  # SESSION_CLOSE in_flight_policy drain (nnrp-rs crates/nnrp-core/src/enums.rs InFlightPolicy)
_DROP_PEER_CANCELLED = 3  # drop_reason_code peer_cancelled (nnrp-doc runtime-control value-registries)
_SCOPE_SESSION = 1
_SCOPE_FRAME = 2


class _Op:
    """One active operation: the pair fixed at FRAME_SUBMIT (nnrp-rs ``crates/nnrp-core/src/operation.rs``).
    ``streamable`` turns False at the client's FRAME_CANCEL (the shipped native client rejects PARTIAL_RESULT and
    PROGRESS after it); ``cancelled`` is set by the first FRAME_CANCEL / CANCEL / ABORT / SUPERSEDE; ``sequence``
    is the ``result_sequence`` of the last PARTIAL_RESULT sent (0: none), so a drop the core sends itself
    (:meth:`ServerConnection._on_session_close`) numbers after it."""

    __slots__ = ("session_id", "frame_id", "operation_id", "streamable", "cancelled", "sequence")

    def __init__(self, session_id: int, frame_id: int, operation_id: int) -> None:
        self.session_id = session_id
        self.frame_id = frame_id
        self.operation_id = operation_id
        self.streamable = True
        self.cancelled = False
        self.sequence = 0


class _Session:
    __slots__ = ("session_id", "ops", "reservations", "reserved_frames", "finished", "finished_frames",
                 "finished_ops", "draining")  # fmt: skip

    def __init__(self, session_id: int) -> None:
        self.session_id = session_id
        self.ops: dict[int, _Op] = {}  # operation_id → op
        self.reservations: dict[int, tuple[int, int]] = {}  # operation_id → (frame_id, deadline_unix_ms)
        self.reserved_frames: dict[int, int] = {}  # frame_id → operation_id of a reservation
        self.finished: dict[tuple[int, int], None] = {}  # (frame_id, operation_id) of recent terminals, oldest first
        # the same pairs by frame and by operation (latest pair of each id; an entry leaves with its pair)
        self.finished_frames: dict[int, int] = {}  # frame_id → operation_id
        self.finished_ops: dict[int, int] = {}  # operation_id → frame_id
        #: the client's SESSION_CLOSE (drain) while operations ran: its ``last_operation_id``, echoed by the
        #: closed ack that follows the last terminal; None while the session is open
        self.draining: int | None = None


class _SessionIds:
    """The session ids used on one connection — opened (open or closed) or reserved by a pending open — with
    O(1) work per open and close and bounded memory, whatever the connection did before.

    Every id below ``next`` is used: the ids this server picks are handed out in increasing order, and ``next``
    moves past each id a client asked for (SESSION_OPEN ``requested_session_id``) as soon as it is reached.
    ``above`` holds the requested ids beyond ``next``; each enters and leaves it once. When more than
    :attr:`MAX_ABOVE` wait there, ``next`` jumps past the largest and ``above`` empties: the ids passed over are
    never handed out (nothing is reused, only skipped; a client that asks for ids far ahead can at worst use up
    its own connection's ids, and :meth:`allocate` then says so). An id is never handed out twice on a
    connection (the native client refuses an id its connection used before: nnrp-rs
    ``crates/nnrp-core/src/lifecycle.rs``)."""

    __slots__ = ("next", "above")

    #: requested ids remembered beyond ``next`` on one connection
    MAX_ABOVE = 1024
    #: the largest session id (u32)
    LAST = 0xFFFFFFFF

    def __init__(self) -> None:
        self.next = 1
        self.above: set[int] = set()

    def __contains__(self, session_id: int) -> bool:
        """``session_id`` is used (or reserved by a pending open)."""
        return session_id < self.next or session_id in self.above

    def add(self, session_id: int) -> None:
        """Mark a requested id used (one not :meth:`__contains__`)."""
        self.above.add(session_id)
        self._advance()
        if len(self.above) > self.MAX_ABOVE:
            self.next = max(self.above) + 1
            self.above.clear()

    def discard(self, session_id: int) -> None:
        """Free a requested id that was never opened (a rejected open), unless ``next`` passed it already."""
        self.above.discard(session_id)

    def allocate(self) -> int:
        """The lowest id nobody used (≥ 1, increasing), now used; 0 when no u32 id is left."""
        session_id = self.next
        if session_id > self.LAST:
            return 0
        self.next = session_id + 1
        self._advance()
        return session_id

    def _advance(self) -> None:
        above, candidate = self.above, self.next
        while candidate in above:
            above.discard(candidate)
            candidate += 1
        self.next = candidate


class _PendingOpen:
    __slots__ = ("metadata", "reserved_id")

    def __init__(self, metadata: SessionOpenMetadata, reserved_id: int) -> None:
        self.metadata = metadata
        self.reserved_id = reserved_id


class _Fatal(Exception):
    """Internal: the packet ends the connection."""


class _Ignore(Exception):
    """Internal: a late control for an operation this server already finished (a race, not an error)."""


class ServerConnection:
    """The server side of one NNRP/1 connection (plain data; see the module docstring).

    ``max_in_flight_per_session`` is advertised in SERVER_HELLO_ACK ``max_concurrent_frames`` and in every
    SESSION_OPEN_ACK, and bounds the pre-submit DEADLINE reservations of a session; ``max_packet_bytes`` bounds
    one received packet (:class:`~.framing.PacketReader`) and is advertised as ``max_body_bytes``;
    ``profiles`` are the profile ids sessions may open (hello bitmap bit N-1 for profile N, nnrp-rs
    ``server.rs`` profile bitmap); ``schemas`` the accepted ``(schema_id, schema_version)`` pairs.
    ``authenticate``: ``None`` when the server requires no key; else a pure function that is given an
    authentication block (:mod:`vllm_nnrp_plugin.auth_block`) and returns whether it holds an accepted key,
    raising ``ValueError`` when the block is malformed (the connection then ends, as for any malformed hello).
    """

    #: SESSION_CLOSE with ``in_flight_policy`` drain while operations run: True → :class:`~.events.SessionDraining`,
    #: each operation keeps its terminal and the closing ack follows the last one (:meth:`_on_session_close`);
    #: False → the core ends them itself as for an abort (a ``peer_cancelled`` drop each, then the ack) and
    #: reports :class:`~.events.SessionClosed`. Set it (on the instance) once the application handles
    #: SessionDraining (:mod:`vllm_nnrp_plugin.nnrp_binding.connection` does).
    drain_sessions: bool = False

    def __init__(
        self,
        *,
        max_in_flight_per_session: int,
        max_packet_bytes: int = framing.MAX_PACKET_BYTES,
        profiles: tuple[int, ...] = (2,),
        schemas: tuple[tuple[int, int], ...] = ((4097, 3),),
        authenticate: Callable[[bytes], bool] | None = None,
    ) -> None:
        if not 1 <= max_in_flight_per_session:
            raise ValueError("max_in_flight_per_session must be at least 1")
        if not framing.HEADER_LENGTH <= max_packet_bytes <= 0xFFFFFFFF:
            raise ValueError("max_packet_bytes must fit a u32 and hold a header")
        self._max_in_flight = max_in_flight_per_session
        self._credit = min(max_in_flight_per_session, 0xFFFF)
        self._max_packet_bytes = max_packet_bytes
        self._profiles = frozenset(profiles)
        self._profile_bitmap = 0
        for profile in profiles:
            if 1 <= profile <= 32:
                self._profile_bitmap |= 1 << (profile - 1)
        self._schemas = frozenset(schemas)
        self._authenticate = authenticate
        #: the hello's verdict: True once a key was accepted (or none is required)
        self._authenticated = authenticate is None
        self._hello_auth_status = AUTH_STATUS_NOT_REQUIRED
        self._finished_memory = max(64, 4 * max_in_flight_per_session)

        self._reader = framing.PacketReader(max_packet_bytes)
        self._out = bytearray()
        self._handshaken = False
        self._ended = False
        self._sessions: dict[int, _Session] = {}
        self._ops: dict[tuple[int, int], _Op] = {}  # (session_id, frame_id) → op: the send hot path's one lookup
        self._used_ids = _SessionIds()  # opened on this connection (open or closed) or reserved by a pending open
        self._pending: dict[int, _PendingOpen] = {}
        self._next_request = 1

    # -- state ---------------------------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """ConnectionEnded was emitted (EOF or fatal); nothing more is queued after that."""
        return self._ended

    @property
    def sessions(self) -> int:
        """Sessions open right now on this connection."""
        return len(self._sessions)

    @property
    def buffered(self) -> int:
        """Bytes received that belong to a packet not complete yet (what the next read may finish)."""
        return self._reader.buffered

    def release(self) -> None:
        """The transport is gone: drop the receive buffer and what waits to be sent at once (a connection's
        memory is freed when it ends, not when a garbage collection finds it). Nothing is reported after it."""
        self._ended = True
        self._reader = framing.PacketReader(framing.HEADER_LENGTH)
        self._out = bytearray()
        self._sessions.clear()
        self._ops.clear()
        self._pending.clear()

    def data_to_send(self) -> bytes:
        """Everything queued since the last call (``b""`` if nothing), then cleared."""
        if not self._out:
            return b""
        data = bytes(self._out)
        self._out.clear()
        return data

    # -- input ---------------------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list:
        """Feed bytes read from the transport (``b""``: the peer's end of stream); return the events they
        completed, in order. Never raises: whatever the bytes are, the worst outcome is
        :class:`~.events.ConnectionEnded`, after which this returns ``[]``."""
        if self._ended:
            return []
        events: list = []
        if not data:
            buffered = self._reader.buffered
            self._end(events, None if not buffered else f"end of stream inside a packet ({buffered} bytes buffered)")
            return events
        try:
            packets = self._reader.feed(data)
        except framing.FramingError as exc:
            self._end(events, str(exc))
            return events
        for packet in packets:
            try:
                self._dispatch(packet, events)
            except _Fatal as exc:
                self._end(events, str(exc))
            except Exception as exc:  # noqa: BLE001 - never raise on peer input; a bug ends only this connection
                self._end(events, f"internal error ({type(exc).__name__}) handling {message_name(packet.msg_type)} of session "
                                  f"{packet.session_id} frame {packet.frame_id}")  # never the packet: it is the client's
            if self._ended:
                break
        return events

    def _end(self, events: list, error: str | None) -> None:
        self._ended = True
        self._sessions.clear()
        self._ops.clear()
        self._pending.clear()
        events.append(ConnectionEnded(error))

    def _queue(self, msg_type: int, session_id: int, frame_id: int, meta: bytes, body: bytes = b"", trace_id: int = 0) -> None:
        out = self._out
        out += _pack_header(
            HEADER_MAGIC, 1, 0, msg_type, HEADER_LENGTH, 0, len(meta), len(body), session_id, frame_id, 0, 0, trace_id
        )
        out += meta
        if body:
            out += body

    def _dispatch(self, packet: framing.Packet, events: list) -> None:
        msg_type = packet.msg_type
        if not self._handshaken:
            # nnrp-rs crates/nnrp-runtime/src/server.rs: the first non-probe packet must be CLIENT_HELLO
            if msg_type == _T.TRANSPORT_PROBE:
                self._on_probe(packet)
            elif msg_type == _T.CLIENT_HELLO:
                self._on_hello(packet, events)
            else:
                raise _Fatal(f"{message_name(msg_type)} before CLIENT_HELLO")
            return
        session_id = packet.session_id
        if session_id == 0:
            # nnrp-rs server.rs: after the handshake session 0 carries only SESSION_OPEN and TRANSPORT_PROBE
            if msg_type == _T.SESSION_OPEN:
                self._on_session_open(packet, events)
            elif msg_type == _T.TRANSPORT_PROBE:
                self._on_probe(packet)
            elif msg_type == _T.CLIENT_HELLO:
                raise _Fatal("second CLIENT_HELLO on the connection")
            else:
                raise _Fatal(f"{message_name(msg_type)} on session 0 after the handshake")
            return
        session = self._sessions.get(session_id)
        if session is None:
            # nnrp-rs crates/nnrp-runtime/src/multiplex.rs: a packet for an unregistered session id is fatal
            state = "closed" if session_id in self._used_ids else "unknown"
            raise _Fatal(f"{message_name(msg_type)} for {state} session {session_id}")
        if msg_type == _T.CLIENT_HELLO:
            raise _Fatal("second CLIENT_HELLO on the connection")
        handler = _SESSION_HANDLERS.get(msg_type)
        try:
            if handler is None:
                raise PacketError(f"{message_name(msg_type)} is not accepted from a client on a session", ERR_STATE)
            handler(self, session, packet, events)
        except PacketError as rejection:
            self._reject(packet, rejection, events)
        except _Ignore:
            pass

    def _reject(self, packet: framing.Packet, rejection: PacketError, events: list) -> None:
        """PacketRejected + ERROR_RECOVERABLE (frame scope when the header names a frame, else session scope;
        header frame = ``related_frame_id`` as nnrp-rs ``server.rs`` ``send_recoverable_error``; source_role
        server, no retry, the reason as the diagnostic). The session goes on."""
        events.append(PacketRejected(packet.session_id, packet.frame_id, packet.msg_type, rejection.reason))
        diagnostic = rejection.reason.encode("utf-8", "replace")[:MAX_DIAGNOSTIC_BYTES]
        meta = RecoverableErrorMetadata(
            rejection.error_code,
            _SCOPE_FRAME if packet.frame_id else _SCOPE_SESSION,
            _RECOVERY_UNSPECIFIED,
            ROLE_SERVER,
            0,
            0,
            packet.session_id,
            packet.frame_id,
            0,
            len(diagnostic),
        ).pack()
        self._queue(_T.ERROR_RECOVERABLE, packet.session_id, packet.frame_id, meta, diagnostic)

    # -- connection scope ----------------------------------------------------------------------------------

    def _on_probe(self, packet: framing.Packet) -> None:
        """TRANSPORT_PROBE → TRANSPORT_PROBE_ACK echoing ``probe_id``, ``reserved0`` 0 and ``server_recv_ts_us``
        0 (no clock in the core); ``meta_len`` 16 and ``body_len == probe_payload_bytes`` or the connection ends
        (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` probe handling, ``crates/nnrp-core/src/control.rs``
        ``TransportProbe``/``TransportProbeAck``)."""
        if packet.session_id != 0:
            raise _Fatal("TRANSPORT_PROBE with a session id")
        if len(packet.meta) != TransportProbeMetadata.STRUCT.size:
            raise _Fatal(f"TRANSPORT_PROBE meta_len {len(packet.meta)} (must be 16)")
        probe = TransportProbeMetadata.unpack(packet.meta)
        if len(packet.body) != probe.probe_payload_bytes:
            raise _Fatal(
                f"TRANSPORT_PROBE body_len {len(packet.body)} != probe_payload_bytes {probe.probe_payload_bytes}"
            )
        self._queue(_T.TRANSPORT_PROBE_ACK, 0, 0, TransportProbeAckMetadata(probe.probe_id, 0, 0).pack())

    def _on_hello(self, packet: framing.Packet, events: list) -> None:
        """CLIENT_HELLO → SERVER_HELLO_ACK with the native server's values (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` hello ack; checks of ``crates/nnrp-core/src/control.rs``
        ``ClientHello`` validation): ``meta_len`` 64 exactly, version window containing 1, wire-format bit 0,
        non-zero profile and payload-kind bitmaps, a profile in common, a body of exactly ``auth_bytes``
        (no control extension block: none is negotiated here). Any failure ends the connection with nothing
        sent, as the native server.

        The body is the authentication block (NNRP/1-preview1 §6.2.1: ``auth_block`` belongs to the body,
        after the control extension block; layout and ``auth_status`` values: :mod:`vllm_nnrp_plugin.auth_block`).
        Without ``authenticate`` it is ignored and ``auth_status`` is 0; with it, the verdict is ``auth_status``
        (accepted, rejected, or missing), and after a failure the connection's sessions need a block of their
        own (:meth:`_on_session_open`); a block over ``MAX_AUTH_BYTES`` or one ``authenticate`` calls malformed
        ends the connection."""
        if packet.session_id != 0:
            raise _Fatal("CLIENT_HELLO with a session id")
        if len(packet.meta) != ClientHelloMetadata.STRUCT.size:
            raise _Fatal(f"CLIENT_HELLO meta_len {len(packet.meta)} (must be 64)")
        hello = ClientHelloMetadata.unpack(packet.meta)
        if not hello.min_version_major <= 1 <= hello.max_version_major:
            raise _Fatal(f"CLIENT_HELLO version window {hello.min_version_major}..{hello.max_version_major} excludes 1")
        if not hello.supported_wire_format_bitmap & 1:
            raise _Fatal("CLIENT_HELLO does not offer wire format 0")
        if not hello.supported_profile_bitmap or not hello.supported_payload_kind_bitmap:
            raise _Fatal("CLIENT_HELLO offers no profile or no payload kind")
        if hello.control_extension_bytes:
            raise _Fatal("CLIENT_HELLO declares a control extension block (none is negotiated)")
        if len(packet.body) != hello.auth_bytes:
            raise _Fatal(f"CLIENT_HELLO body_len {len(packet.body)} != auth_bytes {hello.auth_bytes}")
        auth_status = self._check_auth(packet.body, "CLIENT_HELLO")
        self._hello_auth_status = auth_status
        self._authenticated = auth_status in (AUTH_STATUS_NOT_REQUIRED, AUTH_STATUS_ACCEPTED)
        accepted_profiles = hello.supported_profile_bitmap & self._profile_bitmap
        if not accepted_profiles:
            raise _Fatal(f"CLIENT_HELLO profile bitmap {hello.supported_profile_bitmap:#x} has no profile in common")
        ack = ServerHelloAckMetadata(
            selected_version_major=1,
            selected_wire_format=0,
            auth_status=auth_status,
            session_id=0,
            accepted_profile_bitmap=accepted_profiles,
            accepted_payload_kind_bitmap=hello.supported_payload_kind_bitmap,
            accepted_codec_bitmap=hello.supported_codec_bitmap,
            accepted_compression_bitmap=hello.supported_compression_bitmap,
            accepted_dtype_bitmap=hello.supported_dtype_bitmap,
            accepted_layout_bitmap=hello.supported_layout_bitmap,
            cache_digest_bitmap=hello.cache_digest_bitmap,
            cache_object_bitmap=0,  # client's AND the server's cache kinds (none)
            max_cache_entries=0,
            max_cache_bytes=0,
            max_lane_count=max(1, hello.max_lane_count),
            max_concurrent_frames=self._credit,
            target_cadence_x100=hello.target_cadence_x100,
            latency_budget_ms=hello.latency_budget_ms,
            quality_tier=hello.quality_tier,
            degrade_policy=hello.degrade_policy,
            max_body_bytes=self._max_packet_bytes,
            token_ttl_ms=0,  # resume is never granted
            retry_after_ms=0,
            control_extension_bytes=0,
            server_flags=0,
        )
        self._queue(_T.SERVER_HELLO_ACK, 0, 0, ack.pack())
        self._handshaken = True

    def _on_session_open(self, packet: framing.Packet, events: list) -> None:
        """SESSION_OPEN (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` session open handling,
        ``crates/nnrp-core/src/session.rs`` ``SessionOpen::parse``, ``crates/nnrp-core/src/recovery.rs``).
        Malformed (``meta_len`` ≠ 48, reserved0, unknown ``session_flags`` bits or priority, ``body_len`` ≠
        token + auth + extension lengths, session extension bytes at all, auth bytes when the server requires
        none, a malformed or oversized auth block, a token without flag 0x01 or without a requested id) → the
        connection ends. Then, answered by the core: no accepted key when one is required (neither the hello's
        nor the block after the resume token: :mod:`vllm_nnrp_plugin.auth_block`) → rejected ``auth_failed``
        with :class:`~.events.AuthenticationFailed`, before anything else about the session is decided; a
        resume → rejected ``resume_rejected``;
        a profile not offered → ``profile_unsupported``; a schema not offered → ``schema_unsupported``; a
        requested id already used on this connection (or asked by a pending open) →
        ``session_limit_reached`` (the native server's code for an id in use). Otherwise
        :class:`~.events.SessionOpenRequested` for the application to accept or reject."""
        if len(packet.meta) != SessionOpenMetadata.STRUCT.size:
            raise _Fatal(f"SESSION_OPEN meta_len {len(packet.meta)} (must be 48)")
        try:
            request = SessionOpenMetadata.unpack(packet.meta)
        except (ValueError, TypeError) as exc:
            raise _Fatal(f"malformed SESSION_OPEN: {exc}") from None
        declared = request.resume_token_bytes + request.auth_bytes + request.session_extension_bytes
        if len(packet.body) != declared:
            raise _Fatal(f"SESSION_OPEN body_len {len(packet.body)} != declared {declared}")
        if request.session_extension_bytes:
            raise _Fatal("SESSION_OPEN with session extension bytes (not negotiated)")
        if request.auth_bytes and self._authenticate is None:
            raise _Fatal("SESSION_OPEN with auth bytes, but this server requires no authentication (auth_status 0)")
        if self._authenticate is not None:
            block = packet.body[request.resume_token_bytes : request.resume_token_bytes + request.auth_bytes]
            if block:
                status = self._check_auth(block, "SESSION_OPEN")
            else:
                status = AUTH_STATUS_ACCEPTED if self._authenticated else self._hello_auth_status
            if status != AUTH_STATUS_ACCEPTED:
                presented = bool(block) or self._hello_auth_status == AUTH_STATUS_REJECTED
                events.append(AuthenticationFailed(presented))
                reason = "the API key is not valid" if presented else "this server requires an API key"
                self._queue_rejection(request, SESSION_ERROR_AUTH_FAILED, f"authentication failed: {reason}")
                return
        if request.resume_token_bytes:
            if not request.session_flags & 0x01 or not request.requested_session_id:
                raise _Fatal("SESSION_OPEN resume token without allow_resume or without a requested session id")
            self._queue_rejection(request, SESSION_ERROR_RESUME_REJECTED, "session resume is not supported")
            return
        if request.profile_id not in self._profiles:
            self._queue_rejection(request, SESSION_ERROR_PROFILE_UNSUPPORTED, "requested profile is unsupported")
            return
        if (request.schema_id, request.schema_version) not in self._schemas:
            self._queue_rejection(request, SESSION_ERROR_SCHEMA_UNSUPPORTED, "requested schema is unsupported")
            return
        wanted = request.requested_session_id
        if wanted:
            if wanted in self._used_ids:
                self._queue_rejection(
                    request, SESSION_ERROR_SESSION_LIMIT_REACHED, "requested session id is already in use"
                )
                return
            self._used_ids.add(wanted)
        token = self._next_request
        self._next_request += 1
        self._pending[token] = _PendingOpen(request, wanted)
        events.append(
            SessionOpenRequested(
                request=token,
                requested_session_id=wanted,
                profile_id=request.profile_id,
                priority_class=int(request.priority_class),
                session_flags=request.session_flags,
                schema_id=request.schema_id,
                schema_version=request.schema_version,
                default_deadline_ms=request.default_deadline_ms,
                max_in_flight_operations=request.max_in_flight_operations,
            )
        )

    def _check_auth(self, block: bytes, where: str) -> int:
        """The ``auth_status`` of ``block`` (:mod:`vllm_nnrp_plugin.auth_block`); raises :class:`_Fatal` for a block
        that is oversized or that ``authenticate`` calls malformed."""
        if self._authenticate is None:
            return AUTH_STATUS_NOT_REQUIRED
        if not block:
            return AUTH_STATUS_MISSING
        if len(block) > MAX_AUTH_BYTES:
            raise _Fatal(f"{where} auth block of {len(block)} bytes (at most {MAX_AUTH_BYTES})")
        try:
            accepted = self._authenticate(block)
        except ValueError as exc:
            raise _Fatal(f"{where} auth block is malformed: {exc}") from None
        return AUTH_STATUS_ACCEPTED if accepted else AUTH_STATUS_REJECTED

    def _ack(self, request: SessionOpenMetadata, session_id: int, status: int, error_code: int, ext: int) -> bytes:
        return SessionOpenAckMetadata(
            session_id=session_id,
            accepted_profile_id=request.profile_id,
            accepted_priority_class=int(request.priority_class),
            session_status=status,
            schema_id=request.schema_id,
            schema_version=request.schema_version,
            granted_operation_credit=self._credit,
            max_in_flight_operations=self._credit,
            lease_ttl_ms=LEASE_TTL_MS,
            resume_window_ms=0,
            resume_token_bytes=0,
            session_extension_bytes=ext,
            server_session_tag=session_id,
            route_scope_id=0,
            session_error_code=error_code,
            session_flags_ack=0,
        ).pack()

    def _queue_rejection(self, request: SessionOpenMetadata, error_code: int, diagnostic: str) -> None:
        """A rejected SESSION_OPEN_ACK as the native server sends it: header and metadata session 0, status
        rejected, the code, the UTF-8 diagnostic as body (``session_extension_bytes``) — nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` rejection ack; the native client turns it into an open error with
        that code and keeps the connection."""
        body = diagnostic.encode("utf-8")
        self._queue(_T.SESSION_OPEN_ACK, 0, 0, self._ack(request, 0, SESSION_STATUS_REJECTED, error_code, len(body)), body)

    # -- the application's answers to SessionOpenRequested ------------------------------------------------

    def _take_pending(self, request: int) -> _PendingOpen | None:
        pending = self._pending.pop(request, None)
        if pending is None:
            if self._ended and 1 <= request < self._next_request:
                return None
            raise LocalProtocolError(f"session-open request {request!r} is unknown or already answered")
        return pending

    def accept_session(self, request: int) -> int:
        """Queue the accepted SESSION_OPEN_ACK for ``request`` and return the new session id: the requested id
        when non-zero, else the next id this connection hands out (ids increase: the first is 1, and no id is
        used twice on a connection, :class:`_SessionIds`; O(1) whatever the connection did before). The ack's
        header carries the new id (the native client only routes early session packets for an id it saw in an
        ack header: nnrp-rs ``crates/nnrp-runtime/src/multiplex.rs``). Returns 0 when the connection ended before
        the answer (nothing queued), and when no u32 session id is left on this connection (then a rejected ack
        ``session_limit_reached`` is queued instead); raises :class:`LocalProtocolError` for a request that was
        never issued or already answered."""
        pending = self._take_pending(request)
        if pending is None:
            return 0
        session_id = pending.reserved_id or self._used_ids.allocate()
        if not session_id:
            self._queue_rejection(
                pending.metadata, SESSION_ERROR_SESSION_LIMIT_REACHED, "no session id is left on this connection"
            )
            return 0
        self._sessions[session_id] = _Session(session_id)
        self._queue(
            _T.SESSION_OPEN_ACK, session_id, 0, self._ack(pending.metadata, session_id, SESSION_STATUS_OPENED, 0, 0)
        )
        return session_id

    def reject_session(self, request: int, session_error_code: int, diagnostic: str) -> None:
        """Queue a rejected SESSION_OPEN_ACK for ``request`` (header and metadata session 0,
        ``session_error_code`` non-zero, ``diagnostic`` as the UTF-8 body). Nothing happens when the connection
        ended first; :class:`LocalProtocolError` for an unknown request or a code of 0."""
        if not 0 < session_error_code <= 0xFFFFFFFF:
            raise LocalProtocolError(f"session_error_code {session_error_code!r} must be a non-zero u32")
        pending = self._take_pending(request)
        if pending is None:
            return
        if pending.reserved_id:
            # never opened: the id may still be asked for later (unless ids handed out since passed it)
            self._used_ids.discard(pending.reserved_id)
        self._queue_rejection(pending.metadata, session_error_code, diagnostic)

    # -- session scope: client packets ---------------------------------------------------------------------

    def _on_frame_submit(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """FRAME_SUBMIT: the layout (:func:`.layouts.frame_submit`), then header frame ≠ 0;
        neither the frame nor the operation id active or used by a recently finished operation of the session
        (the last ``max(64, 4 × max_in_flight_per_session)`` terminals; the native server refuses every frame
        and operation id its session ever registered: ``crates/nnrp-runtime/src/server.rs`` "duplicate
        FRAME_SUBMIT frame id", ``crates/nnrp-core/src/operation.rs`` ``register`` — its registry keeps them
        all); not on a session that is draining after the client's SESSION_CLOSE. Each is refused like any
        duplicate (ERROR_RECOVERABLE ``INVALID_STATE``; the session goes on). A pre-submit DEADLINE
        reservation binds here: both ids must match it (shipped build; public nnrp-rs
        ``crates/nnrp-runtime/src/pre_submit.rs`` at 00074cf), and the DeadlineReceived(submitted=False) follows
        the OperationSubmitted."""
        metadata = layouts.frame_submit(packet)
        frame_id = packet.frame_id
        operation_id = metadata.operation_id
        sid = session.session_id
        if not frame_id:
            raise PacketError("FRAME_SUBMIT with frame id 0", ERR_STATE)
        if (sid, frame_id) in self._ops:
            raise PacketError(f"FRAME_SUBMIT frame {frame_id} is bound to an active operation", ERR_STATE)
        if operation_id in session.ops:
            raise PacketError(f"FRAME_SUBMIT operation {operation_id} is already active", ERR_STATE)
        if frame_id in session.finished_frames:
            raise PacketError(f"FRAME_SUBMIT frame {frame_id} was used by a finished operation", ERR_STATE)
        if operation_id in session.finished_ops:
            raise PacketError(f"FRAME_SUBMIT operation {operation_id} already finished", ERR_STATE)
        if session.draining is not None:
            raise PacketError("FRAME_SUBMIT on a session the client is closing", ERR_STATE)
        reservation = session.reservations.get(operation_id)
        reserved_op = session.reserved_frames.get(frame_id)
        if reservation is not None and reservation[0] != frame_id:
            raise PacketError("FRAME_SUBMIT does not match its pre-submit DEADLINE frame id", ERR_STATE)
        if reserved_op is not None and reserved_op != operation_id:
            raise PacketError("FRAME_SUBMIT frame is reserved by a pre-submit DEADLINE of another operation", ERR_STATE)
        op = _Op(sid, frame_id, operation_id)
        session.ops[operation_id] = op
        self._ops[(sid, frame_id)] = op
        events.append(OperationSubmitted(sid, frame_id, operation_id, packet.trace_id, metadata, packet.body))
        if reservation is not None:
            del session.reservations[operation_id]
            del session.reserved_frames[frame_id]
            events.append(DeadlineReceived(sid, frame_id, operation_id, reservation[1], False))

    def _on_frame_cancel(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """FRAME_CANCEL: header-only (:func:`.layouts.header_only`), the header frame bound to an active operation (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` FRAME_CANCEL arm). After it no PARTIAL_RESULT or PROGRESS is sent
        for the operation (the shipped native client rejects them "for a terminal operation"); a terminal is
        still expected. A second cancel of the same operation is rejected (shipped server: "server cancel did
        not transition an active operation")."""
        layouts.header_only(packet)
        op = self._ops.get((session.session_id, packet.frame_id))
        if op is None:
            self._unknown(session, packet.frame_id, None, "FRAME_CANCEL")
        op.streamable = False
        if op.cancelled:
            raise PacketError(f"FRAME_CANCEL for operation {op.operation_id} already cancelled", ERR_STATE)
        op.cancelled = True
        events.append(OperationCancelled(session.session_id, op.frame_id, op.operation_id, int(_T.FRAME_CANCEL), b""))

    def _on_cancel(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """CANCEL / ABORT: the layout (:func:`.layouts.control_request`), an active operation whose frame is the
        header frame (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` CANCEL/ABORT arms). The first cancel of an operation is reported; a repeated one is rejected."""
        name = message_name(packet.msg_type)
        metadata = layouts.control_request(packet)
        op = self._target(session, packet, metadata.operation_id, name)
        if op.cancelled:
            raise PacketError(f"{name} for operation {op.operation_id} already cancelled", ERR_STATE)
        op.cancelled = True
        events.append(OperationCancelled(session.session_id, op.frame_id, op.operation_id, packet.msg_type, packet.body))

    def _on_scheduling(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """DEADLINE / PRIORITY_UPDATE / EXPIRE_AT: the layout (:func:`.layouts.scheduling`). For an active
        operation the header frame must be its frame (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` scheduling
        arm); DEADLINE and EXPIRE_AT →
        :class:`~.events.DeadlineReceived` (submitted True; EXPIRE_AT bounds the operation as a deadline does),
        PRIORITY_UPDATE → :class:`~.events.PriorityUpdated`. A DEADLINE (only) for an operation not submitted yet
        is a pre-submit reservation (shipped build; nnrp-rs ``crates/nnrp-runtime/src/pre_submit.rs`` at
        00074cf): both ids non-zero, frame free, no duplicate, at most ``max_in_flight_per_session`` per
        session; the event comes right after the matching FRAME_SUBMIT's OperationSubmitted, with submitted
        False. (No clock in the core: "deadline in the future" is the application's to judge.)"""
        msg_type = packet.msg_type
        name = message_name(msg_type)
        metadata = layouts.scheduling(packet)
        operation_id = metadata.operation_id
        sid = session.session_id
        if msg_type == _T.DEADLINE and operation_id and operation_id not in session.ops:
            frame_id = packet.frame_id
            if (frame_id, operation_id) in session.finished:
                raise _Ignore
            if not frame_id:
                raise PacketError("pre-submit DEADLINE with frame id 0", ERR_STATE)
            if (sid, frame_id) in self._ops:
                raise PacketError(f"pre-submit DEADLINE frame {frame_id} is bound to another operation", ERR_STATE)
            if operation_id in session.reservations or frame_id in session.reserved_frames:
                raise PacketError("duplicate pre-submit DEADLINE reservation", ERR_STATE)
            if len(session.reservations) >= self._max_in_flight:
                raise PacketError("pre-submit DEADLINE reservations exceed the session's in-flight limit", ERR_LIMIT)
            session.reservations[operation_id] = (frame_id, metadata.deadline_unix_ms)
            session.reserved_frames[frame_id] = operation_id
            return
        op = self._target(session, packet, operation_id, name)
        if msg_type == _T.PRIORITY_UPDATE:
            events.append(PriorityUpdated(sid, op.frame_id, op.operation_id, metadata.priority_class,
                                          metadata.priority_delta))  # fmt: skip
        else:
            events.append(DeadlineReceived(sid, op.frame_id, op.operation_id, metadata.deadline_unix_ms, True))

    def _on_supersede(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """SUPERSEDE: the layout (:func:`.layouts.supersede`), and ``old_operation_id`` an active operation whose frame is the header frame (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` SUPERSEDE arm, ``require_operation_frame``). The operation is
        cancelled as by CANCEL (a repeated SUPERSEDE or cancel of it is rejected) →
        :class:`~.events.OperationSuperseded`."""
        metadata = layouts.supersede(packet)
        op = self._target(session, packet, metadata.old_operation_id, "SUPERSEDE")
        if op.cancelled:
            raise PacketError(f"SUPERSEDE for operation {op.operation_id} already cancelled", ERR_STATE)
        op.cancelled = True
        events.append(OperationSuperseded(session.session_id, op.frame_id, op.operation_id,
                                          metadata.new_operation_id, metadata.drop_reason_code, packet.body))  # fmt: skip

    def _on_budget_update(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """BUDGET_UPDATE: the layout (:func:`.layouts.budget_update`), an active operation whose frame is the
        header frame (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` BUDGET_UPDATE arm) →
        :class:`~.events.BudgetUpdated`."""
        metadata = layouts.budget_update(packet)
        op = self._target(session, packet, metadata.operation_id, "BUDGET_UPDATE")
        events.append(
            BudgetUpdated(
                session.session_id, op.frame_id, op.operation_id, metadata.token_budget,
                metadata.compute_budget_units, metadata.memory_budget_bytes, metadata.bandwidth_budget_bytes,
            )  # fmt: skip
        )

    def _on_trace_context(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """TRACE_CONTEXT: the layout (:func:`.layouts.trace_context`); header frame 0
        = session scope, else the frame of an active operation (shipped build: "TRACE_CONTEXT references an
        unknown operation frame")."""
        metadata = layouts.trace_context(packet)
        operation_id = None
        if packet.frame_id:
            op = self._ops.get((session.session_id, packet.frame_id))
            if op is None:
                self._unknown(session, packet.frame_id, None, "TRACE_CONTEXT")
            operation_id = op.operation_id
        events.append(
            TraceContextReceived(
                session.session_id, packet.frame_id, operation_id, metadata.trace_id, metadata.span_id,
                metadata.parent_span_id, metadata.stage_code, metadata.flags, metadata.body_bytes,
            )  # fmt: skip
        )

    def _on_pressure(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """BACKPRESSURE / CREDIT_UPDATE from the client: pressure metadata (``meta_len`` 32, flags ⊆ 0x3,
        reserved 0, body empty; BACKPRESSURE ``pressure_level`` 1..3; nnrp-rs ``crates/nnrp-core/src/control.rs``
        ``Pressure``). Recorded by nobody (nnrp-rs ``crates/nnrp-runtime/src/pressure.rs``): ignored."""
        layouts.pressure(packet)

    def _on_flow_update(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """FLOW_UPDATE: ``meta_len`` 32, body empty, nnrp-py ``FlowUpdateMetadata`` parse plus reserved0/1 zero;
        on a session the scope must be session or operation (nnrp-rs ``crates/nnrp-core/src/flow.rs`` routing
        rule). Advisory: ignored."""
        layouts.flow_update(packet)

    def _on_result_hint(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """RESULT_HINT: ``meta_len`` 16, known enum values (nnrp-rs ``crates/nnrp-core/src/control.rs``
        ``ResultHint``), body empty. Advisory: ignored."""
        layouts.result_hint(packet)

    def _on_client_error(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """ERROR_RECOVERABLE / RETRY_AFTER from the client (a native client can send them): layout checks
        (flags, a non-reserved source_role, known error scope, ``body_len == diagnostic_bytes``; nnrp-rs
        ``crates/nnrp-core/src/control.rs``). Advisory: ignored."""
        if packet.msg_type == _T.ERROR_RECOVERABLE:
            layouts.recoverable_error(packet)
        else:
            layouts.retry_after(packet)

    def _on_ping(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """PING → PONG on the same session and frame; PONG is taken and ignored. Both header-only (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` ``receive_ping``/``send_ping``)."""
        layouts.header_only(packet)
        if packet.msg_type == _T.PING:
            self._queue(_T.PONG, session.session_id, packet.frame_id, b"")

    def _on_session_close(self, session: _Session, packet: framing.Packet, events: list) -> None:
        """SESSION_CLOSE (the layout: :func:`.layouts.session_close`). The one SESSION_CLOSE_ACK has header
        session = the session, frame 0, close_status closed, ``last_operation_id`` echoed (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` close ack).

        The rule, whatever the application does and in whatever order its sends come: every operation of the
        session gets its terminal **before** the ack, and nothing is ever queued for the session after it. The
        native client unregisters the session at the ack, and a later packet for it ends the whole connection,
        its other sessions included (nnrp-rs ``crates/nnrp-runtime/src/multiplex.rs`` unknown-session packets);
        the native server also sends no ack before its application has finished with the session. So no ack
        with close_status draining is ever sent (NagareWorks/nnrp-doc ``docs/en/design/v1-preview3.md`` §7.1C
        allows it; a client that already counts the session as closed could not take the terminals behind it).

        ``in_flight_policy`` says what happens to the operations still running (§7.1C):

        * nothing in flight: :class:`~.events.SessionClosed` and the ack, at once;
        * abort (1), or drain while :attr:`drain_sessions` is False: the core ends each operation itself, in
          submit order, with a RESULT_DROP_REASON ``peer_cancelled`` (source_role server, ``result_sequence``
          one past its last PARTIAL_RESULT, no diagnostic), then queues the ack; :class:`~.events.SessionClosed`
          follows, and every later send of the application for those operations returns False;
        * drain (0): :class:`~.events.SessionDraining`, nothing queued. The operations run on and each still
          gets its terminal from the application (partial results and controls as before; a new FRAME_SUBMIT is
          refused); right behind the last terminal the core queues the ack (the native client waits for it:
          nnrp-rs ``crates/nnrp-runtime/src/client.rs`` close handling, 30 s). A second SESSION_CLOSE while
          draining: with abort it ends the drain as above, with drain it is refused.

        Once closed, the id is never used again on this connection (a later packet for it ends the connection,
        every later send for it returns False)."""
        metadata = layouts.session_close(packet)
        sid = session.session_id
        drain = int(metadata.in_flight_policy) == _IN_FLIGHT_DRAIN
        if session.draining is not None and drain:
            raise PacketError("SESSION_CLOSE for a session that is already draining", ERR_STATE)
        if drain and session.ops and self.drain_sessions:
            session.draining = metadata.last_operation_id
            events.append(
                SessionDraining(sid, int(metadata.close_reason), metadata.drain_timeout_ms, tuple(session.ops))
            )
            return
        for op in session.ops.values():  # submit order (dict order)
            del self._ops[(sid, op.frame_id)]
            self._queue(_T.RESULT_DROP_REASON, sid, op.frame_id, _DROP_REASON_STRUCT.pack(
                op.operation_id, op.sequence + 1, _DROP_PEER_CANCELLED, ROLE_SERVER, 0, 0, 0))  # fmt: skip
        del self._sessions[sid]
        events.append(SessionClosed(sid, int(metadata.close_reason)))
        self._queue(_T.SESSION_CLOSE_ACK, sid, 0, SessionCloseAckMetadata(CLOSE_STATUS_CLOSED, metadata.last_operation_id).pack())

    def session_open(self, session_id: int) -> bool:
        """``session_id`` is open on this connection: accepted, and its SESSION_CLOSE_ACK closed not queued yet
        (a session draining after the client's SESSION_CLOSE is still open; the ack that follows its last
        terminal closes it)."""
        return session_id in self._sessions

    # -- helpers for the handlers --------------------------------------------------------------------------

    def _target(self, session: _Session, packet: framing.Packet, operation_id: int, name: str) -> _Op:
        """The active operation a control names by ``operation_id``; its frame must be the header frame
        (every later packet about an operation carries both ids: nnrp-rs ``crates/nnrp-runtime/src/server.rs``)."""
        op = session.ops.get(operation_id)
        if op is None:
            self._unknown(session, packet.frame_id, operation_id, name)
        if op.frame_id != packet.frame_id:
            raise PacketError(f"{name} header frame {packet.frame_id} does not match operation {operation_id}", ERR_STATE)
        return op

    @staticmethod
    def _unknown(session: _Session, frame_id: int, operation_id: int | None, name: str):
        if operation_id is None:
            if frame_id in session.finished_frames:
                raise _Ignore
            raise PacketError(f"{name} references an unknown operation frame {frame_id}", ERR_STATE)
        if (frame_id, operation_id) in session.finished:
            raise _Ignore
        raise PacketError(f"{name} references an unknown operation {operation_id}", ERR_STATE)

    def _finish(self, op: _Op) -> None:
        """``op``'s terminal was queued: forget it, remember its ids (bounded: :meth:`_on_frame_submit`), and
        close its session right behind it when that was its draining session's last operation."""
        session = self._sessions[op.session_id]
        frame_id, operation_id = op.frame_id, op.operation_id
        del session.ops[operation_id]
        del self._ops[(op.session_id, frame_id)]
        finished = session.finished
        finished[(frame_id, operation_id)] = None
        session.finished_frames[frame_id] = operation_id
        session.finished_ops[operation_id] = frame_id
        if len(finished) > self._finished_memory:
            old_frame, old_op = next(iter(finished))
            del finished[(old_frame, old_op)]
            if session.finished_frames.get(old_frame) == old_op:
                del session.finished_frames[old_frame]
            if session.finished_ops.get(old_op) == old_frame:
                del session.finished_ops[old_op]
        if session.draining is not None and not session.ops:
            del self._sessions[session.session_id]
            self._queue(_T.SESSION_CLOSE_ACK, session.session_id, 0,
                        SessionCloseAckMetadata(CLOSE_STATUS_CLOSED, session.draining).pack())  # fmt: skip

    # -- output: results and session-scope controls --------------------------------------------------------

    def send_partial_result(self, session_id: int, frame_id: int, operation_id: int, sequence: int, body: bytes) -> bool:
        """PARTIAL_RESULT (``result_sequence = delta_sequence = sequence``, object 0, flags 0, the inline body;
        nnrp-rs ``crates/nnrp-core/src/control.rs`` ``PartialResult``: with no object the body must not be
        empty). False when the operation is not active or the client FRAME_CANCELled it."""
        if sequence < 1 or not body:
            raise LocalProtocolError("PARTIAL_RESULT needs a sequence ≥ 1 and a non-empty body")
        op = self._ops.get((session_id, frame_id))
        if op is None or op.operation_id != operation_id or not op.streamable:
            _check_u64("PARTIAL_RESULT", operation_id, sequence)  # misuse raises even when the operation is gone
            return False
        size = len(body)
        try:
            header = _pack_partial(
                HEADER_MAGIC, 1, 0, 0x38, 40, 0, _PARTIAL_META_LEN, size, session_id, frame_id, 0, 0, 0,
                operation_id, sequence, 0, sequence, size, 0,
            )  # fmt: skip
        except struct.error as exc:
            raise LocalProtocolError(f"PARTIAL_RESULT field out of range: {exc}") from None
        op.sequence = sequence
        out = self._out
        out += header
        out += body
        return True

    def send_progress(
        self, session_id: int, frame_id: int, operation_id: int, sequence: int, stage_code: int, percent_x100: int
    ) -> bool:
        """PROGRESS (``progress_sequence = sequence``, object 0, no body; ``percent_x100`` 0..10000 or 0xffff:
        nnrp-rs ``crates/nnrp-core/src/control.rs`` ``Progress``). False when the operation is not active or
        the client FRAME_CANCELled it."""
        if sequence < 1 or not (0 <= percent_x100 <= 10_000 or percent_x100 == 0xFFFF):
            raise LocalProtocolError("PROGRESS needs a sequence ≥ 1 and percent_x100 in 0..10000 or 0xffff")
        op = self._ops.get((session_id, frame_id))
        if op is None or op.operation_id != operation_id or not op.streamable:
            _check_u64("PROGRESS", operation_id, sequence)
            return False
        try:
            meta = _PROGRESS_STRUCT.pack(operation_id, sequence, stage_code, percent_x100, 0, 0)
        except struct.error as exc:
            raise LocalProtocolError(f"PROGRESS field out of range: {exc}") from None
        self._queue(_T.PROGRESS, session_id, frame_id, meta)
        return True

    def send_result_push(self, session_id: int, frame_id: int, metadata: bytes, body: bytes) -> bool:
        """RESULT_PUSH, the terminal of the operation bound to ``frame_id`` (``metadata``: a packed 64-byte
        ``ResultPushMetadata``; matched by frame alone: nnrp-rs ``crates/nnrp-runtime/src/client.rs``). Allowed
        after any cancel (the native client delivers it). Frees the operation; False when it is not active."""
        if len(metadata) != _RESULT_PUSH_META_LEN:
            raise LocalProtocolError(f"RESULT_PUSH metadata must be {_RESULT_PUSH_META_LEN} bytes, got {len(metadata)}")
        op = self._ops.get((session_id, frame_id))
        if op is None:
            return False
        self._queue(_T.RESULT_PUSH, session_id, frame_id, metadata, body)
        self._finish(op)
        return True

    def send_result_drop_reason(
        self, session_id: int, frame_id: int, operation_id: int, sequence: int, drop_reason_code: int, diagnostic: bytes
    ) -> bool:
        """RESULT_DROP_REASON, a terminal (source_role server, flags 0, ``result_sequence = sequence``,
        ``drop_reason_code`` non-zero; nnrp-rs ``crates/nnrp-core/src/control.rs`` ``ResultDropReason``; matched
        by operation and frame by the client). Allowed after any cancel. Frees the operation; False when it is
        not active."""
        if not 0 < drop_reason_code <= 0xFFFF or sequence < 0:
            raise LocalProtocolError("RESULT_DROP_REASON needs a non-zero u16 drop_reason_code and a sequence ≥ 0")
        op = self._ops.get((session_id, frame_id))
        if op is None or op.operation_id != operation_id:
            _check_u64("RESULT_DROP_REASON", operation_id, sequence)
            return False
        try:
            meta = _DROP_REASON_STRUCT.pack(operation_id, sequence, drop_reason_code, ROLE_SERVER, 0, len(diagnostic), 0)
        except struct.error as exc:
            raise LocalProtocolError(f"RESULT_DROP_REASON field out of range: {exc}") from None
        self._queue(_T.RESULT_DROP_REASON, session_id, frame_id, meta, diagnostic)
        self._finish(op)
        return True

    def send_backpressure(
        self, session_id: int, credit_window: int, pressure_level: int, pressure_reason: int, retry_after_ms: int
    ) -> bool:
        """BACKPRESSURE for the session (header frame 0, ``scope_id`` 0 = the whole connection as the native
        server sends it, flags 0; ``pressure_level`` 1..3: nnrp-rs ``crates/nnrp-core/src/control.rs``
        ``Pressure``). False when the session is not open."""
        if not 1 <= pressure_level <= 3:
            raise LocalProtocolError(f"BACKPRESSURE pressure_level {pressure_level!r} must be 1..3")
        return self._send_pressure(_T.BACKPRESSURE, session_id, credit_window, pressure_level, pressure_reason, retry_after_ms)

    def send_credit_update(self, session_id: int, credit_window: int) -> bool:
        """CREDIT_UPDATE for the session (header frame 0, ``scope_id`` 0, level/reason/retry 0, flags 0). False
        when the session is not open."""
        return self._send_pressure(_T.CREDIT_UPDATE, session_id, credit_window, 0, 0, 0)

    def send_recoverable_error(self, session_id: int, frame_id: int, error_code: int, diagnostic: str) -> bool:
        """ERROR_RECOVERABLE from the application for an open session (frame scope when ``frame_id`` names a
        frame, else session scope; source_role server, no retry flags; ``diagnostic`` as UTF-8, at most
        :data:`MAX_DIAGNOSTIC_BYTES`): the layout the core uses for a refused packet (nnrp-rs
        ``crates/nnrp-core/src/control.rs`` ``RecoverableError``; nnrp-doc runtime-control ``control-frames.md``
        "Recoverable Error Metadata"), ``error_code`` from the common error registry (nnrp-py
        ``nnrp.core.enums.ErrorCode``), e.g. ``LIMIT_EXCEEDED`` before the application ends a connection that
        floods beyond its credit. False when the session is not open."""
        if not 0 < error_code <= 0xFFFFFFFF or not 0 <= frame_id <= 0xFFFFFFFF:
            raise LocalProtocolError(f"ERROR_RECOVERABLE error_code {error_code!r} or frame {frame_id!r} out of range")
        if session_id not in self._sessions:
            return False
        body = diagnostic.encode("utf-8", "replace")[:MAX_DIAGNOSTIC_BYTES]
        meta = RecoverableErrorMetadata(
            error_code, _SCOPE_FRAME if frame_id else _SCOPE_SESSION, _RECOVERY_UNSPECIFIED, ROLE_SERVER, 0, 0,
            session_id, frame_id, 0, len(body),
        ).pack()  # fmt: skip
        self._queue(_T.ERROR_RECOVERABLE, session_id, frame_id, meta, body)
        return True

    def _send_pressure(self, msg_type: int, session_id: int, credit: int, level: int, reason: int, retry: int) -> bool:
        try:
            meta = _PRESSURE_STRUCT.pack(0, credit, level, reason, retry, 0, 0)
        except struct.error as exc:
            raise LocalProtocolError(f"{message_name(msg_type)} field out of range: {exc}") from None
        if session_id not in self._sessions:
            return False
        self._queue(msg_type, session_id, 0, meta)
        return True


_SESSION_HANDLERS = {
    int(_T.FRAME_SUBMIT): ServerConnection._on_frame_submit,
    int(_T.FRAME_CANCEL): ServerConnection._on_frame_cancel,
    int(_T.CANCEL): ServerConnection._on_cancel,
    int(_T.ABORT): ServerConnection._on_cancel,
    int(_T.DEADLINE): ServerConnection._on_scheduling,
    int(_T.PRIORITY_UPDATE): ServerConnection._on_scheduling,
    int(_T.EXPIRE_AT): ServerConnection._on_scheduling,
    int(_T.SUPERSEDE): ServerConnection._on_supersede,
    int(_T.BUDGET_UPDATE): ServerConnection._on_budget_update,
    int(_T.TRACE_CONTEXT): ServerConnection._on_trace_context,
    int(_T.BACKPRESSURE): ServerConnection._on_pressure,
    int(_T.CREDIT_UPDATE): ServerConnection._on_pressure,
    int(_T.FLOW_UPDATE): ServerConnection._on_flow_update,
    int(_T.RESULT_HINT): ServerConnection._on_result_hint,
    int(_T.ERROR_RECOVERABLE): ServerConnection._on_client_error,
    int(_T.RETRY_AFTER): ServerConnection._on_client_error,
    int(_T.PING): ServerConnection._on_ping,
    int(_T.PONG): ServerConnection._on_ping,
    int(_T.SESSION_CLOSE): ServerConnection._on_session_close,
}


def _check_u64(kind: str, operation_id: int, sequence: int) -> None:
    """Raise :class:`LocalProtocolError` when ``operation_id`` or ``sequence`` does not fit its u64 field: a call
    for an operation that is not active (False) is a lost race, one with such a value is misuse."""
    if not (0 <= operation_id < 1 << 64 and 0 <= sequence < 1 << 64):
        raise LocalProtocolError(f"{kind} field out of range: operation_id {operation_id}, sequence {sequence}")

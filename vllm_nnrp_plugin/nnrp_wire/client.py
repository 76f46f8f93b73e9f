"""One NNRP/1 client connection, sans-IO: bytes from the server in → :mod:`.events` out; calls in → bytes out.

::

    conn = ClientConnection()
    token = conn.open_session()                  # queues CLIENT_HELLO (first call only) + SESSION_OPEN
    sock.sendall(conn.data_to_send())
    for event in conn.receive_data(sock.recv(65536)):   # b"" = end of stream
        ...                                      # SessionOpenAccepted(request=token, session_id=…), …
    frame_id, operation_id = conn.submit(session_id, body_region)

What it sends is what nnrp-py's native client sends for the same calls (nnrp-rs
``crates/nnrp-runtime/src/client.rs``): CLIENT_HELLO once, with the first session's requested id and
deadline (``min/max_version_major`` 1, wire formats 0x1, profiles 0x3, payload kinds 0x73, one lane);
SESSION_OPEN (the caller's priority class, balanced by default; no resume, lease hint 30 000 ms,
``client_session_tag`` = the requested id); FRAME_SUBMIT of one STRUCTURED_EVENT typed frame (``tile_index_mode``
1, ``loss_tolerance_policy`` 0xff inherit; the body is the caller's body region, nnrp-doc
``design/v1-preview3.md`` §9.2A); FRAME_CANCEL (header only); CANCEL (source client); DEADLINE, EXPIRE_AT and
PRIORITY_UPDATE (scheduling metadata); SUPERSEDE (drop reason superseded); BUDGET_UPDATE (token budget only);
TRACE_CONTEXT (header trace id = the metadata's); SESSION_CLOSE (client shutdown, drain, ``last_operation_id``,
``session_close_tag`` = the session id). Every per-operation control has the operation's frame in its header
(for SUPERSEDE, the superseded operation's).
Metadata are nnrp-py's struct codecs (``nnrp.core.messages``, ``nnrp.runtime.types``) and, for SESSION_OPEN_ACK
and SESSION_CLOSE_ACK, :mod:`.codecs`.

Identity (``client.rs`` ``submit_operation``): frame ids are per session, from 1, strictly increasing;
operation ids are the caller's or the next after the session's last (this core requires them increasing,
which also keeps the protocol's "never reused"). Per-operation controls carry a ``control_sequence`` counted
per operation from 1.

Incoming packets are checked as the native client checks them (``client.rs`` ``decode_event_packet``,
``crates/nnrp-runtime/src/multiplex.rs``; the layout rules are :mod:`.layouts`, shared with the server core):

* a header error or an oversized packet (:mod:`.framing`), a SERVER_HELLO_ACK that breaks a rule (body not
  empty, reserved bits, a version or wire format outside the offer, an accepted bitmap not a subset of the
  offer: ``crates/nnrp-core/src/control.rs`` ``ServerHelloAck::validate_against``), anything before it, or a
  packet for a session id this connection does not have open (never opened, or already closed) end the
  connection: :class:`~.events.ConnectionEnded` with the reason;
* a SESSION_OPEN_ACK answers the oldest open still waiting (``crates/nnrp-core/src/lifecycle.rs``,
  ``recovery.rs``): accepted → :class:`~.events.SessionOpenAccepted`; rejected or retry-later →
  :class:`~.events.SessionOpenRejected` with the server's code; an ack that breaks a rule (length mismatch,
  unknown status, flag bits, a resume nobody asked for, session id 0 or one already used on this
  connection) → ``SessionOpenRejected`` with code 0 and the broken rule; the connection goes on;
* a packet of an open session that breaks a rule — wrong ``meta_len``, body length not the declared one,
  reserved bits, an unknown or finished operation, a frame that is not the operation's, a PARTIAL_RESULT or
  PROGRESS after this client's FRAME_CANCEL, a header trace id that is not TRACE_CONTEXT's, a type a client
  does not take (PING, FRAME_SUBMIT, …), a session-0 packet after the handshake — is dropped with a
  :class:`~.events.PacketRejected`; the session and the connection go on.

Terminals end an operation: RESULT_PUSH (matched by frame), RESULT_DROP_REASON (operation and frame),
RESULT_DROP (frame). Plain data: no sockets, threads or clock reads.
"""

from __future__ import annotations

import collections
import itertools

from nnrp.core.enums import MessageType, PayloadKind
from nnrp.core.messages.control import (
    SERVER_HELLO_ACK_STRUCT,
    ClientHelloMetadata,
    SessionOpenMetadata,
)
from nnrp.core.messages.data import FrameSubmitMetadata, InputProfile, TileIndexMode
from nnrp.runtime.types import (
    BudgetMetadata,
    ControlRequestMetadata,
    InFlightPolicy,
    ResultDropReasonCode,
    RuntimeRole,
    SchedulingMetadata,
    SessionCloseMetadata,
    SessionCloseReason,
    SupersedeMetadata,
    TraceContextMetadata,
)

from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire import layouts
from vllm_nnrp_plugin.nnrp_wire.codecs import (
    CLOSE_STATUS_CLOSED,
    CLOSE_STATUS_REJECTED,
    PRIORITY_CLASSES,
    SESSION_STATUS_REJECTED,
    SESSION_STATUS_RESUMED,
    SESSION_STATUS_RETRY_LATER,
    SessionOpenAckMetadata,
)
from vllm_nnrp_plugin.nnrp_wire.errors import FatalError, LocalProtocolError, PacketError
from vllm_nnrp_plugin.nnrp_wire.framing import MAX_PACKET_BYTES, FramingError, Packet, PacketReader, encode

__all__ = ["ClientConnection"]

_T = MessageType
#: what CLIENT_HELLO offers, as the native client does (``client.rs`` ``client_hello``)
_OFFER_PROFILES = 0x3
_OFFER_PAYLOAD_KINDS = 0x73
_OFFER_WIRE_FORMATS = 0x1
_SUPERSEDED = int(ResultDropReasonCode.SUPERSEDED)
_LEASE_TTL_HINT_MS = 30_000
_STRUCTURED_EVENT = int(PayloadKind.STRUCTURED_EVENT)

_OPEN_ACK_SIZE = SessionOpenAckMetadata.STRUCT.size


class _Operation:
    __slots__ = ("operation_id", "frame_id", "control_sequence", "frame_cancelled")

    def __init__(self, operation_id: int, frame_id: int) -> None:
        self.operation_id = operation_id
        self.frame_id = frame_id
        self.control_sequence = 0
        self.frame_cancelled = False


class _Session:
    __slots__ = ("session_id", "next_frame", "last_operation_id", "operations", "closing")

    def __init__(self, session_id: int) -> None:
        self.session_id = session_id
        self.next_frame = 1
        self.last_operation_id = 0
        self.operations: dict[int, _Operation] = {}  # frame id -> active operation
        self.closing = False


class ClientConnection:
    """The client side of one NNRP/1 connection (module docstring). ``max_packet_bytes``: the largest packet
    accepted from the server (header + metadata + body, bytes). ``auth_block``: the authentication block the
    CLIENT_HELLO carries as its body (``auth_bytes`` long; :mod:`vllm_nnrp_plugin.contract.auth_block`), ``b""`` for
    none; the server's verdict is :attr:`auth_status` once the SERVER_HELLO_ACK came."""

    def __init__(self, *, max_packet_bytes: int = MAX_PACKET_BYTES, auth_block: bytes = b"") -> None:
        self._auth_block = bytes(auth_block)
        #: SERVER_HELLO_ACK ``auth_status`` (``None`` until it came)
        self.auth_status: int | None = None
        self._reader = PacketReader(max_packet_bytes)
        self._out: list[bytes] = []
        self._hello: ClientHelloMetadata | None = None
        self._hello_acked = False
        self._opens: collections.deque[int] = collections.deque()  # request tokens, oldest first
        self._tokens = itertools.count(1)
        self._sessions: dict[int, _Session] = {}
        self._used_session_ids: set[int] = set()
        self._ended = False
        self._handlers = {
            int(_T.PARTIAL_RESULT): self._on_partial,
            int(_T.PROGRESS): self._on_progress,
            int(_T.RESULT_PUSH): self._on_push,
            int(_T.RESULT_DROP_REASON): self._on_drop_reason,
            int(_T.RESULT_DROP): self._on_drop,
            int(_T.TRACE_CONTEXT): self._on_trace,
            int(_T.BACKPRESSURE): self._on_pressure,
            int(_T.CREDIT_UPDATE): self._on_pressure,
            int(_T.ERROR_RECOVERABLE): self._on_recoverable,
            int(_T.RETRY_AFTER): self._on_retry_after,
            int(_T.SESSION_CLOSE_ACK): self._on_close_ack,
        }

    # -- bytes ---------------------------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Every byte queued since the last call (b"" when none)."""
        out, self._out = self._out, []
        return b"".join(out)

    def receive_data(self, data: bytes) -> list[object]:
        """Feed bytes read from the server (b"" = its end of stream); returns the events they completed, in
        order. After :class:`~.events.ConnectionEnded` (returned once) it returns [] and every call raises
        :class:`LocalProtocolError`."""
        if self._ended:
            return []
        if not data:
            return [self._end(None)]
        try:
            packets = self._reader.feed(data)
        except FramingError as exc:
            return [self._end(str(exc))]
        out: list[object] = []
        for packet in packets:
            try:
                event = self._receive(packet)
            except FatalError as exc:
                out.append(self._end(str(exc)))
                break
            if event is not None:
                out.append(event)
        return out

    # -- calls ---------------------------------------------------------------------------------------------

    def open_session(
        self,
        *,
        requested_session_id: int = 0,
        max_in_flight_operations: int = 16,
        profile_id: int = 2,
        schema: tuple[int, int] = (4097, 3),
        default_deadline_ms: int = 500,
        priority_class: int = 1,
    ) -> int:
        """Queue a SESSION_OPEN (after the CLIENT_HELLO on the first call); returns the request token that
        the answering :class:`~.events.SessionOpenAccepted` / ``SessionOpenRejected`` carries. Opens are
        answered in order. ``requested_session_id`` 0 lets the server choose; ``schema`` is (schema_id,
        schema_version); ``default_deadline_ms`` in ms; ``priority_class`` 0 interactive, 1 balanced (nnrp-py's
        ``NativeClientSessionOptions`` default), 2 background. Raises :class:`LocalProtocolError` once the
        connection ended or for an unknown priority class, ``ValueError`` / ``struct.error`` for a value that
        does not fit its field."""
        self._check_open()
        if priority_class not in PRIORITY_CLASSES:
            raise LocalProtocolError(f"priority_class {priority_class!r} must be 0, 1 or 2")
        metadata = SessionOpenMetadata(
            requested_session_id,
            profile_id,
            priority_class,
            0,
            schema[0],
            schema[1],
            default_deadline_ms,
            max_in_flight_operations,
            _LEASE_TTL_HINT_MS,
            0,
            0,
            0,
            requested_session_id,
        )
        packed = metadata.pack()
        if self._hello is None:
            self._hello = ClientHelloMetadata(
                1,
                1,
                _OFFER_WIRE_FORMATS,
                _OFFER_PROFILES,
                _OFFER_PAYLOAD_KINDS,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                1,
                0,
                0,
                0,
                default_deadline_ms,
                0,
                0,
                requested_session_id,
                len(self._auth_block),
                0,
            )
            self._out.append(encode(_T.CLIENT_HELLO, 0, 0, self._hello.pack(), self._auth_block))
        self._out.append(encode(_T.SESSION_OPEN, 0, 0, packed))
        token = next(self._tokens)
        self._opens.append(token)
        return token

    def submit(
        self, session_id: int, body: bytes, *, operation_id: int | None = None, trace_id: int = 0
    ) -> tuple[int, int]:
        """Queue a FRAME_SUBMIT of ``body`` (a body region holding one STRUCTURED_EVENT typed frame); returns
        ``(frame_id, operation_id)``. ``operation_id`` (u64) defaults to the session's last + 1; ``trace_id``
        goes into the header. Raises :class:`LocalProtocolError` for a session that is not open (or
        closing) or an operation id not above the session's last."""
        session = self._session(session_id)
        if session.closing:
            raise LocalProtocolError(f"session {session_id} is closing")
        if operation_id is None:
            operation_id = session.last_operation_id + 1
        elif not session.last_operation_id < operation_id < 1 << 64:
            raise LocalProtocolError(
                f"operation id {operation_id} must be above the session's last ({session.last_operation_id}), u64"
            )
        frame_id = session.next_frame
        metadata = FrameSubmitMetadata(
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            InputProfile.UNSPECIFIED,
            TileIndexMode.RAW_U16,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            operation_id,
            payload_kind_bitmap=_STRUCTURED_EVENT,
            payload_frame_count=1,
        )
        self._out.append(encode(_T.FRAME_SUBMIT, session_id, frame_id, metadata.pack(), body, trace_id=trace_id))
        session.next_frame = frame_id + 1
        session.last_operation_id = operation_id
        session.operations[frame_id] = _Operation(operation_id, frame_id)
        return frame_id, operation_id

    def frame_cancel(self, session_id: int, frame_id: int) -> None:
        """Queue a FRAME_CANCEL (header only) for the active operation of ``frame_id``. From now on a
        PARTIAL_RESULT or PROGRESS for it is rejected; its terminal still comes. Raises
        :class:`LocalProtocolError` when the operation is not active or was frame-cancelled already."""
        op = self._operation(session_id, frame_id)
        if op.frame_cancelled:
            raise LocalProtocolError(f"frame {frame_id} of session {session_id} is already cancelled")
        op.frame_cancelled = True
        self._out.append(encode(_T.FRAME_CANCEL, session_id, frame_id))

    def cancel(self, session_id: int, frame_id: int, *, reason_code: int = 0, diagnostic: bytes = b"") -> None:
        """Queue a CANCEL (source client) for the active operation of ``frame_id``; ``reason_code`` u16,
        ``diagnostic`` opaque bytes. Raises :class:`LocalProtocolError` when the operation is not active."""
        op = self._operation(session_id, frame_id)
        op.control_sequence += 1
        metadata = ControlRequestMetadata(
            op.operation_id, op.control_sequence, reason_code, RuntimeRole.CLIENT, 0, len(diagnostic)
        )
        self._out.append(encode(_T.CANCEL, session_id, frame_id, metadata.pack(), diagnostic))

    def deadline(self, session_id: int, frame_id: int, deadline_unix_ms: int) -> None:
        """Queue a DEADLINE (wall clock, ms since the Unix epoch, > 0) for the active operation of
        ``frame_id``. Raises :class:`LocalProtocolError` when the operation is not active or the deadline is 0."""
        self._scheduling(_T.DEADLINE, session_id, frame_id, 0, 0, deadline_unix_ms)

    def expire_at(self, session_id: int, frame_id: int, expire_at_unix_ms: int) -> None:
        """Queue an EXPIRE_AT (wall clock, ms since the Unix epoch, > 0; priority fields 0, flags 0, as nnrp-py's
        ``expire_runtime_operation_at``) for the active operation of ``frame_id``. Raises
        :class:`LocalProtocolError` when the operation is not active or the time is 0."""
        self._scheduling(_T.EXPIRE_AT, session_id, frame_id, 0, 0, expire_at_unix_ms)

    def priority_update(self, session_id: int, frame_id: int, priority_class: int, priority_delta: int = 0) -> None:
        """Queue a PRIORITY_UPDATE (``deadline_unix_ms`` 0, flags 0, as nnrp-py's ``update_runtime_priority``)
        for the active operation of ``frame_id``: ``priority_class`` 0 interactive, 1 balanced, 2 background,
        ``priority_delta`` i16. Raises :class:`LocalProtocolError` when the operation is not active or the class
        is unknown, ``struct.error`` for a delta outside i16."""
        if priority_class not in PRIORITY_CLASSES:
            raise LocalProtocolError(f"priority_class {priority_class!r} must be 0, 1 or 2")
        self._scheduling(_T.PRIORITY_UPDATE, session_id, frame_id, priority_class, priority_delta, 0)

    def _scheduling(
        self, kind: int, session_id: int, frame_id: int, priority_class: int, delta: int, at_ms: int
    ) -> None:
        """Scheduling metadata (nnrp-rs ``crates/nnrp-core/src/control.rs`` ``SchedulingMetadata``): a non-zero
        time for DEADLINE and EXPIRE_AT."""
        op = self._operation(session_id, frame_id)
        if kind != _T.PRIORITY_UPDATE and at_ms <= 0:
            raise LocalProtocolError(f"{_T(kind).name} time must be > 0")
        packed = SchedulingMetadata(op.operation_id, op.control_sequence + 1, priority_class, delta, at_ms, 0).pack()
        op.control_sequence += 1
        self._out.append(encode(kind, session_id, frame_id, packed))

    def supersede(self, session_id: int, frame_id: int, new_operation_id: int = 0, *, diagnostic: bytes = b"") -> None:
        """Queue a SUPERSEDE of the active operation of ``frame_id`` (the header carries that OLD operation's
        frame): ``new_operation_id`` the replacing operation (0: none named), ``drop_reason_code`` 2 superseded,
        flags 0, ``diagnostic`` opaque bytes (nnrp-py's ``supersede_runtime_operation``; nnrp-rs
        ``crates/nnrp-core/src/control.rs`` ``SupersedeMetadata``). Its terminal still comes (usually a
        RESULT_DROP_REASON superseded). Raises :class:`LocalProtocolError` when the operation is not active,
        ``struct.error`` for an id outside u64."""
        op = self._operation(session_id, frame_id)
        packed = SupersedeMetadata(
            op.operation_id, new_operation_id, op.control_sequence + 1, _SUPERSEDED, 0, len(diagnostic)
        ).pack()
        op.control_sequence += 1
        self._out.append(encode(_T.SUPERSEDE, session_id, frame_id, packed, diagnostic))

    def budget_update(self, session_id: int, frame_id: int, token_budget: int) -> None:
        """Queue a BUDGET_UPDATE for the active operation of ``frame_id``: ``token_budget`` tokens (u32), the
        compute, memory and bandwidth budgets 0, flags 0 (nnrp-py's ``update_runtime_budget``; nnrp-rs
        ``crates/nnrp-core/src/control.rs`` ``BudgetMetadata``; it has no control_sequence). Raises
        :class:`LocalProtocolError` when the operation is not active, ``struct.error`` outside u32."""
        op = self._operation(session_id, frame_id)
        packed = BudgetMetadata(op.operation_id, 0, 0, 0, token_budget, 0).pack()
        self._out.append(encode(_T.BUDGET_UPDATE, session_id, frame_id, packed))

    def trace_context(
        self,
        session_id: int,
        frame_id: int,
        trace_id: int,
        span_id: int,
        parent_span_id: int,
        stage_code: int = 0,
        flags: int = 0,
        attributes: bytes = b"",
    ) -> None:
        """Queue a TRACE_CONTEXT: session scope for ``frame_id`` 0, else the active operation's. ``trace_id``
        and ``span_id`` non-zero; ``flags`` bit 0 sampled, bit 1 error; ``attributes`` the opaque body.
        Raises :class:`LocalProtocolError` (unknown scope, zero ids), ``ValueError`` for other flag bits."""
        session = self._session(session_id)
        if frame_id:
            self._operation(session_id, frame_id)
        if not trace_id or not span_id:
            raise LocalProtocolError("TRACE_CONTEXT needs a non-zero trace_id and span_id")
        metadata = TraceContextMetadata(trace_id, span_id, parent_span_id, stage_code, flags, len(attributes))
        self._out.append(
            encode(_T.TRACE_CONTEXT, session.session_id, frame_id, metadata.pack(), attributes, trace_id=trace_id)
        )

    def close_session(self, session_id: int) -> None:
        """Queue a SESSION_CLOSE; :class:`~.events.SessionCloseAcked` ends the session. Its operations'
        results still arrive until then; no new submit. Raises :class:`LocalProtocolError` for a session that
        is not open or already closing."""
        session = self._session(session_id)
        if session.closing:
            raise LocalProtocolError(f"session {session_id} is already closing")
        session.closing = True
        metadata = SessionCloseMetadata(
            SessionCloseReason.CLIENT_SHUTDOWN, InFlightPolicy.DRAIN, 0, session.last_operation_id, 0, session_id
        )
        self._out.append(encode(_T.SESSION_CLOSE, session_id, 0, metadata.pack()))

    # -- state ---------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._ended:
            raise LocalProtocolError("the connection has ended")

    def _session(self, session_id: int) -> _Session:
        self._check_open()
        session = self._sessions.get(session_id)
        if session is None:
            raise LocalProtocolError(f"session {session_id} is not open on this connection")
        return session

    def _operation(self, session_id: int, frame_id: int) -> _Operation:
        op = self._session(session_id).operations.get(frame_id)
        if op is None:
            raise LocalProtocolError(f"no active operation with frame {frame_id} in session {session_id}")
        return op

    def _end(self, error: str | None) -> ev.ConnectionEnded:
        self._ended = True
        self._sessions.clear()
        self._opens.clear()
        return ev.ConnectionEnded(error)

    # -- incoming ------------------------------------------------------------------------------------------

    def _receive(self, packet: Packet) -> object | None:
        kind = packet.msg_type
        if not self._hello_acked:
            if self._hello is None or kind != _T.SERVER_HELLO_ACK or packet.session_id:
                raise FatalError(f"expected SERVER_HELLO_ACK first, got {packet!r}")
            self._check_hello_ack(packet)
            self._hello_acked = True
            return None
        if kind == _T.SESSION_OPEN_ACK:
            return self._on_open_ack(packet)
        if packet.session_id == 0:
            return _rejected(packet, "session 0 after the handshake carries only SESSION_OPEN_ACK")
        session = self._sessions.get(packet.session_id)
        if session is None:
            raise FatalError(f"packet for session {packet.session_id}, not open on this connection: {packet!r}")
        handler = self._handlers.get(kind)
        if handler is None:
            return _rejected(packet, "not a packet a client takes")
        try:
            return handler(session, packet)
        except PacketError as exc:
            return _rejected(packet, exc.reason)

    def _check_hello_ack(self, packet: Packet) -> None:
        if packet.body:
            raise FatalError("SERVER_HELLO_ACK must have an empty body")
        if len(packet.meta) < SERVER_HELLO_ACK_STRUCT.size:
            raise FatalError(
                f"SERVER_HELLO_ACK metadata is {len(packet.meta)} bytes, under {SERVER_HELLO_ACK_STRUCT.size}"
            )
        (
            version,
            wire_format,
            auth_status,
            reserved0,
            _sid,
            profiles,
            kinds,
            codecs,
            compression,
            dtypes,
            layouts,
            digests,
            objects,
            *_rest,
            server_flags,
        ) = SERVER_HELLO_ACK_STRUCT.unpack_from(packet.meta)
        hello = self._hello
        assert hello is not None  # _receive takes a SERVER_HELLO_ACK only after CLIENT_HELLO was queued
        offered = (
            ("accepted_profile_bitmap", profiles, hello.supported_profile_bitmap),
            ("accepted_payload_kind_bitmap", kinds, hello.supported_payload_kind_bitmap),
            ("accepted_codec_bitmap", codecs, hello.supported_codec_bitmap),
            ("accepted_compression_bitmap", compression, hello.supported_compression_bitmap),
            ("accepted_dtype_bitmap", dtypes, hello.supported_dtype_bitmap),
            ("accepted_layout_bitmap", layouts, hello.supported_layout_bitmap),
            ("cache_digest_bitmap", digests, hello.cache_digest_bitmap),
            ("cache_object_bitmap", objects, hello.cache_object_bitmap),
        )
        if reserved0 or server_flags & ~0x1:
            raise FatalError(
                f"SERVER_HELLO_ACK reserved0 {reserved0} / server_flags {server_flags:#x} (only 0x1 allowed)"
            )
        if not hello.min_version_major <= version <= hello.max_version_major:
            raise FatalError(f"SERVER_HELLO_ACK selected version {version}, outside the offer")
        if wire_format > 15 or not hello.supported_wire_format_bitmap >> wire_format & 1:
            raise FatalError(f"SERVER_HELLO_ACK selected wire format {wire_format}, outside the offer")
        for name, accepted, offer in offered:
            if accepted & ~offer:
                raise FatalError(f"SERVER_HELLO_ACK {name} {accepted:#x} is not a subset of the offer {offer:#x}")
        self.auth_status = auth_status

    def _on_open_ack(self, packet: Packet) -> object:
        if not self._opens:
            return _rejected(packet, "SESSION_OPEN_ACK with no open waiting")
        token = self._opens.popleft()
        if len(packet.meta) < _OPEN_ACK_SIZE:  # "at least": nnrp-rs session.rs SessionOpenAck::parse
            return _refused(token, f"metadata is {len(packet.meta)} bytes, under {_OPEN_ACK_SIZE}")
        try:
            ack = SessionOpenAckMetadata.unpack(packet.meta[:_OPEN_ACK_SIZE])
        except ValueError as exc:
            return _refused(token, str(exc))
        if len(packet.body) != ack.body_length:
            return _refused(token, f"body is {len(packet.body)} bytes, the metadata declares {ack.body_length}")
        if ack.session_status in (SESSION_STATUS_REJECTED, SESSION_STATUS_RETRY_LATER):
            diagnostic = packet.body[ack.resume_token_bytes :].decode("utf-8", "replace")
            return ev.SessionOpenRejected(token, ack.session_error_code, diagnostic)
        if ack.session_status == SESSION_STATUS_RESUMED:
            return _refused(token, "status resumed for an open that resumed nothing")
        if ack.session_extension_bytes:
            return _refused(token, "an accepted open carries no session extension")
        session_id = ack.session_id
        if session_id == 0 or session_id in self._used_session_ids:
            return _refused(token, f"session id {session_id} is 0 or was used before on this connection")
        if packet.session_id not in (0, session_id):
            return _refused(token, f"header session {packet.session_id} is not the ack's {session_id}")
        self._used_session_ids.add(session_id)
        self._sessions[session_id] = _Session(session_id)
        return ev.SessionOpenAccepted(token, session_id, ack.max_in_flight_operations, ack.granted_operation_credit)

    @staticmethod
    def _lookup(session: _Session, packet: Packet, operation_id: int | None) -> _Operation:
        """The active operation of the packet's frame (``client.rs`` ``runtime_operation_for_event``); raises
        :class:`~.errors.PacketError` when there is none or it is another operation."""
        op = session.operations.get(packet.frame_id)
        if op is None:
            finished = 0 < packet.frame_id < session.next_frame
            raise PacketError("a finished operation" if finished else "an unknown frame")
        if operation_id is not None and operation_id != op.operation_id:
            raise PacketError(f"operation {operation_id}, but the frame is operation {op.operation_id}'s")
        return op

    def _on_partial(self, session: _Session, packet: Packet) -> object:
        operation_id, sequence = layouts.partial_result(packet)
        if self._lookup(session, packet, operation_id).frame_cancelled:
            raise PacketError("PARTIAL_RESULT after this client's FRAME_CANCEL")
        return ev.PartialResultReceived(session.session_id, packet.frame_id, operation_id, sequence, packet.body)

    def _on_progress(self, session: _Session, packet: Packet) -> object:
        meta = layouts.progress(packet)
        if self._lookup(session, packet, meta.operation_id).frame_cancelled:
            raise PacketError("PROGRESS after this client's FRAME_CANCEL")
        return ev.ProgressReceived(
            session.session_id,
            packet.frame_id,
            meta.operation_id,
            meta.progress_sequence,
            meta.stage_code,
            meta.percent_x100,
            packet.body,
        )

    def _on_push(self, session: _Session, packet: Packet) -> object:
        meta = layouts.result_push(packet)
        op = self._lookup(session, packet, None)
        del session.operations[packet.frame_id]
        return ev.ResultPushed(session.session_id, packet.frame_id, op.operation_id, meta, packet.body)

    def _on_drop_reason(self, session: _Session, packet: Packet) -> object:
        meta = layouts.result_drop_reason(packet)
        op = self._lookup(session, packet, meta.operation_id)
        del session.operations[packet.frame_id]
        return ev.ResultDropReasonReceived(
            session.session_id,
            packet.frame_id,
            op.operation_id,
            meta.result_sequence,
            int(meta.drop_reason_code),
            int(meta.source_role),
            packet.body,
        )

    def _on_drop(self, session: _Session, packet: Packet) -> object:
        layouts.header_only(packet)
        op = self._lookup(session, packet, None)
        del session.operations[packet.frame_id]
        return ev.ResultDropped(session.session_id, packet.frame_id, op.operation_id)

    def _on_trace(self, session: _Session, packet: Packet) -> object:
        meta = layouts.trace_context(packet)
        operation_id = self._lookup(session, packet, None).operation_id if packet.frame_id else None
        return ev.TraceContextReceived(
            session.session_id,
            packet.frame_id,
            operation_id,
            meta.trace_id,
            meta.span_id,
            meta.parent_span_id,
            meta.stage_code,
            meta.flags,
            meta.body_bytes,
        )

    def _on_pressure(self, session: _Session, packet: Packet) -> object:
        meta = layouts.pressure(packet)
        return ev.PressureReceived(
            session.session_id,
            packet.msg_type,
            meta.scope_id,
            meta.credit_window,
            meta.pressure_level,
            meta.pressure_reason,
            meta.retry_after_ms,
        )

    def _on_recoverable(self, session: _Session, packet: Packet) -> object:
        meta = layouts.recoverable_error(packet)
        return ev.ErrorRecoverableReceived(
            session.session_id,
            packet.frame_id,
            meta.error_code,
            meta.error_scope,
            meta.recovery_action,
            meta.retry_after_ms,
            meta.related_frame_id,
            packet.body,
        )

    def _on_retry_after(self, session: _Session, packet: Packet) -> object:
        meta = layouts.retry_after(packet)
        return ev.RetryAfterReceived(
            session.session_id, meta.scope_id, meta.retry_after_ms, meta.jitter_ms, meta.reason_code, packet.body
        )

    def _on_close_ack(self, session: _Session, packet: Packet) -> object | None:
        meta = layouts.session_close_ack(packet)
        if not session.closing:
            raise PacketError("SESSION_CLOSE_ACK for a session this client is not closing")
        if meta.close_status == CLOSE_STATUS_CLOSED:
            del self._sessions[session.session_id]
            return ev.SessionCloseAcked(session.session_id)
        if meta.close_status == CLOSE_STATUS_REJECTED:
            session.closing = False
            raise PacketError("the server rejected SESSION_CLOSE (close_status 3)")
        return None  # acknowledged / draining: the closed ack follows


def _rejected(packet: Packet, reason: str) -> ev.PacketRejected:
    return ev.PacketRejected(packet.session_id, packet.frame_id, packet.msg_type, reason)


def _refused(token: int, rule: str) -> ev.SessionOpenRejected:
    return ev.SessionOpenRejected(token, 0, f"SESSION_OPEN_ACK refused by the client: {rule}")

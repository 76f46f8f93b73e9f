"""One NNRP/1 (preview4) server connection, sans-IO: bytes in → typed events out, calls in → bytes out.

:class:`ServerConnection` owns everything the protocol decides on one connection and nothing else: the
handshake and the sessions multiplexed on it (:mod:`.handshake`), the operations of each session
(:mod:`.operations`) and the runtime control frames; it dispatches each packet and carries out the application's
sends. It reads no socket, starts no thread and reads no clock; the asyncio shell feeds it what it read
(:meth:`~ServerConnection.receive_data`, ``b""`` for end of stream), writes what it queued
(:meth:`~ServerConnection.data_to_send`, once per loop iteration, so many packets go out in one write) and
closes the transport after :class:`~.events.ConnectionEnded`.

The model is the native server of nnrp-py 1.0.0rc4.post20 (nnrp-rs ``crates/nnrp-runtime/src/server.rs``),
byte for byte where a native client can tell, with these deliberate differences:

* in the handshake and session opens (resume, the credit values, authentication, session ids): :mod:`.handshake`;
* a known session's packet that breaks a rule is answered with ERROR_RECOVERABLE (the native server sends
  nothing and only its application sees a poll error);
* a control (FRAME_CANCEL, CANCEL, ABORT, DEADLINE, PRIORITY_UPDATE, EXPIRE_AT, SUPERSEDE, BUDGET_UPDATE,
  TRACE_CONTEXT) for an operation whose terminal this server sent recently is ignored silently: the client cannot
  avoid that race.

Rules and their sources (nnrp-rs paths at the readable commit 784a4a3 unless said otherwise; the behaviour of
the shipped build where it differs, see each method):

* Framing and header errors: :mod:`.framing` (nnrp-rs ``crates/nnrp-core/src/header.rs``,
  ``crates/nnrp-runtime/src/transport.rs``) — each ends the connection.
* Connection start, session opens and closes (:mod:`.handshake`): only TRANSPORT_PROBE or CLIENT_HELLO may come
  first (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` ``accept``); a bad hello closes the connection without a
  reply.
* After the handshake, session 0 carries only SESSION_OPEN and TRANSPORT_PROBE; any other session-0 packet, a
  second CLIENT_HELLO, a malformed SESSION_OPEN, or a packet for a session id that is not open ends the
  connection (``server.rs``; ``crates/nnrp-runtime/src/multiplex.rs``: unknown session ids are fatal).
* Session-scoped runtime packets (``server.rs`` ``handle_runtime_packet`` arms): the layout rules of
  :mod:`.layouts` (shared with the client core), then operation identity and state (:mod:`.operations`).
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
from nnrp.runtime.types import (
    PartialResultMetadata,
    PressureMetadata,
    ProgressMetadata,
    RecoverableErrorMetadata,
    ResultDropReasonMetadata,
)

from . import framing, layouts
from .errors import FatalError, LocalProtocolError, PacketError
from .events import (
    BudgetUpdated,
    ConnectionEnded,
    DeadlineReceived,
    OperationCancelled,
    OperationSubmitted,
    OperationSuperseded,
    PacketRejected,
    PriorityUpdated,
    TraceContextReceived,
)
from .handshake import Handshake
from .layouts import ERR_STATE, ROLE_SERVER, message_name
from .operations import LateControl, Operation, OperationRegistry, OperationState, Session

__all__ = ["ServerConnection"]

#: longest diagnostic body put into an ERROR_RECOVERABLE (bytes of UTF-8)
MAX_DIAGNOSTIC_BYTES = 512

_T = MessageType
_pack_header = HEADER_STRUCT.pack
# the hot path: header + PARTIAL_RESULT metadata in one pack (same bytes as HEADER_STRUCT + PartialResultMetadata)
_PARTIAL_STRUCT = struct.Struct(
    "<" + HEADER_STRUCT.format.lstrip("<") + PartialResultMetadata.STRUCT.format.lstrip("<")
)
_pack_partial = _PARTIAL_STRUCT.pack
_PARTIAL_META_LEN = PartialResultMetadata.STRUCT.size
_PROGRESS_STRUCT = ProgressMetadata.STRUCT
_DROP_REASON_STRUCT = ResultDropReasonMetadata.STRUCT
_PRESSURE_STRUCT = PressureMetadata.STRUCT
_FRAME_CANCELLED = OperationState.FRAME_CANCELLED
_RESULT_PUSH_META_LEN = 64

# ERROR_RECOVERABLE sent (nnrp-doc runtime-control ``control-frames.md`` "Recoverable Error Metadata"): error_code
# from the common error registry (:class:`~.errors.PacketError`), recovery_action from the reason_code registry.
_RECOVERY_UNSPECIFIED = 0  # reason_code "unspecified" (value-registries "Reason And Stage Codes")
_SCOPE_SESSION = 1
_SCOPE_FRAME = 2


class ServerConnection:
    """The server side of one NNRP/1 connection (plain data; see the module docstring).

    ``max_in_flight_per_session`` is advertised in SERVER_HELLO_ACK ``max_concurrent_frames`` and in every
    SESSION_OPEN_ACK, and bounds the pre-submit DEADLINE reservations of a session; ``max_packet_bytes`` bounds
    one received packet (:class:`~.framing.PacketReader`) and is advertised as ``max_body_bytes``;
    ``profiles`` are the profile ids sessions may open (hello bitmap bit N-1 for profile N, nnrp-rs
    ``server.rs`` profile bitmap); ``schemas`` the accepted ``(schema_id, schema_version)`` pairs.
    ``authenticate``: ``None`` when the server requires no key; else a pure function that is given an
    authentication block (:mod:`vllm_nnrp_plugin.contract.auth_block`) and returns whether it holds an accepted key,
    raising ``ValueError`` when the block is malformed (the connection then ends, as for any malformed hello).
    """

    #: SESSION_CLOSE with ``in_flight_policy`` drain while operations run: True → :class:`~.events.SessionDraining`,
    #: each operation keeps its terminal and the closing ack follows the last one
    #: (:meth:`.handshake.Handshake.close`); False → the core ends them itself as for an abort (a
    #: ``peer_cancelled`` drop each, then the ack) and reports :class:`~.events.SessionClosed`. Set it (on the
    #: instance) once the application handles SessionDraining (:mod:`vllm_nnrp_plugin.nnrp_binding.connection`
    #: does).
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
        self._reader = framing.PacketReader(max_packet_bytes)
        self._out = bytearray()
        self._ended = False
        self._operations = OperationRegistry(
            max_reservations=max_in_flight_per_session, finished_memory=max(64, 4 * max_in_flight_per_session)
        )
        self._handshake = Handshake(
            self._queue,
            self._operations,
            credit=min(max_in_flight_per_session, 0xFFFF),
            max_packet_bytes=max_packet_bytes,
            profiles=profiles,
            schemas=schemas,
            authenticate=authenticate,
        )
        self._active = self._operations.by_frame  # (session_id, frame_id) → active operation, read by the sends

    # -- state ---------------------------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """ConnectionEnded was emitted (EOF or fatal); nothing more is queued after that."""
        return self._ended

    @property
    def sessions(self) -> int:
        """Sessions open right now on this connection."""
        return len(self._operations.sessions)

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
        self._operations.clear()
        self._handshake.end()

    def data_to_send(self) -> bytes:
        """Everything queued since the last call (``b""`` if nothing), then cleared."""
        if not self._out:
            return b""
        data = bytes(self._out)
        self._out.clear()
        return data

    # -- input ---------------------------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[object]:
        """Feed bytes read from the transport (``b""``: the peer's end of stream); return the events they
        completed, in order. Never raises: whatever the bytes are, the worst outcome is
        :class:`~.events.ConnectionEnded`, after which this returns ``[]``."""
        if self._ended:
            return []
        events: list[object] = []
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
            except FatalError as exc:
                self._end(events, str(exc))
            except Exception as exc:  # noqa: BLE001 - never raise on peer input; a bug ends only this connection
                kind = message_name(packet.msg_type)  # never the packet itself: it is the client's
                self._end(
                    events,
                    f"internal error ({type(exc).__name__}) handling {kind} of session "
                    f"{packet.session_id} frame {packet.frame_id}",
                )
            if self._ended:
                break
        return events

    def _end(self, events: list[object], error: str | None) -> None:
        self._ended = True
        self._operations.clear()
        self._handshake.end()
        events.append(ConnectionEnded(error))

    def _queue(
        self, msg_type: int, session_id: int, frame_id: int, meta: bytes, body: bytes = b"", trace_id: int = 0
    ) -> None:
        out = self._out
        out += _pack_header(
            HEADER_MAGIC, 1, 0, msg_type, HEADER_LENGTH, 0, len(meta), len(body), session_id, frame_id, 0, 0, trace_id
        )
        out += meta
        if body:
            out += body

    def _dispatch(self, packet: framing.Packet, events: list[object]) -> None:
        msg_type = packet.msg_type
        if not self._handshake.done:
            # nnrp-rs crates/nnrp-runtime/src/server.rs: the first non-probe packet must be CLIENT_HELLO
            if msg_type == _T.TRANSPORT_PROBE:
                self._handshake.probe(packet)
            elif msg_type == _T.CLIENT_HELLO:
                self._handshake.hello(packet)
            else:
                raise FatalError(f"{message_name(msg_type)} before CLIENT_HELLO")
            return
        session_id = packet.session_id
        if session_id == 0:
            # nnrp-rs server.rs: after the handshake session 0 carries only SESSION_OPEN and TRANSPORT_PROBE
            if msg_type == _T.SESSION_OPEN:
                self._handshake.session_open(packet, events)
            elif msg_type == _T.TRANSPORT_PROBE:
                self._handshake.probe(packet)
            elif msg_type == _T.CLIENT_HELLO:
                raise FatalError("second CLIENT_HELLO on the connection")
            else:
                raise FatalError(f"{message_name(msg_type)} on session 0 after the handshake")
            return
        session = self._operations.sessions.get(session_id)
        if session is None:
            # nnrp-rs crates/nnrp-runtime/src/multiplex.rs: a packet for an unregistered session id is fatal
            state = "closed" if session_id in self._handshake.session_ids else "unknown"
            raise FatalError(f"{message_name(msg_type)} for {state} session {session_id}")
        if msg_type == _T.CLIENT_HELLO:
            raise FatalError("second CLIENT_HELLO on the connection")
        try:
            handler = _SESSION_HANDLERS.get(msg_type)
            if handler is not None:
                handler(self, session, packet, events)
            else:
                advisory = _ADVISORY.get(msg_type)
                if advisory is None:
                    raise PacketError(f"{message_name(msg_type)} is not accepted from a client on a session", ERR_STATE)
                advisory(packet)
        except PacketError as rejection:
            self._reject(packet, rejection, events)
        except LateControl:
            pass

    def _reject(self, packet: framing.Packet, rejection: PacketError, events: list[object]) -> None:
        """PacketRejected + ERROR_RECOVERABLE (frame scope when the header names a frame, else session scope;
        header frame = ``related_frame_id`` as nnrp-rs ``server.rs`` ``send_recoverable_error``; source_role
        server, no retry, the reason as the diagnostic). The session goes on."""
        events.append(PacketRejected(packet.session_id, packet.frame_id, packet.msg_type, rejection.reason))
        self._queue_error(packet.session_id, packet.frame_id, rejection.error_code, rejection.reason)

    def _queue_error(self, session_id: int, frame_id: int, error_code: int, diagnostic: str) -> None:
        """ERROR_RECOVERABLE (nnrp-rs ``crates/nnrp-core/src/control.rs`` ``RecoverableError``; nnrp-doc
        runtime-control ``control-frames.md`` "Recoverable Error Metadata"): frame scope when ``frame_id`` names a
        frame, else session scope; ``related_frame_id`` = ``frame_id``; source_role server, recovery unspecified,
        no retry; ``diagnostic`` as UTF-8, cut at :data:`MAX_DIAGNOSTIC_BYTES`."""
        body = diagnostic.encode("utf-8", "replace")[:MAX_DIAGNOSTIC_BYTES]
        meta = RecoverableErrorMetadata(
            error_code,
            _SCOPE_FRAME if frame_id else _SCOPE_SESSION,
            _RECOVERY_UNSPECIFIED,
            ROLE_SERVER,
            0,
            0,
            session_id,
            frame_id,
            0,
            len(body),
        ).pack()
        self._queue(_T.ERROR_RECOVERABLE, session_id, frame_id, meta, body)

    # -- the application's answers to SessionOpenRequested --------------------------------------------------

    def accept_session(self, request: int) -> int:
        """Queue the accepted SESSION_OPEN_ACK for ``request`` and return the new session id: the requested id
        when non-zero, else the next id this connection hands out (ids increase: the first is 1, and no id is
        used twice on a connection, :class:`~.session_ids.SessionIds`; O(1) whatever the connection did before).
        The ack's header carries the new id (the native client only routes early session packets for an id it saw
        in an ack header: nnrp-rs ``crates/nnrp-runtime/src/multiplex.rs``). Returns 0 when the connection ended
        before the answer (nothing queued), and when no u32 session id is left on this connection (then a rejected
        ack ``session_limit_reached`` is queued instead); raises :class:`LocalProtocolError` for a request that
        was never issued or already answered."""
        return self._handshake.accept(request)

    def reject_session(self, request: int, session_error_code: int, diagnostic: str) -> None:
        """Queue a rejected SESSION_OPEN_ACK for ``request`` (header and metadata session 0,
        ``session_error_code`` non-zero, ``diagnostic`` as the UTF-8 body). Nothing happens when the connection
        ended first; :class:`LocalProtocolError` for an unknown request or a code of 0."""
        self._handshake.reject(request, session_error_code, diagnostic)

    # -- session scope: client packets ---------------------------------------------------------------------

    def _on_frame_submit(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """FRAME_SUBMIT: the layout (:func:`.layouts.frame_submit`), then the identity rules of
        :meth:`.operations.OperationRegistry.submit` (refused like any duplicate: ERROR_RECOVERABLE
        ``INVALID_STATE``, the session goes on) → :class:`~.events.OperationSubmitted`; when it binds a pre-submit
        DEADLINE, the :class:`~.events.DeadlineReceived` (submitted False) follows."""
        metadata = layouts.frame_submit(packet)
        frame_id = packet.frame_id
        operation_id = metadata.operation_id
        sid = session.session_id
        deadline = self._operations.submit(session, frame_id, operation_id)
        events.append(OperationSubmitted(sid, frame_id, operation_id, packet.trace_id, metadata, packet.body))
        if deadline is not None:
            events.append(DeadlineReceived(sid, frame_id, operation_id, deadline, False))

    def _on_frame_cancel(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """FRAME_CANCEL: header-only (:func:`.layouts.header_only`), the header frame bound to an active
        operation (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` FRAME_CANCEL arm). After it no PARTIAL_RESULT or
        PROGRESS is sent for the operation; a terminal is still expected. A second cancel of the same operation is
        rejected (:meth:`.operations.OperationRegistry.frame_cancel`)."""
        layouts.header_only(packet)
        op = self._operations.at_frame(session, packet.frame_id, "FRAME_CANCEL")
        self._operations.frame_cancel(op)
        events.append(OperationCancelled(session.session_id, op.frame_id, op.operation_id, int(_T.FRAME_CANCEL), b""))

    def _on_cancel(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """CANCEL / ABORT: the layout (:func:`.layouts.control_request`), an active operation whose frame is the
        header frame (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` CANCEL/ABORT arms). The first cancel of an
        operation is reported; a repeated one is rejected (:meth:`.operations.OperationRegistry.cancel`)."""
        name = message_name(packet.msg_type)
        metadata = layouts.control_request(packet)
        op = self._operations.target(session, packet.frame_id, metadata.operation_id, name)
        self._operations.cancel(op, name)
        events.append(
            OperationCancelled(session.session_id, op.frame_id, op.operation_id, packet.msg_type, packet.body)
        )

    def _on_scheduling(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """DEADLINE / PRIORITY_UPDATE / EXPIRE_AT: the layout (:func:`.layouts.scheduling`). For an active
        operation the header frame must be its frame (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` scheduling
        arm); DEADLINE and EXPIRE_AT → :class:`~.events.DeadlineReceived` (submitted True; EXPIRE_AT bounds the
        operation as a deadline does), PRIORITY_UPDATE → :class:`~.events.PriorityUpdated`. A DEADLINE (only)
        for an operation not submitted yet is a pre-submit reservation
        (:meth:`.operations.OperationRegistry.reserve`, at most ``max_in_flight_per_session`` per session); its
        event comes right after the matching FRAME_SUBMIT's OperationSubmitted, with submitted False. (No clock
        in the core: "deadline in the future" is the application's to judge.)"""
        msg_type = packet.msg_type
        name = message_name(msg_type)
        metadata = layouts.scheduling(packet)
        operation_id = metadata.operation_id
        sid = session.session_id
        if msg_type == _T.DEADLINE and operation_id and operation_id not in session.ops:
            self._operations.reserve(session, packet.frame_id, operation_id, metadata.deadline_unix_ms)
            return
        op = self._operations.target(session, packet.frame_id, operation_id, name)
        if msg_type == _T.PRIORITY_UPDATE:
            events.append(
                PriorityUpdated(sid, op.frame_id, op.operation_id, metadata.priority_class, metadata.priority_delta)
            )
        else:
            events.append(DeadlineReceived(sid, op.frame_id, op.operation_id, metadata.deadline_unix_ms, True))

    def _on_supersede(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """SUPERSEDE: the layout (:func:`.layouts.supersede`), and ``old_operation_id`` an active operation whose
        frame is the header frame (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` SUPERSEDE arm,
        ``require_operation_frame``). The operation is cancelled as by CANCEL (a repeated SUPERSEDE or cancel of
        it is rejected) → :class:`~.events.OperationSuperseded`."""
        metadata = layouts.supersede(packet)
        op = self._operations.target(session, packet.frame_id, metadata.old_operation_id, "SUPERSEDE")
        self._operations.cancel(op, "SUPERSEDE")
        events.append(
            OperationSuperseded(
                session.session_id,
                op.frame_id,
                op.operation_id,
                metadata.new_operation_id,
                metadata.drop_reason_code,
                packet.body,
            )
        )

    def _on_budget_update(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """BUDGET_UPDATE: the layout (:func:`.layouts.budget_update`), an active operation whose frame is the
        header frame (nnrp-rs ``crates/nnrp-runtime/src/server.rs`` BUDGET_UPDATE arm) →
        :class:`~.events.BudgetUpdated`."""
        metadata = layouts.budget_update(packet)
        op = self._operations.target(session, packet.frame_id, metadata.operation_id, "BUDGET_UPDATE")
        events.append(
            BudgetUpdated(
                session.session_id,
                op.frame_id,
                op.operation_id,
                metadata.token_budget,
                metadata.compute_budget_units,
                metadata.memory_budget_bytes,
                metadata.bandwidth_budget_bytes,
            )
        )

    def _on_trace_context(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """TRACE_CONTEXT: the layout (:func:`.layouts.trace_context`); header frame 0 = session scope, else the
        frame of an active operation (shipped build: "TRACE_CONTEXT references an unknown operation frame")."""
        metadata = layouts.trace_context(packet)
        operation_id = None
        if packet.frame_id:
            operation_id = self._operations.at_frame(session, packet.frame_id, "TRACE_CONTEXT").operation_id
        events.append(
            TraceContextReceived(
                session.session_id,
                packet.frame_id,
                operation_id,
                metadata.trace_id,
                metadata.span_id,
                metadata.parent_span_id,
                metadata.stage_code,
                metadata.flags,
                metadata.body_bytes,
            )
        )

    def _on_ping(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """PING → PONG on the same session and frame; PONG is taken and ignored. Both header-only (nnrp-rs
        ``crates/nnrp-runtime/src/server.rs`` ``receive_ping``/``send_ping``)."""
        layouts.header_only(packet)
        if packet.msg_type == _T.PING:
            self._queue(_T.PONG, session.session_id, packet.frame_id, b"")

    def _on_session_close(self, session: Session, packet: framing.Packet, events: list[object]) -> None:
        """SESSION_CLOSE: :meth:`.handshake.Handshake.close`, draining as :attr:`drain_sessions` says."""
        self._handshake.close(session, packet, events, drain_sessions=self.drain_sessions)

    def session_open(self, session_id: int) -> bool:
        """``session_id`` is open on this connection: accepted, and its SESSION_CLOSE_ACK closed not queued yet
        (a session draining after the client's SESSION_CLOSE is still open; the ack that follows its last
        terminal closes it)."""
        return session_id in self._operations.sessions

    def _finish(self, op: Operation) -> None:
        """``op``'s terminal was queued: the registry forgets it; when it was its draining session's last
        operation, the closing ack goes right behind it."""
        closed = self._operations.finish(op)
        if closed is not None:
            self._handshake.drained(closed)

    # -- output: results and session-scope controls --------------------------------------------------------

    def send_partial_result(
        self, session_id: int, frame_id: int, operation_id: int, sequence: int, body: bytes
    ) -> bool:
        """PARTIAL_RESULT (``result_sequence = delta_sequence = sequence``, object 0, flags 0, the inline body;
        nnrp-rs ``crates/nnrp-core/src/control.rs`` ``PartialResult``: with no object the body must not be
        empty). False when the operation is not active or the client FRAME_CANCELled it."""
        if sequence < 1 or not body:
            raise LocalProtocolError("PARTIAL_RESULT needs a sequence ≥ 1 and a non-empty body")
        op = self._active.get((session_id, frame_id))
        if op is None or op.operation_id != operation_id or op.state is _FRAME_CANCELLED:
            _check_u64("PARTIAL_RESULT", operation_id, sequence)  # misuse raises even when the operation is gone
            return False
        size = len(body)
        try:
            header = _pack_partial(
                HEADER_MAGIC,
                1,
                0,
                0x38,
                40,
                0,
                _PARTIAL_META_LEN,
                size,
                session_id,
                frame_id,
                0,
                0,
                0,
                operation_id,
                sequence,
                0,
                sequence,
                size,
                0,
            )
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
        op = self._active.get((session_id, frame_id))
        if op is None or op.operation_id != operation_id or op.state is _FRAME_CANCELLED:
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
        op = self._active.get((session_id, frame_id))
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
        op = self._active.get((session_id, frame_id))
        if op is None or op.operation_id != operation_id:
            _check_u64("RESULT_DROP_REASON", operation_id, sequence)
            return False
        try:
            meta = _DROP_REASON_STRUCT.pack(
                operation_id, sequence, drop_reason_code, ROLE_SERVER, 0, len(diagnostic), 0
            )
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
        return self._send_pressure(
            _T.BACKPRESSURE, session_id, credit_window, pressure_level, pressure_reason, retry_after_ms
        )

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
        if session_id not in self._operations.sessions:
            return False
        self._queue_error(session_id, frame_id, error_code, diagnostic)
        return True

    def _send_pressure(self, msg_type: int, session_id: int, credit: int, level: int, reason: int, retry: int) -> bool:
        try:
            meta = _PRESSURE_STRUCT.pack(0, credit, level, reason, retry, 0, 0)
        except struct.error as exc:
            raise LocalProtocolError(f"{message_name(msg_type)} field out of range: {exc}") from None
        if session_id not in self._operations.sessions:
            return False
        self._queue(msg_type, session_id, 0, meta)
        return True


#: what a client may send on a session that is advisory to this server: checked (:mod:`.layouts`), then ignored.
#: BACKPRESSURE / CREDIT_UPDATE are recorded by nobody (nnrp-rs ``crates/nnrp-runtime/src/pressure.rs``);
#: FLOW_UPDATE and RESULT_HINT are hints; ERROR_RECOVERABLE / RETRY_AFTER a native client can send.
_ADVISORY = {
    int(_T.BACKPRESSURE): layouts.pressure,
    int(_T.CREDIT_UPDATE): layouts.pressure,
    int(_T.FLOW_UPDATE): layouts.flow_update,
    int(_T.RESULT_HINT): layouts.result_hint,
    int(_T.ERROR_RECOVERABLE): layouts.recoverable_error,
    int(_T.RETRY_AFTER): layouts.retry_after,
}

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
    int(_T.PING): ServerConnection._on_ping,
    int(_T.PONG): ServerConnection._on_ping,
    int(_T.SESSION_CLOSE): ServerConnection._on_session_close,
}


def _check_u64(kind: str, operation_id: int, sequence: int) -> None:
    """Raise :class:`LocalProtocolError` when ``operation_id`` or ``sequence`` does not fit its u64 field: a call
    for an operation that is not active (False) is a lost race, one with such a value is misuse."""
    if not (0 <= operation_id < 1 << 64 and 0 <= sequence < 1 << 64):
        raise LocalProtocolError(f"{kind} field out of range: operation_id {operation_id}, sequence {sequence}")

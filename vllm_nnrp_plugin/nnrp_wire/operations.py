"""The operations of one server connection (:class:`OperationRegistry`): which are active in which session, the
one state each is in, the pre-submit DEADLINE reservations, and the ids recently finished operations used.

Each active operation is in exactly one :class:`OperationState`; a terminal the server sends removes it, and its
pair of ids is remembered (bounded) so that a late control for it is told apart from a client's mistake. The
identity rules are nnrp-rs ``crates/nnrp-core/src/operation.rs`` (``register``: frame and operation ids unique)
and ``crates/nnrp-runtime/src/server.rs`` (every later packet about an operation carries both ids; the
FRAME_CANCEL, CANCEL/ABORT, SUPERSEDE arms); reservations are the shipped build's pre-submit DEADLINE (public
nnrp-rs ``crates/nnrp-runtime/src/pre_submit.rs`` at 00074cf). A packet that breaks one raises
:class:`~.errors.PacketError` (``INVALID_STATE``, or ``LIMIT_EXCEEDED`` for too many reservations); a control
for an operation finished recently raises :class:`LateControl`. Plain data: no I/O, no clock.
"""

from __future__ import annotations

import enum

from .errors import PacketError
from .layouts import ERR_LIMIT, ERR_STATE

__all__ = ["LateControl", "Operation", "OperationRegistry", "OperationState", "Session"]


class LateControl(Exception):
    """A control for an operation whose terminal this server sent recently: a race the client cannot avoid,
    ignored silently (not an error)."""


class OperationState(enum.Enum):
    """Where an active operation is. Every operation starts :attr:`ACTIVE`; its terminal (RESULT_PUSH or
    RESULT_DROP_REASON, from any state) removes it from the registry."""

    #: submitted; results stream
    ACTIVE = "active"
    #: the client's CANCEL, ABORT or SUPERSEDE came: results may still stream, its terminal is due; a second
    #: cancel is refused
    CANCELLED = "cancelled"
    #: the client's FRAME_CANCEL came (after a cancel or not): no PARTIAL_RESULT or PROGRESS any more (the
    #: shipped native client rejects them "for a terminal operation"), only its terminal; any further cancel is
    #: refused
    FRAME_CANCELLED = "frame_cancelled"


class Operation:
    """One active operation: the pair of ids fixed at FRAME_SUBMIT, its :class:`OperationState`, and
    ``sequence``, the ``result_sequence`` of the last PARTIAL_RESULT sent for it (0: none), so that a drop the
    server core sends itself numbers after it."""

    __slots__ = ("session_id", "frame_id", "operation_id", "state", "sequence")

    def __init__(self, session_id: int, frame_id: int, operation_id: int) -> None:
        self.session_id = session_id
        self.frame_id = frame_id
        self.operation_id = operation_id
        self.state = OperationState.ACTIVE
        self.sequence = 0


class Session:
    """The operations of one open session: ``ops`` (operation_id → active :class:`Operation`, submit order),
    ``reservations`` (operation_id → (frame_id, deadline_unix_ms)) with ``reserved_frames`` (frame_id →
    operation_id), ``finished`` ((frame_id, operation_id) of recent terminals, oldest first) with the same pairs
    by frame (``finished_frames``) and by operation (``finished_ops``), and ``draining``: the
    ``last_operation_id`` of the client's SESSION_CLOSE (drain) while operations ran, echoed by the closed ack
    that follows the last terminal; None while the session is open."""

    __slots__ = (
        "session_id",
        "ops",
        "reservations",
        "reserved_frames",
        "finished",
        "finished_frames",
        "finished_ops",
        "draining",
    )

    def __init__(self, session_id: int) -> None:
        self.session_id = session_id
        self.ops: dict[int, Operation] = {}
        self.reservations: dict[int, tuple[int, int]] = {}
        self.reserved_frames: dict[int, int] = {}
        self.finished: dict[tuple[int, int], None] = {}
        self.finished_frames: dict[int, int] = {}
        self.finished_ops: dict[int, int] = {}
        self.draining: int | None = None


class OperationRegistry:
    """The open sessions of one connection (``sessions``: session_id → :class:`Session`) and their active
    operations, also by ``(session_id, frame_id)`` (``by_frame``: the send hot path's one lookup; callers read
    both mappings and change them only through these methods).
    ``max_reservations``: pre-submit DEADLINE reservations a session may hold; ``finished_memory``: finished
    pairs remembered per session (the native server remembers every id its session ever registered; here the
    last ``finished_memory``, so memory stays bounded)."""

    __slots__ = ("sessions", "by_frame", "_max_reservations", "_finished_memory")

    def __init__(self, *, max_reservations: int, finished_memory: int) -> None:
        self.sessions: dict[int, Session] = {}
        self.by_frame: dict[tuple[int, int], Operation] = {}
        self._max_reservations = max_reservations
        self._finished_memory = finished_memory

    def open(self, session_id: int) -> None:
        """Register the newly accepted ``session_id``."""
        self.sessions[session_id] = Session(session_id)

    def close(self, session: Session) -> list[Operation]:
        """Forget ``session`` and return its active operations, in submit order (their ids are not remembered:
        the session id is never used again on the connection)."""
        ops = list(session.ops.values())
        for op in ops:
            del self.by_frame[(session.session_id, op.frame_id)]
        del self.sessions[session.session_id]
        return ops

    def clear(self) -> None:
        """The connection ended: forget everything."""
        self.sessions.clear()
        self.by_frame.clear()

    # -- what the client's packets change --------------------------------------------------------------------

    def submit(self, session: Session, frame_id: int, operation_id: int) -> int | None:
        """Register the FRAME_SUBMIT of ``(frame_id, operation_id)`` in ``session``; return the
        ``deadline_unix_ms`` of the pre-submit DEADLINE it binds, or None. Refused: frame id 0; either id active
        or used by a finished operation still remembered (the native server refuses every frame and operation id
        its session ever registered: nnrp-rs ``crates/nnrp-runtime/src/server.rs`` "duplicate FRAME_SUBMIT frame
        id", ``crates/nnrp-core/src/operation.rs`` ``register``); a session draining after the client's
        SESSION_CLOSE; ids that do not both match a reservation (shipped build; public nnrp-rs
        ``crates/nnrp-runtime/src/pre_submit.rs`` at 00074cf)."""
        sid = session.session_id
        if not frame_id:
            raise PacketError("FRAME_SUBMIT with frame id 0", ERR_STATE)
        if (sid, frame_id) in self.by_frame:
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
        op = Operation(sid, frame_id, operation_id)
        session.ops[operation_id] = op
        self.by_frame[(sid, frame_id)] = op
        if reservation is None:
            return None
        del session.reservations[operation_id]
        del session.reserved_frames[frame_id]
        return reservation[1]

    def reserve(self, session: Session, frame_id: int, operation_id: int, deadline_unix_ms: int) -> None:
        """A DEADLINE for ``operation_id`` (≠ 0), not active in ``session``: a pre-submit reservation. Both ids
        non-zero, the frame free, no duplicate, at most ``max_reservations`` per session."""
        if (frame_id, operation_id) in session.finished:
            raise LateControl
        if not frame_id:
            raise PacketError("pre-submit DEADLINE with frame id 0", ERR_STATE)
        if (session.session_id, frame_id) in self.by_frame:
            raise PacketError(f"pre-submit DEADLINE frame {frame_id} is bound to another operation", ERR_STATE)
        if operation_id in session.reservations or frame_id in session.reserved_frames:
            raise PacketError("duplicate pre-submit DEADLINE reservation", ERR_STATE)
        if len(session.reservations) >= self._max_reservations:
            raise PacketError("pre-submit DEADLINE reservations exceed the session's in-flight limit", ERR_LIMIT)
        session.reservations[operation_id] = (frame_id, deadline_unix_ms)
        session.reserved_frames[frame_id] = operation_id

    def target(self, session: Session, frame_id: int, operation_id: int, name: str) -> Operation:
        """The active operation a control ``name`` names by ``operation_id``; its frame must be the header's
        ``frame_id``."""
        op = session.ops.get(operation_id)
        if op is None:
            if (frame_id, operation_id) in session.finished:
                raise LateControl
            raise PacketError(f"{name} references an unknown operation {operation_id}", ERR_STATE)
        if op.frame_id != frame_id:
            raise PacketError(f"{name} header frame {frame_id} does not match operation {operation_id}", ERR_STATE)
        return op

    def at_frame(self, session: Session, frame_id: int, name: str) -> Operation:
        """The active operation bound to the header's ``frame_id``, for a control ``name`` that names no
        operation (FRAME_CANCEL, TRACE_CONTEXT)."""
        op = self.by_frame.get((session.session_id, frame_id))
        if op is None:
            if frame_id in session.finished_frames:
                raise LateControl
            raise PacketError(f"{name} references an unknown operation frame {frame_id}", ERR_STATE)
        return op

    @staticmethod
    def cancel(op: Operation, name: str) -> None:
        """CANCEL, ABORT or SUPERSEDE ``name`` of ``op``: :attr:`~OperationState.ACTIVE` →
        :attr:`~OperationState.CANCELLED`; refused in any other state."""
        if op.state is not OperationState.ACTIVE:
            raise PacketError(f"{name} for operation {op.operation_id} already cancelled", ERR_STATE)
        op.state = OperationState.CANCELLED

    @staticmethod
    def frame_cancel(op: Operation) -> None:
        """FRAME_CANCEL of ``op``: → :attr:`~OperationState.FRAME_CANCELLED` from any state (results stop even
        when the FRAME_CANCEL is refused); refused unless ``op`` was :attr:`~OperationState.ACTIVE` (shipped
        server: "server cancel did not transition an active operation")."""
        was = op.state
        op.state = OperationState.FRAME_CANCELLED
        if was is not OperationState.ACTIVE:
            raise PacketError(f"FRAME_CANCEL for operation {op.operation_id} already cancelled", ERR_STATE)

    # -- what the server's terminals change ------------------------------------------------------------------

    def finish(self, op: Operation) -> Session | None:
        """``op``'s terminal was queued: forget it and remember its ids (the last ``finished_memory`` pairs of
        its session). Returns its session when that was draining and this was its last operation: the session is
        then closed (forgotten), and its closing ack is the caller's to queue."""
        session = self.sessions[op.session_id]
        frame_id, operation_id = op.frame_id, op.operation_id
        del session.ops[operation_id]
        del self.by_frame[(op.session_id, frame_id)]
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
            del self.sessions[session.session_id]
            return session
        return None

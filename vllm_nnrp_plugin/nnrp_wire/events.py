"""What the wire core reports: typed events, plain data (``attrs`` frozen classes).

Server side (:class:`~.server.ServerConnection.receive_data` returns them): a session open to decide, a session
the client closed (or is closing while its operations drain), an operation submitted, cancelled, superseded,
bounded by a DEADLINE or EXPIRE_AT, re-prioritised (PRIORITY_UPDATE), re-budgeted (BUDGET_UPDATE), a TRACE_CONTEXT,
a packet the core refused (the connection goes on), and the end of the connection.
Client side
(:class:`~.client.ClientConnection.receive_data`): a session opened or refused, results and terminals,
pressure and trace frames from the server, a session close acknowledged, and the end of the connection.

Ids follow NNRP/1: ``session_id`` u32 (the header's), ``frame_id`` u32 (the operation's work unit, per session),
``operation_id`` u64 (the client's, per session). Times are wall-clock ms since the Unix epoch where named
``*_unix_ms``.
"""

from __future__ import annotations

from typing import Any

import attrs

# -- server side ---------------------------------------------------------------------------------------------


@attrs.frozen
class SessionOpenRequested:
    """A valid SESSION_OPEN the application must accept or reject
    (:meth:`~.server.ServerConnection.accept_session` / ``reject_session``); the core already refused
    what the protocol refuses (unsupported profile or schema, a resume, a requested id already used).
    ``request`` identifies it in those calls."""

    request: int
    requested_session_id: int
    profile_id: int
    priority_class: int
    session_flags: int
    schema_id: int
    schema_version: int
    default_deadline_ms: int
    max_in_flight_operations: int


@attrs.frozen
class AuthenticationFailed:
    """A SESSION_OPEN was rejected with ``auth_failed`` (0x00010001) because the server requires a key and
    none accepted came: ``presented`` is True when a key was sent (in the hello or the open) but is not one the
    server holds, False when none was sent. The key itself is never reported."""

    presented: bool


@attrs.frozen
class SessionClosed:
    """The client closed ``session_id`` (SESSION_CLOSE; the SESSION_CLOSE_ACK is already queued, behind a
    ``peer_cancelled`` RESULT_DROP_REASON the core queued for each operation still running). Its operations are
    gone: nothing more can be sent for them. ``close_reason``: NNRP close_reason (u16). Comes when the close's
    ``in_flight_policy`` is abort, or nothing was in flight; a drain with operations in flight gives
    :class:`SessionDraining` instead."""

    session_id: int
    close_reason: int


@attrs.frozen
class SessionDraining:
    """The client closed ``session_id`` with ``in_flight_policy`` drain while ``operation_ids`` (the session's
    active operations, in submit order) ran; nothing is queued for the close yet (no ack with close_status
    draining: the terminals come first, :meth:`~.handshake.Handshake.close`).

    The session stays open for them: each still needs its terminal (send it as for any operation; partial
    results and the client's controls go on as before, a new FRAME_SUBMIT is refused). The core queues the
    closing SESSION_CLOSE_ACK (close_status closed) right behind the last of those terminals, and from then on
    :meth:`~.server.ServerConnection.session_open` is False and sends for the session return False: that is when
    the application's own session ends. No other event follows for it (a later SESSION_CLOSE with
    ``in_flight_policy`` abort gives :class:`SessionClosed`, and the operations still running are gone then).

    ``drain_timeout_ms``: the client's window for the drain, ms from now (NagareWorks/nnrp-doc
    ``docs/en/design/v1-preview3.md`` §7.1C: drain lets in-flight operations "drain within drain_timeout_ms";
    "0 means apply immediately"). The core has no clock: the application ends each operation still running when
    the window passes, with a terminal (a cancel's, e.g. RESULT_DROP_REASON ``peer_cancelled``) — with 0 (what
    nnrp-py's native client and this package's client send) at once. ``close_reason``: as in
    :class:`SessionClosed`. Only with :attr:`~.server.ServerConnection.drain_sessions` set."""

    session_id: int
    close_reason: int
    drain_timeout_ms: int
    operation_ids: tuple[int, ...]


@attrs.frozen
class OperationSubmitted:
    """A FRAME_SUBMIT whose metadata passed the protocol's rules: ``metadata`` is nnrp-py's
    ``FrameSubmitMetadata``, ``body`` the raw body region (typed payload rules are the profile's to apply),
    ``trace_id`` the header's. The operation is active until its terminal is sent."""

    session_id: int
    frame_id: int
    operation_id: int
    trace_id: int
    metadata: Any
    body: bytes


@attrs.frozen
class OperationCancelled:
    """The client cancelled an active operation: ``kind`` is the ``MessageType`` (FRAME_CANCEL, CANCEL or
    ABORT), ``diagnostic`` the control's diagnostic bytes (empty for FRAME_CANCEL). After a FRAME_CANCEL the
    core refuses further PARTIAL_RESULT and PROGRESS for it (the native client rejects them); a terminal is
    still expected."""

    session_id: int
    frame_id: int
    operation_id: int
    kind: int
    diagnostic: bytes


@attrs.frozen
class DeadlineReceived:
    """A DEADLINE or EXPIRE_AT control (``deadline_unix_ms`` > 0; EXPIRE_AT bounds the operation as a deadline
    does). ``submitted`` is False for a DEADLINE that arrived before its FRAME_SUBMIT (nnrp-py's
    ``submit_and_poll_result(timeout_ms=…)`` sends it first); an EXPIRE_AT always names an active operation."""

    session_id: int
    frame_id: int
    operation_id: int
    deadline_unix_ms: int
    submitted: bool


@attrs.frozen
class PriorityUpdated:
    """A PRIORITY_UPDATE for an active operation: ``priority_class`` 0 interactive, 1 balanced, 2 background
    (nnrp-rs ``crates/nnrp-core/src/enums.rs`` ``PriorityClass``), ``priority_delta`` the signed i16 within it.
    Advisory: what to reschedule is the application's."""

    session_id: int
    frame_id: int
    operation_id: int
    priority_class: int
    priority_delta: int


@attrs.frozen
class OperationSuperseded:
    """A SUPERSEDE: the active operation ``operation_id`` (the metadata's ``old_operation_id``; ``frame_id`` is
    its frame) is replaced by ``new_operation_id`` (0: by nothing named). ``drop_reason_code``: 0 or a known
    drop reason (1..9, usually 2 superseded), ``diagnostic`` the control's bytes. The core marks the operation
    cancelled as for CANCEL; a terminal is still expected (RESULT_DROP_REASON superseded fits)."""

    session_id: int
    frame_id: int
    operation_id: int
    new_operation_id: int
    drop_reason_code: int
    diagnostic: bytes


@attrs.frozen
class BudgetUpdated:
    """A BUDGET_UPDATE for an active operation (nnrp-rs ``crates/nnrp-core/src/control.rs`` ``BudgetMetadata``):
    ``token_budget`` tokens (u32), ``compute_budget_units`` (u64, unit the deployment's),
    ``memory_budget_bytes`` and ``bandwidth_budget_bytes`` (u64, bytes); 0 = no budget of that kind."""

    session_id: int
    frame_id: int
    operation_id: int
    token_budget: int
    compute_budget_units: int
    memory_budget_bytes: int
    bandwidth_budget_bytes: int


@attrs.frozen
class TraceContextReceived:
    """A TRACE_CONTEXT: session scope when ``frame_id == 0`` (``operation_id`` None), else the scope of that
    active operation. Fields as the metadata (``TraceContextMetadata``)."""

    session_id: int
    frame_id: int
    operation_id: int | None
    trace_id: int
    span_id: int
    parent_span_id: int
    stage_code: int
    flags: int
    body_bytes: int


@attrs.frozen
class PacketRejected:
    """A packet of an open session that broke a protocol rule (``reason`` says which); the core answered it
    as the protocol says (see :mod:`.server`) and the session and connection go on."""

    session_id: int
    frame_id: int
    msg_type: int
    reason: str


@attrs.frozen
class ConnectionEnded:
    """The connection is over: ``error`` is None for the peer's end of stream, else the protocol violation
    that ended it. Every session on it is gone; the application closes the transport once the queued
    bytes are written."""

    error: str | None


# -- client side ---------------------------------------------------------------------------------------------


@attrs.frozen
class SessionOpenAccepted:
    """The server accepted the open ``request`` (the token ``open_session`` returned) as ``session_id``;
    ``max_in_flight_operations`` and ``granted_operation_credit`` are the ack's."""

    request: int
    session_id: int
    max_in_flight_operations: int
    granted_operation_credit: int


@attrs.frozen
class SessionOpenRejected:
    """The server refused the open ``request``: NNRP ``session_error_code`` (u32) and its UTF-8 diagnostic."""

    request: int
    session_error_code: int
    diagnostic: str


@attrs.frozen
class PartialResultReceived:
    """A PARTIAL_RESULT: ``body`` is the inline payload (``body_bytes`` long)."""

    session_id: int
    frame_id: int
    operation_id: int
    result_sequence: int
    body: bytes


@attrs.frozen
class ResultPushed:
    """A RESULT_PUSH (terminal): ``metadata`` is nnrp-py's ``ResultPushMetadata``, ``body`` the body region."""

    session_id: int
    frame_id: int
    operation_id: int
    metadata: Any
    body: bytes


@attrs.frozen
class ResultDropReasonReceived:
    """A RESULT_DROP_REASON (terminal): NNRP ``drop_reason_code``, ``source_role`` and the diagnostic bytes."""

    session_id: int
    frame_id: int
    operation_id: int
    result_sequence: int
    drop_reason_code: int
    source_role: int
    diagnostic: bytes


@attrs.frozen
class PressureReceived:
    """A BACKPRESSURE or CREDIT_UPDATE (``kind``, a ``MessageType``) for ``session_id``: fields as
    ``PressureMetadata`` (``scope_id`` 0 = the whole connection)."""

    session_id: int
    kind: int
    scope_id: int
    credit_window: int
    pressure_level: int
    pressure_reason: int
    retry_after_ms: int


@attrs.frozen
class SessionCloseAcked:
    """The server acknowledged the close of ``session_id`` (SESSION_CLOSE_ACK, close_status closed)."""

    session_id: int


@attrs.frozen
class ResultDropped:
    """A header-only RESULT_DROP (terminal): the operation ended without a result or a reason."""

    session_id: int
    frame_id: int
    operation_id: int


@attrs.frozen
class ProgressReceived:
    """A PROGRESS for an active operation: fields as ``ProgressMetadata`` (``percent_x100`` 0..10000, or
    0xffff for unknown); ``body`` the optional payload."""

    session_id: int
    frame_id: int
    operation_id: int
    progress_sequence: int
    stage_code: int
    percent_x100: int
    body: bytes


@attrs.frozen
class ErrorRecoverableReceived:
    """An ERROR_RECOVERABLE for ``session_id``: fields as ``RecoverableErrorMetadata`` (``error_scope`` 0
    connection, 1 session, 2 frame; ``retry_after_ms`` ms) and the diagnostic bytes."""

    session_id: int
    frame_id: int
    error_code: int
    error_scope: int
    recovery_action: int
    retry_after_ms: int
    related_frame_id: int
    diagnostic: bytes


@attrs.frozen
class RetryAfterReceived:
    """A RETRY_AFTER for ``session_id``: fields as ``RetryAfterMetadata`` (``scope_id`` 0 = the whole
    connection; ``retry_after_ms`` and ``jitter_ms`` in ms) and the diagnostic bytes."""

    session_id: int
    scope_id: int
    retry_after_ms: int
    jitter_ms: int
    reason_code: int
    diagnostic: bytes

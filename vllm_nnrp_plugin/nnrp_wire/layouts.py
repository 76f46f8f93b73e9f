"""The layout rules of the session-scoped packets both wire cores receive, written once: each function takes a
received :class:`~.framing.Packet`, returns its parsed metadata and raises :class:`~.errors.PacketError`
(``MALFORMED_BODY``) for the first rule it breaks, with the rule as the reason. What a core does with that error
is its own (the server answers an ERROR_RECOVERABLE, the client reports :class:`~.events.PacketRejected`); which
operation a packet names is the cores' business, not a layout's.

Sources: nnrp-rs ``crates/nnrp-core/src/control.rs``, ``data.rs``, ``flow.rs``, ``session.rs`` (each layout's
parse rules, at the readable commit 784a4a3); nnrp-doc ``docs/en/profiles/runtime-control/value-registries.md``
("Receivers MUST reject fixed metadata that sets a reserved flag bit, uses a reserved enum value, or sets a
reserved field to a non-zero value"; role, drop reason and reason codes); the metadata codecs are nnrp-py's
(``nnrp.core.messages``, ``nnrp.runtime.types``: exact size, known enum values) and :mod:`.codecs`.
"""

from __future__ import annotations

import struct
from typing import Any

from nnrp.core.enums import ErrorCode, MessageType
from nnrp.core.messages.control import FlowUpdateMetadata, ResultHintMetadata
from nnrp.core.messages.data import FrameSubmitMetadata, ResultPushMetadata
from nnrp.runtime.types import (
    BudgetMetadata,
    ControlRequestMetadata,
    PartialResultMetadata,
    PressureMetadata,
    ProgressMetadata,
    RecoverableErrorMetadata,
    ResultDropReasonMetadata,
    RetryAfterMetadata,
    SchedulingMetadata,
    SessionCloseMetadata,
    SupersedeMetadata,
    TraceContextMetadata,
)

from .codecs import PRIORITY_CLASSES, SessionCloseAckMetadata
from .errors import PacketError
from .framing import Packet

__all__ = [
    "ERR_LIMIT",
    "ERR_STATE",
    "ROLE_SERVER",
    "budget_update",
    "control_request",
    "flow_update",
    "frame_submit",
    "header_only",
    "metadata",
    "message_name",
    "partial_result",
    "pressure",
    "progress",
    "recoverable_error",
    "result_drop_reason",
    "result_hint",
    "result_push",
    "retry_after",
    "scheduling",
    "session_close",
    "session_close_ack",
    "supersede",
    "trace_context",
]

_T = MessageType
#: ERROR_RECOVERABLE error_code of an unknown, duplicate or finished operation or frame, or of a type the
#: receiver does not take (nnrp-py ``ErrorCode.INVALID_STATE``)
ERR_STATE = int(ErrorCode.INVALID_STATE)
#: ERROR_RECOVERABLE error_code of a bound exceeded (nnrp-py ``ErrorCode.LIMIT_EXCEEDED``)
ERR_LIMIT = int(ErrorCode.LIMIT_EXCEEDED)

#: source_role of everything the server core sends (nnrp-doc runtime-control value-registries "Role Codes")
ROLE_SERVER = 2

_FRAME_CLASSES = frozenset((0, 1, 2, 3))  # keyframe, delta, retransmit, discardable (nnrp-rs enums.rs FrameClass)
# drop_reason_code 1 deadline_expired .. 9 conformance_injection (nnrp-py ResultDropReasonCode; nnrp-doc
# runtime-control value-registries); SUPERSEDE may also carry 0 (none)
_DROP_REASON_CODES = range(1, 10)
_PARTIAL = PartialResultMetadata.STRUCT


def message_name(msg_type: int) -> str:
    """``msg_type``'s name in nnrp-py's ``MessageType``, or ``msg_type 0x..`` for a value it does not know."""
    try:
        name: str = MessageType(msg_type).name  # nnrp-py's enum, untyped
        return name
    except ValueError:
        return f"msg_type {msg_type:#04x}"


def metadata(codec: Any, packet: Packet, name: str) -> Any:
    """``codec.unpack`` of the packet's metadata (``codec``: an nnrp-py or :mod:`.codecs` layout class):
    ``meta_len`` must be ``codec.STRUCT.size``, and the codec's own rules must hold."""
    if len(packet.meta) != codec.STRUCT.size:
        raise PacketError(f"{name} meta_len {len(packet.meta)} (must be {codec.STRUCT.size})")
    try:
        return codec.unpack(packet.meta)
    except (ValueError, TypeError, struct.error) as exc:
        raise PacketError(f"malformed {name} metadata: {exc}") from None


def header_only(packet: Packet) -> None:
    """FRAME_CANCEL, PING, PONG, RESULT_DROP: no metadata, no body (nnrp-rs ``crates/nnrp-runtime/src/server.rs``
    FRAME_CANCEL arm and ``receive_ping``; ``client.rs`` RESULT_DROP)."""
    if packet.meta or packet.body:
        raise PacketError(f"{message_name(packet.msg_type)} must be header-only")


def _role_ok(role: int) -> bool:
    # source_role: 0x00-0x07 standard, 0x08-0x7f reserved (rejected), 0x80-0xff private
    # (nnrp-rs crates/nnrp-core/src/object.rs RuntimeRole; control.rs role checks)
    return role <= 0x07 or role >= 0x80


def _body_is(packet: Packet, declared: int, name: str, field: str) -> None:
    if len(packet.body) != declared:
        raise PacketError(f"{name} body_len {len(packet.body)} != {field} {declared}")


def _empty_body(packet: Packet, name: str) -> None:
    if packet.body:
        raise PacketError(f"{name} must have an empty body")


# -- what a server receives ------------------------------------------------------------------------------------


def frame_submit(packet: Packet) -> FrameSubmitMetadata:
    """FRAME_SUBMIT: ``meta_len`` 72; nnrp-py ``FrameSubmitMetadata`` parse (known submit mode, budget policy,
    loss tolerance, input profile, tile index mode; ``payload_kind_bitmap`` ⊆ 0x7f; ``operation_id`` ≠ 0; no tile
    fields without TENSOR) plus what it does not check: reserved0-4 zero, a known frame_class (nnrp-rs
    ``crates/nnrp-core/src/data.rs`` ``FrameSubmit::parse``). The body is the caller's."""
    meta = metadata(FrameSubmitMetadata, packet, "FRAME_SUBMIT")
    if meta.reserved0 or meta.reserved1 or meta.reserved2 or meta.reserved3 or meta.reserved4:
        raise PacketError("FRAME_SUBMIT reserved fields must be zero")
    if meta.frame_class not in _FRAME_CLASSES:
        raise PacketError(f"FRAME_SUBMIT unknown frame_class {meta.frame_class}")
    return meta


def control_request(packet: Packet) -> ControlRequestMetadata:
    """CANCEL / ABORT: control request metadata (``meta_len`` 32, reserved 0, flags ⊆ 0x3, a non-reserved
    source_role; nnrp-rs ``crates/nnrp-core/src/control.rs`` ``ControlRequest``), ``body_len ==
    diagnostic_bytes``."""
    name = message_name(packet.msg_type)
    meta = metadata(ControlRequestMetadata, packet, name)
    if meta.flags & ~0x03:
        raise PacketError(f"{name} flags have reserved bits {meta.flags:#x}")
    if not _role_ok(int(meta.source_role)):
        raise PacketError(f"{name} reserved source_role {int(meta.source_role):#x}")
    _body_is(packet, meta.diagnostic_bytes, name, "diagnostic_bytes")
    return meta


def scheduling(packet: Packet) -> SchedulingMetadata:
    """DEADLINE / PRIORITY_UPDATE / EXPIRE_AT: scheduling metadata (``meta_len`` 32, flags ⊆ 0x3; nnrp-rs
    ``crates/nnrp-core/src/control.rs`` ``Scheduling``), body empty, ``deadline_unix_ms`` ≠ 0 for DEADLINE and
    EXPIRE_AT, a known priority class for PRIORITY_UPDATE."""
    msg_type = packet.msg_type
    name = message_name(msg_type)
    meta = metadata(SchedulingMetadata, packet, name)
    _empty_body(packet, name)
    if msg_type != _T.PRIORITY_UPDATE and not meta.deadline_unix_ms:
        raise PacketError(f"{name} deadline_unix_ms must be non-zero")
    if msg_type == _T.PRIORITY_UPDATE and meta.priority_class not in PRIORITY_CLASSES:
        raise PacketError(f"PRIORITY_UPDATE unknown priority_class {meta.priority_class}")
    return meta


def supersede(packet: Packet) -> SupersedeMetadata:
    """SUPERSEDE: supersede metadata (``meta_len`` 32, flags ⊆ 0x1; nnrp-rs ``crates/nnrp-core/src/control.rs``
    ``SupersedeMetadata``, ``SUPERSEDE_FLAGS_KNOWN_MASK``), ``body_len == diagnostic_bytes``,
    ``drop_reason_code`` 0 or a known drop reason (value-registries "Drop Reason Codes")."""
    meta = metadata(SupersedeMetadata, packet, "SUPERSEDE")
    _body_is(packet, meta.diagnostic_bytes, "SUPERSEDE", "diagnostic_bytes")
    code = meta.drop_reason_code
    if code and code not in _DROP_REASON_CODES:
        raise PacketError(f"SUPERSEDE unknown drop_reason_code {code}")
    return meta


def budget_update(packet: Packet) -> BudgetMetadata:
    """BUDGET_UPDATE: budget metadata (``meta_len`` 40, flags ⊆ 0x3; nnrp-rs ``crates/nnrp-core/src/control.rs``
    ``BudgetMetadata``, ``BUDGET_FLAGS_KNOWN_MASK``), body empty."""
    meta = metadata(BudgetMetadata, packet, "BUDGET_UPDATE")
    _empty_body(packet, "BUDGET_UPDATE")
    return meta


def flow_update(packet: Packet) -> FlowUpdateMetadata:
    """FLOW_UPDATE on a session: ``meta_len`` 32, nnrp-py ``FlowUpdateMetadata`` parse plus reserved0/1 zero,
    body empty, scope session or operation (nnrp-rs ``crates/nnrp-core/src/flow.rs`` routing rule)."""
    meta = metadata(FlowUpdateMetadata, packet, "FLOW_UPDATE")
    raw = FlowUpdateMetadata.STRUCT.unpack(packet.meta)
    if raw[3] or raw[7]:
        raise PacketError("FLOW_UPDATE reserved fields must be zero")
    _empty_body(packet, "FLOW_UPDATE")
    if int(meta.scope_kind) == 0:
        raise PacketError("connection-scope FLOW_UPDATE on a session")
    return meta


def result_hint(packet: Packet) -> ResultHintMetadata:
    """RESULT_HINT: ``meta_len`` 16, known enum values (nnrp-rs ``crates/nnrp-core/src/control.rs``
    ``ResultHint``), body empty."""
    meta = metadata(ResultHintMetadata, packet, "RESULT_HINT")
    _empty_body(packet, "RESULT_HINT")
    return meta


def session_close(packet: Packet) -> SessionCloseMetadata:
    """SESSION_CLOSE: ``meta_len`` 24, reserved0 0, known close_reason and in_flight_policy, body empty (nnrp-rs
    ``crates/nnrp-core/src/session.rs`` ``SessionClose``)."""
    meta = metadata(SessionCloseMetadata, packet, "SESSION_CLOSE")
    _empty_body(packet, "SESSION_CLOSE")
    return meta


# -- what both receive -----------------------------------------------------------------------------------------


def trace_context(packet: Packet) -> TraceContextMetadata:
    """TRACE_CONTEXT: ``meta_len`` 32, flags ⊆ 0x3, ``trace_id`` and ``span_id`` non-zero, ``body_len ==
    body_bytes`` (nnrp-rs ``crates/nnrp-core/src/control.rs`` ``TraceContext``); the header ``trace_id`` 0 or the
    metadata's (nnrp-py 1.0.0rc4 build: "TRACE_CONTEXT header trace id does not match metadata")."""
    meta = metadata(TraceContextMetadata, packet, "TRACE_CONTEXT")
    if not meta.trace_id or not meta.span_id:
        raise PacketError("TRACE_CONTEXT trace_id and span_id must be non-zero")
    _body_is(packet, meta.body_bytes, "TRACE_CONTEXT", "body_bytes")
    if packet.trace_id and packet.trace_id != meta.trace_id:
        raise PacketError("TRACE_CONTEXT header trace id does not match metadata")
    return meta


def pressure(packet: Packet) -> PressureMetadata:
    """BACKPRESSURE / CREDIT_UPDATE: pressure metadata (``meta_len`` 32, flags ⊆ 0x3, reserved 0), body empty;
    BACKPRESSURE ``pressure_level`` 1..3 (nnrp-rs ``crates/nnrp-core/src/control.rs`` ``Pressure``)."""
    name = message_name(packet.msg_type)
    meta = metadata(PressureMetadata, packet, name)
    _empty_body(packet, name)
    if packet.msg_type == _T.BACKPRESSURE and not 1 <= meta.pressure_level <= 3:
        raise PacketError(f"BACKPRESSURE pressure_level {meta.pressure_level} (must be 1..3)")
    return meta


def recoverable_error(packet: Packet) -> RecoverableErrorMetadata:
    """ERROR_RECOVERABLE: ``meta_len`` 48, a non-reserved source_role, error_scope 0..2 (connection, session,
    frame), ``body_len == diagnostic_bytes`` (nnrp-rs ``crates/nnrp-core/src/control.rs`` ``RecoverableError``;
    nnrp-doc runtime-control ``control-frames.md`` "Recoverable Error Metadata")."""
    meta = metadata(RecoverableErrorMetadata, packet, "ERROR_RECOVERABLE")
    if not _role_ok(int(meta.source_role)):
        raise PacketError(f"ERROR_RECOVERABLE reserved source_role {int(meta.source_role):#x}")
    if meta.error_scope > 2:
        raise PacketError(f"ERROR_RECOVERABLE unknown error_scope {meta.error_scope}")
    _body_is(packet, meta.diagnostic_bytes, "ERROR_RECOVERABLE", "diagnostic_bytes")
    return meta


def retry_after(packet: Packet) -> RetryAfterMetadata:
    """RETRY_AFTER: ``meta_len`` 32, a non-reserved source_role, ``body_len == diagnostic_bytes`` (nnrp-rs
    ``crates/nnrp-core/src/control.rs`` ``RetryAfter``)."""
    meta = metadata(RetryAfterMetadata, packet, "RETRY_AFTER")
    if not _role_ok(int(meta.source_role)):
        raise PacketError(f"RETRY_AFTER reserved source_role {int(meta.source_role):#x}")
    _body_is(packet, meta.diagnostic_bytes, "RETRY_AFTER", "diagnostic_bytes")
    return meta


# -- what a client receives ------------------------------------------------------------------------------------


def partial_result(packet: Packet) -> tuple[int, int]:
    """PARTIAL_RESULT: ``meta_len`` 40, ``operation_id`` ≠ 0, flags ⊆ 0x3, an object id where flag 0x2 or an
    empty body needs one, ``body_len == body_bytes`` (nnrp-rs ``crates/nnrp-core/src/control.rs``
    ``PartialResult``). Returns ``(operation_id, result_sequence)``: the hot path unpacks no more."""
    if len(packet.meta) != _PARTIAL.size:
        raise PacketError(f"PARTIAL_RESULT meta_len {len(packet.meta)} (must be {_PARTIAL.size})")
    operation_id, sequence, object_id, _delta, body_bytes, flags = _PARTIAL.unpack(packet.meta)
    if not operation_id or flags & ~0x3 or (not object_id and (flags & 0x2 or not body_bytes)):
        raise PacketError("PARTIAL_RESULT operation id 0, unknown flags, or no object id where one is needed")
    _body_is(packet, body_bytes, "PARTIAL_RESULT", "body_bytes")
    return operation_id, sequence


def progress(packet: Packet) -> ProgressMetadata:
    """PROGRESS: ``meta_len`` 32, ``operation_id`` ≠ 0, ``body_len == body_bytes`` (nnrp-rs
    ``crates/nnrp-core/src/control.rs`` ``Progress``)."""
    meta = metadata(ProgressMetadata, packet, "PROGRESS")
    if not meta.operation_id:
        raise PacketError("PROGRESS operation id 0")
    _body_is(packet, meta.body_bytes, "PROGRESS", "body_bytes")
    return meta


def result_push(packet: Packet) -> ResultPushMetadata:
    """RESULT_PUSH: ``meta_len`` 64 and nnrp-py's ``ResultPushMetadata`` parse (nnrp-rs
    ``crates/nnrp-core/src/data.rs`` ``ResultPush``); the body is the result's."""
    return metadata(ResultPushMetadata, packet, "RESULT_PUSH")


def result_drop_reason(packet: Packet) -> ResultDropReasonMetadata:
    """RESULT_DROP_REASON: ``meta_len`` 32, ``drop_reason_code`` ≠ 0, a non-reserved source_role, ``body_len ==
    diagnostic_bytes`` (nnrp-rs ``crates/nnrp-core/src/control.rs`` ``ResultDropReason``)."""
    meta = metadata(ResultDropReasonMetadata, packet, "RESULT_DROP_REASON")
    if not meta.drop_reason_code:
        raise PacketError("RESULT_DROP_REASON drop_reason_code must be non-zero")
    if not _role_ok(int(meta.source_role)):
        raise PacketError(f"RESULT_DROP_REASON reserved source_role {int(meta.source_role):#x}")
    _body_is(packet, meta.diagnostic_bytes, "RESULT_DROP_REASON", "diagnostic_bytes")
    return meta


def session_close_ack(packet: Packet) -> SessionCloseAckMetadata:
    """SESSION_CLOSE_ACK: body empty, ``meta_len`` 16, reserved 0, a known close_status (nnrp-rs
    ``crates/nnrp-core/src/session.rs`` ``SessionCloseAck``; :class:`~.codecs.SessionCloseAckMetadata`)."""
    if packet.body:
        raise PacketError("SESSION_CLOSE_ACK has an empty body")
    meta: SessionCloseAckMetadata = metadata(SessionCloseAckMetadata, packet, "SESSION_CLOSE_ACK")
    return meta

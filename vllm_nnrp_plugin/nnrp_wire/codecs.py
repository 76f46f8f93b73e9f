"""The NNRP/1 metadata layouts nnrp-py has no codec for: SESSION_OPEN_ACK and SESSION_CLOSE_ACK.

Both sides of the wire core use them (the server packs and the client unpacks, and the other way round in
tests), so each layout has ``pack()`` and ``unpack()`` in the style of nnrp-py's own struct codecs
(``cls.STRUCT``, ``cls.unpack(meta)``, ``obj.pack()``; ``unpack`` takes exactly the fixed size and raises
:class:`ValueError` on a rule violation). Little-endian, no padding.

Sources: nnrp-rs ``crates/nnrp-core/src/session.rs`` (``SessionOpenAck``, ``SessionCloseAck``: layout and
parse rules), ``crates/nnrp-core/src/recovery.rs`` (``session_flags_ack`` mask and the resume-grant rule),
``crates/nnrp-core/src/enums.rs`` (priority class, session status, close status values),
``crates/nnrp-core/src/codes.rs`` (session error codes); nnrp-doc ``docs/en/design/v1-preview3.md`` §7.1A
(SESSION_OPEN / SESSION_OPEN_ACK) and §7.1C (SESSION_CLOSE / SESSION_CLOSE_ACK).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "PRIORITY_CLASSES",
    "CLOSE_STATUS_ACKNOWLEDGED",
    "CLOSE_STATUS_CLOSED",
    "CLOSE_STATUS_DRAINING",
    "CLOSE_STATUS_REJECTED",
    "SESSION_ERROR_AUTH_FAILED",
    "SESSION_ERROR_LEASE_POLICY_REJECTED",
    "SESSION_ERROR_NONE",
    "SESSION_ERROR_PRIORITY_REJECTED",
    "SESSION_ERROR_PROFILE_UNSUPPORTED",
    "SESSION_ERROR_RESUME_REJECTED",
    "SESSION_ERROR_SCHEMA_UNSUPPORTED",
    "SESSION_ERROR_SESSION_LIMIT_REACHED",
    "SESSION_FLAGS_ACK_MASK",
    "SESSION_FLAGS_ACK_RESUME_ENABLED",
    "SESSION_STATUS_OPENED",
    "SESSION_STATUS_REJECTED",
    "SESSION_STATUS_RESUMED",
    "SESSION_STATUS_RETRY_LATER",
    "SessionCloseAckMetadata",
    "SessionOpenAckMetadata",
]

# session_status u8 (nnrp-rs crates/nnrp-core/src/enums.rs SessionStatus)
SESSION_STATUS_OPENED = 0
SESSION_STATUS_REJECTED = 1
SESSION_STATUS_RETRY_LATER = 2
SESSION_STATUS_RESUMED = 3
_SESSION_STATUSES = frozenset((0, 1, 2, 3))

# priority_class u8: interactive, balanced, background (nnrp-rs crates/nnrp-core/src/enums.rs PriorityClass)
PRIORITY_CLASSES = frozenset((0, 1, 2))

# session_error_code u32 (nnrp-rs crates/nnrp-core/src/codes.rs; nnrp-doc design/v1-preview3.md §7.1B)
SESSION_ERROR_NONE = 0
SESSION_ERROR_AUTH_FAILED = 0x00010001
SESSION_ERROR_PROFILE_UNSUPPORTED = 0x00010002
SESSION_ERROR_SCHEMA_UNSUPPORTED = 0x00010003
SESSION_ERROR_PRIORITY_REJECTED = 0x00010004
SESSION_ERROR_LEASE_POLICY_REJECTED = 0x00010005
SESSION_ERROR_RESUME_REJECTED = 0x00010006
SESSION_ERROR_SESSION_LIMIT_REACHED = 0x00010007

# session_flags_ack u32: resume, background results, cache leases, schema override enabled, priority downgraded
# (nnrp-rs crates/nnrp-core/src/recovery.rs, crates/nnrp-core/src/session.rs)
SESSION_FLAGS_ACK_RESUME_ENABLED = 0x01
SESSION_FLAGS_ACK_MASK = 0x1F

# close_status u8 (nnrp-rs crates/nnrp-core/src/enums.rs SessionCloseStatus)
CLOSE_STATUS_ACKNOWLEDGED = 0
CLOSE_STATUS_DRAINING = 1
CLOSE_STATUS_CLOSED = 2
CLOSE_STATUS_REJECTED = 3
_CLOSE_STATUSES = frozenset((0, 1, 2, 3))


@dataclass(frozen=True, slots=True)
class SessionOpenAckMetadata:
    """SESSION_OPEN_ACK (0x08) metadata, 56 bytes, ``<IHBBIIHHIIIIQIII``. The body that follows is
    ``resume_token_bytes`` bytes of resume token then ``session_extension_bytes`` bytes (a rejection's UTF-8
    diagnostic in the native server's acks).

    ``unpack`` checks what nnrp-rs ``SessionOpenAck::parse`` / ``recovery.rs`` check: a known
    ``accepted_priority_class`` and ``session_status``, ``session_flags_ack`` ⊆ 0x1f, and a resume grant
    (flag 0x01) carrying a non-zero ``resume_window_ms`` and ``resume_token_bytes``. The body length rule
    (``body_len == resume_token_bytes + session_extension_bytes``, :meth:`body_length`) is the receiver's to
    apply to the packet."""

    STRUCT: ClassVar[struct.Struct] = struct.Struct("<IHBBIIHHIIIIQIII")

    session_id: int
    accepted_profile_id: int
    accepted_priority_class: int
    session_status: int
    schema_id: int
    schema_version: int
    granted_operation_credit: int
    max_in_flight_operations: int
    lease_ttl_ms: int
    resume_window_ms: int
    resume_token_bytes: int
    session_extension_bytes: int
    server_session_tag: int
    route_scope_id: int
    session_error_code: int
    session_flags_ack: int

    def pack(self) -> bytes:
        """The 56 bytes. Raises ``ValueError`` for a value the layout cannot carry or the parse rules refuse."""
        self._validate()
        try:
            return self.STRUCT.pack(
                self.session_id,
                self.accepted_profile_id,
                self.accepted_priority_class,
                self.session_status,
                self.schema_id,
                self.schema_version,
                self.granted_operation_credit,
                self.max_in_flight_operations,
                self.lease_ttl_ms,
                self.resume_window_ms,
                self.resume_token_bytes,
                self.session_extension_bytes,
                self.server_session_tag,
                self.route_scope_id,
                self.session_error_code,
                self.session_flags_ack,
            )
        except struct.error as exc:
            raise ValueError(f"SESSION_OPEN_ACK field out of range: {exc}") from None

    @classmethod
    def unpack(cls, payload: bytes) -> SessionOpenAckMetadata:
        if len(payload) != cls.STRUCT.size:
            raise ValueError(f"expected {cls.STRUCT.size} bytes, got {len(payload)}")
        metadata = cls(*cls.STRUCT.unpack(payload))
        metadata._validate()
        return metadata

    @property
    def body_length(self) -> int:
        """The body length this metadata declares (token + extension)."""
        return self.resume_token_bytes + self.session_extension_bytes

    def _validate(self) -> None:
        if self.accepted_priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"SESSION_OPEN_ACK unknown accepted_priority_class {self.accepted_priority_class}")
        if self.session_status not in _SESSION_STATUSES:
            raise ValueError(f"SESSION_OPEN_ACK unknown session_status {self.session_status}")
        if self.session_flags_ack & ~SESSION_FLAGS_ACK_MASK:
            raise ValueError(f"SESSION_OPEN_ACK session_flags_ack has unknown bits {self.session_flags_ack:#x}")
        if self.session_flags_ack & SESSION_FLAGS_ACK_RESUME_ENABLED and not (
            self.resume_window_ms and self.resume_token_bytes
        ):
            raise ValueError("SESSION_OPEN_ACK grants resume without resume_window_ms and resume_token_bytes")


@dataclass(frozen=True, slots=True)
class SessionCloseAckMetadata:
    """SESSION_CLOSE_ACK (0x0a) metadata, 16 bytes, ``<BBHQI``: ``close_status u8 @0``, ``reserved0 u8 @1``
    and ``reserved1 u16 @2`` (both must be 0), ``last_operation_id u64 @4``, ``session_error_code u32 @12``;
    body empty. ``unpack`` checks the reserved fields and a known ``close_status`` (nnrp-rs
    ``crates/nnrp-core/src/session.rs`` ``SessionCloseAck::parse``)."""

    STRUCT: ClassVar[struct.Struct] = struct.Struct("<BBHQI")

    close_status: int
    last_operation_id: int
    session_error_code: int = 0

    def pack(self) -> bytes:
        if self.close_status not in _CLOSE_STATUSES:
            raise ValueError(f"SESSION_CLOSE_ACK unknown close_status {self.close_status}")
        try:
            return self.STRUCT.pack(self.close_status, 0, 0, self.last_operation_id, self.session_error_code)
        except struct.error as exc:
            raise ValueError(f"SESSION_CLOSE_ACK field out of range: {exc}") from None

    @classmethod
    def unpack(cls, payload: bytes) -> SessionCloseAckMetadata:
        if len(payload) != cls.STRUCT.size:
            raise ValueError(f"expected {cls.STRUCT.size} bytes, got {len(payload)}")
        close_status, reserved0, reserved1, last_operation_id, session_error_code = cls.STRUCT.unpack(payload)
        if reserved0 or reserved1:
            raise ValueError("SESSION_CLOSE_ACK reserved fields must be zero")
        if close_status not in _CLOSE_STATUSES:
            raise ValueError(f"SESSION_CLOSE_ACK unknown close_status {close_status}")
        return cls(close_status, last_operation_id, session_error_code)

"""The frozen Preview4 wire mapping of the ``openai-compatible/1`` profile (its normative contract,
``openai-compatible-1.json``, section "wire mapping"), as pure functions over nnrp-py's frame types.

Request: one FRAME_SUBMIT, ``payload_kind_bitmap == STRUCTURED_EVENT (16)``, ``payload_frame_count == 1``,
body = 32-byte region prelude + one 24-byte typed-payload descriptor (STRUCTURED_EVENT, profile 0, schema 0,
version 0, SNAPSHOT, flags 0) + the UTF-8 JSON envelope. Non-terminal events: one PARTIAL_RESULT each,
body = the raw JSON event, sequences from 1. Terminal: one RESULT_PUSH whose body is the same typed mapping
around the terminal event, or a RESULT_DROP_REASON (PEER_CANCELLED / TRANSPORT_CLOSED, source SERVER).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnrp.core import (
    PayloadKind,
    ResultFlags,
    ResultPushMetadata,
    build_typed_payload_frame,
    pack_body,
    pack_typed_payload_frames,
    unpack_body,
    unpack_typed_payload_frames,
)
from nnrp.runtime import PartialResultMetadata, ResultDropReasonCode, ResultDropReasonMetadata, RuntimeRole
from nnrp.schema import StreamSemantics

from vllm_nnrp_plugin.profile import errors as E

if TYPE_CHECKING:  # the server's decisions; the client uses only the typed bodies and never imports them
    from vllm_nnrp_plugin.core.operation import DropReason, PartialResult, ResultDrop, ResultPush

STRUCTURED_EVENT = int(PayloadKind.STRUCTURED_EVENT)


def typed_body(payload: bytes) -> bytes:
    """Wrap ``payload`` (JSON bytes) in the one-frame STRUCTURED_EVENT typed body (submit and RESULT_PUSH)."""
    frame = build_typed_payload_frame(
        PayloadKind.STRUCTURED_EVENT,
        payload,
        profile_id=0,
        schema_id=0,
        schema_version=0,
        stream_semantics=StreamSemantics.SNAPSHOT,
    )
    descriptors, frames = pack_typed_payload_frames((frame,))
    return pack_body(typed_payload_descriptor_region=descriptors, typed_payload_frame_region=frames)


def unwrap_typed_body(payload_kind_bitmap: int, payload_frame_count: int, body: bytes) -> bytes:
    """The JSON payload inside a typed body (the reverse of :func:`typed_body`), after checking every rule of
    the mapping.

    ``payload_kind_bitmap`` / ``payload_frame_count`` come from the frame's metadata (FrameSubmitMetadata or
    ResultPushMetadata). Raises :class:`ProfileError` ``invalid_frame`` naming the broken rule.
    """
    if payload_kind_bitmap != STRUCTURED_EVENT:
        raise _invalid(f"payload_kind_bitmap must be STRUCTURED_EVENT (16), got {payload_kind_bitmap}")
    if payload_frame_count != 1:
        raise _invalid(f"exactly one typed payload frame is required, got {payload_frame_count}")
    try:
        view = unpack_body(body)
        frames = unpack_typed_payload_frames(
            view.typed_payload_descriptor_region,
            view.typed_payload_frame_region,
            payload_kind_bitmap=payload_kind_bitmap,
        )
    except (ValueError, TypeError) as exc:
        raise _invalid(f"typed payload body does not decode: {exc}") from None
    if len(frames) != 1:
        raise _invalid(f"exactly one typed payload frame is required, got {len(frames)}")
    (frame,) = frames
    if int(frame.payload_kind) != STRUCTURED_EVENT:
        raise _invalid(f"payload kind must be STRUCTURED_EVENT (16), got {int(frame.payload_kind)}")
    ids = (frame.profile_id, frame.schema_id, frame.schema_version)
    if ids != (0, 0, 0):
        raise _invalid(f"profile/schema/version must be 0/0/0, got {ids[0]}/{ids[1]}/{ids[2]}")
    if int(frame.stream_semantics) != int(StreamSemantics.SNAPSHOT):
        raise _invalid(f"stream semantics must be SNAPSHOT (1), got {int(frame.stream_semantics)}")
    if int(frame.descriptor_flags) != 0:
        raise _invalid(f"descriptor flags must be 0, got {int(frame.descriptor_flags)}")
    return bytes(frame.payload)


_PARTIAL_RESULT_METADATA = PartialResultMetadata.STRUCT


def partial_result(operation_id: int, action: PartialResult) -> bytes:
    """The PARTIAL_RESULT payload for one non-terminal event: nnrp-py's packed
    ``PartialResultMetadata(op, seq, 0, seq, len(body), 0)`` followed by the body (the raw JSON event)."""
    body = action.body
    return _PARTIAL_RESULT_METADATA.pack(operation_id, action.sequence, 0, action.sequence, len(body), 0) + body


def result_push(action: ResultPush, server_total_ms: int = 0) -> tuple[ResultPushMetadata, bytes]:
    """RESULT_PUSH metadata + typed body for a terminal event; ``server_total_ms`` in ms, clamped to the
    field's u16 (65535 ms: an operation longer than that must not make the RESULT_PUSH unpackable)."""
    metadata = ResultPushMetadata(
        status_code=action.status,
        result_flags=ResultFlags(0),
        section_count=0,
        tile_count=0,
        active_profile_id=0,
        reserved0=0,
        inference_ms=0,
        queue_ms=0,
        server_total_ms=min(server_total_ms, 0xFFFF),
        reserved1=0,
        tile_base_id=0,
        tile_index_bytes=0,
        payload_kind_bitmap=PayloadKind.STRUCTURED_EVENT,
        payload_frame_count=1,
    )
    return metadata, typed_body(action.event)


def drop_code(reason: DropReason) -> int:
    """The NNRP ``ResultDropReasonCode`` of ``reason`` (the member of the same name)."""
    return int(ResultDropReasonCode[reason.name])


def result_drop(operation_id: int, action: ResultDrop) -> tuple[ResultDropReasonMetadata, bytes]:
    """RESULT_DROP_REASON metadata + diagnostic bytes (the ``response.cancelled`` JSON), source SERVER."""
    diagnostic = action.diagnostic
    metadata = ResultDropReasonMetadata(
        operation_id, action.sequence, drop_code(action.reason), RuntimeRole.SERVER, 0, len(diagnostic)
    )
    return metadata, diagnostic


def _invalid(message: str) -> E.ProfileError:
    return E.ProfileError(E.INVALID_FRAME, message)

import pytest
from nnrp.core import MessageType, PayloadKind, build_typed_payload_frame, pack_body, pack_typed_payload_frames
from nnrp.runtime import PartialResultMetadata, decode_runtime_control_metadata
from nnrp.schema import StreamSemantics

from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.core.operation import DropReason, PartialResult, ResultDrop, ResultPush
from vllm_nnrp_plugin.profile.errors import ProfileError


def body_of(*frames):
    descriptors, payloads = pack_typed_payload_frames(frames)
    return pack_body(typed_payload_descriptor_region=descriptors, typed_payload_frame_region=payloads)


def frame(kind=PayloadKind.STRUCTURED_EVENT, payload=b"{}", **kw):
    kw.setdefault("stream_semantics", StreamSemantics.SNAPSHOT)
    return build_typed_payload_frame(kind, payload, **kw)


def test_typed_body_round_trips():
    assert wire_mapping.unwrap_typed_body(16, 1, wire_mapping.typed_body(b'{"a":1}')) == b'{"a":1}'


@pytest.mark.parametrize(
    "bitmap, count, body, fragment",
    [
        (1, 1, body_of(frame()), "payload_kind_bitmap"),
        (16, 2, body_of(frame(), frame()), "exactly one"),
        (16, 1, body_of(frame(profile_id=2)), "profile/schema/version"),
        (16, 1, body_of(frame(schema_version=3)), "profile/schema/version"),
        (16, 1, body_of(frame(stream_semantics=StreamSemantics.UNSPECIFIED)), "SNAPSHOT"),
        (16, 1, b"\x01\x02garbage", "does not decode"),
        (16, 1, b"", "does not decode"),
    ],
)
def test_submit_bodies_outside_the_mapping_are_invalid_frames(bitmap, count, body, fragment):
    with pytest.raises(ProfileError) as info:
        wire_mapping.unwrap_typed_body(bitmap, count, body)
    assert info.value.code == "invalid_frame"
    assert fragment in info.value.message


def test_partial_result_metadata_follows_the_frozen_mapping():
    payload = wire_mapping.partial_result(42, PartialResult({"type": "x"}, 3, b'{"type":"x"}'))
    decoded = decode_runtime_control_metadata(MessageType.PARTIAL_RESULT, payload)  # nnrp-py's own decoder
    assert decoded.metadata == PartialResultMetadata(42, 3, 0, 3, len(b'{"type":"x"}'), 0)
    assert decoded.tail == b'{"type":"x"}'


def test_result_push_metadata_matches_its_typed_body():
    metadata, body = wire_mapping.result_push(ResultPush(404, b'{"type":"response.error"}'), server_total_ms=12)
    assert metadata.status_code == 404 and metadata.server_total_ms == 12
    assert int(metadata.payload_kind_bitmap) == 16 and metadata.payload_frame_count == 1
    assert wire_mapping.unwrap_typed_body(16, 1, body) == b'{"type":"response.error"}'


def test_result_drop_carries_the_cancelled_event():
    metadata, diagnostic = wire_mapping.result_drop(
        7, ResultDrop(DropReason.PEER_CANCELLED, 4, b'{"type":"response.cancelled"}')
    )
    assert int(metadata.drop_reason_code) == 3  # PEER_CANCELLED
    assert int(metadata.source_role) == 2  # SERVER
    assert metadata.diagnostic_bytes == len(diagnostic) and metadata.result_sequence == 4


@pytest.mark.parametrize("reason, code", [(DropReason.PEER_CANCELLED, 3), (DropReason.TRANSPORT_CLOSED, 8)])
def test_every_drop_reason_has_the_nnrp_code_of_its_name(reason, code):
    assert wire_mapping.drop_code(reason) == code
    assert int(wire_mapping.result_drop(1, ResultDrop(reason, 1, b"{}"))[0].drop_reason_code) == code


def test_an_operation_longer_than_the_u16_millisecond_field_still_packs():
    """Found by the soak: operations queued > 65.5 s behind others made RESULT_PUSH.pack raise."""
    metadata, _body = wire_mapping.result_push(
        ResultPush(200, b'{"type":"response.completed"}'), server_total_ms=70_000
    )
    assert metadata.server_total_ms == 0xFFFF
    metadata.pack()

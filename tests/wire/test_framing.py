"""Framing: golden header bytes, reassembly across any read boundaries, each header error, the size bound."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnrp.core.enums import MessageType as T
from nnrp.core.header import HEADER_STRUCT

from vllm_nnrp_plugin.nnrp_wire.framing import MAX_PACKET_BYTES, FramingError, PacketReader, encode

from .wirekit import CAPTURE_NAMES, VECTORS, connections, raw, split, stream

# the golden header of the conformance recipe "preview4.header.all_caller_controlled_fields" (FRAME_SUBMIT,
# flags 0x21, meta_len 0x00010203, body_len 0x00040506, session 0x11223344, frame 0x55667788, view 0x99aa, route
# 0xbbcc, trace 0x0102030405060708) as nnrp-conformance crates/nnrp-conformance-fixtures renders it
GOLDEN = "4e4e5250010010282100000003020100060504004433221188776655aa99ccbb0807060504030201"


def test_golden_header_of_the_semantic_recipe() -> None:
    recipes = json.loads((VECTORS / "vectors" / "semantic-vectors.json").read_text())["vectors"]
    (recipe,) = [v for v in recipes if v["name"] == "preview4.header.all_caller_controlled_fields"]
    flags = {"ack_required": 0x01, "keyframe": 0x20}
    packed = HEADER_STRUCT.pack(
        b"NNRP",
        recipe["version_major"],
        recipe["wire_format"],
        T.FRAME_SUBMIT,
        40,
        sum(flags[f] for f in recipe["flags"]),
        recipe["meta_len"],
        recipe["body_len"],
        recipe["session_id"],
        recipe["frame_id"],
        recipe["view_id"],
        recipe["route_id"],
        recipe["trace_id"],
    )
    assert packed.hex() == GOLDEN
    # encode() writes the same header for a packet of those lengths
    meta, body = bytes(recipe["meta_len"]), bytes(recipe["body_len"])
    packet_bytes = encode(
        T.FRAME_SUBMIT,
        recipe["session_id"],
        recipe["frame_id"],
        meta,
        body,
        trace_id=recipe["trace_id"],
        flags=0x21,
        view_id=recipe["view_id"],
        route_id=recipe["route_id"],
    )
    assert packet_bytes[:40].hex() == GOLDEN
    # the reader accepts the header, waits for its 66051 + 263430 bytes, then returns the fields
    reader = PacketReader()
    assert reader.feed(packet_bytes[:40]) == []
    assert reader.buffered == 40
    (packet,) = reader.feed(packet_bytes[40:])
    assert (
        packet.msg_type,
        packet.flags,
        packet.session_id,
        packet.frame_id,
        packet.view_id,
        packet.route_id,
        packet.trace_id,
    ) == (0x10, 0x21, 0x11223344, 0x55667788, 0x99AA, 0xBBCC, 0x0102030405060708)
    assert len(packet.meta) == 0x00010203 and len(packet.body) == 0x00040506


def test_golden_header_of_the_case_manifest_round_trips() -> None:
    case = json.loads((VECTORS / "cases" / "common-header-core.json").read_text())["cases"][0]
    golden = bytes.fromhex(case["parameters"]["header_hex"])
    fields = HEADER_STRUCT.unpack(golden)
    magic, major, wire_format, msg_type, header_len, flags, meta_len, body_len, sid, frame, view, route, trace = fields
    reader = PacketReader()
    (packet,) = reader.feed(golden + bytes(meta_len + body_len))
    assert (
        packet.msg_type,
        packet.flags,
        packet.session_id,
        packet.frame_id,
        packet.view_id,
        packet.route_id,
        packet.trace_id,
    ) == (msg_type, flags, sid, frame, view, route, trace)
    assert raw(packet)[:40] == golden


def test_baseline_golden_packets_parse() -> None:
    cases = json.loads((VECTORS / "cases" / "nnrp1-baseline-core.json").read_text())["cases"]
    hexes = [c["parameters"]["packet_hex"] for c in cases if "packet_hex" in c.get("parameters", {})]
    assert hexes
    for golden in hexes:
        (packet,) = split(bytes.fromhex(golden))
        assert raw(packet).hex() == golden


def _streams() -> list[bytes]:
    return [
        stream(name, direction, conn)
        for name in CAPTURE_NAMES
        for conn in connections(name)
        for direction in ("c2s", "s2c")
    ]


STREAMS = _streams()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(STREAMS) - 1), cuts=st.lists(st.integers(0, 4000), max_size=40))
def test_any_read_boundaries_give_the_same_packets(index: int, cuts: list[int]) -> None:
    data = STREAMS[index]
    whole = [raw(p) for p in split(data)]
    points = sorted({c % (len(data) + 1) for c in cuts})
    reader = PacketReader()
    got = []
    previous = 0
    for point in points + [len(data)]:
        got += [raw(p) for p in reader.feed(data[previous:point])]
        previous = point
    assert got == whole
    assert reader.buffered == 0


def test_one_byte_reads() -> None:
    data = stream("tcp-control", "c2s")
    reader = PacketReader()
    got = [raw(p) for i in range(len(data)) for p in reader.feed(data[i : i + 1])]
    assert got == [raw(p) for p in split(data)]


def _header(**changes) -> bytes:
    fields = dict(magic=b"NNRP", major=1, wire=0, msg=int(T.PING), hlen=40, flags=0, meta=0, body=0)
    fields.update(changes)
    return HEADER_STRUCT.pack(
        fields["magic"],
        fields["major"],
        fields["wire"],
        fields["msg"],
        fields["hlen"],
        fields["flags"],
        fields["meta"],
        fields["body"],
        1,
        0,
        0,
        0,
        0,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"magic": b"NNRQ"}, "magic"),
        ({"major": 2}, "version_major"),
        ({"wire": 1}, "wire_format"),
        ({"hlen": 41}, "header_len"),
        ({"flags": 0x40}, "flag"),
        ({"msg": 0x50}, "msg_type"),
        ({"msg": 0x00}, "msg_type"),
        ({"meta": MAX_PACKET_BYTES}, "exceeds"),
    ],
)
def test_each_header_error_fails_the_reader_for_good(changes: dict, message: str) -> None:
    reader = PacketReader()
    good = _header()
    with pytest.raises(FramingError, match=message):
        reader.feed(good + _header(**changes))
    with pytest.raises(FramingError):
        reader.feed(good)
    assert reader.buffered == 0


def test_the_size_bound_is_checked_on_the_header_alone() -> None:
    reader = PacketReader(max_packet_bytes=1000)
    reader.feed(_header(body=960))  # exactly at the bound: waits for the body
    assert reader.buffered == 40
    reader = PacketReader(max_packet_bytes=1000)
    with pytest.raises(FramingError, match="exceeds"):
        reader.feed(_header(body=961))  # nothing but the 40 header bytes was ever given
    assert reader.buffered == 0


def test_partial_header_waits() -> None:
    reader = PacketReader()
    data = _header()
    assert reader.feed(data[:39]) == []
    assert reader.buffered == 39
    (packet,) = reader.feed(data[39:])
    assert packet.msg_type == T.PING and packet.session_id == 1

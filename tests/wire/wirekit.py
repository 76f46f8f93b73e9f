"""Shared helpers of the wire-core tests: the recorded native exchanges (``data/captures``), a packet splitter,
and a replay driver that plays the client side of a capture into a :class:`ServerConnection` while making the
same application calls the native server's application made.

Capture format (``data/README.md``): JSON lines ``{"t", "conn", "dir": "c2s"|"s2c", "hex"}`` (chunks as
``recv()`` returned them), ``{"dir", "eof": true}`` and ``{"dir": "note", "text"}``; no ``conn`` means 0.
"""

from __future__ import annotations

import json
import pathlib
import struct
from dataclasses import dataclass, field

from nnrp.core.enums import MessageType as T
from nnrp.runtime.types import PartialResultMetadata, PressureMetadata, ProgressMetadata, ResultDropReasonMetadata

from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.framing import Packet, PacketReader, encode
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

DATA = pathlib.Path(__file__).parent / "data"
CAPTURES = DATA / "captures"
VECTORS = DATA / "vectors" / "protocol" / "nnrp-1-preview4"
CAPTURE_NAMES = ("tcp-basic", "ipc-basic", "tcp-multiplex", "tcp-control", "tcp-session")

SERVER_EVENTS = (
    ev.SessionOpenRequested,
    ev.SessionClosed,
    ev.SessionDraining,
    ev.OperationSubmitted,
    ev.OperationCancelled,
    ev.DeadlineReceived,
    ev.PriorityUpdated,
    ev.OperationSuperseded,
    ev.BudgetUpdated,
    ev.TraceContextReceived,
    ev.PacketRejected,
    ev.ConnectionEnded,
)


def records(name: str) -> list[dict]:
    with open(CAPTURES / f"{name}.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def stream(name: str, direction: str, conn: int = 0) -> bytes:
    """All bytes one direction of one connection carried, in order."""
    return b"".join(
        bytes.fromhex(r["hex"])
        for r in records(name)
        if r.get("dir") == direction and r.get("conn", 0) == conn and "hex" in r
    )


def connections(name: str) -> list[int]:
    return sorted({r.get("conn", 0) for r in records(name) if r.get("dir") in ("c2s", "s2c")})


def split(data: bytes) -> list[Packet]:
    """Whole packets of ``data`` (which must hold whole packets only)."""
    reader = PacketReader()
    packets = reader.feed(data)
    assert reader.buffered == 0, "trailing partial packet"
    return packets


def raw(packet: Packet) -> bytes:
    return encode(
        packet.msg_type,
        packet.session_id,
        packet.frame_id,
        packet.meta,
        packet.body,
        trace_id=packet.trace_id,
        flags=packet.flags,
        view_id=packet.view_id,
        route_id=packet.route_id,
    )


#: s2c packets the native server's application asked for, with no counterpart in the core's API
NO_API = frozenset((int(T.TRACE_CONTEXT), int(T.ERROR_RECOVERABLE), int(T.RETRY_AFTER)))


@dataclass
class Replay:
    """The outcome of replaying one connection of a capture."""

    events: list = field(default_factory=list)
    produced: bytes = b""
    expected: list[Packet] = field(default_factory=list)  # the capture's s2c packets, in order
    server: ServerConnection | None = None


def replay(name: str, conn: int = 0, *, stop_after_c2s: int | None = None, max_in_flight: int = 4) -> Replay:
    """Feed the c2s chunks of ``conn`` as recorded (same chunk boundaries) into a fresh ServerConnection;
    accept every SessionOpenRequested at once; whenever the capture shows the native server sending an
    application-driven packet (PARTIAL_RESULT, PROGRESS, RESULT_PUSH, RESULT_DROP_REASON, BACKPRESSURE,
    CREDIT_UPDATE), make the matching ``send_*`` call with the capture's values. ``stop_after_c2s``: stop after
    that many c2s packets were fed (no EOF then)."""
    server = ServerConnection(max_in_flight_per_session=max_in_flight)
    result = Replay(server=server)
    s2c_reader = PacketReader()
    c2s_reader = PacketReader()  # only to count c2s packets for stop_after_c2s
    fed_packets = 0
    out = bytearray()

    def handle(new_events: list) -> None:
        for event in new_events:
            result.events.append(event)
            if isinstance(event, ev.SessionOpenRequested):
                server.accept_session(event.request)

    for record in records(name):
        if record.get("conn", 0) != conn or record.get("dir") not in ("c2s", "s2c"):
            continue
        if record["dir"] == "c2s":
            if record.get("eof"):
                handle(server.receive_data(b""))
                continue
            chunk = bytes.fromhex(record["hex"])
            if stop_after_c2s is not None:
                # feed packet by packet so the stop point is exact
                for packet in c2s_reader.feed(chunk):
                    if fed_packets >= stop_after_c2s:
                        break
                    handle(server.receive_data(raw(packet)))
                    fed_packets += 1
                if fed_packets >= stop_after_c2s:
                    out += server.data_to_send()
                    break
            else:
                handle(server.receive_data(chunk))
            out += server.data_to_send()
        else:
            if record.get("eof"):
                continue
            for packet in s2c_reader.feed(bytes.fromhex(record["hex"])):
                result.expected.append(packet)
                _mirror(server, packet)
                out += server.data_to_send()
    out += server.data_to_send()
    result.produced = bytes(out)
    return result


def _mirror(server: ServerConnection, packet: Packet) -> None:
    kind = packet.msg_type
    sid, frame = packet.session_id, packet.frame_id
    if kind == T.PARTIAL_RESULT:
        meta = PartialResultMetadata.unpack(packet.meta)
        assert meta.result_sequence == meta.delta_sequence and meta.object_id == 0 and meta.flags == 0
        assert server.send_partial_result(sid, frame, meta.operation_id, meta.result_sequence, packet.body)
    elif kind == T.PROGRESS:
        meta = ProgressMetadata.unpack(packet.meta)
        assert server.send_progress(
            sid, frame, meta.operation_id, meta.progress_sequence, meta.stage_code, meta.percent_x100
        )
    elif kind == T.RESULT_PUSH:
        assert server.send_result_push(sid, frame, packet.meta, packet.body)
    elif kind == T.RESULT_DROP_REASON:
        meta = ResultDropReasonMetadata.unpack(packet.meta)
        assert int(meta.source_role) == 2 and meta.flags == 0
        assert server.send_result_drop_reason(
            sid, frame, meta.operation_id, meta.result_sequence, int(meta.drop_reason_code), packet.body
        )
    elif kind in (T.BACKPRESSURE, T.CREDIT_UPDATE):
        meta = PressureMetadata.unpack(packet.meta)
        assert meta.scope_id == 0 and meta.flags == 0
        if kind == T.BACKPRESSURE:
            assert server.send_backpressure(
                sid, meta.credit_window, meta.pressure_level, meta.pressure_reason, meta.retry_after_ms
            )
        else:
            assert meta.pressure_level == meta.pressure_reason == meta.retry_after_ms == 0
            assert server.send_credit_update(sid, meta.credit_window)


# -- client packet builders (the native client's values, from tcp-basic) -------------------------------------

from nnrp.core.messages.control import ClientHelloMetadata  # noqa: E402
from nnrp.runtime.types import (  # noqa: E402
    BudgetMetadata,
    ControlRequestMetadata,
    SchedulingMetadata,
    SessionCloseMetadata,
    SupersedeMetadata,
    TraceContextMetadata,
)

HELLO_FIELDS = dict(
    min_version_major=1,
    max_version_major=1,
    supported_wire_format_bitmap=1,
    supported_profile_bitmap=3,
    supported_payload_kind_bitmap=0x73,
    supported_codec_bitmap=0,
    supported_compression_bitmap=0,
    supported_dtype_bitmap=0,
    supported_layout_bitmap=0,
    cache_digest_bitmap=0,
    cache_object_bitmap=0,
    cache_namespace_count=0,
    max_lane_count=1,
    max_cache_entries=0,
    max_cache_bytes=0,
    target_cadence_x100=0,
    latency_budget_ms=500,
    quality_tier=0,
    degrade_policy=0,
    requested_session_id=0,
    auth_bytes=0,
    control_extension_bytes=0,
)


def hello(**changes) -> bytes:
    return encode(T.CLIENT_HELLO, 0, 0, ClientHelloMetadata(**{**HELLO_FIELDS, **changes}).pack())


def open_meta(requested: int = 0, **changes) -> bytes:
    fields = dict(
        requested_session_id=requested,
        profile_id=2,
        priority_class=1,
        session_flags=0,
        schema_id=4097,
        schema_version=3,
        default_deadline_ms=500,
        max_in_flight_operations=4,
        lease_ttl_hint_ms=30000,
        resume_token_bytes=0,
        auth_bytes=0,
        session_extension_bytes=0,
        client_session_tag=requested,
    )
    fields.update(changes)
    return struct.pack(
        "<IHBBIIIHHIIIIQ",
        fields["requested_session_id"],
        fields["profile_id"],
        fields["priority_class"],
        fields["session_flags"],
        fields["schema_id"],
        fields["schema_version"],
        fields["default_deadline_ms"],
        fields["max_in_flight_operations"],
        fields.get("reserved0", 0),
        fields["lease_ttl_hint_ms"],
        fields["resume_token_bytes"],
        fields["auth_bytes"],
        fields["session_extension_bytes"],
        fields["client_session_tag"],
    )


def session_open(requested: int = 0, body: bytes = b"", **changes) -> bytes:
    return encode(T.SESSION_OPEN, 0, 0, open_meta(requested, **changes), body)


def submit_meta(operation_id: int, **changes) -> bytes:
    fields = dict(
        src_width=0,
        src_height=0,
        tile_width=0,
        tile_height=0,
        tile_count=0,
        section_count=0,
        frame_class=0,
        input_profile=0,
        tile_index_mode=1,
        reserved0=0,
        latency_budget_ms=0,
        target_fps_x100=0,
        retry_of_frame=0,
        tile_base_id=0,
        camera_bytes=0,
        tile_index_bytes=0,
        operation_id=operation_id,
        payload_kind_bitmap=0x10,
        payload_frame_count=1,
    )
    fields.update(changes)
    return struct.pack(
        "<HHHHHHBBBBHHIIIIIQIBBBBIIIHH",
        fields["src_width"],
        fields["src_height"],
        fields["tile_width"],
        fields["tile_height"],
        fields["tile_count"],
        fields["section_count"],
        fields["frame_class"],
        fields["input_profile"],
        fields["tile_index_mode"],
        fields["reserved0"],
        fields["latency_budget_ms"],
        fields["target_fps_x100"],
        fields["retry_of_frame"],
        fields["tile_base_id"],
        fields["camera_bytes"],
        fields["tile_index_bytes"],
        fields.get("reserved1", 0),
        fields["operation_id"],
        fields.get("reserved2", 0),
        fields.get("submit_mode", 0),
        fields.get("budget_policy", 0),
        fields.get("loss_tolerance_policy", 0xFF),
        fields.get("reserved3", 0),
        0,
        0,
        fields["payload_kind_bitmap"],
        fields["payload_frame_count"],
        fields.get("reserved4", 0),
    )


def submit(
    session_id: int, frame_id: int, operation_id: int, body: bytes = b"{}", trace_id: int = 0, **changes
) -> bytes:
    return encode(T.FRAME_SUBMIT, session_id, frame_id, submit_meta(operation_id, **changes), body, trace_id=trace_id)


def frame_cancel(session_id: int, frame_id: int) -> bytes:
    return encode(T.FRAME_CANCEL, session_id, frame_id)


def control(
    kind: int,
    session_id: int,
    frame_id: int,
    operation_id: int,
    diagnostic: bytes = b"",
    *,
    flags: int = 0,
    role: int = 1,
    sequence: int = 1,
) -> bytes:
    packed = ControlRequestMetadata.STRUCT.pack(operation_id, sequence, 0, role, flags, len(diagnostic), 0)
    return encode(kind, session_id, frame_id, packed, diagnostic)


def scheduling(
    kind: int,
    session_id: int,
    frame_id: int,
    operation_id: int,
    deadline: int = 1_796_147_824_844,
    priority_class: int = 0,
    delta: int = 0,
    flags: int = 0,
) -> bytes:
    meta = SchedulingMetadata.STRUCT.pack(operation_id, 1, priority_class, delta, deadline, flags)
    return encode(kind, session_id, frame_id, meta)


def supersede(
    session_id: int,
    frame_id: int,
    old_operation_id: int,
    new_operation_id: int = 0,
    diagnostic: bytes = b"",
    *,
    code: int = 2,
    flags: int = 0,
) -> bytes:
    """SUPERSEDE of ``old_operation_id`` (header frame = its frame), ``code`` the drop_reason_code."""
    meta = SupersedeMetadata.STRUCT.pack(old_operation_id, new_operation_id, 1, code, flags, len(diagnostic))
    return encode(T.SUPERSEDE, session_id, frame_id, meta, diagnostic)


def budget_update(
    session_id: int,
    frame_id: int,
    operation_id: int,
    tokens: int,
    *,
    compute: int = 0,
    memory: int = 0,
    bandwidth: int = 0,
    flags: int = 0,
) -> bytes:
    meta = BudgetMetadata.STRUCT.pack(operation_id, compute, memory, bandwidth, tokens, flags)
    return encode(T.BUDGET_UPDATE, session_id, frame_id, meta)


def trace_context(
    session_id: int,
    frame_id: int,
    trace: int = 91,
    span: int = 92,
    *,
    header_trace: int | None = None,
    body: bytes = b"",
    flags: int = 0,
) -> bytes:
    meta = TraceContextMetadata.STRUCT.pack(trace, span, 90, 5, flags, len(body))
    return encode(
        T.TRACE_CONTEXT, session_id, frame_id, meta, body, trace_id=trace if header_trace is None else header_trace
    )


def session_close(session_id: int, last_operation_id: int = 0, policy: int = 0, drain_timeout_ms: int = 0) -> bytes:
    """SESSION_CLOSE as the native client sends it (client_shutdown, ``policy`` 0 drain; 1 abort)."""
    meta = SessionCloseMetadata(1, policy, drain_timeout_ms, last_operation_id, 0, session_id).pack()
    return encode(T.SESSION_CLOSE, session_id, 0, meta)


def opened(max_in_flight: int = 4, requested: int = 7, **kwargs) -> tuple[ServerConnection, int]:
    """A connection past the handshake with one accepted session; the output so far is drained."""
    server = ServerConnection(max_in_flight_per_session=max_in_flight, **kwargs)
    events = server.receive_data(hello() + session_open(requested))
    (request,) = [e for e in events if isinstance(e, ev.SessionOpenRequested)]
    session_id = server.accept_session(request.request)
    server.data_to_send()
    return server, session_id


def sent(server: ServerConnection) -> list[Packet]:
    return split(server.data_to_send())

"""The sans-IO client core (``vllm_nnrp_plugin.nnrp_wire.client``): what it sends is byte for byte what
nnrp-py's native client sent for the same calls (the c2s packets of ``data/captures/*.jsonl``, recorded between the
native client and server), it reads the native server's packets (their s2c side), and it checks incoming
packets as the native client does (connection-fatal vs. dropped packet)."""

from __future__ import annotations

import pathlib
import struct

import orjson
import pytest
from nnrp.core import MessageType as T
from nnrp.runtime import PartialResultMetadata, PressureMetadata, ResultDropReasonMetadata, TraceContextMetadata

from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.nnrp_wire.errors import LocalProtocolError
from vllm_nnrp_plugin.nnrp_wire.framing import HEADER_LENGTH, encode

DATA = pathlib.Path(__file__).parent / "data" / "captures"


def capture(name: str, conn: int = 0) -> dict[str, list[bytes]]:
    """The packets (raw bytes) of one connection of a capture, per direction, in order."""
    streams = {"c2s": bytearray(), "s2c": bytearray()}
    for line in (DATA / name).read_text().splitlines():
        record = orjson.loads(line)
        if "hex" in record and record.get("conn", 0) == conn:
            streams[record["dir"]] += bytes.fromhex(record["hex"])
    out = {}
    for direction, data in streams.items():
        packets, offset = [], 0
        while offset < len(data):
            meta_len, body_len = struct.unpack_from("<II", data, offset + 12)
            end = offset + HEADER_LENGTH + meta_len + body_len
            packets.append(bytes(data[offset:end]))
            offset = end
        out[direction] = packets
    return out


class Peer:
    """A client core checked against a capture: ``sends(n)`` compares what the core queued with the next
    ``n`` c2s packets; ``feed(n)`` gives it the next ``n`` s2c packets and returns the events."""

    def __init__(self, name: str, conn: int = 0) -> None:
        self.packets = capture(name, conn)
        self.core = ClientConnection()
        self._c2s = self._s2c = 0

    def sends(self, n: int = 1) -> None:
        expected = b"".join(self.packets["c2s"][self._c2s : self._c2s + n])
        assert self.core.data_to_send().hex() == expected.hex()
        self._c2s += n

    def skip_c2s(self, n: int = 1) -> None:
        self._c2s += n

    def feed(self, n: int = 1) -> list[object]:
        data = b"".join(self.packets["s2c"][self._s2c : self._s2c + n])
        self._s2c += n
        return self.core.receive_data(data)


def test_basic_scenario_bytes_and_events():
    """tcp-basic: session-scope TRACE_CONTEXT, op 101 (two partials + push), op 202 FRAME_CANCEL -> drop,
    op 303 DEADLINE + CANCEL -> drop, close."""
    peer = Peer("tcp-basic.jsonl")
    core = peer.core
    token = core.open_session(requested_session_id=7, max_in_flight_operations=4)
    peer.sends(2)  # CLIENT_HELLO + SESSION_OPEN
    assert peer.feed(2) == [ev.SessionOpenAccepted(token, 7, 4, 2)]
    core.trace_context(7, 0, 91, 92, 90, stage_code=5, flags=3)
    peer.sends()
    assert core.submit(7, wire_mapping.typed_body(b'{"hello":1}'), operation_id=101, trace_id=0x1122334455667788) == (
        1,
        101,
    )
    peer.sends()
    partials = peer.feed(1) + peer.feed(1)
    assert [(e.operation_id, e.result_sequence, e.body) for e in partials] == [
        (101, 1, b'{"d":"He"}'),
        (101, 2, b'{"d":"llo"}'),
    ]
    (push,) = peer.feed()
    assert isinstance(push, ev.ResultPushed) and (push.frame_id, push.operation_id) == (1, 101)
    assert (
        wire_mapping.unwrap_typed_body(
            int(push.metadata.payload_kind_bitmap), push.metadata.payload_frame_count, push.body
        )
        == b'{"type":"response.completed"}'
    )
    assert core.submit(7, wire_mapping.typed_body(b'{"long":true}'), operation_id=202) == (2, 202)
    peer.sends()
    core.frame_cancel(7, 2)
    peer.sends()
    assert peer.feed() == [ev.ResultDropReasonReceived(7, 2, 202, 0, 3, 2, b"peer cancelled")]
    assert core.submit(7, wire_mapping.typed_body(b'{"x":3}'), operation_id=303) == (3, 303)
    peer.sends()
    deadline_ms = struct.unpack_from("<Q", peer.packets["c2s"][peer._c2s], HEADER_LENGTH + 20)[0]
    core.deadline(7, 3, deadline_ms)
    peer.sends()
    core.cancel(7, 3, diagnostic=b"stop")  # control_sequence 2: after the DEADLINE's 1
    peer.sends()
    assert peer.feed() == [ev.ResultDropReasonReceived(7, 3, 303, 0, 3, 2, b"")]
    core.close_session(7)
    peer.sends()
    assert peer.feed() == [ev.SessionCloseAcked(7)]
    assert core.receive_data(b"") == [ev.ConnectionEnded(None)]
    with pytest.raises(LocalProtocolError):
        core.open_session()


def test_two_sessions_on_one_connection():
    """tcp-multiplex: server-assigned ids 1 and 2, both with frame 1, answers interleaved, B closed first."""
    peer = Peer("tcp-multiplex.jsonl")
    core = peer.core
    a, b = core.open_session(max_in_flight_operations=4), core.open_session(max_in_flight_operations=4)
    peer.sends(3)  # one CLIENT_HELLO, two SESSION_OPEN
    assert peer.feed(3) == [ev.SessionOpenAccepted(a, 1, 4, 2), ev.SessionOpenAccepted(b, 2, 4, 2)]
    assert core.submit(1, wire_mapping.typed_body(b'{"s":"A","n":1}'), operation_id=1001) == (1, 1001)
    peer.sends()
    assert core.submit(2, wire_mapping.typed_body(b'{"s":"B","n":1}'), operation_id=2001) == (1, 2001)
    peer.sends()
    got = peer.feed(4)
    assert [(type(e).__name__, e.session_id, e.operation_id) for e in got] == [
        ("PartialResultReceived", 2, 2001),
        ("PartialResultReceived", 1, 1001),
        ("ResultPushed", 2, 2001),
        ("ResultPushed", 1, 1001),
    ]
    core.close_session(2)
    peer.sends()
    assert core.submit(1, wire_mapping.typed_body(b'{"s":"A","n":2}'), operation_id=1002) == (2, 1002)
    peer.sends()
    got = peer.feed(2)
    assert got[0] == ev.SessionCloseAcked(2) and (got[1].session_id, got[1].operation_id) == (1, 1002)
    core.close_session(1)
    peer.sends()
    assert peer.feed() == [ev.SessionCloseAcked(1)]


def test_native_server_control_frames():
    """tcp-control: PROGRESS, operation- and session-scope TRACE_CONTEXT, BACKPRESSURE, CREDIT_UPDATE,
    ERROR_RECOVERABLE, RETRY_AFTER from the native server; our op-scope TRACE_CONTEXT bytes."""
    peer = Peer("tcp-control.jsonl")
    core = peer.core
    core.open_session(requested_session_id=21, max_in_flight_operations=4)
    peer.sends(2)
    peer.feed(2)
    core.submit(21, wire_mapping.typed_body(b'{"q":"deadline-first"}'), operation_id=501)
    core.data_to_send()
    peer.skip_c2s(2)  # the native client's pre-submit DEADLINE + FRAME_SUBMIT
    got = peer.feed(8)
    assert got[0] == ev.ProgressReceived(21, 1, 501, 1, 5, 2500, b"stage1")
    assert got[1] == ev.TraceContextReceived(21, 1, 501, 0xAB, 0xCD, 0xEF, 5, 1, 0)
    assert isinstance(got[2], ev.ResultPushed) and got[2].operation_id == 501
    assert got[3] == ev.TraceContextReceived(21, 0, None, 0x51, 0x52, 0, 1, 0, 4)
    assert got[4] == ev.PressureReceived(21, T.BACKPRESSURE, 0, 1, 1, 1, 50)
    assert got[5] == ev.PressureReceived(21, T.CREDIT_UPDATE, 0, 4, 0, 0, 0)
    assert got[6] == ev.ErrorRecoverableReceived(21, 0, 11, 1, 0, 100, 0, got[6].diagnostic)
    assert len(got[6].diagnostic) == 9
    assert got[7] == ev.RetryAfterReceived(21, 0, 250, 10, 0, b"")
    assert core.submit(21, wire_mapping.typed_body(b'{"q":"controls"}'), operation_id=502, trace_id=0x77) == (2, 502)
    peer.sends()
    core.trace_context(21, 2, 0x77, 0x78, 0, stage_code=5)
    peer.sends()
    # PRIORITY_UPDATE and EXPIRE_AT: the native client's bytes but for control_sequence (the capture's driver
    # numbered them 10 and 11; this core counts per operation from 1)
    priority, expire = peer.packets["c2s"][peer._c2s : peer._c2s + 2]
    core.priority_update(21, 2, 0, 2)
    core.expire_at(21, 2, struct.unpack_from("<Q", expire, 60)[0])
    ours = core.data_to_send()
    assert ours.hex() == (with_sequence(priority, 1) + with_sequence(expire, 2)).hex()
    peer.skip_c2s(3)  # PRIORITY_UPDATE, EXPIRE_AT (checked above), ABORT (not a call of this core)
    assert peer.feed() == [ev.ResultDropReasonReceived(21, 2, 502, 0, 3, 2, b"")]
    core.close_session(21)
    peer.sends()
    assert peer.feed() == [ev.SessionCloseAcked(21)]


def with_sequence(packet: bytes, sequence: int) -> bytes:
    """``packet`` (a control with ``control_sequence`` u64 at metadata offset 8) with another sequence."""
    return packet[:48] + struct.pack("<Q", sequence) + packet[56:]


def test_runtime_control_calls_and_their_rules():
    """priority_class in SESSION_OPEN; SUPERSEDE / BUDGET_UPDATE / PRIORITY_UPDATE / EXPIRE_AT layouts (their
    bytes against the native client's: tests/wire/test_controls_interop.py)."""
    core = ClientConnection()
    core.open_session(requested_session_id=5, priority_class=2)
    hello_and_open = core.data_to_send()
    assert hello_and_open[-48 + 6] == 2  # SESSION_OPEN priority_class u8 @6
    with pytest.raises(LocalProtocolError):
        core.open_session(priority_class=3)
    core = opened()
    core.submit(5, b"x")
    core.data_to_send()
    core.supersede(5, 1, 2, diagnostic=b"why")
    core.budget_update(5, 2, 64)
    supersede, budget = split_packets(core.data_to_send())
    assert (supersede[6], struct.unpack_from("<II", supersede, 20)) == (T.SUPERSEDE, (5, 1))
    assert struct.unpack_from("<QQQHHI", supersede, 40) == (1, 2, 1, 2, 0, 3) and supersede[72:] == b"why"
    assert (budget[6], struct.unpack_from("<II", budget, 20)) == (T.BUDGET_UPDATE, (5, 2))
    assert struct.unpack_from("<QQQQII", budget, 40) == (2, 0, 0, 0, 64, 0) and len(budget) == 80
    for call in (
        lambda: core.priority_update(5, 1, 3),
        lambda: core.expire_at(5, 1, 0),
        lambda: core.supersede(5, 9),
        lambda: core.budget_update(6, 1, 1),
    ):
        with pytest.raises(LocalProtocolError):
            call()
    assert core.data_to_send() == b""


def split_packets(data: bytes) -> list[bytes]:
    packets, offset = [], 0
    while offset < len(data):
        meta_len, body_len = struct.unpack_from("<II", data, offset + 12)
        end = offset + HEADER_LENGTH + meta_len + body_len
        packets.append(data[offset:end])
        offset = end
    return packets


def test_rejected_open_keeps_the_connection():
    """tcp-session: profile 1 refused (0x00010002 + diagnostic); the next open on the connection works."""
    peer = Peer("tcp-session.jsonl")
    core = peer.core
    token = core.open_session(requested_session_id=31, profile_id=1, max_in_flight_operations=4)
    peer.sends(2)
    (rejected,) = peer.feed(2)
    assert rejected == ev.SessionOpenRejected(token, 0x00010002, rejected.diagnostic)
    assert "profile" in rejected.diagnostic
    core.open_session(requested_session_id=32)
    assert core.data_to_send()  # a SESSION_OPEN, no second CLIENT_HELLO
    assert core.data_to_send() == b""


# -- incoming validation (native client behaviour: notes of each case name the probe) -----------------------


def opened(session_id: int = 5) -> ClientConnection:
    """A core with one open session ``session_id`` and operation frame 1 (op 1) submitted."""
    packets = capture("tcp-basic.jsonl")["s2c"]
    core = ClientConnection()
    core.open_session()
    core.receive_data(packets[0] + open_ack(session_id))
    core.submit(session_id, wire_mapping.typed_body(b"{}"))
    core.data_to_send()
    return core


def open_ack(session_id: int, *, header: int | None = None, status: int = 0, body: bytes = b"", code: int = 0) -> bytes:
    meta = struct.pack(
        "<IHBBIIHHIIIIQIII",
        session_id,
        2,
        1,
        status,
        4097,
        3,
        2,
        4,
        30000,
        120000,
        0,
        len(body),
        session_id,
        0,
        code,
        0,
    )
    return encode(T.SESSION_OPEN_ACK, session_id if header is None else header, 0, meta, body)


def partial(session_id: int, frame_id: int, op: int, seq: int = 1, body: bytes = b'{"type":"x"}') -> bytes:
    return encode(
        T.PARTIAL_RESULT, session_id, frame_id, PartialResultMetadata(op, seq, 0, seq, len(body), 0).pack(), body
    )


def push(session_id: int, frame_id: int) -> bytes:
    meta = struct.pack("<HHHHHHHHHHIIQQBBHIHHIHH", 200, *[0] * 19, 0x10, 1, 0)
    return encode(T.RESULT_PUSH, session_id, frame_id, meta, wire_mapping.typed_body(b'{"type":"response.completed"}'))


def credit(session_id: int, meta_len: int = 32) -> bytes:
    meta = PressureMetadata(0, 4, 0, 0, 0, 0).pack()
    return encode(T.CREDIT_UPDATE, session_id, 0, meta + b"\0" * (meta_len - 32))


def kinds(events: list[object]) -> list[str]:
    return [type(e).__name__ for e in events]


def test_after_frame_cancel_partials_are_dropped_and_the_terminal_still_comes():
    """probe push-after-cancel: PARTIAL rejected, PUSH delivered, duplicate PUSH and an unknown frame rejected,
    then a CREDIT_UPDATE is delivered and a new submit works."""
    core = opened()
    core.frame_cancel(5, 1)
    got = core.receive_data(partial(5, 1, 1) + push(5, 1) + push(5, 1) + push(5, 77) + credit(5))
    assert kinds(got) == ["PacketRejected", "ResultPushed", "PacketRejected", "PacketRejected", "PressureReceived"]
    assert "FRAME_CANCEL" in got[0].reason and "finished" in got[2].reason and "unknown" in got[3].reason
    assert core.submit(5, wire_mapping.typed_body(b"{}")) == (2, 2)
    with pytest.raises(LocalProtocolError):
        core.frame_cancel(5, 1)  # finished


def test_a_bad_packet_of_a_known_session_is_dropped():
    core = opened()
    drop = ResultDropReasonMetadata(1, 0, 3, 2, 0, 0).pack()
    got = core.receive_data(
        credit(5, meta_len=36)
        + credit(5)  # probe bad-meta-len
        + encode(T.PING, 5, 0)  # probe ping-from-server
        + partial(5, 1, 9)  # operation 9 is not frame 1's
        + encode(T.TRACE_CONTEXT, 5, 0, TraceContextMetadata(0x52, 1, 0, 0, 0, 0).pack(), trace_id=0x99)
        + encode(T.TRACE_CONTEXT, 5, 0, TraceContextMetadata(0x51, 1, 0, 0, 0, 0).pack())  # probe trace-header
        + encode(T.TRACE_CONTEXT, 5, 55, TraceContextMetadata(0x51, 1, 0, 0, 0, 0).pack(), trace_id=0x51)
        + encode(T.CREDIT_UPDATE, 0, 0, PressureMetadata(0, 4, 0, 0, 0, 0).pack())  # session 0 after the handshake
        + push(5, 1)
        + encode(T.RESULT_DROP_REASON, 5, 1, drop)  # probe drop-after-push
        + credit(5)
    )
    assert kinds(got) == [
        "PacketRejected",
        "PressureReceived",
        "PacketRejected",
        "PacketRejected",
        "PacketRejected",
        "TraceContextReceived",
        "PacketRejected",
        "PacketRejected",
        "ResultPushed",
        "PacketRejected",
        "PressureReceived",
    ]
    assert got[2].msg_type == T.PING and got[6].frame_id == 55 and got[7].session_id == 0


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(credit(99), id="unknown-session"),
        pytest.param(encode(T.CREDIT_UPDATE, 5, 0, b"", flags=0x40), id="reserved-flag"),
        pytest.param(bytearray(encode(T.PING, 5, 0)).replace(bytes([T.PING]), b"\x50", 1), id="unknown-msg-type"),
    ],
)
def test_connection_fatal_packets(data):
    core = opened()
    got = core.receive_data(bytes(data) + credit(5))
    assert kinds(got) == ["ConnectionEnded"] and got[0].error
    assert core.receive_data(credit(5)) == []
    with pytest.raises(LocalProtocolError):
        core.submit(5, b"")


def test_a_packet_after_the_close_ack_ends_the_connection():
    """probe late-packet-after-close: the session is unregistered, so its next packet is fatal."""
    core = opened()
    core.close_session(5)
    close_ack = encode(T.SESSION_CLOSE_ACK, 5, 0, struct.pack("<BBHQI", 2, 0, 0, 1, 0))
    got = core.receive_data(push(5, 1) + close_ack + credit(5))
    assert kinds(got) == ["ResultPushed", "SessionCloseAcked", "ConnectionEnded"]


def test_close_status_draining_waits_and_rejected_is_reported():
    """probes close-draining-then-closed and close-3."""
    core = opened()
    core.close_session(5)
    ack = lambda status: encode(T.SESSION_CLOSE_ACK, 5, 0, struct.pack("<BBHQI", status, 0, 0, 1, 0))  # noqa: E731
    assert core.receive_data(ack(1)) == []
    assert kinds(core.receive_data(ack(3))) == ["PacketRejected"]
    core.close_session(5)  # may be asked again
    assert core.receive_data(ack(2)) == [ev.SessionCloseAcked(5)]


@pytest.mark.parametrize(
    ("patch", "fatal"),
    [
        pytest.param({76: 0x2}, True, id="server-flags-0x2"),
        pytest.param({76: 0x1}, False, id="server-flags-0x1"),
        pytest.param({8: 0x6}, True, id="profile-not-a-subset"),
        pytest.param({8: 0x0}, False, id="zero-profiles"),
        pytest.param({0: 2}, True, id="version-2"),
    ],
)
def test_server_hello_ack_rules(patch, fatal):
    hello_ack = bytearray(capture("tcp-basic.jsonl")["s2c"][0])
    for offset, value in patch.items():
        struct.pack_into("<I" if offset else "<B", hello_ack, HEADER_LENGTH + offset, value)
    core = ClientConnection()
    token = core.open_session()
    got = core.receive_data(bytes(hello_ack) + open_ack(3))
    assert kinds(got) == (["ConnectionEnded"] if fatal else ["SessionOpenAccepted"])
    if not fatal:
        assert got[0] == ev.SessionOpenAccepted(token, 3, 4, 2)


def test_open_ack_rules():
    """probes ack-header-zero (accepted), ack-other-id (accepted), reuse-session-id and a body that is not
    the declared length (refused, connection kept)."""
    core = opened(3)
    tokens = [core.open_session() for _ in range(4)]
    bad_length = bytearray(open_ack(8, body=b"xx"))
    bad_length[-2 - 56 + 32 : -2 - 56 + 36] = struct.pack("<I", 5)  # session_extension_bytes 5 for a 2-byte body
    got = core.receive_data(open_ack(4, header=0) + open_ack(99) + open_ack(3) + bytes(bad_length))
    assert got[:2] == [ev.SessionOpenAccepted(tokens[0], 4, 4, 2), ev.SessionOpenAccepted(tokens[1], 99, 4, 2)]
    assert [(type(e).__name__, e.request, e.session_error_code) for e in got[2:]] == [
        ("SessionOpenRejected", tokens[2], 0),
        ("SessionOpenRejected", tokens[3], 0),
    ]
    assert "used before" in got[2].diagnostic
    assert core.receive_data(open_ack(7)) == [
        ev.PacketRejected(7, 0, T.SESSION_OPEN_ACK, "SESSION_OPEN_ACK with no open waiting")
    ]
    assert kinds(core.receive_data(credit(4) + credit(99))) == ["PressureReceived", "PressureReceived"]


def test_local_rules():
    core = opened()
    with pytest.raises(LocalProtocolError):
        core.submit(5, b"", operation_id=1)  # not above the last operation id
    with pytest.raises(LocalProtocolError):
        core.submit(6, b"")  # no such session
    with pytest.raises(LocalProtocolError):
        core.trace_context(5, 9, 1, 1, 0)  # no operation with frame 9
    with pytest.raises(LocalProtocolError):
        core.deadline(5, 1, 0)
    core.close_session(5)
    with pytest.raises(LocalProtocolError):
        core.submit(5, b"")  # closing
    core.cancel(5, 1)  # controls for its operations still go out while it closes
    assert core.data_to_send()[6] == T.SESSION_CLOSE

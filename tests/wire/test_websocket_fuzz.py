"""Fuzz of the WebSocket framing of the server connection (:class:`vllm_nnrp_plugin.nnrp_binding.websocket.
WebSocketConnection`), driven over a fake transport that records its writes, close and abort, with the input
cut at random byte boundaries across ``data_received`` calls (a closed transport is read no more, as asyncio
does). What must hold (the module docstring of :mod:`~vllm_nnrp_plugin.nnrp_binding.websocket`):

* no input makes ``data_received`` raise or abort the transport (the abort is the handler of an internal bug),
  and nothing is logged at ERROR;
* every malformed input ends with the transport closed and — where the Upgrade completed — a close frame, the
  last thing written, whose code is the one the docstring names: 1003 a text message, 1009 a message over the
  packet limit, 1002 a message that ends inside an NNRP packet or bytes the wire core refuses, wsproto's own
  code for malformed frames (unmasked client frames, reserved bits or opcodes, fragmented or oversized control
  frames, a continuation without a start, a new message inside a fragmented one, non-minimal lengths, invalid
  close payloads: 1002, or 1007 for invalid UTF-8), 1008 no session in time, 1001 the server stops; an HTTP 404
  for an Upgrade of another path, another 4xx for a request that is no Upgrade;
* every well-formed stream (Upgrade, CLIENT_HELLO, SESSION_OPEN, NNRP pings, submits, a SESSION_CLOSE, in
  fragmented binary messages, several packets to a message, with pings and pongs between the frames, and maybe
  the client's close) gives, however it is cut, the same NNRP packets, the same pongs and the same close as
  when it arrives in one piece (the client's close frame starting a read of its own; the test at the end checks
  a close frame that shares a read with the messages before it);
* nothing grows without bound: the wire core's incomplete packet and the listener budget's share stay within
  the packet limit, wsproto holds no more than a frame header and a control frame;
* every server frame is well-formed (final, unmasked, no RSV bit, minimal length, binary / pong / close, one
  NNRP packet per binary message), and nothing follows a close frame.

Each malformed category is fuzzed on its own (a parametrized test each) and checked on its own terms by a
reference ``wsproto`` server fed the same bytes (the frames are malformed the way the category says, or
well-formed where the fault is NNRP's); a count proves each category's generator produced such input. The
well-formed streams, the bad Upgrades and the garbage count the features they must have produced too.
Two bugs the fuzz found (answers lost to a close frame in the same read; frames lost behind a bare-LF request
head) are pinned by the tests at the end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import struct
from collections import Counter
from dataclasses import dataclass, field

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnrp.core.enums import MessageType as T
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request

from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding.bounds import BufferBudget, CarrierBounds
from vllm_nnrp_plugin.nnrp_binding.connection import FlushRound, NNRPConnection, SessionGate
from vllm_nnrp_plugin.nnrp_binding.websocket import WebSocketConnection
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader, encode

from . import wirekit as w
from .fuzz_rounds import run_until

SCALE = int(os.environ.get("NNRP_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=150 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_PACKET = 2048  # the packet (and message) limit of the connections here: small, so oversized input is cheap
PATH = "/nnrp"
SESSION = 7
H11_MAX_HEAD = 16 * 1024  # h11's max_incomplete_event_size: a request head may not grow beyond it
#: most hypothesis runs a coverage test makes before it fails for what its examples never produced
COVERAGE_ROUNDS = 4

CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_PROTOCOL_ERROR, CLOSE_UNSUPPORTED_DATA = 1000, 1001, 1002, 1003
CLOSE_INVALID_PAYLOAD, CLOSE_POLICY_VIOLATION, CLOSE_MESSAGE_TOO_BIG = 1007, 1008, 1009


# -- the client's bytes ------------------------------------------------------------------------------------------


def silence_passes(protocol) -> None:
    """The handshake timer fires after the client has been silent for the whole bound (its clock marks moved
    back by the timeout, :func:`vllm_nnrp_plugin.nnrp_binding.bounds.handshake_recheck`)."""
    nnrp = protocol.nnrp
    nnrp._started_at -= nnrp._handshake_timeout_s
    nnrp._heard_at -= nnrp._handshake_timeout_s
    nnrp._handshake_expired()


def frame(
    opcode: int,
    payload: bytes,
    *,
    fin: bool = True,
    rsv: int = 0,
    key: bytes | None = b"\x5a\x0f\xc3\x81",
    form: str | None = None,
    announce: int | None = None,
) -> bytes:
    """A client frame built by hand (RFC 6455 §5.2), for what wsproto's client would refuse to send. ``key``
    None: unmasked; ``form`` ``short`` / ``u16`` / ``u64`` forces a length encoding (None: the minimal one);
    ``announce``: the length the header states (default the payload's)."""
    n = len(payload) if announce is None else announce
    form = form or ("short" if n < 126 else "u16" if n < 1 << 16 else "u64")
    mask_bit = 0x80 if key is not None else 0
    head = bytes([(0x80 if fin else 0) | rsv << 4 | opcode])
    if form == "short":
        head += bytes([mask_bit | n])
    elif form == "u16":
        head += bytes([mask_bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", n)
    if key is None:
        return head + payload
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def upgrade(target: str = PATH) -> tuple[WSConnection, bytes]:
    """wsproto's client and its Upgrade request (the client checks the server's answer)."""
    client = WSConnection(ConnectionType.CLIENT)
    return client, client.send(Request(host="127.0.0.1", target=target))


HELLO = w.hello()
OPEN = w.session_open(SESSION)
ENVELOPE = {"schema_version": "openai-compatible/1", "operation": "chat.completions.create", "body": {"model": "m"}}
BODY = wire_mapping.typed_body(orjson.dumps(ENVELOPE))


def nnrp_ping(frame_id: int = 0) -> bytes:
    return encode(T.PING, SESSION, frame_id)


KEYS = st.binary(min_size=4, max_size=4)


@dataclass
class Stream:
    """Client bytes, and what they hold: the pings' payloads (each owed a pong, in order) and counts of the
    features used (for the coverage)."""

    data: bytes = b""
    pings: tuple[bytes, ...] = ()
    features: Counter = field(default_factory=Counter)


def messages(draw, payloads: list[bytes], *, controls: bool = True, at: tuple[int, ...] = ()) -> Stream:
    """Each payload as one binary message: fragmented at random points (and at ``at``; continuation frames,
    empty fragments included), random masking keys, and pings and pongs between the frames."""
    out, pings, features = bytearray(), [], Counter()
    for payload in payloads:
        cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=3)) + list(at))
        pieces = [payload[a:b] for a, b in zip([0] + cuts, cuts + [len(payload)], strict=True)]
        features["fragmented"] += len(pieces) > 1
        for i, piece in enumerate(pieces):
            if controls and draw(st.integers(0, 3)) == 0:
                payload_ = draw(st.binary(max_size=125))
                if draw(st.booleans()):
                    out += frame(0x9, payload_, key=draw(KEYS))
                    pings.append(payload_)
                    features["ping between frames" if i else "ping between messages"] += 1
                else:
                    out += frame(0xA, payload_, key=draw(KEYS))
                    features["pong"] += 1
            out += frame(0x2 if i == 0 else 0x0, piece, fin=i == len(pieces) - 1, key=draw(KEYS))
    return Stream(bytes(out), tuple(pings), features)


def _groups(draw, packets: list[bytes]) -> list[bytes]:
    """``packets`` in messages of one to three packets; a SESSION_OPEN ends its message (the session exists
    only once the ack was decided, and a client waits for it: the packets behind it in the same message
    would name an unknown session)."""
    groups, current = [], b""
    for packet in packets:
        current += packet
        if packet[6] == T.SESSION_OPEN or draw(st.integers(0, 2)) == 0:
            groups.append(current)
            current = b""
    return groups + ([current] if current else [])


# -- the server side: the connection over a fake transport -------------------------------------------------------


class Transport:
    """asyncio's transport as the connection sees it: writes recorded, close and abort noted."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_extra_info(self, name: str) -> None:
        return None


class Handler:
    """The service: counts sessions and submits, does nothing else."""

    def __init__(self) -> None:
        self.sessions = 0
        self.submitted = 0

    def on_submit(self, sop) -> None:
        self.submitted += 1

    def on_session(self, transport, opened) -> None:
        self.sessions += 1 if opened else -1

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Output:
    """The server's bytes, parsed strictly."""

    status: int | None  # HTTP status of its answer to the Upgrade; None: no answer
    packets: list[bytes]  # the NNRP packet of each binary message, in order
    pongs: list[bytes]
    close: tuple[int | None, str] | None  # its close frame: (code, or None without one; reason)


@dataclass
class Run:
    out: Output
    closed: bool
    submitted: int


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each frame, failing unless each is what a server sends: final, no RSV bit,
    unmasked, the minimal length encoding, whole."""
    pos, out = 0, []
    while pos < len(data):
        assert len(data) - pos >= 2, "torn frame header"
        b0, b1 = data[pos], data[pos + 1]
        assert b0 & 0x80 and not b0 & 0x70 and not b1 & 0x80, f"not final, plain, unmasked: {data[pos : pos + 2]!r}"
        n, start = b1 & 0x7F, pos + 2
        if n == 126:
            (n,), start = struct.unpack_from("!H", data, start), start + 2
            assert n > 125, "non-minimal length"
        elif n == 127:
            (n,), start = struct.unpack_from("!Q", data, start), start + 8
            assert n > 0xFFFF, "non-minimal length"
        assert start + n <= len(data), "torn frame"
        out.append((b0 & 0x0F, data[start : start + n]))
        pos = start + n
    return out


def parse_output(data: bytes, client: WSConnection) -> Output:
    if not data:
        return Output(None, [], [], None)
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 "), data[:80]
    status = int(head.split(b" ", 2)[1])
    if status != 101:
        assert 400 <= status < 500 and rest == b"", data[:200]  # an HTTP error, no body, nothing after it
        return Output(status, [], [], None)
    client.receive_data(head + sep)  # the answer is a valid 101 for this client's key, no subprotocol or extension
    (accept,) = client.events()
    assert isinstance(accept, AcceptConnection) and accept.subprotocol is None and accept.extensions == [], accept
    assert b"sec-websocket-extensions" not in head.lower() and b"sec-websocket-protocol" not in head.lower()
    packets, pongs, close = [], [], None
    for opcode, payload in server_frames(rest):
        assert close is None, "a frame after the close frame"
        if opcode == 0x2:
            reader = PacketReader()
            assert len(reader.feed(payload)) == 1 and reader.buffered == 0  # exactly one whole NNRP packet
            packets.append(payload)
        elif opcode == 0xA:
            assert len(payload) <= 125
            pongs.append(payload)
        else:
            assert opcode == 0x8, opcode
            assert len(payload) != 1 and len(payload) <= 125, payload
            close = (struct.unpack("!H", payload[:2])[0], payload[2:].decode("utf-8")) if payload else (None, "")
    return Output(status, packets, pongs, close)


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0] + points, points + [len(data)], strict=True)]


async def _drive(
    client: WSConnection,
    data: bytes,
    cuts: list[int],
    *,
    eof: bool = False,
    expire: bool = False,
    stop: bool = False,
    open_until_eof: bool = False,
) -> Run:
    handler, transport = Handler(), Transport()
    gate, budget = SessionGate(8), BufferBudget(1 << 30)
    protocol = WebSocketConnection(
        NNRPConnection(
            handler,
            transport_name="websocket",
            limits=SessionLimits(max_in_flight=4, max_queued_events=64),
            gate=gate,
            flush_round=FlushRound(asyncio.get_running_loop()),
            on_lost=lambda c: None,
            bounds=CarrierBounds(max_packet_bytes=MAX_PACKET),
            budget=budget,
        ),
        path=PATH,
    )
    errors = Errors()
    package_logger = logging.getLogger("vllm_nnrp_plugin")
    package_logger.addHandler(errors)
    try:
        protocol.connection_made(transport)  # type: ignore[arg-type]
        for chunk in chunks(data, cuts):
            if transport.is_closing():  # asyncio reads nothing more from a transport it closes
                break
            protocol.data_received(chunk)  # must not raise
            _check_bounded(protocol, budget, transport)
            await asyncio.sleep(0)  # the loop turns between reads: the flush round runs
        if open_until_eof:  # a frame cut short waits for the rest, holding no more than it may
            assert not transport.closed, "closed while a frame was still arriving"
        if eof and not transport.is_closing():
            if not protocol.eof_received():
                transport.close()  # what asyncio does when eof_received returns a false value
        if expire and not transport.is_closing():
            silence_passes(protocol)  # the handshake timer fires
        if stop and not transport.is_closing():
            protocol.nnrp.shut_down()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not transport.aborted, "aborted: handling the input failed (a bug)"
        assert not errors.records, [r.getMessage() for r in errors.records]
        out = parse_output(b"".join(transport.writes), client)
        if out.close is not None:
            assert transport.closed, "a close frame, and the transport left open"
        closed = transport.closed
        submitted = handler.submitted
        protocol.connection_lost(None)  # asyncio reports the end: nothing stays counted
        assert gate.open == 0 and handler.sessions == 0 and budget.used == 0
        return Run(out, closed, submitted)
    finally:
        package_logger.removeHandler(errors)


def _check_bounded(protocol: WebSocketConnection, budget: BufferBudget, transport: Transport) -> None:
    """Nothing grows with what a client sends: the core's incomplete packet and the budget's share stay within
    the packet limit; wsproto holds at most a frame header and a control frame; a request head at most h11's
    limit."""
    assert protocol.nnrp._core.buffered <= MAX_PACKET, protocol.nnrp._core.buffered
    assert budget.used <= MAX_PACKET, budget.used
    if transport.is_closing():
        return
    connection = protocol._ws._ws.connection  # the carrier mapping's wsproto connection
    if connection is not None:  # wsproto internals: checked while they are where 1.3 keeps them
        buffer = getattr(
            getattr(getattr(getattr(connection, "_proto", None), "_frame_decoder", None), "buffer", None),
            "buffer",
            None,
        )
        if buffer is not None:
            assert len(buffer) <= 14 + 125, len(buffer)
    elif protocol._ws._head is not None:
        assert len(protocol._ws._head) <= H11_MAX_HEAD + 2, len(protocol._ws._head)


def drive(client: WSConnection, data: bytes, cuts: list[int], **kwargs) -> Run:
    return asyncio.run(_drive(client, data, cuts, **kwargs))


def cuts_of(draw, data: bytes) -> list[int]:
    """Where the stream is cut into reads: nowhere, at random places, or after every byte."""
    mode = draw(st.sampled_from(["random", "random", "random", "none", "bytes"]))
    if mode == "none":
        return []
    if mode == "bytes" and len(data) <= 4096:
        return list(range(1, len(data)))
    return draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=16))


# -- the reference: what wsproto itself makes of the frames -----------------------------------------------------


def reference(frames: bytes) -> tuple[int | None, list]:
    """A plain wsproto server, past the Upgrade, fed ``frames`` in one piece: the code of the first failure it
    reports (None: the frames are well-formed) and the events before it."""
    client, request = upgrade()
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(request)
    list(server.events())
    server.send(AcceptConnection())
    server.receive_data(frames)
    events = []
    for event in server.events():
        if isinstance(event, CloseConnection):
            return int(event.code), events
        events.append(event)
    return None, events


# -- malformed input ------------------------------------------------------------------------------------------


CONTROL_OPS = (0x8, 0x9, 0xA)
RESERVED_OPS = (0x3, 0x4, 0x5, 0x6, 0x7, 0xB, 0xC, 0xD, 0xE, 0xF)
BAD_CLOSE_CODES = st.one_of(
    st.integers(0, 999), st.sampled_from([1004, 1005, 1006, 1015, 1016, 2000, 2999]), st.integers(5000, 0xFFFF)
)
UNKNOWN_TYPES = sorted(set(range(256)) - {int(k) for k in T})


@dataclass
class Case:
    """One malformed input: the bytes after the Upgrade (``frames``), what must happen, and how the reference
    must see the frames (``ws_code``: wsproto's failure code; None: well-formed frames, the fault is NNRP's)."""

    frames: bytes
    code: int | None  # the close frame's code; None: no close frame expected (the transport still closes)
    ws_code: int | None = None
    session: str = "maybe"  # the hello and the open before it: "yes", "no" or "maybe"
    eof: bool = False
    expire: bool = False
    stop: bool = False
    open_until_eof: bool = False
    answers: tuple[int, ...] = ()  # NNRP packets the server must have sent (before its close)


def _text(draw) -> Case:
    text = draw(st.text(max_size=40)).encode("utf-8")
    if draw(st.booleans()):
        return Case(frame(0x1, text, key=draw(KEYS)), CLOSE_UNSUPPORTED_DATA)
    cut = draw(st.integers(0, len(text)))  # a fragmented text message
    return Case(
        frame(0x1, text[:cut], fin=False, key=draw(KEYS)) + frame(0x0, text[cut:], key=draw(KEYS)),
        CLOSE_UNSUPPORTED_DATA,
    )


def _text_invalid_utf8(draw) -> Case:
    """Invalid from its first byte on (a text message whose first bytes are valid is a text message first: 1003
    as soon as they arrive, whatever follows)."""
    payload = draw(st.sampled_from([b"\xff", b"\xc0\xaf", b"\x80", b"\xfe\xfe", b"\xf8"]))
    payload += draw(st.binary(max_size=20))
    return Case(frame(0x1, payload, key=draw(KEYS)), CLOSE_INVALID_PAYLOAD, ws_code=CLOSE_INVALID_PAYLOAD)


def _unmasked(draw) -> Case:
    opcode = draw(st.sampled_from([0x0, 0x1, 0x2, 0x2, 0x8, 0x9, 0xA]))
    payload = draw(st.binary(max_size=125 if opcode >= 0x8 else 300))
    if opcode == 0x8 and payload:
        payload = struct.pack("!H", 1000) + payload[:120]
    return Case(frame(opcode, payload, key=None), CLOSE_PROTOCOL_ERROR, ws_code=CLOSE_PROTOCOL_ERROR)


def _reserved_bits(draw) -> Case:
    opcode = draw(st.sampled_from([0x1, 0x2, 0x2, 0x9, 0xA]))
    return Case(
        frame(opcode, draw(st.binary(max_size=60)), rsv=draw(st.integers(1, 7)), key=draw(KEYS)),
        CLOSE_PROTOCOL_ERROR,
        ws_code=CLOSE_PROTOCOL_ERROR,
    )


def _reserved_opcode(draw) -> Case:
    return Case(
        frame(
            draw(st.sampled_from(RESERVED_OPS)), draw(st.binary(max_size=60)), fin=draw(st.booleans()), key=draw(KEYS)
        ),
        CLOSE_PROTOCOL_ERROR,
        ws_code=CLOSE_PROTOCOL_ERROR,
    )


def _fragmented_control(draw) -> Case:
    payload = draw(st.binary(max_size=20))
    opcode = draw(st.sampled_from(CONTROL_OPS))
    if opcode == 0x8:
        payload = struct.pack("!H", 1000) + payload
    return Case(frame(opcode, payload, fin=False, key=draw(KEYS)), CLOSE_PROTOCOL_ERROR, ws_code=CLOSE_PROTOCOL_ERROR)


def _oversized_control(draw) -> Case:
    payload = draw(st.binary(min_size=126, max_size=400))
    return Case(
        frame(draw(st.sampled_from(CONTROL_OPS)), payload, key=draw(KEYS)),
        CLOSE_PROTOCOL_ERROR,
        ws_code=CLOSE_PROTOCOL_ERROR,
    )


def _non_minimal_length(draw, form: str) -> Case:
    if form == "msb":  # an 8-byte length with the most significant bit set
        bad = frame(0x2, b"", form="u64", announce=(1 << 63) | draw(st.integers(1 << 16, 1 << 20)), key=draw(KEYS))
    else:
        size = draw(st.integers(0, 125 if form == "u16" else 0xFFFF))  # the header is refused: a short payload
        bad = frame(0x2, b"\x00" * min(size, 40), form=form, announce=size, key=draw(KEYS))
    return Case(bad, CLOSE_PROTOCOL_ERROR, ws_code=CLOSE_PROTOCOL_ERROR)


def _continuation_without_start(draw) -> Case:
    return Case(
        frame(0x0, draw(st.binary(max_size=60)), fin=draw(st.booleans()), key=draw(KEYS)),
        CLOSE_PROTOCOL_ERROR,
        ws_code=CLOSE_PROTOCOL_ERROR,
    )


def _message_inside_message(draw) -> Case:
    start = nnrp_ping()[: draw(st.integers(0, 39))]  # the start of a packet: nothing the core refuses yet
    return Case(
        frame(0x2, start, fin=False, key=draw(KEYS))
        + frame(draw(st.sampled_from([0x1, 0x2])), draw(st.binary(max_size=40)), key=draw(KEYS)),
        CLOSE_PROTOCOL_ERROR,
        ws_code=CLOSE_PROTOCOL_ERROR,
        session="yes",
    )


def _bad_close(draw, kind: str) -> Case:
    if kind == "one byte":
        return Case(
            frame(0x8, draw(st.binary(min_size=1, max_size=1)), key=draw(KEYS)),
            CLOSE_PROTOCOL_ERROR,
            ws_code=CLOSE_PROTOCOL_ERROR,
        )
    if kind == "code":
        payload = struct.pack("!H", draw(BAD_CLOSE_CODES)) + draw(st.text(max_size=20)).encode()
        return Case(frame(0x8, payload[:125], key=draw(KEYS)), CLOSE_PROTOCOL_ERROR, ws_code=CLOSE_PROTOCOL_ERROR)
    payload = struct.pack("!H", draw(st.sampled_from([1000, 1001, 3000, 4999]))) + b"\xff"
    payload += draw(st.binary(max_size=20))
    return Case(frame(0x8, payload, key=draw(KEYS)), CLOSE_INVALID_PAYLOAD, ws_code=CLOSE_INVALID_PAYLOAD)


def _over_the_limit(draw, kind: str) -> Case:
    """A message of whole packets the core takes (NNRP pings, answered), or one packet of exactly the limit in
    frames of its own (the core takes it whole: a PING with a body, refused with an ERROR_RECOVERABLE, the
    session goes on), then more: 1009 once the message is over the limit, after the answers."""
    if kind == "whole packets":
        payload = nnrp_ping() * (MAX_PACKET // 40 + draw(st.integers(1, 3)))
        return Case(messages(draw, [payload], controls=False).data, CLOSE_MESSAGE_TOO_BIG, session="yes")
    packet = encode(T.PING, SESSION, 0, b"", b"\x00" * (MAX_PACKET - 40))
    payload = packet + draw(st.binary(min_size=1, max_size=50))
    return Case(
        messages(draw, [payload], controls=False, at=(len(packet),)).data,
        CLOSE_MESSAGE_TOO_BIG,
        session="yes",
        answers=(T.ERROR_RECOVERABLE,),
    )


def _ends_inside_a_packet(draw) -> Case:
    whole = nnrp_ping() * draw(st.integers(0, 3))
    packet = draw(st.sampled_from([nnrp_ping(), w.submit(SESSION, 1, 1, BODY), w.session_close(SESSION)]))
    stream = messages(draw, [whole + packet[: draw(st.integers(1, len(packet) - 1))]], controls=False)
    return Case(stream.data, CLOSE_PROTOCOL_ERROR, session="yes")


def _ends_inside_the_hello(draw) -> Case:
    cut = draw(st.integers(1, len(HELLO) + len(OPEN) - 2))
    payload = (HELLO + OPEN)[: cut + (cut >= len(HELLO))]  # never the boundary between the two
    return Case(messages(draw, [payload], controls=False).data, CLOSE_PROTOCOL_ERROR)


def _empty_message(draw) -> Case:
    return Case(messages(draw, [b""], controls=False).data, CLOSE_PROTOCOL_ERROR)


def _refused_by_the_core(draw, kind: str) -> Case:
    if kind == "magic":
        packet = b"NNRQ" + nnrp_ping()[4:]
    elif kind == "type":
        packet = bytearray(nnrp_ping())
        packet[6] = draw(st.sampled_from(UNKNOWN_TYPES))
        packet = bytes(packet)
    elif kind == "session":
        packet = encode(T.PING, draw(st.sampled_from([1, 99, 1 << 31])), 0)
    elif kind == "second hello":
        packet = HELLO
    elif kind == "oversized":  # a header announcing a packet over the limit
        packet = encode(T.FRAME_SUBMIT, SESSION, 1, b"", b"")[:12] + struct.pack("<II", 72, MAX_PACKET)
        packet += encode(T.FRAME_SUBMIT, SESSION, 1)[20:]
    else:
        packet = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * draw(st.integers(2, 4))
    before = nnrp_ping() * draw(st.integers(0, 2))
    return Case(messages(draw, [before + packet], controls=False).data, CLOSE_PROTOCOL_ERROR, session="yes")


def _submit_before_the_hello(draw) -> Case:
    return Case(
        messages(draw, [w.submit(SESSION, 1, 1, BODY)], controls=False).data, CLOSE_PROTOCOL_ERROR, session="no"
    )


def _truncated(draw) -> Case:
    """A frame cut short (in its header or its payload): the connection waits, bounded, until the end of
    stream, which closes it."""
    whole = frame(
        0x2, draw(st.sampled_from([nnrp_ping(), w.submit(SESSION, 1, 1, BODY), nnrp_ping() * 50])), key=draw(KEYS)
    )
    return Case(whole[: draw(st.integers(1, len(whole) - 1))], None, session="yes", eof=True, open_until_eof=True)


def _no_session_in_time(draw) -> Case:
    payloads = [HELLO] if draw(st.booleans()) else []
    return Case(messages(draw, payloads).data, CLOSE_POLICY_VIOLATION, session="no", expire=True)


def _server_stops(draw) -> Case:
    return Case(b"", CLOSE_GOING_AWAY, session="yes", stop=True)


#: every malformed category, the builder of its input (each category is fuzzed on its own: its coverage does not
#: depend on how hypothesis spreads its examples)
MALFORMED = {
    "text message": _text,
    "text with invalid UTF-8": _text_invalid_utf8,
    "unmasked frame": _unmasked,
    "reserved bits": _reserved_bits,
    "reserved opcode": _reserved_opcode,
    "fragmented control frame": _fragmented_control,
    "oversized control frame": _oversized_control,
    **{
        f"non-minimal length ({form})": functools.partial(_non_minimal_length, form=form)
        for form in ("u16", "u64", "msb")
    },
    "continuation without a start": _continuation_without_start,
    "new message inside a fragmented one": _message_inside_message,
    **{
        f"invalid close payload ({kind})": functools.partial(_bad_close, kind=kind)
        for kind in ("one byte", "code", "utf-8")
    },
    **{
        f"message over the packet limit ({kind})": functools.partial(_over_the_limit, kind=kind)
        for kind in ("whole packets", "a packet of the limit, then more")
    },
    "message ending inside a packet": _ends_inside_a_packet,
    "message ending inside the hello": _ends_inside_the_hello,
    "empty message": _empty_message,
    **{
        f"bytes the core refuses ({kind})": functools.partial(_refused_by_the_core, kind=kind)
        for kind in ("magic", "type", "session", "second hello", "oversized", "not NNRP")
    },
    "submit before the hello": _submit_before_the_hello,
    "truncated frame, then end of stream": _truncated,
    "no session in time": _no_session_in_time,
    "server stops": _server_stops,
}

BAD_REQUESTS = [
    b"GET /nnrp HTTP/1.1\r\nHost: x\r\n\r\n",  # not an Upgrade
    b"POST /nnrp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    b"GET /nnrp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 8\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    b"GET /nnrp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\r\n",
    b"NNRP\x01\x00\x01\x28" + b"\x00" * 100 + b"\r\n\r\n",
    b"GET /nnrp HTTP/1.1\r\nX: " + b"y" * (H11_MAX_HEAD + 100) + b"\r\n\r\n",  # a head over h11's limit
]

SEEN: Counter = Counter()


def _prefix(draw, session: str) -> Stream:
    """What follows the Upgrade before the fault: the hello and the open with NNRP pings (``session`` "yes", or
    drawn for "maybe"), ws pings and pongs between the frames."""
    payloads = []
    if session == "yes" or session == "maybe" and draw(st.booleans()):
        payloads = _groups(draw, [HELLO, OPEN] + [nnrp_ping(k) for k in range(draw(st.integers(0, 2)))])
    return messages(draw, payloads)


@settings(FUZZ, max_examples=20 * SCALE)  # per category
@given(data=st.data())
def _malformed_inputs(category: str, data) -> None:
    draw = data.draw
    case = MALFORMED[category](draw)
    prefix = _prefix(draw, case.session)
    seen_by_reference, _ = reference(prefix.data + case.frames)
    if case.ws_code is not None:  # the generator made the frames malformed the way the category says
        assert seen_by_reference == case.ws_code, (category, seen_by_reference)
    else:  # the frames are well-formed: the fault is NNRP's (or nobody's: the end of stream, the timer)
        assert seen_by_reference is None, (category, seen_by_reference)
    unread = case.code is not None and not (case.expire or case.stop)
    trailer = frame(0x2, nnrp_ping(), key=draw(KEYS)) if unread and draw(st.booleans()) else b""  # never read
    client, request = upgrade(draw(st.sampled_from([PATH, PATH, PATH + "?k=v"])))
    stream = request + prefix.data + case.frames + trailer
    run = drive(
        client,
        stream,
        cuts_of(draw, stream),
        eof=case.eof,
        expire=case.expire,
        stop=case.stop,
        open_until_eof=case.open_until_eof,
    )
    assert run.out.status == 101
    assert run.closed, category
    if case.code is None:
        assert run.out.close is None or run.out.close[0] in (CLOSE_NORMAL, CLOSE_PROTOCOL_ERROR), run.out.close
    else:
        assert run.out.close is not None and run.out.close[0] == case.code, (category, run.out.close)
    assert run.out.pongs[: len(prefix.pings)] == list(prefix.pings)  # each ping before the fault was answered
    if case.session == "yes":
        assert [p[6] for p in run.out.packets[:2]] == [T.SERVER_HELLO_ACK, T.SESSION_OPEN_ACK]
    assert [p[6] for p in run.out.packets[2:] if p[6] in case.answers] == list(case.answers), run.out.packets
    SEEN[category] += 1


@FUZZ
@given(data=st.data())
def _bad_upgrades(data) -> None:
    """An Upgrade of another path → 404; a request that is no valid Upgrade → the 4xx wsproto / h11 name;
    the transport closes and the frames behind the request are never read."""
    draw = data.draw
    if draw(st.booleans()):
        client, request = upgrade(draw(st.sampled_from(["/", "/nnrp/", "/NNRP", "/other", "/nnrpx", "/nnrp/x?y"])))
        expected = {404}
        SEEN["wrong path"] += 1
    else:
        client, request = upgrade()
        request = draw(st.sampled_from(BAD_REQUESTS))
        expected = {400, 426, 431}
        SEEN["bad request"] += 1
    stream = request + frame(0x2, HELLO) + frame(0x2, OPEN)
    run = drive(client, stream, cuts_of(draw, stream))
    assert run.out.status in expected, run.out.status
    assert run.closed and run.submitted == 0


@FUZZ
@given(data=st.data())
def _garbage(data) -> None:
    """Random bytes after the Upgrade (or random frames): no exception, no abort, bounded buffers, well-formed
    output; a close frame, if any, with a code a peer may send."""
    draw = data.draw
    prefix = _prefix(draw, "maybe")
    noise = draw(
        st.one_of(
            st.binary(max_size=200),
            st.builds(
                frame,
                st.integers(0, 15),
                st.binary(max_size=200),
                fin=st.booleans(),
                rsv=st.sampled_from([0, 0, 0, 1, 4]),
                key=st.sampled_from([b"\x01\x02\x03\x04"] * 3 + [None]),
            ),
        )
    )
    client, request = upgrade()
    stream = request + prefix.data + noise
    run = drive(client, stream, cuts_of(draw, stream), eof=draw(st.booleans()))
    assert run.out.status == 101
    if run.out.close is not None and run.out.close[0] is not None:  # a code a peer may send (its own, or the
        code = run.out.close[0]  # echo of the client's close): never a reserved or local-only one
        assert 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999, run.out.close
    SEEN["garbage"] += 1


def _covering(fuzz, expected) -> Counter:
    """Run the hypothesis test ``fuzz`` until its examples covered every one of ``expected`` (at most
    :data:`COVERAGE_ROUNDS` runs); fail with what it never produced."""
    SEEN.clear()
    run_until(fuzz, COVERAGE_ROUNDS, lambda: not set(expected) - set(SEEN))
    missing = set(expected) - set(SEEN)
    if not missing:
        return SEEN
    raise AssertionError(f"in {COVERAGE_ROUNDS} runs the generator never produced {sorted(missing)}: {dict(SEEN)}")


@pytest.mark.parametrize("category", MALFORMED)
def test_malformed_input_gets_the_close_code_the_docstring_names(category: str) -> None:
    SEEN.clear()
    _malformed_inputs(category)
    # the count: the generator made this category's input (as the reference saw it) and the server answered it
    assert SEEN[category] >= 1, dict(SEEN)


def test_bad_upgrades_get_an_http_error() -> None:
    _covering(_bad_upgrades, ["wrong path", "bad request"])


def test_garbage_never_crashes_or_leaks() -> None:
    _covering(_garbage, ["garbage"])


# -- well-formed input --------------------------------------------------------------------------------------------


def _well_formed(draw) -> tuple[list[bytes], Stream, bytes, tuple[int | None, str] | None]:
    """Upgrade + hello + open, then NNRP pings, submits and maybe a SESSION_CLOSE, in messages of one to three
    packets, fragmented, with pings and pongs between the frames; maybe the client's close at the end (its
    frame, returned apart with the close frame the server must answer with, is to start a read of its own: the
    test at the end covers the other case)."""
    packets = [HELLO, OPEN]
    frame_id = 0
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()) or frame_id == 4:  # at most max_in_flight submits: none is refused
            packets.append(nnrp_ping(draw(st.integers(0, 3))))
        else:
            frame_id += 1
            packets.append(w.submit(SESSION, frame_id, frame_id, BODY))
    if draw(st.booleans()):
        packets.append(w.session_close(SESSION, frame_id))
    groups = _groups(draw, packets)
    stream = messages(draw, groups)
    stream.features["several packets in a message"] += any(len(PacketReader().feed(g)) > 1 for g in groups)
    close, answer = b"", None
    if draw(st.booleans()):  # the client's close: answered with the same code and reason (none without a code)
        code = draw(st.sampled_from([None, 1000, 1001, 3000, 4999]))
        reason = "" if code is None else draw(st.text(max_size=20))
        close = frame(0x8, b"" if code is None else struct.pack("!H", code) + reason.encode(), key=draw(KEYS))
        answer = (code, reason)
    return packets, stream, close, answer


WELL_FORMED_FEATURES = (
    "fragmented",
    "ping between frames",
    "ping between messages",
    "pong",
    "several packets in a message",
    "client close",
    "split into reads",
)


@FUZZ
@given(data=st.data())
def _split_well_formed_streams(data) -> None:
    draw = data.draw
    packets, stream, close, answer = _well_formed(draw)
    assert reference(stream.data)[0] is None  # well-formed frames (the close aside: wsproto reports it as a close)
    client, request = upgrade()
    whole = drive(client, request + stream.data + close, [len(request) + len(stream.data)])
    assert whole.out.status == 101
    assert [p[6] for p in whole.out.packets[:2]] == [T.SERVER_HELLO_ACK, T.SESSION_OPEN_ACK]
    pings = [p for p in packets if p[6] == T.PING]
    assert [p for p in whole.out.packets if p[6] == T.PONG] == [
        encode(T.PONG, SESSION, struct.unpack_from("<I", p, 24)[0]) for p in pings
    ]
    assert whole.out.pongs == list(stream.pings)
    assert whole.submitted == sum(p[6] == T.FRAME_SUBMIT for p in packets)
    assert whole.out.close == answer and whole.closed == bool(close)  # a client's close is answered in kind
    client, request = upgrade()
    data_ = request + stream.data + close
    cuts = cuts_of(draw, data_)
    split = drive(client, data_, cuts + [len(request) + len(stream.data)])
    assert split.out.status == 101
    assert split.out.packets == whole.out.packets
    assert split.out.pongs == whole.out.pongs
    assert split.out.close == whole.out.close and split.closed == whole.closed
    assert split.submitted == whole.submitted
    SEEN.update(k for k, v in stream.features.items() if v)
    SEEN["client close"] += bool(close)
    SEEN["split into reads"] += len(chunks(data_, cuts)) > 1


def test_well_formed_streams_split_anywhere_give_the_same_output() -> None:
    _covering(_split_well_formed_streams, WELL_FORMED_FEATURES)


def test_the_answers_to_messages_in_the_same_read_as_the_clients_close_go_out_before_the_close() -> None:
    """A client that sends SESSION_CLOSE and its close frame at once still gets its acks (found by the fuzz)."""
    client, request = upgrade()
    run = drive(
        client, request + frame(0x2, HELLO) + frame(0x2, OPEN) + frame(0x8, struct.pack("!H", 1000)), [len(request)]
    )
    assert run.out.close == (1000, "") and run.closed
    assert [p[6] for p in run.out.packets] == [T.SERVER_HELLO_ACK, T.SESSION_OPEN_ACK]


def test_frames_in_the_same_read_as_a_request_head_with_bare_lf_line_ends_are_served() -> None:
    """h11 takes a head whose lines end in a bare LF; the frames behind it in the same read are served too."""
    client, request = upgrade()
    run = drive(client, request.replace(b"\r\n", b"\n") + frame(0x2, HELLO) + frame(0x2, OPEN), [])
    assert run.out.status == 101 and not run.closed
    assert [p[6] for p in run.out.packets] == [T.SERVER_HELLO_ACK, T.SESSION_OPEN_ACK]

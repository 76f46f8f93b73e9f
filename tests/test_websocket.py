"""WebSocket (``ws://``, ``wss://``) on the project's own carrier (:mod:`vllm_nnrp_plugin.nnrp_binding.websocket`):

* the mapping is the one nnrp-py's native peers use, checked on their recorded bytes
  (``tests/wire/data/captures/ws-*.jsonl``): the native client's own byte stream is served;
* bad input ends the connection as RFC 6455 says (a close frame with the code it names, or an HTTP error for a
  bad Upgrade), never with an exception, a hang or a session left counted: examples and a fuzz of the framing;
* vLLM's API key over ws/wss as over TCP (a raw WebSocket client with the wire core's client), and nnrp-py's
  native client, which cannot send a key, refused with ``auth_failed``.

Unit tests drive a :class:`WebSocketConnection` over a fake transport with ``wsproto``'s client as the peer;
the key tests run the real listener on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import socket
import ssl
import struct

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Pong,
    Request,
)

from tests.support import ServedNNRP, envelope, free_port, self_signed
from vllm_nnrp_plugin.carriers.websocket import binary_frames
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.contract.auth_block import bearer_block
from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.core.operation import State
from vllm_nnrp_plugin.nnrp_binding.bounds import BufferBudget, CarrierBounds
from vllm_nnrp_plugin.nnrp_binding.connection import FlushRound, NNRPConnection, SessionGate
from vllm_nnrp_plugin.nnrp_binding.websocket import WebSocketConnection
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.nnrp_wire.codecs import SESSION_ERROR_AUTH_FAILED
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader

CAPTURES = pathlib.Path(__file__).parent / "wire" / "data" / "captures"
SCALE = int(os.environ.get("NNRP_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=150 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = "sk-ws-key-0123"
STREAM = envelope({"model": "a-stream-text", "messages": [], "stream": True})
MAX_PACKET = 64 * 1024


# -- the peer and the fake transport ----------------------------------------------------------------------------


def silence_passes(protocol) -> None:
    """The handshake timer fires after the client has been silent for the whole bound (its clock marks moved
    back by the timeout, :func:`vllm_nnrp_plugin.nnrp_binding.bounds.handshake_recheck`)."""
    nnrp = protocol.nnrp
    nnrp._started_at -= nnrp._handshake_timeout_s
    nnrp._heard_at -= nnrp._handshake_timeout_s
    nnrp._handshake_expired()


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_extra_info(self, name: str) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def take(self) -> bytes:
        data = b"".join(self.writes)
        self.writes.clear()
        return data


class Handler:
    def __init__(self) -> None:
        self.submitted: list = []
        self.sessions = 0

    def on_submit(self, sop) -> None:
        self.submitted.append(sop)

    def on_session(self, transport, opened) -> None:
        self.sessions += 1 if opened else -1

    def __getattr__(self, name):  # every other report: nothing to do
        return lambda *args, **kwargs: None


class Served:
    """One :class:`WebSocketConnection` on the running loop, its fake transport and listener state."""

    def __init__(self, path: str = "/nnrp", authenticate=None) -> None:
        self.handler, self.transport = Handler(), Transport()
        self.gate, self.budget = SessionGate(8), BufferBudget(1 << 20)
        self.protocol = WebSocketConnection(
            NNRPConnection(
                self.handler,
                transport_name="websocket",
                limits=SessionLimits(max_in_flight=4, max_queued_events=64),
                gate=self.gate,
                flush_round=FlushRound(asyncio.get_running_loop()),
                on_lost=lambda c: None,
                bounds=CarrierBounds(max_packet_bytes=MAX_PACKET),
                budget=self.budget,
                authenticate=authenticate,
            ),
            path=path,
        )
        self.protocol.connection_made(self.transport)  # type: ignore[arg-type]

    def feed(self, data: bytes) -> None:
        self.protocol.data_received(data)

    def lose(self) -> None:
        """The transport ends (as asyncio reports it after a close): nothing may stay counted."""
        self.protocol.connection_lost(None)
        assert self.gate.open == 0 and self.handler.sessions == 0
        assert self.budget.used == 0


class Peer:
    """``wsproto``'s client plus the wire core's client: what the server's bytes mean."""

    def __init__(self, path: str = "/nnrp", auth_block: bytes = b"", subprotocols=()) -> None:
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.nnrp = ClientConnection(auth_block=auth_block)
        self.upgrade = self.ws.send(Request(host="127.0.0.1", target=path, subprotocols=list(subprotocols)))

    def send_nnrp(self) -> bytes:
        """The wire core's output, one binary message per packet (as the native client sends it)."""
        return b"".join(self.ws.send(BytesMessage(p)) for p in packets_of(self.nnrp.data_to_send()))

    def receive(self, data: bytes) -> list:
        """wsproto's events for ``data``; binary messages are also fed to the wire core (``self.nnrp_events``)."""
        self.ws.receive_data(data)
        out = list(self.ws.events())
        self.nnrp_events = []
        for event in out:
            if isinstance(event, BytesMessage):
                assert event.message_finished and len(packets_of(event.data)) == 1  # one packet per message
                self.nnrp_events += self.nnrp.receive_data(event.data)
        return out


def packets_of(data: bytes) -> list[bytes]:
    """``data`` cut into NNRP packets: their headers valid (the wire core's reader) and nothing left over."""
    reader, out, pos = PacketReader(), [], 0
    reader.feed(data)
    assert reader.buffered == 0
    while pos < len(data):
        meta_len, body_len = struct.unpack_from("<II", data, pos + 12)
        out.append(data[pos : pos + 40 + meta_len + body_len])
        pos += 40 + meta_len + body_len
    assert pos == len(data)
    return out


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each frame in ``data``, frames a server sends: final and unmasked, or failing here."""
    pos, out = 0, []
    while pos < len(data):
        assert data[pos] & 0xF0 == 0x80 and not data[pos + 1] & 0x80  # FIN, no RSV, not masked
        n, start = data[pos + 1], pos + 2
        if n == 126:
            n, start = struct.unpack_from("!H", data, start)[0], start + 2
        elif n == 127:
            n, start = struct.unpack_from("!Q", data, start)[0], start + 8
        out.append((data[pos] & 0x0F, data[start : start + n]))
        pos = start + n
    assert pos == len(data)
    return out


def opened(served: Served, peer: Peer) -> int:
    """Upgrade, hello and one session; returns its id."""
    served.feed(peer.upgrade)
    (accept,) = peer.receive(served.transport.take())
    assert isinstance(accept, AcceptConnection)
    peer.nnrp.open_session()
    served.feed(peer.send_nnrp())
    peer.receive(served.transport.take())
    (ack,) = peer.nnrp_events
    assert isinstance(ack, ev.SessionOpenAccepted)
    return ack.session_id


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, rsv: int = 0) -> bytes:
    """A client frame built by hand (RFC 6455 §5.2), for what wsproto would refuse to send."""
    head = bytes([(0x80 if fin else 0) | rsv << 4 | opcode])
    n = len(payload)
    length = (
        bytes([n]) if n < 126 else (b"\x7e" + struct.pack("!H", n) if n < 1 << 16 else b"\x7f" + struct.pack("!Q", n))
    )
    if not mask:
        return head + bytes([length[0]]) + length[1:] + payload
    key = b"\x01\x02\x03\x04"
    return head + bytes([length[0] | 0x80]) + length[1:] + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def closed_with(served: Served, peer: Peer, code: int) -> None:
    """The server's last frame is a close with ``code``, and it closed the transport."""
    events = peer.receive(served.transport.take())
    assert isinstance(events[-1], CloseConnection), events
    assert events[-1].code == code
    assert served.transport.closed and not served.transport.aborted


def run(coro):
    return asyncio.run(coro)


# -- the native peers' mapping ----------------------------------------------------------------------------------


def capture(name: str) -> dict[str, bytes]:
    streams: dict[str, bytearray] = {"c2s": bytearray(), "s2c": bytearray()}
    for line in (CAPTURES / f"{name}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "hex" in record:
            streams[record["dir"]] += bytes.fromhex(record["hex"])
    return {k: bytes(v) for k, v in streams.items()}


@pytest.mark.parametrize("name", ["ws-basic", "ws-multiplex"])
def test_the_native_peers_send_one_packet_per_binary_message_with_no_subprotocol(name):
    """What the recordings of nnrp-py's native client and server show (and nnrp-rs' transport requires)."""
    recorded = capture(name)
    request, _, client_frames = recorded["c2s"].partition(b"\r\n\r\n")
    assert request.startswith(b"GET /nnrp HTTP/1.1\r\n")
    headers = request.lower()
    assert b"sec-websocket-protocol" not in headers and b"sec-websocket-extensions" not in headers
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(request + b"\r\n\r\n")
    events = list(server.events())
    assert isinstance(events[0], Request) and events[0].subprotocols == [] and events[0].extensions == []
    server.send(AcceptConnection())
    server.receive_data(client_frames)
    messages = [e for e in server.events() if isinstance(e, BytesMessage)]
    assert messages and all(e.message_finished and len(packets_of(e.data)) == 1 for e in messages)
    response, _, frames = recorded["s2c"].partition(b"\r\n\r\n")
    assert b"101 Switching Protocols" in response and b"sec-websocket-protocol" not in response.lower()
    # the native server's frames: unmasked, final, binary, one packet each; ours are byte-identical
    server_packets = [payload for op, payload in server_frames(frames)]
    assert all(len(packets_of(p)) == 1 for p in server_packets)
    assert binary_frames(b"".join(server_packets)) == frames


def test_the_native_clients_recorded_bytes_are_served():
    """The native client's recorded stream (Upgrade, hello, session 7, submits, cancels, close), replayed in
    one piece: 101 without subprotocol or extension, each answer one binary message, its close answered."""

    async def main():
        served = Served()
        served.feed(capture("ws-basic")["c2s"])
        response = served.transport.writes[0]
        assert response.startswith(b"HTTP/1.1 101 ")
        assert b"sec-websocket-protocol" not in response.lower() and b"sec-websocket-extensions" not in response.lower()
        frames = server_frames(served.transport.take().partition(b"\r\n\r\n")[2])
        assert [op for op, _ in frames[:-1]] == [0x2] * (len(frames) - 1) and len(frames) > 3
        assert all(len(packets_of(payload)) == 1 for _, payload in frames[:-1])
        assert frames[-1] == (0x8, b"") and served.transport.closed  # its close (no code) answered in kind
        assert len(served.handler.submitted) == 3
        served.lose()

    run(main())


def test_a_stream_goes_out_one_packet_per_message_in_one_write_per_iteration():
    async def main():
        served, peer = Served(), Peer()
        session = opened(served, peer)
        peer.nnrp.submit(session, wire_mapping.typed_body(orjson.dumps(STREAM)))
        served.feed(peer.send_nnrp())
        (sop,) = served.handler.submitted
        from vllm_nnrp_plugin.profile import events

        for text in ("a", "b", "c"):
            sop.partial(events.output_text_delta(0, text))
        await asyncio.sleep(0)
        assert len(served.transport.writes) == 1
        peer.receive(served.transport.take())
        assert [e.result_sequence for e in peer.nnrp_events] == [1, 2, 3]
        served.lose()

    run(main())


# -- bad input: RFC 6455's answers -------------------------------------------------------------------------------


BAD_FRAMES = [
    ("text message", frame(0x1, b"hello"), 1003),
    ("unmasked frame", frame(0x2, b"\x00" * 40, mask=False), 1002),
    ("reserved bits", frame(0x2, b"\x00" * 40, rsv=4), 1002),
    ("reserved opcode", frame(0x3, b""), 1002),
    ("fragmented ping", frame(0x9, b"x", fin=False), 1002),
    ("control frame over 125 bytes", frame(0x9, b"x" * 126), 1002),
    ("continuation without a start", frame(0x0, b"\x00" * 40), 1002),
    ("new message inside a fragmented one", frame(0x2, b"NN", fin=False) + frame(0x2, b"RP"), 1002),
    ("close with a 1-byte payload", frame(0x8, b"\x03"), 1002),
    ("close with invalid UTF-8", frame(0x8, b"\x03\xe8\xff\xfe"), 1007),
    ("message not NNRP", frame(0x2, b"GET / HTTP/1.1\r\n" * 4), 1002),
    ("message ending inside a packet", frame(0x2, b"NNRP\x01\x00\x01\x28"), 1002),
    ("empty binary message", frame(0x2, b""), 1002),
    ("message over the packet limit", frame(0x2, b"\x00" * (MAX_PACKET + 1)), 1009),
]


@pytest.mark.parametrize(("label", "bad", "code"), BAD_FRAMES, ids=[b[0] for b in BAD_FRAMES])
def test_bad_frames_end_the_connection_with_rfc_6455s_code(label, bad, code):
    async def main():
        served, peer = Served(), Peer()
        opened(served, peer)
        served.feed(bad)
        closed_with(served, peer, code)
        served.feed(frame(0x2, b"more"))  # after the close: ignored, nothing written
        assert served.transport.writes == []
        served.lose()

    run(main())


def test_a_message_growing_over_the_packet_limit_is_refused_as_its_bytes_arrive():
    """A packet of exactly the limit is announced, then the message goes on: 1009 as soon as the bytes that
    arrived take the message over the limit; the core never held more than one packet's worth."""

    async def main():
        served, peer = Served(), Peer()
        session = opened(served, peer)
        peer.nnrp.submit(session, b"x")
        header = bytearray(peer.nnrp.data_to_send()[:40])
        meta_len = struct.unpack_from("<I", header, 12)[0]
        struct.pack_into("<I", header, 16, MAX_PACKET - 40 - meta_len)  # body_len: the packet is the limit
        start = frame(0x2, b"\x00" * (MAX_PACKET + 100))[:14]  # a frame header announcing more than the limit
        key = start[-4:]
        masked = bytes(b ^ key[i % 4] for i, b in enumerate(bytes(header) + b"\x00" * (MAX_PACKET + 60)))
        served.feed(start + masked[:40])
        assert not served.transport.closed
        served.feed(masked[40 : MAX_PACKET - 10])
        assert not served.transport.closed and served.budget.used > 0
        served.feed(masked[MAX_PACKET - 10 :])
        closed_with(served, peer, 1009)
        served.lose()

    run(main())


def test_fragments_with_a_ping_between_them_carry_one_packet_and_the_ping_is_answered():
    async def main():
        served, peer = Served(), Peer()
        session = opened(served, peer)
        peer.nnrp.close_session(session)
        packet = peer.nnrp.data_to_send()
        served.feed(frame(0x2, packet[:10], fin=False) + frame(0x9, b"hi") + frame(0x0, packet[10:30], fin=False))
        served.feed(frame(0x0, packet[30:]))
        events = peer.receive(served.transport.take())
        assert isinstance(events[0], Pong) and events[0].payload == b"hi"
        assert any(isinstance(e, ev.SessionCloseAcked) for e in peer.nnrp_events)
        assert not served.transport.closed
        served.feed(frame(0xA, b"unsolicited"))  # a pong: ignored
        assert served.transport.writes == [] and not served.transport.closed
        served.lose()

    run(main())


def test_a_clients_close_is_answered_and_its_operations_stop():
    async def main():
        served, peer = Served(), Peer()
        session = opened(served, peer)
        peer.nnrp.submit(session, wire_mapping.typed_body(orjson.dumps(STREAM)))
        served.feed(peer.send_nnrp())
        (sop,) = served.handler.submitted
        served.feed(peer.ws.send(CloseConnection(code=1000, reason="bye")))
        closed_with(served, peer, 1000)
        assert sop.rules.state is State.SENT  # stopped as for a lost client: nothing of it can be sent
        served.lose()

    run(main())


def test_the_server_says_goodbye_with_1001_when_it_stops_and_1008_when_no_session_opened_in_time():
    async def main():
        served, peer = Served(), Peer()
        opened(served, peer)
        served.protocol.nnrp.shut_down()
        closed_with(served, peer, 1001)
        served.lose()
        served, peer = Served(), Peer()
        served.feed(peer.upgrade)
        peer.receive(served.transport.take())
        silence_passes(served.protocol)
        closed_with(served, peer, 1008)
        served.lose()

    run(main())


@pytest.mark.parametrize(
    ("label", "request_bytes", "status"),
    [
        ("another path", None, 404),
        ("not an upgrade", b"GET /nnrp HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (
            "POST",
            b"POST /nnrp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
            400,
        ),
        (
            "wrong version",
            b"GET /nnrp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 8\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
            426,
        ),
        (
            "no key",
            b"GET /nnrp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n",
            400,
        ),
        ("not HTTP", b"NNRP\x01\x00\x01\x28" + b"\x00" * 100 + b"\r\n\r\n", 400),
    ],
)
def test_a_bad_upgrade_gets_an_http_error_and_the_connection_closes(label, request_bytes, status):
    async def main():
        served = Served()
        if label == "another path":
            request_bytes_ = Peer(path="/other").upgrade
        else:
            request_bytes_ = request_bytes
        served.feed(request_bytes_)
        answer = served.transport.take()
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
        assert served.transport.closed and not served.transport.aborted
        assert served.handler.sessions == 0
        served.lose()

    run(main())


def test_plain_nnrp_on_a_websocket_address_waits_for_a_request_head_until_the_handshake_timeout():
    """NNRP bytes hold no request head: h11 waits for one (at most 16 KiB, then 400); the handshake timeout
    closes the connection without a word."""

    async def main():
        served, client = Served(), ClientConnection()
        client.open_session()
        served.feed(client.data_to_send())
        assert served.transport.writes == [] and not served.transport.closed
        silence_passes(served.protocol)
        assert served.transport.writes == [] and served.transport.closed
        served.lose()
        served = Served()
        served.feed(b"GET /nnrp HTTP/1.1\r\nX: " + b"y" * 20000)
        assert served.transport.take().startswith(b"HTTP/1.1 4") and served.transport.closed
        served.lose()

    run(main())


def test_a_client_offering_a_subprotocol_gets_none():
    async def main():
        served, peer = Served(), Peer(subprotocols=["nnrp.v1"])
        served.feed(peer.upgrade)
        (accept,) = peer.receive(served.transport.take())
        assert isinstance(accept, AcceptConnection) and accept.subprotocol is None
        served.lose()

    run(main())


# -- fuzz ------------------------------------------------------------------------------------------------------


def _valid_client_stream() -> list[bytes]:
    """The Upgrade, then a hello and a session open, each one masked binary message."""
    client = ClientConnection()
    client.open_session()
    frames = [frame(0x2, p) for p in packets_of(client.data_to_send())]
    return [Peer().upgrade] + frames


FRAME_PIECES = st.one_of(
    st.builds(
        frame,
        st.sampled_from([0x0, 0x1, 0x2, 0x3, 0x8, 0x9, 0xA, 0xB, 0xF]),
        st.binary(max_size=200),
        fin=st.booleans(),
        mask=st.booleans(),
        rsv=st.integers(0, 7),
    ),
    st.binary(max_size=64),  # raw garbage
    st.builds(lambda n: frame(0x2, b"\x00" * 14)[:2] + n, st.binary(min_size=0, max_size=10)),  # a torn header
)


@FUZZ
@given(
    pieces=st.lists(FRAME_PIECES, max_size=8),
    prefix_valid=st.booleans(),
    cuts=st.lists(st.integers(1, 50), max_size=20),
    eof=st.booleans(),
)
def test_fuzzed_framing_never_crashes_hangs_or_leaks(pieces, prefix_valid, cuts, eof):
    """Whatever frames follow (or replace) a valid Upgrade + hello + open, cut anywhere: no exception, no
    abort (the handler of a bug), every server frame well-formed and unmasked, nothing written after a close
    frame or an HTTP error, and once the transport is gone nothing stays counted."""

    async def main():
        served = Served()
        data = b"".join(_valid_client_stream() if prefix_valid else [Peer().upgrade]) + b"".join(pieces)
        pos = 0
        for cut in cuts + [len(data)]:
            if pos >= len(data):
                break
            served.feed(data[pos : pos + cut])
            pos += cut
        if eof:
            served.protocol.eof_received()
        out = served.transport.take()
        assert not served.transport.aborted
        if out.startswith(b"HTTP/1.1 101 "):
            frames = server_frames(out.partition(b"\r\n\r\n")[2])  # final, unmasked, whole
            assert all(op != 0x8 for op, _ in frames[:-1])  # a close frame is the last thing written
            for op, payload in frames:
                assert op in (0x2, 0x8, 0xA), op  # binary, close, pong
                if op == 0x2:
                    assert len(packets_of(payload)) == 1
            if frames and frames[-1][0] == 0x8:
                assert served.transport.closed
        elif out:
            assert out.startswith(b"HTTP/1.1 4"), out[:40]
            assert served.transport.closed
        served.lose()

    run(main())


# -- API keys over the real listener ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wskeys")
    cert, key, der = self_signed(tmp)
    served = ServedNNRP(
        (f"ws://127.0.0.1:{free_port()}", f"wss://127.0.0.1:{free_port()}/deep/path"),
        api_keys=(KEY,),
        tls_cert_file=cert,
        tls_key_file=key,
    )
    served.der = der
    yield served
    served.stop()


def raw_session(uri: str, der: bytes | None, api_key: str | None) -> object:
    """Upgrade, hello with ``api_key``'s block and one SESSION_OPEN over a blocking socket; returns the
    wire core client's answer (SessionOpenAccepted / SessionOpenRejected) after also streaming one operation."""
    from vllm_nnrp_plugin.contract.endpoints import parse_endpoint

    carrier = parse_endpoint(uri)
    port = int(carrier.provider_uri.rsplit(":", 1)[1].split("/", 1)[0])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if carrier.tls:
        context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
        sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
    peer = Peer(path=carrier.provider_uri.split(str(port), 1)[1], auth_block=bearer_block(api_key) if api_key else b"")
    try:
        sock.sendall(peer.upgrade)
        accepted = False
        while not accepted:
            data = sock.recv(65536)
            assert data, "closed before the Upgrade was answered"
            accepted = any(isinstance(e, AcceptConnection) for e in peer.receive(data))
        peer.nnrp.open_session()
        sock.sendall(peer.send_nnrp())
        answer = None
        while answer is None:
            data = sock.recv(65536)
            assert data, "closed before the open was answered"
            peer.receive(data)
            for event in peer.nnrp_events:
                if isinstance(event, (ev.SessionOpenAccepted, ev.SessionOpenRejected)):
                    answer = event
        if isinstance(answer, ev.SessionOpenAccepted):
            peer.nnrp.submit(answer.session_id, wire_mapping.typed_body(orjson.dumps(STREAM)))
            sock.sendall(peer.send_nnrp())
            done = False
            while not done:
                data = sock.recv(65536)
                assert data
                peer.receive(data)
                done = any(not isinstance(e, ev.PartialResultReceived) for e in peer.nnrp_events)
            sock.sendall(peer.ws.send(CloseConnection(code=1000)))
        return answer
    finally:
        sock.close()


@pytest.mark.parametrize("scheme", ["ws", "wss"])
def test_ws_and_wss_serve_only_with_one_of_vllms_keys(keyed, scheme):
    (uri,) = [u for u in keyed.bound if u.startswith(f"{scheme}://")]
    assert isinstance(raw_session(uri, keyed.der, KEY), ev.SessionOpenAccepted)
    for key in (None, "sk-wrong"):
        refused = raw_session(uri, keyed.der, key)
        assert isinstance(refused, ev.SessionOpenRejected)
        assert refused.session_error_code == SESSION_ERROR_AUTH_FAILED


@pytest.mark.parametrize("scheme", ["ws", "wss"])
def test_nnrp_pys_native_client_cannot_send_a_key_and_is_refused_over_websocket(keyed, scheme):
    from vllm_nnrp_plugin.client import ProfileClient
    from vllm_nnrp_plugin.client.errors import ClientTransportError

    (uri,) = [u for u in keyed.bound if u.startswith(f"{scheme}://")]
    with pytest.raises(ClientTransportError) as refused:
        asyncio.run(ProfileClient.connect(uri, trusted_cert_der=keyed.der))
    assert refused.value.status.protocol_error_code == SESSION_ERROR_AUTH_FAILED

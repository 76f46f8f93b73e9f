"""The handshake bound measures the client's silence, not the server's: a connection whose CLIENT_HELLO and
SESSION_OPEN wait unread in its socket while vLLM's loop is busy is never closed for it, while a client that
sends nothing, half a hello, or a trickle of bytes is closed as before (``nnrp.handshake_timeout_ms``;
:func:`vllm_nnrp_plugin.nnrp_binding.bounds.handshake_recheck`)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from nnrp.core.enums import MessageType as T

from tests.support import ServedNNRP, envelope, free_port, metric, wait_until
from tests.wire import wirekit as w
from vllm_nnrp_plugin.client import connect
from vllm_nnrp_plugin.nnrp_binding.bounds import HANDSHAKE_CAP_FACTOR, handshake_recheck
from vllm_nnrp_plugin.nnrp_wire.codecs import SessionOpenAckMetadata
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader

TIMEOUT_MS = 300
STREAM = envelope({"model": "a-stream-text", "messages": [], "stream": True})


def test_the_rule_closes_on_silence_or_a_long_trickle_and_never_with_bytes_waiting() -> None:
    timeout = 10.0
    assert handshake_recheck(10.0, 10.0, 0, timeout) is None  # silent since it connected
    assert handshake_recheck(10.0, 10.0, 112, timeout) == timeout  # its hello waits unread: the loop was busy
    assert handshake_recheck(500.0, 500.0, 1, timeout) == timeout  # however long the loop was stalled
    assert handshake_recheck(10.0, 4.0, 0, timeout) == pytest.approx(6.0)  # it spoke 4 s ago: 6 s more
    assert handshake_recheck(25.0, 1.0, 0, timeout) == pytest.approx(5.0)  # a trickle: at most the cap
    assert handshake_recheck(HANDSHAKE_CAP_FACTOR * timeout, 0.5, 0, timeout) is None


@pytest.fixture
def served():
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), handshake_timeout_ms=TIMEOUT_MS)
    yield served
    served.stop()


def _connection(served: ServedNNRP):
    listener = served.service._listener
    assert wait_until(lambda: len(listener._connections) == 1)
    (connection,) = listener._connections
    return connection


def _on_loop(served: ServedNNRP, call) -> None:
    async def run() -> None:
        call()

    asyncio.run_coroutine_threadsafe(run(), served.loop).result(5)


def _timeouts(served: ServedNNRP) -> float:
    return metric("nnrp_handshake_timeouts_total", transport="tcp")


def test_a_hello_waiting_unread_while_the_loop_is_busy_is_served_not_closed(served) -> None:
    """The server does not read the connection (as a busy vLLM loop, whose timers run before its reads: libuv
    runs due timers first) for longer than the handshake bound, cap included, while the client's CLIENT_HELLO
    and SESSION_OPEN wait in the socket: the timer keeps it; once read, the session opens and serves."""
    host, port = served.bound[0].removeprefix("tcp://").rsplit(":", 1)
    before = _timeouts(served)
    sock = socket.create_connection((host, int(port)))
    connection = _connection(served)
    _on_loop(served, lambda: connection.carrier.hold_input(True))
    sock.sendall(w.hello() + w.session_open(0))
    time.sleep((HANDSHAKE_CAP_FACTOR + 1) * TIMEOUT_MS / 1000)  # the bound passes, several times
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):  # nothing: neither an answer (unread) nor the end of the connection
        sock.recv(1)
    assert _timeouts(served) == before
    _on_loop(served, lambda: connection.carrier.hold_input(False))
    reader, packets = PacketReader(), []
    sock.settimeout(5)
    while len(packets) < 2:
        packets += reader.feed(sock.recv(65536))
    hello_ack, open_ack = packets
    assert (hello_ack.msg_type, open_ack.msg_type) == (T.SERVER_HELLO_ACK, T.SESSION_OPEN_ACK)
    assert SessionOpenAckMetadata.unpack(open_ack.meta).session_status == 0
    assert served.service.sessions == 1
    sock.close()


def test_silent_half_and_trickling_clients_are_closed_and_counted(served) -> None:
    host, port = served.bound[0].removeprefix("tcp://").rsplit(":", 1)
    before = _timeouts(served)
    started = time.monotonic()
    silent = socket.create_connection((host, int(port)))
    half = socket.create_connection((host, int(port)))
    half.sendall(b"NNRP\x01\x00\x01")  # the first bytes of a header, then nothing
    trickle = socket.create_connection((host, int(port)))
    hello = w.hello()
    closed_at = {}
    for index in range(len(hello)):
        for name, sock in (("silent", silent), ("half", half)):
            if name not in closed_at:
                sock.settimeout(0.0)
                try:
                    if sock.recv(1) == b"":
                        closed_at[name] = time.monotonic() - started
                except BlockingIOError:
                    pass
        try:
            trickle.sendall(hello[index : index + 1])  # a byte every 50 ms: never silent for the bound
        except OSError:
            break
        time.sleep(0.05)
    trickle.settimeout(5)
    try:
        assert trickle.recv(1) == b""
    except ConnectionResetError:
        pass
    trickled = time.monotonic() - started
    assert 0.25 < closed_at["silent"] < 1.5 and 0.25 < closed_at["half"] < 1.5, closed_at
    assert HANDSHAKE_CAP_FACTOR * TIMEOUT_MS / 1000 - 0.05 < trickled < 3, trickled
    assert wait_until(lambda: _timeouts(served) >= before + 3)
    for sock in (silent, half, trickle):
        sock.close()


def test_a_client_that_opened_its_session_keeps_its_connection(served) -> None:
    async def main() -> None:
        conn = await connect(served.bound[0])
        session = await conn.open_session()
        await asyncio.sleep(2 * TIMEOUT_MS / 1000)  # the bound would have passed
        events = [event async for event in session.submit(STREAM)]
        assert events[-1]["type"] == "response.completed"
        await conn.close()

    asyncio.run(main())

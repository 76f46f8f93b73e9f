"""A hostile client against the asyncio carrier on loopback (the service with a recorded backend): every
resource it can make the server hold is bounded — connections, bytes of incomplete packets, replies queued for a
client that does not read, descriptors — and a well-behaved client on another connection keeps being served."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time

from nnrp.core.enums import MessageType as T

from tests.support import ServedNNRP, envelope, free_port, metric, self_signed, wait_until
from vllm_nnrp_plugin.client import connect
from vllm_nnrp_plugin.nnrp_binding import listener as listener_module
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.nnrp_wire.framing import encode

STREAM = envelope({"model": "a-stream-text", "messages": [], "stream": True})


def address(served: ServedNNRP) -> tuple[str, int]:
    host, port = served.bound[0].removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def opened_socket(served: ServedNNRP) -> tuple[socket.socket, int]:
    """A raw connection with one open session (its id)."""
    client = ClientConnection()
    client.open_session()
    sock = socket.create_connection(address(served))
    sock.sendall(client.data_to_send())
    sock.settimeout(5)
    events: list = []
    while not events:
        events = client.receive_data(sock.recv(65536))
    (accepted,) = events
    assert isinstance(accepted, ev.SessionOpenAccepted)
    return sock, accepted.session_id


def closed_by_server(sock: socket.socket) -> bool:
    """The server closed (EOF) or aborted (reset) ``sock`` within 5 s."""
    sock.settimeout(5)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def served_promptly(served: ServedNNRP) -> float:
    """Seconds a well-behaved client on its own connection takes for one whole streamed answer."""

    async def main() -> float:
        started = time.monotonic()
        conn = await connect(served.bound[0])
        try:
            session = await conn.open_session()
            events = [event async for event in session.submit(STREAM)]
            assert events[-1]["type"] == "response.completed"
        finally:
            await conn.close()
        return time.monotonic() - started

    return asyncio.run(asyncio.wait_for(main(), 10))


def refused(reason: str) -> float:
    return metric("nnrp_connections_refused_total", transport="tcp", reason=reason)


def test_connections_over_max_connections_are_closed_at_once_and_counted():
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_connections=3)
    try:
        held = [socket.create_connection(address(served)) for _ in range(3)]
        connections = served.service._listener._connections
        # generous: in the whole suite's process (vLLM servers and e2e clients beside it) this once took over 5 s
        assert wait_until(lambda: len(connections) == 3, timeout_s=30), (len(connections), refused("max_connections"))
        extra = socket.create_connection(address(served))
        assert closed_by_server(extra)
        assert wait_until(lambda: refused("max_connections") >= 1)
        for sock in held:
            sock.close()
        assert wait_until(lambda: not connections, timeout_s=30), len(connections)
        assert served_promptly(served) < 5  # room again
    finally:
        served.stop()


def test_connections_in_their_tls_handshake_count_once_and_are_forgotten_when_it_times_out(tmp_path):
    """Plain TCP clients that never start TLS on an ``nnrps`` address: each holds one of ``max_connections``
    while its handshake runs (not two: accepted and being set up are one connection), the one over the limit is
    refused, and when asyncio abandons the handshakes the listener forgets them (no carrier ever told them they
    were lost) and a TLS client gets in."""
    cert, key, _ = self_signed(tmp_path)
    served = ServedNNRP(
        (f"nnrps://127.0.0.1:{free_port()}",),
        max_connections=3,
        handshake_timeout_ms=1500,
        tls_cert_file=cert,
        tls_key_file=key,
    )
    try:
        host, port = served.bound[0].removeprefix("nnrps://").rsplit(":", 1)
        connections = served.service._listener._connections
        held = []
        for n in range(1, 4):  # one at a time: each is being set up when the next is accepted
            held.append(socket.create_connection((host, int(port))))
            assert wait_until(lambda n=n: len(connections) == n), (n, len(connections))
        extra = socket.create_connection((host, int(port)))
        assert closed_by_server(extra)
        assert wait_until(
            lambda: metric("nnrp_connections_refused_total", transport="tls", reason="max_connections") >= 1
        )
        assert wait_until(lambda: not connections, timeout_s=10)
        for sock in held:
            sock.close()
    finally:
        served.stop()


def test_incomplete_packets_share_one_budget_and_release_it_when_they_go():
    """Two stalled connections, each most of an allowed packet: the one whose bytes take the total over
    ``max_buffered_bytes`` ends; the other stays; closing it gives its bytes back."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_envelope_bytes=1 << 20, max_buffered_bytes=1 << 20)
    try:
        budget = served.service._listener._budget
        stalled = []
        for _ in range(2):
            sock, session_id = opened_socket(served)
            big = bytearray(encode(T.FRAME_SUBMIT, session_id, 1, b"\0" * 72, b"\0" * (1_500_000)))
            sock.sendall(bytes(big[:700_000]))  # most of a packet, then nothing
            stalled.append(sock)
            assert wait_until(lambda: budget.used >= 700_000)  # the first's bytes are held before the second's come
        first, second = stalled
        assert closed_by_server(second)  # ended: the total would be 1.4 MB
        assert wait_until(lambda: budget.used < 800_000)
        first.close()
        assert wait_until(lambda: budget.used == 0)
        assert served_promptly(served) < 5
    finally:
        served.stop()


def test_a_client_that_does_not_read_stops_being_read_and_others_are_served():
    """A client floods PINGs (each answered with a PONG) and never reads: the server stops reading from it
    once its replies fill the transport's buffer, so what it holds for that client stays near the buffer's
    high-water mark (1 MiB) however long the flood goes on, and a well-behaved client on another connection is
    served at once meanwhile."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    try:
        sock, session_id = opened_socket(served)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        chunk = encode(T.PING, session_id, 0) * 4096  # 160 KiB of PINGs
        stop = threading.Event()

        def flood() -> None:
            sock.settimeout(0.2)
            while not stop.is_set():
                try:
                    sock.sendall(chunk)
                except TimeoutError:  # the server is not reading right now
                    continue
                except OSError:
                    return

        thread = threading.Thread(target=flood)
        thread.start()
        connection = next(iter(served.service._listener._connections))
        held = []
        try:
            for _ in range(30):  # 6 s of flood
                time.sleep(0.2)
                carrier = connection.carrier
                transport = carrier._transport if carrier is not None else None
                held.append(transport.get_write_buffer_size() if transport is not None else 0)
            assert served_promptly(served) < 3
        finally:
            stop.set()
            thread.join(5)
        assert max(held) < 4 << 20, f"replies queued for a client that reads nothing: {max(held)} bytes"
        sock.close()
    finally:
        served.stop()


def test_out_of_descriptors_the_listener_pauses_instead_of_spinning(monkeypatch):
    """``accept`` failing with EMFILE: the listening socket leaves the loop for ACCEPT_PAUSE_S (no busy
    loop, one log line), is counted, and accepting resumes afterwards."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    listener = served.service._listener
    (sock,) = listener._listening
    failing = {"left": 1}
    real_accept = socket.socket.accept

    def accept(self):
        if self is sock and failing["left"]:
            failing["left"] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    monkeypatch.setattr(listener_module, "ACCEPT_PAUSE_S", 0.3)
    try:
        attempt = socket.create_connection(address(served))
        assert wait_until(lambda: refused("no_descriptor") >= 1)
        assert wait_until(lambda: not listener._paused_accepts, timeout_s=5)  # resumed
        attempt.close()
        assert served_promptly(served) < 5
    finally:
        served.stop()


def test_a_closed_connection_releases_its_buffers_at_once():
    """A connection that sent most of a packet and left: its bytes leave the budget and its wire core drops
    its buffers in the same loop iteration as the close (no garbage collection needed)."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    try:
        sock, session_id = opened_socket(served)
        sock.sendall(encode(T.FRAME_SUBMIT, session_id, 1, b"\0" * 72, b"\0" * 900_000)[:800_000])
        listener = served.service._listener
        assert wait_until(lambda: listener._budget.used >= 700_000)
        (connection,) = listener._connections
        sock.close()
        assert wait_until(lambda: listener._budget.used == 0 and not listener._connections)
        assert connection._core.buffered == 0 and connection._core.ended
        assert not connection._sessions
    finally:
        served.stop()


def test_a_session_closed_with_operations_running_gives_each_its_terminal():
    """SESSION_CLOSE with the drain policy (drain time 0, as the clients send it) while a stream runs: the
    operation ends with its ``response.cancelled`` drop before the close completes, its backend request is
    aborted, and the session is gone on the server."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    slow = envelope(
        {"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.05, "repeat": 40}, request_id="drained"
    )

    async def main() -> list[dict]:
        conn = await connect(served.bound[0])
        session = await conn.open_session()
        op = session.submit(slow)
        first = await op.__anext__()
        assert first["type"] == "response.output_text.delta"
        await asyncio.wait_for(session.close(), 5)
        events = [event async for event in op]
        await conn.close()
        return events

    try:
        events = asyncio.run(main())
        assert events[-1]["type"] == "response.cancelled"
        assert wait_until(lambda: any(a.startswith("nnrp-drained") for a in served.backend.aborted))
        assert wait_until(lambda: served.service.sessions == 0)
    finally:
        served.stop()

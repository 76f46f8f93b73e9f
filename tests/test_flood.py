"""A client that keeps submitting beyond the credit its session was granted, without reading the replies, is a
protocol violator: after a bounded number of such submits (:class:`vllm_nnrp_plugin.nnrp_binding.bounds.
ViolationBudget`) its connection ends with ERROR_RECOVERABLE ``LIMIT_EXCEEDED``, counted in
``nnrp_connections_ended_total{reason="credit_violations"}`` and logged, its vLLM requests aborted; a
well-behaved client on another connection keeps its latency meanwhile (loopback, the recorded backend)."""

from __future__ import annotations

import asyncio
import logging
import socket
import statistics
import threading
import time

import orjson
import pytest
from nnrp.core.enums import ErrorCode
from nnrp.core.enums import MessageType as T
from nnrp.runtime.types import RecoverableErrorMetadata

from tests.support import ServedNNRP, envelope, free_port, metric, wait_until
from vllm_nnrp_plugin.client import connect
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.nnrp_binding.bounds import VIOLATION_BURST, ViolationBudget
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader

QUICK = envelope({"model": "c-nonstream-text", "messages": []})
SLOW = envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.5, "repeat": 50})
IN_FLIGHT = 2


def test_the_budget_takes_a_burst_then_a_rate_and_never_recovers_once_spent() -> None:
    budget = ViolationBudget(burst=4, per_s=2.0)
    assert all(budget.spend(0.0) for _ in range(4))
    assert budget.spend(0.5)  # half a second earned one more
    assert not budget.spend(0.5)
    assert not budget.spend(100.0)  # spent: the connection is ending
    steady = ViolationBudget(burst=4, per_s=2.0)
    assert all(steady.spend(t * 0.5) for t in range(1000))  # within the rate, never spent
    with pytest.raises(ValueError):
        ViolationBudget(burst=0)


def _submit(client: ClientConnection, session_id: int, body: dict) -> None:
    client.submit(session_id, wire_mapping.typed_body(orjson.dumps(body)))


def _opened(port: int) -> tuple[socket.socket, ClientConnection, int]:
    client = ClientConnection()
    client.open_session()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(client.data_to_send())
    sock.settimeout(5)
    events: list = []
    while not events:
        events = client.receive_data(sock.recv(65536))
    (accepted,) = events
    assert isinstance(accepted, ev.SessionOpenAccepted)
    return sock, client, accepted.session_id


class Flooder:
    """Connects, runs ``IN_FLIGHT`` slow streams, then submits beyond its credit without reading, as fast as the
    socket takes it; connects again each time the server ends it, until stopped. ``ended``: the connections the
    server ended; ``last``: the bytes the last ended connection received. Its packets are made before it starts
    (the first session of every connection is session 1), so building them costs the test's process nothing
    while latencies are measured."""

    PER_BLOB = 2000

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.ended = 0
        self.submits = 0
        self.last = b""
        client = ClientConnection()
        client.open_session()
        self.hello = client.data_to_send()
        quick, slow = wire_mapping.typed_body(orjson.dumps(QUICK)), wire_mapping.typed_body(orjson.dumps(SLOW))
        accepted = _accept_bytes()
        client.receive_data(accepted)
        self.accepted = len(accepted)
        self.blobs = []
        for index in range(4):
            for n in range(self.PER_BLOB):
                client.submit(1, slow if index == 0 and n < IN_FLIGHT else quick)
            self.blobs.append(client.data_to_send())
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            sock = socket.create_connection(("127.0.0.1", self.port))
            sock.sendall(self.hello)
            sock.settimeout(5)
            got = b""
            while len(got) < self.accepted:  # the acks: session 1 is open
                got += sock.recv(self.accepted - len(got))
            sock.settimeout(0.2)
            try:
                for blob in self.blobs:  # the server ends the connection well within the first
                    while not self.stop.is_set():
                        try:
                            sock.sendall(blob)
                            self.submits += self.PER_BLOB
                            break
                        except TimeoutError:  # the server is not reading right now
                            continue
                while not self.stop.is_set():  # not ended yet: wait for its end without reading
                    sock.sendall(b"")
                    if _closed(sock):
                        raise ConnectionResetError
            except OSError:  # ended by the server
                pass
            if self.stop.is_set():
                sock.close()
                return
            self.ended += 1
            sock.settimeout(2)
            received = bytearray()
            try:
                while chunk := sock.recv(1 << 20):
                    received += chunk
            except OSError:
                pass
            self.last = bytes(received)
            sock.close()


def _closed(sock: socket.socket) -> bool:
    """The server ended ``sock`` (peeked: nothing of what it sent is read); the flooder asks every 10 ms."""
    time.sleep(0.01)
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def _accept_bytes() -> bytes:
    """The server's SERVER_HELLO_ACK and SESSION_OPEN_ACK for session 1, as the wire core answers them."""
    from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

    server = ServerConnection(max_in_flight_per_session=IN_FLIGHT)
    client = ClientConnection()
    client.open_session()
    (request,) = server.receive_data(client.data_to_send())
    assert server.accept_session(request.request) == 1
    return server.data_to_send()


def _latencies(uri: str, count: int) -> list[float]:
    async def main() -> list[float]:
        conn = await connect(uri)
        try:
            session = await conn.open_session()
            took = []
            for _ in range(count):
                started = time.perf_counter()
                events = [event async for event in session.submit(QUICK)]
                took.append(time.perf_counter() - started)
                assert events[-1]["type"] == "response.completed", events[-1]
            return took
        finally:
            await conn.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


def test_a_client_flooding_beyond_its_credit_is_ended_and_others_keep_their_latency(caplog) -> None:
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_in_flight_per_session=IN_FLIGHT)
    caplog.set_level(logging.WARNING, logger="vllm_nnrp_plugin.service")

    def counter() -> float:  # the process's
        return metric("nnrp_connections_ended_total", transport="tcp", reason="credit_violations")

    before = counter()
    try:
        port = int(served.bound[0].rsplit(":", 1)[1])
        _latencies(served.bound[0], 10)  # warm up
        quiet = _latencies(served.bound[0], 150)
        flooder = Flooder(port)
        try:
            assert wait_until(lambda: flooder.ended >= 1, 10)
            during = _latencies(served.bound[0], 150)
            assert flooder.ended >= 1
        finally:
            flooder.stop.set()
            flooder.thread.join(10)
        assert counter() - before >= flooder.ended >= 1
        # the protocol's error came on the session before the end: LIMIT_EXCEEDED, naming the credit
        errors = [p for p in PacketReader().feed(flooder.last) if p.msg_type == T.ERROR_RECOVERABLE]
        assert errors, "no ERROR_RECOVERABLE before the connection ended"
        meta = RecoverableErrorMetadata.unpack(errors[-1].meta)
        assert meta.error_code == int(ErrorCode.LIMIT_EXCEEDED) and b"granted credit" in errors[-1].body
        assert served.backend.started  # the slow streams reached the backend ...
        assert wait_until(lambda: served.backend.open_streams == 0, 10)  # ... and were aborted with the connection
        lines = [r for r in caplog.records if "ended" in r.getMessage() and "granted credit" in r.getMessage()]
        assert 1 <= len(lines) <= max(flooder.ended, 10)
        quiet_p95, during_p95 = _p95(quiet), _p95(during)
        figures = (
            f"p95 {during_p95 * 1000:.1f} ms during the flood ({flooder.ended} connections ended, "
            f"{flooder.submits} submits sent), {quiet_p95 * 1000:.1f} ms without"
        )
        print(figures)
        assert during_p95 <= 2 * quiet_p95 + 0.05, figures
    finally:
        served.stop()


def test_refusals_within_the_budget_are_answered_and_the_connection_lives() -> None:
    """A client that goes beyond its credit a few times (it had not read the BACKPRESSURE yet) gets
    ``too_many_requests`` for each, as before, and keeps its connection."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_in_flight_per_session=IN_FLIGHT)

    def counter() -> float:  # the process's
        return metric("nnrp_connections_ended_total", transport="tcp", reason="credit_violations")

    before = counter()
    try:
        sock, client, sid = _opened(int(served.bound[0].rsplit(":", 1)[1]))
        for _ in range(IN_FLIGHT):
            _submit(client, sid, SLOW)
        for _ in range(VIOLATION_BURST // 2):
            _submit(client, sid, QUICK)
        sock.sendall(client.data_to_send())
        refused, reader = 0, PacketReader()
        while refused < VIOLATION_BURST // 2:
            for packet in reader.feed(sock.recv(65536)):
                if packet.msg_type == T.RESULT_PUSH and b"too_many_requests" in packet.body:
                    refused += 1
        assert counter() == before
        _submit(client, sid, QUICK)  # over the limit still: one more refusal, the connection goes on
        sock.sendall(client.data_to_send())
        assert any(p.msg_type == T.RESULT_PUSH for p in reader.feed(sock.recv(65536)))
        sock.close()
    finally:
        served.stop()

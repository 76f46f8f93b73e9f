"""Limits and backpressure over the real NNRP path (the plugin's server and nnrp-py's native client on loopback;
a raw client on the project's own wire core where the test needs a client that stops reading): work over
a limit is refused with a typed ``response.error`` and never reaches the backend; the session keeps serving."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest
from nnrp.core import MessageType
from nnrp.native import NativeRuntimeError

from tests.support import RecordedBackend, ServedNNRP, envelope, free_port, wait_until
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection

SLOW = envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.05, "repeat": 20})
QUICK = envelope({"model": "c-nonstream-text", "messages": []})


@pytest.fixture
def limited(request, tmp_path):
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}", f"unix://{tmp_path}/nnrp.sock"), **request.param)
    yield served
    served.stop()


def connect(uri):
    return asyncio.run(ProfileClient.connect(uri))


def raw_frames(client, stop, timeout_s=10.0):
    """Poll the session's raw frames until ``stop(types)``; returns ``[(message_type, frame_id), ...]``."""
    seen = []
    loops = int(timeout_s * 10)
    for _ in range(loops):
        try:
            polled = client.session.poll_events(max_events=1, timeout_ms=100)
        except NativeRuntimeError:
            continue
        for raw in polled:
            header = getattr(raw, "header", None)
            if header is not None:
                seen.append((header.message_type, header.frame_id))
        if stop(seen):
            return seen
    raise AssertionError(f"not seen in {timeout_s} s: {seen}")


@pytest.mark.parametrize("limited", [{"max_in_flight_per_session": 2}], indirect=True)
@pytest.mark.parametrize("transport", [0, 1])
def test_a_submit_over_the_session_limit_gets_too_many_requests_and_never_reaches_the_backend(limited, transport):
    client = connect(limited.bound[transport])
    try:
        running = [client.submit(SLOW) for _ in range(2)]
        assert wait_until(lambda: len(limited.backend.started) == 2)
        refused = client.submit(QUICK)
        (terminal,) = list(client.events(refused, timeout_s=10))
        assert terminal.frame == "result_push" and terminal.status == 429
        assert terminal.event["type"] == "response.error"
        assert terminal.event["error"]["code"] == "too_many_requests"
        assert "nnrp.max_in_flight_per_session" in terminal.event["error"]["message"]
        assert len(limited.backend.started) == 2  # the refused operation never reached the backend
        for op in running:
            client.cancel(op)
            assert list(client.events(op, timeout_s=10))[-1].frame == "result_drop"
        (again,) = list(client.events(client.submit(QUICK), timeout_s=10))
        assert again.event["type"] == "response.completed"
    finally:
        client.close()


@pytest.mark.parametrize("limited", [{"max_in_flight_per_session": 1}], indirect=True)
def test_a_refusal_sends_backpressure_then_a_credit_update_when_an_operation_ends(limited):
    client = connect(limited.bound[0])
    try:
        first = client.submit(SLOW)
        assert wait_until(lambda: len(limited.backend.started) == 1)
        refused = client.submit(QUICK)
        seen = raw_frames(client, lambda s: (MessageType.RESULT_PUSH, refused.frame_id) in s)
        assert (MessageType.BACKPRESSURE, 0) in [(t, 0) for t, _f in seen]
        client.connection.cancel_runtime_operation(client.session, operation_id=first.operation_id, control_sequence=1)
        seen = raw_frames(client, lambda s: any(t is MessageType.CREDIT_UPDATE for t, _f in s))
        assert (MessageType.RESULT_DROP_REASON, first.frame_id) in seen
    finally:
        client.close()


@pytest.mark.parametrize("limited", [{"max_in_flight": 3}], indirect=True)
def test_the_process_limit_counts_every_session_and_frees_slots_when_operations_end(limited):
    clients = [connect(uri) for uri in limited.bound]
    try:
        ops = [(c, c.submit(SLOW)) for c in (clients[0], clients[0], clients[1])]
        assert wait_until(lambda: len(limited.backend.started) == 3)
        (terminal,) = list(clients[1].events(clients[1].submit(QUICK), timeout_s=10))
        assert terminal.event["error"]["code"] == "too_many_requests"
        assert "nnrp.max_in_flight" in terminal.event["error"]["message"]
        assert len(limited.backend.started) == 3
        for c, op in ops:
            c.cancel(op)
            list(c.events(op, timeout_s=10))
        assert wait_until(lambda: limited.service.in_flight.used == 0)
        for c in clients:
            (again,) = list(c.events(c.submit(QUICK), timeout_s=10))
            assert again.event["type"] == "response.completed"
        assert wait_until(lambda: limited.service.in_flight.used == 0)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("limited", [{"max_sessions": 2}], indirect=True)
def test_sessions_over_the_limit_are_refused_at_open(limited):
    clients = [connect(limited.bound[0]), connect(limited.bound[1])]
    try:
        assert wait_until(lambda: limited.service.sessions == 2)
        with pytest.raises(NativeRuntimeError, match="limit|LIMIT|auth|108"):
            connect(limited.bound[0])
        clients.pop().close()
        assert wait_until(lambda: limited.service.sessions == 1)
        clients.append(connect(limited.bound[1]))
        (done,) = list(clients[-1].events(clients[-1].submit(QUICK), timeout_s=10))
        assert done.event["type"] == "response.completed"
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("limited", [{"max_queued_events": 8}], indirect=True)
def test_a_client_slower_than_the_stream_ends_with_client_too_slow_and_the_request_is_aborted(limited):
    """A client that stops reading: the socket buffers and the transport's write buffer fill, the server stops
    taking from the session outbox, and the operation ends with ``client_too_slow`` once 8 events wait; the
    terminal arrives when the client reads again, and the session keeps serving."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(limited.bound[1][len("unix://") :])
    sock.settimeout(10)
    conn = ClientConnection()
    request = conn.open_session()
    sock.sendall(conn.data_to_send())
    (opened,) = [e for e in _read(sock, conn, lambda es: any(isinstance(e, ev.SessionOpenAccepted) for e in es))]
    assert opened.request == request
    burst = envelope({"model": "a-stream-text", "messages": [], "stream": True, "repeat": 100_000, "pace_s": 1e-6})
    conn.submit(opened.session_id, wire_mapping.typed_body(orjson.dumps(burst)))
    sock.sendall(conn.data_to_send())  # then read nothing
    assert wait_until(lambda: limited.backend.aborted, timeout_s=30), "the stream was never stopped"
    request_id = limited.backend.started[-1]
    assert request_id in limited.backend.aborted
    received = _read(sock, conn, lambda es: isinstance(es[-1], (ev.ResultPushed, ev.ResultDropReasonReceived)))
    partials = [e for e in received if isinstance(e, ev.PartialResultReceived)]
    assert [p.result_sequence for p in partials] == list(range(1, len(partials) + 1))
    terminal = orjson.loads(wire_mapping.unwrap_typed_body(16, 1, received[-1].body))
    assert terminal["type"] == "response.error" and terminal["error"]["code"] == "client_too_slow", terminal
    assert len(partials) < 100_000  # stopped well before the end of the stream
    conn.submit(opened.session_id, wire_mapping.typed_body(orjson.dumps(QUICK)))
    sock.sendall(conn.data_to_send())
    again = _read(sock, conn, lambda es: isinstance(es[-1], ev.ResultPushed))
    assert orjson.loads(wire_mapping.unwrap_typed_body(16, 1, again[-1].body))["type"] == "response.completed"
    sock.close()


def _read(sock: socket.socket, conn: ClientConnection, done) -> list:
    """Read and decode until ``done(events)`` holds for the events received so far."""
    received: list = []
    while not (received and done(received)):
        data = sock.recv(1 << 20)
        assert data, f"connection closed after {len(received)} events"
        received += conn.receive_data(data)
    return received


class _SlowClose:
    """A backend stream whose close outlives its last chunk by 0.5 s (vLLM's generator finishing after the
    operation's terminal went out)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.inner.__anext__()

    async def aclose(self) -> None:
        await asyncio.sleep(0.5)


def test_a_sent_terminal_frees_its_slot_for_the_clients_next_submit():
    """``nnrp.max_in_flight`` 1 and a stream that takes 0.5 s to close after its terminal: a client that submits
    as soon as it read each terminal is served every time, never refused ``too_many_requests``."""
    from vllm_nnrp_plugin.client import connect
    from vllm_nnrp_plugin.core.adapter import Call

    class Lingering(RecordedBackend):
        async def create(self, operation, body, request_id, traceparent=None, controls=None):
            call = await super().create(operation, body, request_id, traceparent)
            return Call(stream=_SlowClose(call.stream))

    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), backend=Lingering(), max_in_flight=1)

    async def main() -> list[str]:
        conn = await connect(served.bound[0])
        session = await conn.open_session()
        terminals = []
        for _ in range(3):
            events = [
                e async for e in session.submit(envelope({"model": "a-stream-text", "messages": [], "stream": True}))
            ]
            terminals.append(events[-1].get("error", {}).get("code") or events[-1]["type"])
        await conn.close()
        return terminals

    try:
        assert asyncio.run(main()) == ["response.completed"] * 3
    finally:
        served.stop()

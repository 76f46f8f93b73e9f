"""WebSocket (``ws``, ``wss``) and QUIC inside a real ``vllm serve`` (CPU), with nnrp-py's native client as the
oracle: many sessions on one connection streaming at once, a session's in-flight limit (and on a unix socket),
cancel → vLLM abort,
and 256 open sessions costing the API server no thread (every carrier runs on vLLM's event loop). Streaming,
non-streaming, errors, cancels and a killed client per carrier: tests/e2e/test_vllm_serve.py; shutdown:
tests/e2e/test_shutdown.py."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
from nnrp.client import NativeClientSessionOptions

from tests.e2e.conftest import IN_FLIGHT_PER_SESSION, LONG, QUIC, SERVED_NAME, vllm_requests, wait_idle
from tests.support import envelope
from vllm_nnrp_plugin.client import ProfileClient

pytestmark = [pytest.mark.vllm, pytest.mark.binding_core]

CARRIERS = ["ws", "wss", QUIC]
HELLO = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 16,
    "temperature": 0,
    "stream": True,
}


def connected(server, scheme: str) -> ProfileClient:
    return asyncio.run(ProfileClient.connect(server.nnrp[scheme], trusted_cert_der=server.der))


def more_sessions(client: ProfileClient, count: int) -> list[ProfileClient]:
    """``count`` more sessions on ``client``'s connection, each as a client of its own (closed with it)."""

    async def open_all():
        return [await client.connection.open_session(NativeClientSessionOptions()) for _ in range(count)]

    return [ProfileClient(contextlib.ExitStack(), client.connection, session) for session in asyncio.run(open_all())]


def api_server_threads(server) -> int:
    """Threads of the API-server process (``vllm serve`` itself; the engine core is its child)."""
    return len(os.listdir(f"/proc/{server.proc.pid}/task"))


@pytest.mark.parametrize("scheme", CARRIERS)
def test_sessions_on_one_connection_stream_at_once_and_a_cancel_aborts_vllm(vllm_server, scheme):
    assert wait_idle(vllm_server, 30)
    client = connected(vllm_server, scheme)
    try:
        sessions = [client, *more_sessions(client, 3)]
        ops = [(session, session.submit(envelope(HELLO))) for session in sessions]
        long_op = client.submit(envelope({**LONG, "stream": True}))
        texts = []
        for session, op in ops:
            events = list(session.events(op, timeout_s=120))
            assert events[-1].event["type"] == "response.completed"
            texts.append("".join(e.event.get("delta", "") for e in events[:-1]))
        assert texts[0] and len(set(texts)) == 1  # temperature 0: one answer, whichever session asked
        stream = client.events(long_op, timeout_s=120)
        assert next(stream).event["type"] == "response.output_text.delta"
        client.cancel(long_op)
        assert list(stream)[-1].event == {"type": "response.cancelled", "reason": "client_cancelled"}
        assert wait_idle(vllm_server, 15), "vLLM still runs the cancelled request"
    finally:
        client.close()


@pytest.mark.parametrize("scheme", ["ipc", *CARRIERS])
def test_a_session_over_its_in_flight_limit_is_refused_and_vllm_never_sees_it(vllm_server, scheme):
    assert wait_idle(vllm_server, 30)
    client = connected(vllm_server, scheme)
    try:
        ops = [client.submit(envelope(LONG)) for _ in range(IN_FLIGHT_PER_SESSION)]
        (refused,) = list(client.events(client.submit(envelope(LONG)), timeout_s=60))
        assert refused.event["type"] == "response.error" and refused.event["error"]["code"] == "too_many_requests"
        assert vllm_requests(vllm_server) <= IN_FLIGHT_PER_SESSION
        for op in ops:
            client.cancel(op)
        for op in ops:
            assert list(client.events(op, timeout_s=60))[-1].terminal
    finally:
        client.close()
    assert wait_idle(vllm_server, 30), "vLLM still runs cancelled requests"


@pytest.mark.parametrize("scheme", CARRIERS)
def test_256_open_sessions_add_no_api_server_thread(vllm_server, scheme):
    """nnrp-py's native runtime ran a pump thread per session on these carriers; the loop runs none."""
    idle = api_server_threads(vllm_server)
    client = connected(vllm_server, scheme)
    try:
        sessions = [client, *more_sessions(client, 255)]
        ops = [(s, s.submit(envelope({**HELLO, "max_tokens": 2}))) for s in sessions[::32]]  # some of them busy
        for session, op in ops:
            assert list(session.events(op, timeout_s=120))[-1].event["type"] == "response.completed"
        busy = api_server_threads(vllm_server)
        print(f"{scheme}: API-server threads {idle} with no session, {busy} with 256 open")
        assert busy <= idle + 4, (idle, busy)  # vLLM starts a few threads of its own lazily
    finally:
        client.close()

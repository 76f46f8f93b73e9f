"""The real NNRP path (nnrp-py native server and client, TCP and IPC on loopback) around the adapter, with a
backend that replays streams recorded from real vLLM 0.26.0."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import orjson
import pytest
from nnrp.client import SubmitIdentity, SubmitPolicy, SubmitRequest, TypedPayloadInputFrame, TypedPayloadSubmitInput
from nnrp.core import PayloadKind
from nnrp.schema import StreamSemantics

from tests.support import ROOT, RecordedBackend, envelope, free_port, recorded_chunks, wait_until
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.config import NNRPConfig
from vllm_nnrp_plugin.service import NNRPService
from vllm_nnrp_plugin.vllm_binding.fault_injection import with_fault_injection

MAX_ENVELOPE = 4096


class Served:
    """An NNRPService on its own event loop thread (standing in for vLLM's loop); ``fault_model`` wraps the
    backend as the vLLM binding's start-up does (:attr:`backend` stays the recording one)."""

    def __init__(self, tmp_path, *, fault_model: str | None = None, metrics_listen=None, **service_kwargs) -> None:
        self.backend = RecordedBackend()
        self.tcp = f"tcp://127.0.0.1:{free_port()}"
        self.ipc = f"unix://{tmp_path}/nnrp.sock"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        config = NNRPConfig(
            enabled=True,
            listen=(self.tcp, self.ipc),
            max_envelope_bytes=MAX_ENVELOPE,
            fault_injection_backend_error_model=fault_model,
            metrics_listen=metrics_listen,
        )
        self.service = NNRPService(config, with_fault_injection(self.backend, fault_model), self.loop, **service_kwargs)
        self.bound = asyncio.run_coroutine_threadsafe(self.service.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("nnrp"))
    yield server
    server.stop()


@pytest.fixture(params=["tcp", "ipc"])
def client(request, served):
    client = asyncio.run(ProfileClient.connect(getattr(served, request.param)))
    yield client
    client.close()


def collect(client, env, timeout_s=10.0):
    return list(client.events(client.submit(env), timeout_s=timeout_s))


def test_binds_every_configured_address(served):
    assert served.bound == [served.tcp, served.ipc]


def test_streamed_text_arrives_in_order_then_completed(client):
    events = collect(
        client,
        envelope(
            {"model": "b-stream-text-usage", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
        ),
    )
    *partials, terminal = events
    assert [e.frame for e in partials] == ["partial_result"] * len(partials)
    expected = [c["choices"][0]["delta"]["content"] for c in recorded_chunks("b-stream-text-usage")[1:-2]]
    expected.append(recorded_chunks("b-stream-text-usage")[-2]["choices"][0]["delta"]["content"])
    # 16 deltas, or fewer carrying the same text in order when some were merged while waiting to be sent
    assert 1 <= len(partials[:-1]) <= 16 and all(e.event["type"] == "response.output_text.delta" for e in partials[:-1])
    assert "".join(e.event["delta"] for e in partials[:-1]) == "".join(expected)
    assert partials[-1].event == {
        "type": "response.usage",
        "usage": {"input_tokens": 33, "output_tokens": 16, "total_tokens": 49},
    }
    assert terminal.frame == "result_push" and terminal.status == 200
    body = terminal.event["body"]
    assert terminal.event["type"] == "response.completed"
    assert body["choices"][0]["message"]["content"] == "".join(e.event["delta"] for e in partials[:-1])
    assert body["usage"]["completion_tokens"] == 16


def test_non_streaming_body_is_vllms_response(client):
    (terminal,) = collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
    assert terminal.event["type"] == "response.completed"
    assert terminal.event["body"]["choices"][0]["message"]["content"].startswith("Hello!")


def raw_submit(client, payload: bytes, *, kind=PayloadKind.STRUCTURED_EVENT, frames=1, profile_id=0):
    operation_id = next(client._ids)
    frame = TypedPayloadInputFrame(
        profile_id=profile_id, payload_kind=kind, payload=payload, stream_semantics=StreamSemantics.SNAPSHOT
    )
    request = SubmitRequest.typed_payload(
        TypedPayloadSubmitInput(
            identity=SubmitIdentity(operation_id=operation_id, frame_id=operation_id),
            policy=SubmitPolicy(),
            frames=(frame,) * frames,
        )
    )
    return client.session.submit_operation(request)


GOOD = orjson.dumps(envelope({"model": "c-nonstream-text", "messages": []}))


@pytest.mark.parametrize(
    "submit, code",
    [
        (lambda c: c.submit(b"{not json"), "invalid_json"),
        (lambda c: c.submit(b'"a string"'), "invalid_envelope"),
        (lambda c: c.submit({**envelope({}), "body": [1, 2]}), "invalid_envelope"),
        (lambda c: c.submit({**envelope({"messages": []}), "operation": "embeddings.create"}), "unsupported_operation"),
        (lambda c: c.submit({**envelope({"messages": []}), "schema_version": "x/9"}), "unsupported_schema_version"),
        (lambda c: c.submit(envelope({"model": "m"})), "missing_messages"),
        (lambda c: c.submit(envelope({"messages": [{"content": "x" * MAX_ENVELOPE}]})), "envelope_too_large"),
        (lambda c: raw_submit(c, GOOD, kind=PayloadKind.OPAQUE_BYTES), "invalid_frame"),
        (lambda c: raw_submit(c, GOOD, frames=2), "invalid_frame"),
        (lambda c: raw_submit(c, GOOD, profile_id=1), "invalid_frame"),
        (lambda c: c.submit(envelope({"model": "g2-unknown-model-nonstream", "messages": []})), "model_not_found"),
        (
            lambda c: c.submit(envelope({"model": "h2-max-tokens-too-large-nonstream", "messages": []})),
            "invalid_request",
        ),
        (lambda c: c.submit(envelope({"model": "raise", "messages": []})), "backend_error"),
    ],
)
def test_bad_input_gets_one_typed_error_and_the_session_keeps_serving(client, submit, code):
    events = list(client.events(submit(client), timeout_s=10))
    assert [e.frame for e in events] == ["result_push"]
    error = events[0].event
    assert error["type"] == "response.error" and error["error"]["code"] == code
    assert error["error"]["message"] and error["error"]["type"]
    (again,) = collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
    assert again.event["type"] == "response.completed"


def test_midstream_error_ends_with_backend_error_and_aborts(served, client):
    events = collect(client, envelope({"model": "midstream-error", "messages": [], "stream": True}))
    assert events[-1].event["error"]["code"] == "backend_error"
    assert all(e.frame == "partial_result" for e in events[:-1])
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)  # the abort follows the terminal's decision


CANCELS = {
    "frame_cancel": lambda c, op: c.cancel(op),
    "runtime_cancel": lambda c, op: c.connection.cancel_runtime_operation(
        c.session, operation_id=op.operation_id, control_sequence=1
    ),
    "runtime_abort": lambda c, op: c.connection.abort_runtime_operation(
        c.session, operation_id=op.operation_id, control_sequence=1
    ),
}


@pytest.mark.parametrize(
    "how, reason",
    [("frame_cancel", "client_cancelled"), ("runtime_cancel", "client_cancelled"), ("runtime_abort", "client_aborted")],
)
def test_cancel_stops_events_at_once_and_aborts_the_backend_request(served, client, how, reason):
    op = client.submit(envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.05}))
    stream = client.events(op, timeout_s=10)
    first = next(stream)
    assert first.frame == "partial_result"
    CANCELS[how](client, op)
    rest = list(stream)
    assert rest[-1].frame == "result_drop" and rest[-1].drop_reason == 3  # PEER_CANCELLED
    assert rest[-1].event == {"type": "response.cancelled", "reason": reason}
    assert len(rest) <= 2  # at most one delta that was already on the wire
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)
    assert wait_until(lambda: served.backend.open_streams == 0)
    (again,) = collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
    assert again.event["type"] == "response.completed"


def test_stale_cancel_of_a_finished_operation_does_not_kill_the_session(served, client):
    started = len(served.backend.started)
    op = client.submit(envelope({"model": "c-nonstream-text", "messages": []}))
    # the server answered (its in-flight slot is given back once the terminal went out); the client has not
    # read the answer yet
    assert wait_until(lambda: len(served.backend.started) > started and served.service.in_flight.used == 0)
    client.connection.cancel_runtime_operation(client.session, operation_id=op.operation_id, control_sequence=1)
    for _ in range(5):
        (again,) = collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
        assert again.event["type"] == "response.completed"


def test_concurrent_operations_and_sessions_each_keep_their_order(served):
    def one_session(uri, results):
        client = asyncio.run(ProfileClient.connect(uri))
        try:
            ops = [
                client.submit(envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.001}))
                for _ in range(3)
            ]
            for op in ops:
                events = list(client.events(op, timeout_s=20))
                results.append("".join(e.event.get("delta", "") for e in events[:-1]))
        finally:
            client.close()

    results: list[str] = []
    threads = [threading.Thread(target=one_session, args=(uri, results)) for uri in (served.tcp, served.ipc) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = "".join(c["choices"][0]["delta"]["content"] for c in recorded_chunks("a-stream-text"))
    assert results == [expected] * 18


KILLED_CLIENT = textwrap.dedent(
    """
    import asyncio, os, sys
    from vllm_nnrp_plugin.client import ProfileClient
    from tests.support import envelope
    client = asyncio.run(ProfileClient.connect(sys.argv[1]))
    op = client.submit(
        envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.2, "repeat": 10})
    )
    next(client.events(op, timeout_s=10))
    print("streaming", flush=True)
    os._exit(9)
    """
)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_killed_client_gets_its_backend_requests_aborted(served, transport):
    before = len(served.backend.started)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CLIENT, getattr(served, transport)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert "streaming" in proc.stdout, proc.stderr
    assert len(served.backend.started) == before + 1
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted, timeout_s=10)
    assert wait_until(lambda: served.backend.open_streams == 0)


def test_shutdown_gives_in_flight_operations_a_terminal(tmp_path):
    server = Served(tmp_path)
    client = asyncio.run(ProfileClient.connect(server.ipc))
    try:
        op = client.submit(envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.2}))
        stream = client.events(op, timeout_s=10)
        assert next(stream).frame == "partial_result"
        server.stop()
        terminal = list(stream)[-1]
        assert terminal.event["error"]["code"] == "server_shutdown"
        assert server.backend.started[-1] in server.backend.aborted
    finally:
        client.close()


def accepted_sockets_of(port: int) -> list[socket.socket]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if (
                sock.family == socket.AF_INET
                and sock.type == socket.SOCK_STREAM
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                and sock.getsockname()[1] == port
            ):
                found.append(sock)
                continue
        except OSError:
            pass
        sock.close()
    return found


def test_accepted_tcp_connections_have_nagle_turned_off(served):
    client = asyncio.run(ProfileClient.connect(served.tcp))
    port = int(served.tcp.rsplit(":", 1)[1])

    def all_nodelay() -> bool:
        # the client's open_session can return just before the accept thread claimed the session
        sockets = accepted_sockets_of(port)
        try:
            return bool(sockets) and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
        finally:
            for s in sockets:
                s.close()

    try:
        assert wait_until(all_nodelay), "an accepted connection of the listener still has Nagle on"
    finally:
        client.close()


# -- tool calls, capabilities, timeouts, trace context, fault injection ------------------------------------


def test_tool_call_events_travel_as_partial_results_in_order(client):
    events = collect(client, envelope({"model": "d-stream-tool-required", "messages": [], "stream": True}))
    *partials, terminal = events
    assert all(e.frame == "partial_result" for e in partials)
    kinds = [e.event["type"] for e in partials]
    assert kinds[0] == "response.tool_call.started" and kinds[-1] == "response.tool_call.completed"
    assert set(kinds[1:-1]) == {"response.tool_call.delta"}
    assert partials[0].event["call_id"] == "chatcmpl-tool-89caae1990ad0bd5"
    assert orjson.loads(partials[-1].event["arguments"]) == {"city": "Paris"}
    message = terminal.event["body"]["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == partials[-1].event["arguments"]


def test_capability_document_is_fetched_over_nnrp(client):
    document = client.capabilities()
    assert document["profile"] == "openai-compatible" and document["schema_version"] == "openai-compatible/1"
    assert document["models"] == [{"id": "example-model", "owned_by": "recorded"}]
    assert [op["name"] for op in document["operations"]] == ["chat.completions.create"]


def test_a_capabilities_envelope_without_body_is_an_envelope_error(client):
    (terminal,) = collect(client, {"schema_version": "openai-compatible/1", "operation": "nnrp.capabilities"})
    assert terminal.event["error"]["code"] == "invalid_envelope"


SLOW = {"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.05, "repeat": 20}


def assert_timed_out(served, events, *, partials_at_most):
    *partials, terminal = events
    assert all(e.frame == "partial_result" for e in partials) and len(partials) <= partials_at_most
    assert terminal.frame == "result_push" and terminal.status == 504
    assert terminal.event["type"] == "response.error" and terminal.event["error"]["code"] == "request_timeout"
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)
    assert wait_until(lambda: served.backend.open_streams == 0)


def test_envelope_timeout_aborts_the_request_with_one_request_timeout_terminal(served, client):
    start = time.monotonic()
    events = collect(client, envelope(SLOW, nnrp={"timeout_ms": 300}))
    assert 0.25 < time.monotonic() - start < 2
    assert_timed_out(served, events, partials_at_most=8)  # 20 x 17 items at 50 ms would take 17 s
    (again,) = collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
    assert again.event["type"] == "response.completed"


def test_nnrp_deadline_control_bounds_the_operation(served, client):
    start = time.monotonic()
    events = list(client.events(client.submit(envelope(SLOW), deadline_ms=300), timeout_s=10))
    assert 0.25 < time.monotonic() - start < 2
    assert_timed_out(served, events, partials_at_most=8)


def test_the_earlier_of_timeout_ms_and_deadline_wins(served, client):
    start = time.monotonic()
    events = list(
        client.events(client.submit(envelope(SLOW, nnrp={"timeout_ms": 5000}), deadline_ms=200), timeout_s=10)
    )
    assert time.monotonic() - start < 2
    assert_timed_out(served, events, partials_at_most=6)


def test_a_timeout_that_does_not_expire_changes_nothing(client):
    events = collect(
        client, envelope({"model": "a-stream-text", "messages": [], "stream": True}, nnrp={"timeout_ms": 10000})
    )
    assert events[-1].event["type"] == "response.completed"


@pytest.mark.parametrize("bad", [0, -5, "100", 1.5, True])
def test_a_bad_timeout_ms_is_an_envelope_error(client, bad):
    (terminal,) = collect(client, envelope({"model": "c-nonstream-text", "messages": []}, nnrp={"timeout_ms": bad}))
    assert terminal.event["error"]["code"] == "invalid_envelope"


def test_session_trace_context_becomes_the_traceparent_of_later_operations(served):
    client = asyncio.run(ProfileClient.connect(served.tcp))
    try:
        collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
        assert served.backend.traceparents[served.backend.started[-1]] is None  # none before a context
        client.trace_context(91, 92, parent_span_id=90, stage_code=5, flags=3, attributes=b"secret=1")
        collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
        assert (
            served.backend.traceparents[served.backend.started[-1]]
            == "00-0000000000000000000000000000005b-000000000000005c-01"
        )
        client.trace_context(2**64 - 1, 1, flags=0)
        events = collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
        assert (
            served.backend.traceparents[served.backend.started[-1]]
            == "00-0000000000000000ffffffffffffffff-0000000000000001-00"
        )
        assert "secret" not in orjson.dumps([e.event for e in events]).decode()  # never copied into the body
    finally:
        client.close()


@pytest.fixture
def faulty(tmp_path):
    server = Served(tmp_path, fault_model="backend-error")
    yield server
    server.stop()


def test_fault_injection_turns_its_model_into_backend_error(faulty):
    client = asyncio.run(ProfileClient.connect(faulty.tcp))
    try:
        (terminal,) = collect(client, envelope({"model": "backend-error", "messages": []}))
        assert terminal.event["error"]["code"] == "backend_error" and terminal.status == 500
        assert faulty.backend.started == []  # never reached the backend
        (again,) = collect(client, envelope({"model": "c-nonstream-text", "messages": []}))
        assert again.event["type"] == "response.completed"
    finally:
        client.close()


def test_without_fault_injection_the_backend_error_model_reaches_the_backend(served, client):
    (terminal,) = collect(client, envelope({"model": "backend-error", "messages": []}, request_id="no-injection"))
    assert served.backend.started[-1].startswith("nnrp-no-injection-")
    assert "injected" not in terminal.event["error"]["message"]  # the backend's answer (it has no such recording)


def test_conformance_runner_exits_non_zero_when_a_selected_case_fails(served, tmp_path):
    pytest.importorskip("jsonschema")
    from vllm_nnrp_plugin.client.conformance.runner import main
    from vllm_nnrp_plugin.client.conformance.suite import locate_suite

    try:
        locate_suite()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    # the recorded backend knows no "example-model": the suite's text cases fail, its error cases pass
    status = main(
        ["--endpoint", served.tcp, "--recipes", str(ROOT / "recipes"), "--out", str(tmp_path), "--case-timeout", "10"]
    )
    assert status == 1
    results = {r["id"]: r for r in orjson.loads((tmp_path / "results.json").read_bytes())["results"]}
    assert results["openai-compatible.chat.streaming-text"]["outcome"] == "failed"
    assert results["openai-compatible.chat.invalid-body"]["outcome"] == "passed"
    assert results["vllm-nnrp.chat.malformed-json"]["outcome"] == "passed"
    plan = orjson.loads((tmp_path / "plan.json").read_bytes())
    assert len(plan["cases"]) == len(results) == 18

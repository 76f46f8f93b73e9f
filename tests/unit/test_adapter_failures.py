"""Whatever fails while one operation is served — its envelope, the adapter itself, the backend — that operation
ends with one typed ``response.error``, its task ends normally (so the service gives its slots back), the failure
is logged once, and the client never gets the server's raw exception text
(:func:`vllm_nnrp_plugin.core.adapter.run_operation`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import orjson
import pytest

from tests.support import envelope
from vllm_nnrp_plugin.core import adapter
from vllm_nnrp_plugin.core.adapter import AdapterLimits, Call, run_operation
from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.core.operation import Operation, ResultPush, Terminal
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import chat_operation, runtime_document

CAPABILITIES = runtime_document(models=["example-model"], owned_by="vllm", operations=[chat_operation(tool_calls=True)])
LIMITS = AdapterLimits(1 << 20)
SECRET = "/opt/venv/lib/python3.11/site-packages/vllm/engine.py: CUDA context 0x7f3a at 10.0.0.7"


class Sink:
    """The adapter's sink over the real operation rules; records the sealed terminal events."""

    def __init__(self) -> None:
        self.machine = Operation(
            Observation(
                connection_id=1,
                session_id=2,
                operation_id=3,
                frame_id=3,
                transport="tcp",
                submitted_ns=0,
                submitted_unix_ns=0,
            )
        )
        self.observation = self.machine.observation
        self.terminals: list[dict[str, Any]] = []
        self.partials = 0

    def _record(self, action) -> None:
        if isinstance(action, Terminal):
            sealed = self.machine.seal(action, 0)
            assert isinstance(sealed, ResultPush)
            self.terminals.append(orjson.loads(sealed.event))

    def partial(self, event):
        action = self.machine.partial(event)
        if action is not None:
            self.machine.take(action)
            self.partials += 1

    def complete(self, body):
        self._record(self.machine.complete(body).terminal)

    def fail(self, err):
        self._record(self.machine.fail(err).terminal)

    @functools.cached_property
    def controls(self):
        return RuntimeControls()

    def limit_time(self, timeout_ms):
        pass

    def abort_with(self, abort):
        pass

    def dispatch(self):
        return self.machine.dispatch(None)

    def expired(self):
        return False


class Backend:
    """Answers ``body`` at once, or raises ``raises`` from ``create``; records what it was asked."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises, self.started, self.aborted = raises, [], []

    def capabilities(self):
        return CAPABILITIES

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        self.started.append(request_id)
        if self.raises is not None:
            raise self.raises
        return Call(body={"object": "chat.completion", "choices": []})

    def engine_request_id(self, operation, request_id):
        return request_id

    async def abort(self, operation, request_id):
        self.aborted.append(request_id)


def serve(payload: bytes, backend: Backend | None = None, sink: Sink | None = None) -> tuple[Sink, Backend]:
    sink, backend = sink or Sink(), backend or Backend()
    # returns (never raises) and at once
    asyncio.run(asyncio.wait_for(run_operation(sink, payload, backend, LIMITS, CAPABILITIES), 5))
    return sink, backend


def only_error(sink: Sink) -> dict[str, Any]:
    (terminal,) = sink.terminals
    assert terminal["type"] == "response.error" and sink.partials == 0
    error = terminal["error"]
    assert error["type"] and error["code"] and error["message"]
    return error


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("field", ["schema_version", "operation", "model", "timeout_ms", "messages", "tools"])
@pytest.mark.parametrize("depth", [1000, 100_000])
def test_a_deeply_nested_field_ends_the_operation_with_invalid_envelope(field, depth, caplog):
    parts = {"schema_version": b'"openai-compatible/1"', "operation": b'"chat.completions.create"'}
    body = {"messages": b"[]", "model": b'"m"'}
    hints = b"{}"
    if field in parts:
        parts[field] = deep(depth)
    elif field == "timeout_ms":
        hints = b'{"timeout_ms":' + deep(depth) + b"}"
    else:
        body[field] = deep(depth)
    payload = (
        b'{"schema_version":'
        + parts["schema_version"]
        + b',"operation":'
        + parts["operation"]
        + b',"body":{'
        + b",".join(b'"' + k.encode() + b'":' + v for k, v in body.items())
        + b'},"nnrp":'
        + hints
        + b"}"
    )
    with caplog.at_level(logging.WARNING):
        sink, backend = serve(payload)
    assert only_error(sink)["code"] == "invalid_envelope" and backend.started == []
    assert not caplog.records  # a refused envelope is the client's error: nothing to log


def test_an_exception_while_decoding_is_the_envelopes_invalid_envelope_and_logged_once(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded while getting the repr of an object")

    monkeypatch.setattr(adapter, "decode_envelope", broken)
    with caplog.at_level(logging.WARNING):
        sink, backend = serve(orjson.dumps(envelope({"messages": []})))
    error = only_error(sink)
    assert error["code"] == "invalid_envelope" and "RecursionError" in error["message"] and backend.started == []
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.ERROR and "decoding its envelope" in message and "Traceback" in message


def test_an_exception_after_decoding_ends_the_operation_with_backend_error_and_is_logged_once(caplog):
    class Broken(Backend):
        def engine_request_id(self, operation, request_id):
            raise KeyError(SECRET)

    with caplog.at_level(logging.WARNING):
        sink, _ = serve(orjson.dumps(envelope({"messages": []})), Broken())
    error = only_error(sink)
    assert error["code"] == "backend_error" and error["type"] == "server_error" and "KeyError" in error["message"]
    assert "/opt" not in error["message"] and "10.0.0.7" not in error["message"]
    (record,) = caplog.records
    assert "Traceback" in record.getMessage() and SECRET in record.getMessage()  # the server log keeps what failed


def test_a_raw_backend_exception_reaches_the_client_as_its_type_only(caplog):
    with caplog.at_level(logging.WARNING):
        sink, backend = serve(orjson.dumps(envelope({"messages": []})), Backend(RuntimeError(SECRET)))
    error = only_error(sink)
    assert error == {
        "type": "server_error",
        "code": "backend_error",
        "message": "the server failed while serving this operation (RuntimeError); the server log has the details",
    }
    (record,) = caplog.records
    assert "Traceback" in record.getMessage() and f"RuntimeError: {SECRET}" in record.getMessage()
    assert backend.aborted == backend.started  # the unfinished request is still aborted


def test_vllms_own_typed_errors_pass_through_unchanged():
    vllm_error = E.ProfileError(E.INVALID_REQUEST, "'max_tokens' is too large: 99999. This model's maximum …")
    sink, _ = serve(orjson.dumps(envelope({"messages": []})), Backend(vllm_error))
    expected = {"type": "invalid_request_error", "code": "invalid_request", "message": vllm_error.message}
    assert only_error(sink) == expected


def test_a_sink_that_cannot_take_the_error_does_not_raise_either(caplog):
    class Refusing(Sink):
        def fail(self, err):
            raise ValueError("outbox closed")

    with caplog.at_level(logging.WARNING):
        serve(b"{not json", sink=Refusing())
    (record,) = caplog.records
    assert "ValueError: outbox closed" in record.getMessage()


def test_a_model_that_is_not_a_string_is_never_recorded():
    sink, _ = serve(orjson.dumps(envelope({"messages": [], "model": [[["x"]]]}, nnrp={"diagnostics": True})))
    assert sink.observation.model is None and sink.terminals[0]["diagnostics"]["model"] is None
    sink, _ = serve(orjson.dumps(envelope({"messages": [], "model": "m\nx"})))
    assert sink.observation.model == "m\nx"

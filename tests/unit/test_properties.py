"""Property-based tests (hypothesis): any input yields either well-ordered events with exactly one terminal or
one typed error — never an exception escaping, never two terminals.

Covered: frame unwrapping (``wire_mapping.unwrap_typed_body``) and envelope decoding (``decode_envelope``) on arbitrary
bytes and on mutated envelopes; chunk -> event mapping (``ChatStreamMapper``) on realistic and on arbitrary
chunk streams, end to end through ``run_operation`` with the real :class:`Operation`; the operation's rules
(:class:`Operation`) on arbitrary sequences of decisions and wire events. Example counts are bounded so the default
test run stays fast.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import orjson
import pytest

pytest.importorskip("hypothesis", reason="hypothesis (test extra) is not installed in this environment")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.support import envelope  # noqa: E402
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.core.adapter import AdapterLimits, Call, run_operation
from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.core.operation import (
    DropReason,
    Operation,
    PartialResult,
    ResultDrop,
    ResultPush,
    State,
    Terminal,
)
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import trace
from vllm_nnrp_plugin.profile.capabilities import chat_operation, operation_names, runtime_document
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper
from vllm_nnrp_plugin.profile.envelope import decode_envelope
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import vllm_chunks

ERROR_TYPES = {E.INVALID_REQUEST_ERROR, E.SERVER_ERROR}
CODES = {v for k, v in vars(E).items() if k.isupper() and isinstance(v, str)} - ERROR_TYPES
MAX_BYTES = 4096
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False) | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)

CAPABILITIES = runtime_document(models=["example-model"], owned_by="vllm", operations=[chat_operation(tool_calls=True)])
OPERATIONS = operation_names(CAPABILITIES)


# -- envelope decoding --------------------------------------------------------------------------------------


def _decodes_or_typed_error(payload: bytes) -> None:
    try:
        env = decode_envelope(payload, operations=OPERATIONS, max_bytes=MAX_BYTES)
    except E.ProfileError as err:
        assert err.code in CODES and err.message
        return
    assert env.operation in OPERATIONS and isinstance(env.body, dict) and "messages" in env.body


@FAST
@given(st.binary(max_size=6000))
def test_any_bytes_decode_to_an_envelope_or_one_typed_error(payload):
    _decodes_or_typed_error(payload)


field_names = st.sampled_from(["schema_version", "operation", "body", "request_id", "nnrp", "extra"])


@FAST
@given(st.dictionaries(field_names, json_values, max_size=5), st.booleans())
def test_mutated_envelopes_decode_or_fail_typed(mutation, drop_messages):
    doc = envelope({"messages": [{"role": "user", "content": "hi"}]})
    doc.update(mutation)
    if drop_messages and isinstance(doc.get("body"), dict):
        doc["body"].pop("messages", None)
    _decodes_or_typed_error(orjson.dumps(doc))


@FAST
@given(st.integers(0, 64), st.integers(0, 4), st.binary(max_size=300))
def test_any_submit_body_unwraps_to_a_payload_or_invalid_frame(bitmap, frame_count, body):
    try:
        payload = wire_mapping.unwrap_typed_body(bitmap, frame_count, body)
    except E.ProfileError as err:
        assert err.code == E.INVALID_FRAME
    else:
        assert isinstance(payload, bytes)


@FAST
@given(st.binary(max_size=500))
def test_a_wrapped_payload_unwraps_to_itself(payload):
    assert wire_mapping.unwrap_typed_body(wire_mapping.STRUCTURED_EVENT, 1, wire_mapping.typed_body(payload)) == payload


# -- chunk -> event mapping, end to end through the adapter -------------------------------------------------

content = st.none() | st.text(max_size=8)
realistic_chunk = st.fixed_dictionaries(
    {"id": st.just("chatcmpl-x"), "created": st.just(1), "model": st.just("m")},
    optional={
        "choices": st.lists(
            st.fixed_dictionaries(
                {"index": st.integers(0, 2), "delta": st.fixed_dictionaries({}, optional={"content": content})},
                optional={"finish_reason": st.none() | st.sampled_from(["stop", "length"])},
            ),
            max_size=2,
        ),
        "usage": st.none()
        | st.fixed_dictionaries(
            {
                "prompt_tokens": st.integers(0, 9),
                "completion_tokens": st.integers(0, 9),
                "total_tokens": st.integers(0, 18),
            }
        ),
    },
)
error_chunk = st.fixed_dictionaries(
    {"error": st.fixed_dictionaries({"message": st.text(max_size=10), "code": st.integers(400, 599)})}
)
any_chunk = st.dictionaries(st.sampled_from(["id", "choices", "usage", "error", "x"]), json_values, max_size=4)
chunk_streams = st.lists(st.one_of(realistic_chunk, realistic_chunk, error_chunk, any_chunk), max_size=12)


def new_operation() -> Operation:
    return Operation(
        Observation(
            connection_id=1,
            session_id=1,
            operation_id=1,
            frame_id=1,
            transport="tcp",
            submitted_ns=0,
            submitted_unix_ns=0,
        )
    )


class RecordingSink:
    """The adapter's sink backed by the real :class:`Operation`; records the actions it would send (each
    terminal sealed as the session pump seals it)."""

    def __init__(self) -> None:
        self.machine = new_operation()
        self.observation = self.machine.observation
        self.actions: list[Any] = []
        self.calls_after_terminal = 0

    def _record(self, action) -> None:
        if action is None:
            self.calls_after_terminal += 1
        elif isinstance(action, Terminal):
            self.actions.append(self.machine.seal(action, 0))
        else:
            self.actions.append(action)

    def partial(self, event):  # taken at once, as by a pump that keeps up: nothing merges
        action = self.machine.partial(event)
        self._record(None if action is None else self.machine.take(action))

    def complete(self, body):
        self._record(self.machine.complete(body).terminal)

    def fail(self, err):
        assert isinstance(err, E.ProfileError) and err.code in CODES
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


class ScriptedBackend:
    """Streams the given chunks as vLLM's SSE strings through the binding's one parser
    (:func:`~vllm_nnrp_plugin.vllm_binding.chunk_shapes.vllm_chunks`, as production does), or returns ``body``
    when not streaming; records aborts."""

    def __init__(self, chunks, body=None) -> None:
        self.chunks, self.body, self.aborted, self.started = chunks, body, [], []

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        self.started.append(request_id)
        if self.body is not None:
            return Call(body=self.body)

        async def stream():
            for chunk in self.chunks:
                await asyncio.sleep(0)
                yield f"data: {orjson.dumps(chunk).decode()}\n\n"
            yield "data: [DONE]\n\n"

        return Call(stream=vllm_chunks(stream()))

    def engine_request_id(self, operation, request_id):
        return request_id

    async def abort(self, operation, request_id):
        self.aborted.append(request_id)


def _check_one_terminal(sink: RecordingSink) -> dict[str, Any]:
    *partials, terminal = sink.actions
    assert all(isinstance(a, PartialResult) for a in partials)
    assert [a.sequence for a in partials] == list(range(1, len(partials) + 1))
    assert isinstance(terminal, ResultPush)
    event = orjson.loads(terminal.event)
    assert event["type"] in ("response.completed", "response.error")
    if event["type"] == "response.error":
        assert event["error"]["code"] in CODES and event["error"]["message"] and event["error"]["type"]
    for action in partials:
        assert orjson.loads(action.body)["type"] in ("response.output_text.delta", "response.usage")
    return event


@FAST
@given(chunk_streams)
# a usage chunk whose usage is not an object once crashed the usage bookkeeping
@example(
    [{"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}, {"choices": [], "usage": True}]
)
def test_any_chunk_stream_gives_ordered_events_and_exactly_one_terminal(chunks):
    sink, payload = RecordingSink(), orjson.dumps(envelope({"messages": [], "stream": True}))
    backend = ScriptedBackend(chunks)
    asyncio.run(run_operation(sink, payload, backend, AdapterLimits(MAX_BYTES), CAPABILITIES))  # must not raise
    event = _check_one_terminal(sink)
    if event["type"] == "response.error" and "without a finish_reason" not in event["error"]["message"]:
        assert backend.aborted == backend.started  # an unfinished backend request is always aborted


@FAST
@given(st.lists(realistic_chunk, max_size=12))
def test_realistic_streams_complete_with_the_streamed_text(chunks):
    sink, payload = RecordingSink(), orjson.dumps(envelope({"messages": [], "stream": True}))
    asyncio.run(run_operation(sink, payload, ScriptedBackend(chunks), AdapterLimits(MAX_BYTES), CAPABILITIES))
    event = _check_one_terminal(sink)
    finished: dict[int, bool] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            finished[choice["index"]] = finished.get(choice["index"], False) or choice.get("finish_reason") is not None
    if not finished or not all(finished.values()):  # vLLM ended the stream without saying why: a failure
        assert event["type"] == "response.error" and event["error"]["code"] == "backend_error"
        return
    assert event["type"] == "response.completed"
    deltas: dict[int, str] = {}
    for action in sink.actions[:-1]:
        e = orjson.loads(action.body)
        if e["type"] == "response.output_text.delta":
            deltas[e["index"]] = deltas.get(e["index"], "") + e["delta"]
    for choice in event["body"]["choices"]:
        assert (choice["message"]["content"] or "") == deltas.get(choice["index"], "")


@FAST
@given(st.binary(max_size=200) | json_values.map(orjson.dumps))
def test_any_envelope_through_the_adapter_gives_exactly_one_terminal(payload):
    sink = RecordingSink()
    backend = ScriptedBackend([], body={"object": "chat.completion"})
    asyncio.run(run_operation(sink, payload, backend, AdapterLimits(MAX_BYTES), CAPABILITIES))
    _check_one_terminal(sink)


@FAST
@given(st.lists(realistic_chunk, max_size=8))
def test_the_mapper_never_raises_on_realistic_chunks(chunks):
    mapper = ChatStreamMapper()
    for chunk in chunks:
        for event in mapper.feed(chunk):
            assert event["type"] in ("response.output_text.delta", "response.usage")
    assert mapper.completed_body()["object"] == "chat.completion"


# -- the operation's rules --------------------------------------------------------------------------------------

DELTA = {"type": "response.output_text.delta", "index": 0, "delta": "x"}
#: the states in which an operation still decides (no terminal decided yet)
LIVE = (State.ADMITTED, State.RUNNING)
# decisions (vLLM's loop), wire events (the pump) and sends, in any order
steps = st.lists(
    st.sampled_from(
        [
            "partial",
            "complete",
            "fail",
            "time_out",
            "shut_down",
            "overflow",
            "peer_cancel",
            "lose",
            "send",
            "trace",
            "dispatch",
        ]
    )
    | st.tuples(st.just("deadline"), st.integers(0, 10_000))
    | st.tuples(st.just("timeout_ms"), st.integers(1, 10_000)),
    max_size=30,
)


def flush(op: Operation, queue: list, sent: list) -> None:
    """What the session pump does with its queue: partials while admitted, each terminal sealed."""
    for action in queue:
        if isinstance(action, PartialResult):
            taken = op.take(action)  # None: discarded (a drop was decided, or the terminal went out)
            if taken is not None:
                sent.append(taken)
        elif action is not None:
            sealed = op.seal(action, 1)
            if sealed is not None:
                sent.append(sealed)
    queue.clear()


@FAST
@given(steps)
def test_the_rules_give_one_terminal_numbered_partials_and_nothing_after_it(sequence):
    """Whatever happens in whatever order: exactly one terminal goes out once one was decided (none when the
    client was gone first) and nothing after it; partials are numbered from 1 with no gap; after a peer
    cancel no partial goes out and the terminal is a drop; the earliest bound wins; the trace context is the
    one the operation was dispatched with."""
    op, queue, sent, bounds = new_operation(), [], [], []
    made: list[PartialResult] = []  # partial results queued (each carries one or more decided deltas)
    decided = 0  # partial results decided
    cancelled = lost_first = dispatched = False  # cancelled: a peer cancel before any terminal went out
    frozen = None
    for step in sequence:
        name, value = step if isinstance(step, tuple) else (step, None)
        if name == "partial":
            finished = op.state not in LIVE
            waiting = next((a for a in reversed(queue) if isinstance(a, PartialResult)), None)
            action = op.partial(DELTA)
            if finished:
                assert action is None  # nothing after a terminal was decided
            elif action.events > 1:  # it joined the delta still waiting to be sent
                assert action is waiting and waiting.event["delta"].endswith("xx")
            decided += not finished
            if action is not None and action.events == 1:  # a new partial result, queued
                made.append(action)
                queue.append(action)
        elif name == "complete":
            queue.append(op.complete({"object": "chat.completion"}).terminal)
        elif name == "fail":
            queue.append(op.fail(E.backend_error("boom")).terminal)
        elif name == "time_out":
            queue.append(op.time_out(1).terminal)
        elif name == "shut_down":
            queue.append(op.shut_down(1).terminal)
        elif name == "overflow":
            queue.append(op.overflow(8).terminal)
        elif name == "peer_cancel":
            cancelled = cancelled or not any(isinstance(a, ResultPush | ResultDrop) for a in sent)
            drop = op.cancel(DropReason.PEER_CANCELLED, "client_cancelled", 1).terminal
            if drop is not None:
                flush(op, [drop], sent)  # the pump sends the drop at once
        elif name == "lose":
            lost_first = lost_first or not any(isinstance(a, ResultPush | ResultDrop) for a in sent)
            op.lose("client_disconnected", 1)
        elif name == "deadline":
            if value:
                bounds.append(value)
            op.bound(value)
        elif name == "timeout_ms":
            bounds.append(op.submitted_unix_ms + value)
            op.limit_time(value)
        elif name == "trace":
            op.override_trace(trace.TraceContext(len(bounds) + 1, 9, 0, 0, 1, 0, trace.OPERATION))
        elif name == "dispatch":
            if not dispatched:
                dispatched, frozen = True, op.dispatch(None)
        else:
            flush(op, queue, sent)
    flush(op, queue, sent)
    terminals = [a for a in sent if isinstance(a, ResultPush | ResultDrop)]
    assert len(terminals) == (0 if lost_first or op.state in LIVE else 1)
    if terminals:
        assert sent[-1] is terminals[0]
    partials = [a for a in sent if isinstance(a, PartialResult)]
    assert [p.sequence for p in partials] == list(range(1, len(partials) + 1))
    if cancelled and terminals:
        assert isinstance(terminals[0], ResultDrop)
    if terminals and isinstance(terminals[0], ResultDrop):
        assert orjson.loads(terminals[0].diagnostic)["type"] == "response.cancelled"
        assert terminals[0].sequence == len(partials) + 1  # right after the last partial result sent
    assert sum(p.events for p in made) == decided  # every decided delta went into exactly one partial result
    assert op.expires_unix_ms == (min(bounds) if bounds else None)
    if dispatched:
        assert op.dispatch(None) == frozen  # later overrides never change in-flight work

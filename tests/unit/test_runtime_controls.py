"""NNRP's runtime controls on the server side, as plain data and through the adapter: priority classes, SUPERSEDE,
BUDGET_UPDATE, deadlines before dispatch and prefix-cache hits (:mod:`vllm_nnrp_plugin.core.controls`,
:mod:`vllm_nnrp_plugin.core.operation`, :mod:`vllm_nnrp_plugin.vllm_binding.serving`, the engine tap). The same on
real vLLM: tests/e2e/test_runtime_controls_e2e.py."""

from __future__ import annotations

import asyncio
import time
import types

import orjson
import pytest
from prometheus_client import CollectorRegistry

from tests.unit.test_properties import CAPABILITIES, MAX_BYTES
from vllm_nnrp_plugin.core.adapter import AdapterLimits, Call, run_operation
from vllm_nnrp_plugin.core.controls import RuntimeControls, priority_class_of
from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.core.operation import DropReason, Operation, ResultDrop
from vllm_nnrp_plugin.nnrp_binding.server_operation import ServerOperation, SessionLink
from vllm_nnrp_plugin.nnrp_binding.session_policy import SessionPolicy
from vllm_nnrp_plugin.observability.metrics import metrics_for
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.envelope import decode_envelope
from vllm_nnrp_plugin.vllm_binding.serving import with_controls

CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "example-model",
    "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
}
FINISH_CHUNK = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
USAGE_CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "example-model",
    "choices": [],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
}


def envelope(**nnrp) -> bytes:
    body = {
        "model": "example-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return orjson.dumps(
        {"schema_version": "openai-compatible/1", "operation": "chat.completions.create", "body": body, "nnrp": nnrp}
    )


def server_operation(priority_class: int = 1) -> tuple[ServerOperation, SessionLink]:
    link = SessionLink(64, notify=lambda: None)
    sop = ServerOperation(
        link,
        session_id=1,
        operation_id=5,
        frame_id=5,
        envelope=b"",
        transport="tcp",
        connection_id=1,
        now_ns=time.monotonic_ns(),
        now_unix_ns=time.time_ns(),
        priority_class=priority_class,
    )
    return sop, link


class Backend:
    """Streams one text chunk, the finish chunk and the usage chunk; reports ``cached`` prefix-cache hits as a vLLM
    binding does."""

    def __init__(self, cached: int | None = None) -> None:
        self.cached = cached
        self.calls: list[RuntimeControls] = []

    def capabilities(self):
        return CAPABILITIES

    def engine_request_id(self, operation, request_id):
        return request_id

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        self.calls.append(controls)
        controls.cached_tokens = self.cached

        async def stream():
            yield CHUNK
            yield FINISH_CHUNK
            yield USAGE_CHUNK

        return Call(stream=stream())

    async def abort(self, operation, request_id):
        pass


def run(sop: ServerOperation, payload: bytes, backend: Backend) -> None:
    asyncio.run(run_operation(sop, payload, backend, AdapterLimits(MAX_BYTES), CAPABILITIES))


def sent(link: SessionLink) -> list:
    return [action for _sop, action in link.items]


# -- the controls as plain data ------------------------------------------------------------------------------


def test_the_own_class_wins_until_dispatch_and_later_updates_are_only_counted():
    controls = RuntimeControls(session_class=2)
    assert controls.priority_class == 2
    assert controls.update_priority(0) and controls.priority_class == 0
    assert not controls.update_priority(2, dispatched=True)
    assert controls.priority_class == 0 and controls.late_priority_updates == 1


def test_the_lowest_token_budget_wins_and_zero_carries_none():
    controls = RuntimeControls()
    assert not controls.lower_budget(0) and controls.token_budget is None
    assert controls.lower_budget(40) and controls.lower_budget(10)
    assert not controls.lower_budget(30) and controls.token_budget == 10


def test_priority_class_names():
    assert [priority_class_of(n) for n in ("interactive", "balanced", "background")] == [0, 1, 2]
    with pytest.raises(ValueError, match="unknown priority class"):
        priority_class_of("urgent")


# -- what the vLLM binding sends ------------------------------------------------------------------------------


def test_the_class_becomes_vllms_priority_only_on_a_priority_server_and_the_bodys_own_wins():
    body = {"model": "m", "messages": []}
    controls = RuntimeControls(session_class=0)
    assert with_controls(body, controls, None) is body and controls.vllm_priority is None
    assert with_controls(body, controls, (-10, 0, 10))["priority"] == -10 and controls.vllm_priority == -10
    assert "priority" not in body  # the caller's body is never changed
    own = {**body, "priority": 3}
    assert with_controls(own, controls, (-10, 0, 10)) is own and controls.vllm_priority == 3


def test_a_token_budget_caps_every_max_tokens_field_or_sets_the_first():
    controls = RuntimeControls(token_budget=8)
    fields = ("max_completion_tokens", "max_tokens")
    assert with_controls({"max_tokens": 100}, controls, None, fields) == {"max_tokens": 8}
    assert with_controls({"max_tokens": 4}, controls, None, fields) == {"max_tokens": 4}
    assert with_controls({}, controls, None, fields) == {"max_completion_tokens": 8}
    assert with_controls({}, controls, None) == {}  # an operation without a token field (embeddings)


def test_the_envelope_priority_class_is_checked():
    ops = frozenset({"chat.completions.create"})
    assert (
        decode_envelope(envelope(priority_class="background"), operations=ops, max_bytes=MAX_BYTES).priority_class
        == "background"
    )
    with pytest.raises(E.ProfileError) as err:
        decode_envelope(envelope(priority_class=["urgent"]), operations=ops, max_bytes=MAX_BYTES)
    assert err.value.code == E.INVALID_ENVELOPE and "priority_class" in err.value.message


# -- the operation's rules ------------------------------------------------------------------------------------


def rules() -> Operation:
    return Operation(
        Observation(
            connection_id=1,
            session_id=1,
            operation_id=5,
            frame_id=5,
            transport="tcp",
            submitted_ns=0,
            submitted_unix_ns=1_000_000_000_000,
        )
    )


def test_an_nnrp_deadline_before_any_output_is_the_deadline_drop_after_it_a_timeout():
    op = rules()
    op.bound(1_000_000_000_100)
    decision = op.time_out(5, started=False)
    terminal = decision.terminal
    assert (
        decision.stop
        and terminal.drop is DropReason.DEADLINE_EXPIRED
        and terminal.event == {"type": "response.cancelled", "reason": "deadline_expired"}
    )
    assert op.observation.cancel_source == "deadline"
    started = rules()
    started.bound(1_000_000_000_100)
    assert started.time_out(5, started=True).terminal.event["error"]["code"] == E.REQUEST_TIMEOUT


def test_the_envelope_timeout_stays_a_request_timeout_before_output_too():
    op = rules()
    op.limit_time(100)
    assert op.time_out(5, started=False).terminal.event["error"]["code"] == E.REQUEST_TIMEOUT


def test_a_push_decided_before_a_supersede_goes_out_as_the_superseded_drop():
    op = rules()
    push = op.complete({"id": "x"}).terminal
    assert op.cancel(DropReason.SUPERSEDED, "superseded", 1).terminal is None
    sealed = op.seal(push, 2)
    assert isinstance(sealed, ResultDrop) and sealed.reason is DropReason.SUPERSEDED
    assert orjson.loads(sealed.diagnostic) == {"type": "response.cancelled", "reason": "superseded"}


# -- the session policy and the adapter -------------------------------------------------------------------------


class Handler:
    """The service's part: takes the submitted operation over (its owner) and records the stops it is told."""

    def __init__(self) -> None:
        self.stopped: list[ServerOperation] = []

    def on_submit(self, sop):
        sop.owner = self

    def stop_operation(self, sop):
        self.stopped.append(sop)


def test_supersede_queues_the_superseded_drop_and_stops_the_vllm_request():
    sop, link = server_operation()
    handler = Handler()
    policy = SessionPolicy(handler, SessionLimits(4, 64), link, send_credit=lambda window: None)
    policy.submit(sop)
    policy.supersede(sop)
    (drop,) = sent(link)
    assert drop.drop is DropReason.SUPERSEDED and handler.stopped == [sop]
    policy.update_priority(sop, 0)  # it left ADMITTED: its class is fixed, the update only counted
    policy.update_budget(sop, 12)
    assert sop.controls.priority_class == 1 and sop.controls.late_priority_updates == 1
    assert sop.controls.token_budget == 12


def test_an_operation_whose_deadline_passed_before_dispatch_never_reaches_the_backend():
    sop, link = server_operation()
    sop.bound(int(time.time() * 1000) - 1)
    backend = Backend()
    run(sop, envelope(), backend)
    assert backend.calls == []
    (drop,) = sent(link)
    assert drop.drop is DropReason.DEADLINE_EXPIRED and sop.observation.priority_class == "balanced"


def test_the_envelope_class_steers_the_backend_and_cached_tokens_reach_the_usage_event():
    sop, link = server_operation(priority_class=2)
    backend = Backend(cached=7)
    run(sop, envelope(priority_class="interactive"), backend)
    (controls,) = backend.calls
    assert controls is sop.controls and controls.priority_class == 0 and sop.rules.dispatched
    usage = next(a.event for a in sent(link) if getattr(a, "event", {}).get("type") == "response.usage")
    assert usage["usage"] == {
        "input_tokens": 9,
        "output_tokens": 1,
        "total_tokens": 10,
        "input_tokens_details": {"cached_tokens": 7},
    }
    assert "prompt_tokens_details" not in sent(link)[-1].event["body"]["usage"]  # the body stays vLLM's
    assert sop.observation.cached_tokens == 7 and sop.observation.priority_class == "interactive"
    registry = CollectorRegistry()
    metrics_for(registry).observe(sop.observation)
    assert registry.get_sample_value("nnrp_tokens_total", {"kind": "cached"}) == 7


def test_a_priority_update_that_came_before_the_task_wins_over_the_envelope():
    sop, _link = server_operation()
    sop.controls.update_priority(2)
    backend = Backend()
    run(sop, envelope(priority_class="interactive"), backend)
    assert backend.calls[0].priority_class == 2


# -- the engine tap (needs vLLM's RequestOutputKind) -----------------------------------------------------------


def output(token_ids, finished=False, cached=None):
    completion = types.SimpleNamespace(
        index=0, text="x" * len(token_ids), token_ids=token_ids, finish_reason=None, stop_reason=None
    )
    return types.SimpleNamespace(outputs=[completion], finished=finished, num_cached_tokens=cached)


class Engine:
    """``AsyncLLM``'s ``generate``/``abort`` shape: yields ``outputs``; lowers the budget after ``lower_at``."""

    def __init__(self, outputs, controls=None, lower_at=None, budget=None) -> None:
        self.outputs, self.controls, self.lower_at, self.budget = outputs, controls, lower_at, budget
        self.aborted: list[str] = []
        self.closed = False

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        try:
            for position, out in enumerate(self.outputs):
                if position == self.lower_at:
                    self.controls.lower_budget(self.budget)
                yield out
        finally:
            self.closed = True

    async def abort(self, request_id):
        self.aborted.append(request_id)


class Serving:
    """vLLM's serving objects keep their engine client as ``engine_client``."""

    def __init__(self, engine) -> None:
        self.engine_client = engine


def tapped(engine, controls, kind_name="DELTA", n=1):
    pytest.importorskip("vllm")
    from vllm.sampling_params import RequestOutputKind

    from vllm_nnrp_plugin.vllm_binding.engine_tap import view_maker

    view = view_maker(Serving(engine))(controls)
    params = types.SimpleNamespace(n=n, output_kind=RequestOutputKind[kind_name])

    async def read():
        return [o async for o in view.engine_client.generate("p", params, "req-1")]

    return asyncio.run(read())


def test_a_budget_lowered_mid_stream_ends_it_there_with_finish_length_and_aborts_the_engine_request():
    controls = RuntimeControls()
    engine = Engine([output([i], cached=3 if i == 0 else None) for i in range(10)], controls, lower_at=2, budget=4)
    seen = tapped(engine, controls)
    assert len(seen) == 4 and seen[-1].finished and seen[-1].outputs[0].finish_reason == "length"
    assert not engine.outputs[3].finished and engine.outputs[3].outputs[0].finish_reason is None  # the engine's own
    assert engine.aborted == ["req-1"] and engine.closed
    assert controls.budget_ended and controls.engine_started and controls.cached_tokens == 3


def test_without_a_budget_every_output_passes_unchanged():
    controls = RuntimeControls()
    outputs = [output([i]) for i in range(5)] + [output([9], finished=True)]
    seen = tapped(Engine(outputs), controls)
    assert seen == outputs and not controls.budget_ended


def test_a_non_streaming_request_takes_no_budget_mid_way():
    controls = RuntimeControls(token_budget=1)
    outputs = [output([1, 2, 3], finished=True)]
    engine = Engine(outputs)
    assert tapped(engine, controls, kind_name="FINAL_ONLY") == outputs and engine.aborted == []


def test_the_view_without_controls_is_vllms_engine_client():
    from vllm_nnrp_plugin.vllm_binding.engine_tap import view_maker

    serving = Serving(object())
    view = view_maker(serving)(None)
    assert view.engine_client is serving.engine_client and isinstance(view, Serving)


def test_the_budget_end_is_the_operations_input_and_aborts_the_engine_request_only_while_it_runs():
    sop, _ = server_operation()
    assert not sop.controls.end_at_budget() and sop.controls.budget_ended  # not dispatched: nothing runs
    sop.dispatch()
    assert sop.controls.end_at_budget()  # the table's BUDGET row while running: abort
    sop.complete({})
    assert not sop.controls.end_at_budget()  # its terminal was decided: the table says nothing


def test_the_tap_leaves_the_engine_request_alone_when_the_lifecycle_decides_no_abort():
    controls = RuntimeControls(on_budget_end=lambda: False)
    engine = Engine([output([i]) for i in range(10)], controls, lower_at=0, budget=2)
    seen = tapped(engine, controls)
    assert len(seen) == 2 and seen[-1].finished and seen[-1].outputs[0].finish_reason == "length"
    assert engine.aborted == [] and engine.closed and controls.budget_ended

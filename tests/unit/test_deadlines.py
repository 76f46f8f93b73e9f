"""Operation bounds from envelope ``nnrp.timeout_ms`` and NNRP DEADLINE controls in the session pump (plain
data: no native session is touched)."""

import asyncio
import types

import pytest

from vllm_nnrp_plugin.limits import SessionLimits, Slots
from vllm_nnrp_plugin.nnrp_binding import session as session_module
from vllm_nnrp_plugin.nnrp_binding.session import SessionPump


@pytest.fixture
def pump():
    loop = asyncio.new_event_loop()
    bounded = []
    handler = types.SimpleNamespace(on_submit=lambda op: None, on_stop=lambda op: None,
                                    on_deadline=lambda op: bounded.append((op.operation_id, op.expires_unix_ms)))
    pump = SessionPump(types.SimpleNamespace(active_transport_name="tcp"), handler, loop, idle_poll_ms=100,
                       limits=SessionLimits(max_in_flight=16, max_queued_events=1024), in_flight=Slots(256))
    pump.bounded = bounded
    pump.drain = lambda: loop.run_until_complete(asyncio.sleep(0))
    yield pump
    loop.close()


def submit_event(operation_id):
    header = types.SimpleNamespace(header=types.SimpleNamespace(session_id=1))
    op = types.SimpleNamespace(operation_id=operation_id, frame_id=operation_id, submit=header)
    return types.SimpleNamespace(as_submit=lambda: op)


def deadline(operation_id, unix_ms):
    return types.SimpleNamespace(operation_id=operation_id, deadline_unix_ms=unix_ms)


def test_a_deadline_before_the_submit_bounds_the_operation_once_submitted(pump):
    pump._on_deadline(deadline(7, 5_000))
    pump._on_event(submit_event(7))
    pump.drain()
    assert pump._ops[7].expires_unix_ms == 5_000 and pump.bounded == [(7, 5_000)]


def test_the_earliest_bound_wins(pump):
    pump._on_event(submit_event(1))
    sop = pump._ops[1]
    sop.limit_time(10_000)
    expected = sop.submitted_unix_ms + 10_000
    pump._on_deadline(deadline(1, expected + 1))  # later: ignored
    assert sop.expires_unix_ms == expected
    pump._on_deadline(deadline(1, expected - 5_000))
    sop.limit_time(9_000)  # later than the DEADLINE: ignored
    pump.drain()
    assert sop.expires_unix_ms == expected - 5_000
    assert [op for op, _ in pump.bounded] == [1, 1]  # told twice: set, then moved earlier


def test_a_zero_deadline_is_no_bound(pump):
    pump._on_event(submit_event(1))
    pump._on_deadline(deadline(1, 0))
    assert pump._ops[1].expires_unix_ms is None


def test_early_deadlines_keep_only_the_newest(pump, monkeypatch):
    monkeypatch.setattr(session_module, "MAX_EARLY_DEADLINES", 2)
    for operation_id in (1, 2, 3):
        pump._on_deadline(deadline(operation_id, 1_000 * operation_id))
    assert pump._early_deadlines == {2: 2_000, 3: 3_000}


def test_time_out_is_a_request_timeout_error_and_nothing_after_it(pump):
    pump._on_event(submit_event(1))
    sop = pump._ops[1]
    sop.limit_time(250)
    sop.time_out()
    sop.partial({"type": "response.output_text.delta", "index": 0, "delta": "late"})
    sop.complete({})
    actions = [action for _, action in pump._outbox]
    (push,) = actions
    assert push.status == 504 and b'"code":"request_timeout"' in push.event and b"250 ms" in push.event
    record = sop.observation
    assert (record.outcome, record.error_code, record.cancel_source, record.cancel_reason) == (
        "error", "request_timeout", "deadline", "request_timeout",
    )  # fmt: skip

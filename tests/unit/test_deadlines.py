"""Operation bounds from envelope ``nnrp.timeout_ms`` and NNRP DEADLINE controls: the rules in the core
(:class:`vllm_nnrp_plugin.core.operation.Operation`), and what a session's policy tells the service (plain data)."""

import asyncio

import pytest

from tests.unit import fakes
from vllm_nnrp_plugin.core import operation as operation_module
from vllm_nnrp_plugin.core.operation import EarlyDeadlines, Operation, Terminal
from vllm_nnrp_plugin.observability.observation import Observation


def rules() -> Operation:
    return Operation(
        Observation(
            connection_id=1,
            session_id=1,
            operation_id=1,
            frame_id=1,
            transport="tcp",
            submitted_ns=0,
            submitted_unix_ns=1_000_000_000_000,
        )
    )


@pytest.fixture
def pumped():
    pump, handler, loop = fakes.pump()
    yield pump, handler, lambda: loop.run_until_complete(asyncio.sleep(0))
    loop.close()


def test_a_deadline_before_the_submit_bounds_the_operation_once_submitted(pumped):
    pump, handler, drain = pumped
    pump.handle(fakes.deadline(7, 5_000))
    pump.handle(fakes.submit(7))
    drain()
    ((name, sop),) = handler.posted
    assert name == "on_submit" and sop.expires_unix_ms == 5_000  # the service arms its timer at submit


def test_a_deadline_for_a_submitted_operation_goes_to_the_loop(pumped):
    pump, handler, drain = pumped
    pump.handle(fakes.submit(1))
    pump.handle(fakes.deadline(1, 9_000))
    pump.handle(fakes.deadline(1, 0))  # zero: no bound, not posted
    drain()
    assert [(name, *rest) for name, _sop, *rest in handler.posted] == [("on_submit",), ("on_deadline", 9_000)]


def test_the_earliest_bound_wins():
    op = rules()
    assert op.limit_time(10_000)
    expected = op.submitted_unix_ms + 10_000
    assert not op.bound(expected + 1)  # later: ignored
    assert op.expires_unix_ms == expected
    assert op.bound(expected - 5_000)
    assert not op.limit_time(9_000)  # later than the DEADLINE: ignored
    assert op.expires_unix_ms == expected - 5_000


def test_a_zero_deadline_is_no_bound():
    op = rules()
    assert not op.bound(0) and op.expires_unix_ms is None


def test_early_deadlines_keep_only_the_newest(monkeypatch):
    monkeypatch.setattr(operation_module, "MAX_EARLY_DEADLINES", 2)
    early = EarlyDeadlines()
    for operation_id in (1, 2, 3):
        early.keep(operation_id, 1_000 * operation_id)
    assert len(early) == 2 and early.take(1) is None and (early.take(2), early.take(3)) == (2_000, 3_000)


def test_limit_time_tells_the_owner_only_when_the_bound_moved(pumped):
    pump, handler, drain = pumped
    pump.handle(fakes.submit(1))
    drain()
    sop = handler.posted[0][1]
    rearmed = []
    sop.owner = type("Owner", (), {"rearm": lambda self, s: rearmed.append(s.expires_unix_ms)})()
    sop.limit_time(250)
    sop.limit_time(500)  # later: the timer stays
    assert rearmed == [sop.observation.submitted_unix_ns // 1_000_000 + 250]


def test_time_out_is_a_request_timeout_error_and_nothing_after_it(pumped):
    pump, handler, drain = pumped
    pump.handle(fakes.submit(1))
    drain()
    sop = handler.posted[0][1]
    sop.limit_time(250)
    sop.time_out()
    sop.partial({"type": "response.output_text.delta", "index": 0, "delta": "late"})
    sop.complete({})
    actions = [action for _, action in pump.link.items]
    (terminal,) = actions
    assert isinstance(terminal, Terminal) and terminal.status == 504
    assert terminal.event["error"]["code"] == "request_timeout" and "250 ms" in terminal.event["error"]["message"]
    record = sop.observation
    assert (record.outcome, record.error_code, record.cancel_source, record.cancel_reason) == (
        "error",
        "request_timeout",
        "deadline",
        "request_timeout",
    )

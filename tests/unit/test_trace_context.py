"""TRACE_CONTEXT -> traceparent: the frozen rules of the ``openai-compatible/1`` profile's TRACE_CONTEXT
mapping, and their scoping by a session's policy (plain data)."""

import asyncio

import pytest

from tests.unit import fakes
from vllm_nnrp_plugin.profile.trace import TraceContext


def test_the_contract_example():
    assert TraceContext(91, 92, 90, 5, 3, 0).traceparent() == "00-0000000000000000000000000000005b-000000000000005c-01"


@pytest.mark.parametrize(
    "trace_id, span_id, flags, expected",
    [
        (1, 2, 0, "00-00000000000000000000000000000001-0000000000000002-00"),
        (2**64 - 1, 2**64 - 1, 1, "00-0000000000000000ffffffffffffffff-ffffffffffffffff-01"),
        (0xABC, 0xDEF, 2, "00-00000000000000000000000000000abc-0000000000000def-00"),  # only bit 0 is "sampled"
    ],
)
def test_ids_are_zero_extended_hex_and_flag_bit_0_is_sampled(trace_id, span_id, flags, expected):
    assert TraceContext(trace_id, span_id, 77, 0, flags, 0).traceparent() == expected


def test_parent_span_id_is_not_used():
    assert TraceContext(1, 2, 3, 0, 1, 0).traceparent() == TraceContext(1, 2, 999, 0, 1, 0).traceparent()


@pytest.mark.parametrize("trace_id, span_id", [(0, 5), (5, 0), (0, 0)])
def test_zero_ids_are_not_eligible(trace_id, span_id):
    assert not TraceContext(trace_id, span_id, 0, 0, 1, 0).eligible


def test_observation_has_the_fixed_metadata_and_only_the_attribute_size():
    observation = TraceContext(91, 92, 90, 5, 3, 12, "operation").observation()
    assert observation == {
        "trace_id": 91,
        "span_id": 92,
        "parent_span_id": 90,
        "stage_code": 5,
        "flags": 3,
        "attribute_bytes": 12,
        "scope": "operation",
        "traceparent": "00-0000000000000000000000000000005b-000000000000005c-01",
    }


# -- scoping by the session's policy ---------------------------------------------------------------------------


@pytest.fixture
def pumped():
    pump, handler, loop = fakes.pump()
    yield pump, handler, loop
    loop.close()


def submitted(pumped, operation_id):
    """The operation the session hands to the service for a submit of ``operation_id``."""
    pump, handler, loop = pumped
    pump.handle(fakes.submit(operation_id))
    loop.run_until_complete(asyncio.sleep(0))
    name, sop = handler.posted[-1]
    assert name == "on_submit" and sop.operation_id == operation_id
    return sop


def test_session_default_applies_to_operations_dispatched_later(pumped):
    pump, *_ = pumped
    sop = submitted(pumped, 1)
    assert sop.dispatch() is None and sop.observation.trace is None
    pump.handle(fakes.trace_context(0, 5, 6))
    later = submitted(pumped, 2)
    assert later.dispatch().traceparent().endswith("-0000000000000006-01")
    assert later.observation.trace.scope == "session"


def test_operation_scope_overrides_the_session_default_before_dispatch(pumped):
    pump, *_ = pumped
    pump.handle(fakes.trace_context(0, 5, 6))
    sop = submitted(pumped, 1)
    other = submitted(pumped, 2)
    pump.handle(fakes.trace_context(1, 7, 8, flags=0, body_bytes=40))
    context = sop.dispatch()
    assert context.traceparent() == "00-00000000000000000000000000000007-0000000000000008-00"
    assert sop.observation.trace.scope == "operation" and sop.observation.trace.body_bytes == 40
    assert other.dispatch().trace_id == 5  # the override is for its own operation only


def test_a_context_after_dispatch_never_changes_in_flight_work(pumped):
    pump, *_ = pumped
    sop = submitted(pumped, 1)
    pump.handle(fakes.trace_context(1, 7, 8))
    assert sop.dispatch().trace_id == 7
    pump.handle(fakes.trace_context(1, 9, 10))
    assert sop.dispatch().trace_id == 7 and sop.observation.trace.trace_id == 7


def test_ineligible_contexts_are_ignored(pumped):
    pump, *_ = pumped
    pump.handle(fakes.trace_context(0, 5, 6))
    pump.handle(fakes.trace_context(0, 0, 6))
    pump.handle(fakes.trace_context(0, 5, 0))
    sop = submitted(pumped, 1)
    pump.handle(fakes.trace_context(1, 0, 1))
    assert sop.dispatch().traceparent() == "00-00000000000000000000000000000005-0000000000000006-01"


def test_a_context_for_an_unknown_frame_is_ignored(pumped):
    pump, *_ = pumped
    pump.handle(fakes.trace_context(42, 5, 6))
    assert submitted(pumped, 1).dispatch() is None

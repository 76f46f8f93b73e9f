from vllm_nnrp_plugin.observability import observation as obs
from vllm_nnrp_plugin.profile.trace import TraceContext


def record(**changes):
    r = obs.Observation(
        connection_id=3,
        session_id=7,
        operation_id=11,
        frame_id=11,
        transport="ipc",
        submitted_ns=1_000_000,
        submitted_unix_ns=5,
    )
    for name, value in changes.items():
        setattr(r, name, value)
    return r


def test_durations_are_derived_in_ms_from_the_monotonic_times():
    r = record()
    r.started(1_500_000, operation="chat.completions.create", model="m", request_id="chatcmpl-x", diagnostics=False)
    r.backend_chunk(3_000_000)
    r.backend_chunk(9_000_000)  # only the first chunk counts
    r.event_sent(3_250_000)
    r.event_sent(4_000_000)
    r.backend_done(4_500_000)
    r.completed()
    r.terminal_sent(5_000_000, dropped=False)
    assert (r.queue_delay_ms, r.backend_first_chunk_ms, r.first_event_ms, r.backend_ms, r.total_ms) == (
        0.5,
        1.5,
        2.25,
        3.0,
        4.0,
    )
    assert r.events == 2 and r.last_event_ns == 4_000_000 and r.outcome == "completed"


def test_a_drop_makes_the_outcome_cancelled_and_the_first_stop_reason_wins():
    r = record()
    r.failed(code="server_shutdown", family="server_error", status=503)
    r.cancelled(2_000_000, source=obs.CLIENT, reason="client_cancelled")
    r.cancelled(3_000_000, source=obs.SERVER, reason="server_shutdown")
    r.terminal_sent(4_000_000, dropped=True)
    assert (r.outcome, r.error_code, r.error_family, r.error_status) == ("cancelled", None, None, None)
    assert (r.cancel_source, r.cancel_reason, r.cancel_ns) == ("client", "client_cancelled", 2_000_000)


def test_diagnostics_shape_with_absent_values_as_null():
    d = obs.diagnostics(record())
    assert d == {
        "schema": "vllm.diagnostics/1",
        "session_id": 7,
        "operation_id": 11,
        "frame_id": 11,
        "transport": "ipc",
        "request_id": None,
        "model": None,
        "queue_delay_ms": None,
        "backend_first_chunk_ms": None,
        "first_event_ms": None,
        "total_ms": None,
        "events": 0,
        "usage": None,
        "cancel": None,
        "priority": None,
        "token_budget": None,
        "cached_tokens": None,
        "trace": None,
    }
    traced = record(trace=TraceContext(91, 92, 90, 5, 1, 4), input_tokens=3, output_tokens=4)
    d = obs.diagnostics(traced)
    assert d["trace"] == {
        "trace_id": 91,
        "span_id": 92,
        "parent_span_id": 90,
        "stage_code": 5,
        "flags": 1,
        "attribute_bytes": 4,
        "scope": "session",
        "traceparent": "00-0000000000000000000000000000005b-000000000000005c-01",
    }
    assert d["usage"] == {"input_tokens": 3, "output_tokens": 4}


def test_log_line_leaves_out_what_is_unknown():
    r = record(outcome="error", error_code="backend_error", error_family="server_error")
    assert obs.log_line(r) == (
        "nnrp operation transport=ipc connection_id=3 session_id=7 operation_id=11 frame_id=11 outcome=error "
        "error_code=backend_error error_family=server_error events=0"
    )

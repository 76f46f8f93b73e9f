import orjson

from vllm_nnrp_plugin.observation import Observation
from vllm_nnrp_plugin.operation import (
    DropReason,
    Operation,
    OperationMachine,
    PartialResult,
    ResultDrop,
    ResultPush,
    Terminal,
)
from vllm_nnrp_plugin.profile.errors import ProfileError


def test_partials_are_numbered_from_one_and_the_terminal_is_unique():
    m = OperationMachine()
    first, second = m.partial({"type": "a"}), m.partial({"type": "b"})
    assert isinstance(first, PartialResult) and (first.sequence, second.sequence) == (0, 0)  # numbered when taken
    assert (m.number(second).sequence, m.number(first).sequence) == (1, 2)
    assert first.body == b'{"type":"a"}' and m.events_sent == 2
    done = m.complete({"id": "x"})
    assert isinstance(done, Terminal) and done.status == 200 and done.drop is None
    assert done.event == {"type": "response.completed", "body": {"id": "x"}}
    assert m.partial({"type": "late"}) is None
    assert m.fail(ProfileError("backend_error", "late")) is None
    assert m.cancel(DropReason.PEER_CANCELLED, "late") is None
    assert m.outcome == "completed"


def test_error_terminal_has_the_error_shape_and_status():
    m = OperationMachine()
    push = m.fail(ProfileError("model_not_found", "no such model", status=404))
    assert push.status == 404
    assert push.event == {
        "type": "response.error",
        "error": {"type": "invalid_request_error", "code": "model_not_found", "message": "no such model"},
    }


def test_cancel_is_a_drop_carrying_response_cancelled_and_ends_emission():
    m = OperationMachine()
    m.partial({"type": "a"})
    drop = m.cancel(DropReason.PEER_CANCELLED, "client_cancelled")
    assert drop.drop is DropReason.PEER_CANCELLED
    assert drop.event == {"type": "response.cancelled", "reason": "client_cancelled"}
    assert m.partial({"type": "b"}) is None and m.complete({}) is None
    assert m.outcome == "cancelled:client_cancelled"


# -- sealing: the terminal is encoded once, when it is sent ---------------------------------------------------


def operation(diagnostics=False):
    record = Observation(connection_id=1, session_id=1, operation_id=7, frame_id=7, transport="tcp",
                         submitted_ns=1_000_000, submitted_unix_ns=5_000_000_000)  # fmt: skip
    record.diagnostics_requested = diagnostics
    return Operation(record)


def test_a_sealed_push_is_the_encoded_terminal_and_a_drop_is_numbered_after_the_partials():
    op = operation()
    op.partial({"type": "a"})
    push = op.seal(op.complete({"id": "x"}), now_ns=3_000_000)
    assert isinstance(push, ResultPush) and push.status == 200
    assert orjson.loads(push.event) == {"type": "response.completed", "body": {"id": "x"}}
    assert op.seal(Terminal(200, {}), now_ns=4_000_000) is None  # one terminal goes out, never two
    cancelled = operation()
    cancelled.take(cancelled.partial({"type": "a"}))
    drop = cancelled.seal(cancelled.cancel(DropReason.PEER_CANCELLED, "client_cancelled", 2_000_000), 2_000_000)
    assert isinstance(drop, ResultDrop) and drop.sequence == 2
    assert orjson.loads(drop.diagnostic) == {"type": "response.cancelled", "reason": "client_cancelled"}


def test_diagnostics_go_into_the_terminal_with_the_time_it_was_sent():
    op = operation(diagnostics=True)
    push = op.seal(op.fail(ProfileError("backend_error", "boom", status=500)), now_ns=43_000_000)
    event = orjson.loads(push.event)
    assert event["error"]["code"] == "backend_error"
    assert event["diagnostics"]["schema"] == "vllm.diagnostics/1" and event["diagnostics"]["total_ms"] == 42.0
    assert op.elapsed_ms(43_000_000) == 42


def test_a_push_decided_before_a_peer_cancel_goes_out_as_the_cancel_drop():
    op = operation()
    push = op.complete({"id": "x"})
    assert op.cancel(DropReason.PEER_CANCELLED, "client_cancelled", 2_000_000) is None
    assert not op.admits_partials
    drop = op.seal(push, 3_000_000)
    assert isinstance(drop, ResultDrop) and drop.reason is DropReason.PEER_CANCELLED
    assert op.observation.outcome == "cancelled" and op.observation.cancel_source == "client"

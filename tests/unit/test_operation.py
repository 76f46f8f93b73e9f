import orjson

from vllm_nnrp_plugin.operation import DropReason, OperationMachine, PartialResult, ResultDrop, ResultPush
from vllm_nnrp_plugin.profile.errors import ProfileError


def test_partials_are_numbered_from_one_and_the_terminal_is_unique():
    m = OperationMachine()
    first, second = m.partial({"type": "a"}), m.partial({"type": "b"})
    assert isinstance(first, PartialResult) and (first.sequence, second.sequence) == (1, 2)
    done = m.complete({"id": "x"})
    assert isinstance(done, ResultPush) and done.status == 200
    assert orjson.loads(done.event) == {"type": "response.completed", "body": {"id": "x"}}
    assert m.partial({"type": "late"}) is None
    assert m.fail(ProfileError("backend_error", "late")) is None
    assert m.cancel(DropReason.PEER_CANCELLED, "late") is None
    assert m.outcome == "completed"


def test_error_terminal_has_the_error_shape_and_status():
    m = OperationMachine()
    push = m.fail(ProfileError("model_not_found", "no such model", status=404))
    assert push.status == 404
    assert orjson.loads(push.event) == {
        "type": "response.error",
        "error": {"type": "invalid_request_error", "code": "model_not_found", "message": "no such model"},
    }


def test_cancel_is_a_drop_carrying_response_cancelled_and_ends_emission():
    m = OperationMachine()
    m.partial({"type": "a"})
    drop = m.cancel(DropReason.PEER_CANCELLED, "client_cancelled")
    assert isinstance(drop, ResultDrop) and drop.sequence == 2
    assert orjson.loads(drop.diagnostic) == {"type": "response.cancelled", "reason": "client_cancelled"}
    assert m.partial({"type": "b"}) is None and m.complete({}) is None
    assert m.outcome == "cancelled:client_cancelled"

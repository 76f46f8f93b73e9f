"""The backend request's lifecycle table (:mod:`vllm_nnrp_plugin.core.backend_request`); the adapter carrying it out:
tests/unit/test_adapter_abort.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_nnrp_plugin.core.backend_request import TRANSITIONS, BackendRequest, Input, State


def run(*inputs: Input) -> list[bool]:
    request = BackendRequest()
    return [request.step(event) for event in inputs]


def test_a_stop_before_the_backend_streamed_aborts_now_and_again_on_the_way_out():
    assert run(Input.STOP, Input.RELEASE) == [True, True]


def test_a_stop_once_the_backend_streamed_aborts_once():
    assert run(Input.STREAM, Input.STOP, Input.RELEASE) == [False, True, False]


def test_a_refused_abort_is_not_issued_again():
    assert run(Input.STOP, Input.REFUSED, Input.RELEASE) == [True, False, False]


def test_an_unfinished_request_is_aborted_on_the_way_out_and_a_finished_one_never():
    assert run(Input.STREAM, Input.RELEASE) == [False, True]
    assert run(Input.RELEASE) == [True]
    assert run(Input.STREAM, Input.FINISH, Input.STOP, Input.RELEASE) == [False, False, False, False]


@given(st.lists(st.sampled_from(list(Input)), max_size=12))
def test_at_most_two_aborts_and_none_after_the_stream_ended_or_the_way_out(inputs):
    request, aborts = BackendRequest(), 0
    for event in inputs:
        before = request.state
        aborted = request.step(event)
        aborts += aborted
        assert not (aborted and before in (State.FINISHED, State.GONE, State.RELEASED, State.ABORTING))
    assert aborts <= 2
    assert not any(state is State.RELEASED for state, _ in TRANSITIONS)  # nothing leaves the way out

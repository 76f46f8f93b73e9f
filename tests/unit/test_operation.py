import pathlib

import orjson
from hypothesis import given
from hypothesis import strategies as st

from vllm_nnrp_plugin.core.operation import (
    NOTHING,
    TRANSITIONS,
    DropReason,
    Effect,
    Input,
    Operation,
    PartialResult,
    ResultDrop,
    ResultPush,
    State,
    Terminal,
)
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile.errors import ProfileError

A, R, D, X, S = State.ADMITTED, State.RUNNING, State.DECIDED, State.DROPPING, State.SENT
#: the inputs after which the operation's backend work must not go on
STOPPING = (Input.OVERFLOW, Input.TIME_OUT, Input.EXPIRE, Input.SHUT_DOWN, Input.CANCEL, Input.LOSE, Input.UNSENDABLE)


def test_partials_are_numbered_from_one_and_the_terminal_is_unique():
    m = operation()
    first, second = m.partial({"type": "a"}), m.partial({"type": "b"})
    assert isinstance(first, PartialResult) and (first.sequence, second.sequence) == (0, 0)  # numbered when taken
    assert (m.take(second).sequence, m.take(first).sequence) == (1, 2)
    assert first.body == b'{"type":"a"}' and m.events_sent == 2
    done = m.complete({"id": "x"})
    assert done.effect == Effect.QUEUE and m.state is D
    assert isinstance(done.terminal, Terminal) and done.terminal.status == 200 and done.terminal.drop is None
    assert done.terminal.event == {"type": "response.completed", "body": {"id": "x"}}
    assert m.partial({"type": "late"}) is None
    assert m.fail(ProfileError("backend_error", "late")).terminal is None
    assert m.observation.outcome == "completed"


def test_error_terminal_has_the_error_shape_and_status():
    push = operation().fail(ProfileError("model_not_found", "no such model", status=404)).terminal
    assert push.status == 404
    assert push.event == {
        "type": "response.error",
        "error": {"type": "invalid_request_error", "code": "model_not_found", "message": "no such model"},
    }


def test_cancel_is_a_queued_drop_carrying_response_cancelled_that_stops_the_work_and_ends_emission():
    m = operation()
    queued = m.partial({"type": "a"})
    decision = m.cancel(DropReason.PEER_CANCELLED, "client_cancelled", 1)
    assert decision.effect == Effect.QUEUE | Effect.STOP | Effect.DROP and decision.stop and m.state is X
    assert decision.terminal.drop is DropReason.PEER_CANCELLED
    assert decision.terminal.event == {"type": "response.cancelled", "reason": "client_cancelled"}
    assert m.partial({"type": "b"}) is None and m.complete({}).terminal is None
    assert m.take(queued) is None and m.events_sent == 0  # the partial queued before the cancel is discarded


# -- the lifecycle table ------------------------------------------------------------------------------------------


def test_the_table_queues_at_most_one_terminal_and_only_before_one_was_decided():
    queuing = {(state, event) for (state, event), (effect, _) in TRANSITIONS.items() if Effect.QUEUE in effect}
    assert {state for state, _ in queuing} == {A, R}
    # a queued terminal (anything but a partial result) leaves the live states: a second one can never be queued
    assert all(TRANSITIONS[pair][1] in (D, X) for pair in queuing if pair[1] is not Input.PARTIAL)
    # nothing leads back to ADMITTED or RUNNING from DECIDED, DROPPING or SENT, and nothing leaves SENT
    assert all(new in (D, X, S) for (state, _), (_, new) in TRANSITIONS.items() if state in (D, X, S))
    assert all(new is S for (state, _), (_, new) in TRANSITIONS.items() if state is S)


def test_every_input_that_ends_an_operation_stops_its_work_in_every_state_it_may_still_run():
    for event in STOPPING:
        for state in (A, R, D, X):
            if (state, event) in TRANSITIONS:
                assert Effect.STOP in TRANSITIONS[state, event][0], (state, event)
        assert all((state, event) in TRANSITIONS for state in (A, R)), event  # live operations always react
    for event in (Input.TIME_OUT, Input.EXPIRE, Input.SHUT_DOWN):  # the task may still run after its terminal
        assert TRANSITIONS[S, event] == (Effect.STOP, S)


def test_only_a_decided_terminal_is_sent_and_sending_ends_the_lifecycle():
    sending = {pair: new for pair, (effect, new) in TRANSITIONS.items() if Effect.SEND in effect}
    assert {state for state, event in sending if event is Input.SEAL} == {D, X}
    assert {new for (_, event), new in sending.items() if event is not Input.TAKE} == {S}
    # a partial result goes out only before a drop was decided or the terminal went out, and moves nothing
    assert {state: new for (state, event), new in sending.items() if event is Input.TAKE} == {A: A, R: R, D: D}
    # a partial result is decided only before a terminal, and deciding one moves nothing either
    assert {state: new for (state, event), (_, new) in TRANSITIONS.items() if event is Input.PARTIAL} == {A: A, R: R}


def test_a_budget_end_aborts_the_running_request_and_leaves_its_terminal_to_the_stream():
    op = operation()
    assert op.end_budget() is NOTHING  # not dispatched: no request runs
    op.dispatch(None)
    decision = op.end_budget()
    assert decision.abort and not decision.stop and decision.terminal is None and op.state is R
    assert op.partial({"type": "response.output_text.delta", "delta": "x"}) is not None  # the finish chunk
    assert op.complete({"status": "incomplete"}).terminal is not None
    assert op.end_budget() is NOTHING


@given(st.lists(st.sampled_from(list(Input)), max_size=20))
def test_any_sequence_of_inputs_moves_forward_and_decides_one_terminal(inputs):
    """Whatever the adapter, the service and the carrier say in whatever order: the state never moves back, at
    most one terminal is ever queued (only while the operation is live), at most one is sealed (and only one that
    was queued), and an operation that decided one and still waits holds it."""
    op, order = operation(), {A: 0, R: 1, D: 2, X: 2, S: 3}
    queued, partials, decided, sealed = [], [], 0, 0
    for event in inputs:
        before = op.state
        if event is Input.DISPATCH:
            op.dispatch(None)
        elif event is Input.PARTIAL:
            partial = op.partial({"type": "response.output_text.delta", "delta": "x"})
            assert (partial is not None) == (before in (A, R))
            if partial is not None and partial.events == 1:
                partials.append(partial)
        elif event is Input.TAKE:
            if partials:
                taken = op.take(partials.pop(0))
                assert (taken is not None) == (before in (A, R, D)) and op.state is before
        elif event is Input.SEAL:
            results = [op.seal(terminal, 1) for terminal in queued]
            sealed += sum(result is not None for result in results)
            queued.clear()
        elif event is Input.UNSENDABLE:
            decision, drop = op.unsendable(1)
            assert isinstance(drop, ResultDrop) and decision.stop and op.state is S
        elif event is Input.BUDGET:
            decision = op.end_budget()
            assert decision.abort == (before is R) and decision.terminal is None and op.state is before
        elif event is Input.LOSE:
            assert op.lose("client_disconnected", 1).stop == (before is not S)
        else:
            decision = {
                Input.COMPLETE: lambda: op.complete({}),
                Input.FAIL: lambda: op.fail(ProfileError("backend_error", "x")),
                Input.OVERFLOW: lambda: op.overflow(8),
                Input.TIME_OUT: lambda: op.time_out(1),
                Input.EXPIRE: lambda: (op.bound(5), op.time_out(1, started=False))[1],
                Input.SHUT_DOWN: lambda: op.shut_down(1),
                Input.REFUSE: lambda: op.refuse(ProfileError("too_many_requests", "x", status=429)),
                Input.CANCEL: lambda: op.cancel(DropReason.PEER_CANCELLED, "client_cancelled", 1),
            }[event]()
            assert (decision.terminal is not None) == (before in ((A,) if event is Input.REFUSE else (A, R)))
            if decision.terminal is not None:
                queued.append(decision.terminal)
                decided += 1
        assert order[op.state] >= order[before], (before, event, op.state)
    assert decided <= 1 and sealed <= decided
    if op.state in (D, X):
        assert len(queued) == 1  # its one terminal waits to be sent


# -- sealing: the terminal is encoded once, when it is sent ---------------------------------------------------


def operation(diagnostics=False):
    record = Observation(
        connection_id=1,
        session_id=1,
        operation_id=7,
        frame_id=7,
        transport="tcp",
        submitted_ns=1_000_000,
        submitted_unix_ns=5_000_000_000,
    )
    record.diagnostics_requested = diagnostics
    return Operation(record)


def test_a_sealed_push_is_the_encoded_terminal_and_a_drop_is_numbered_after_the_partials():
    op = operation()
    op.partial({"type": "a"})
    push = op.seal(op.complete({"id": "x"}).terminal, now_ns=3_000_000)
    assert isinstance(push, ResultPush) and push.status == 200
    assert orjson.loads(push.event) == {"type": "response.completed", "body": {"id": "x"}}
    assert op.seal(Terminal(200, {}), now_ns=4_000_000) is None  # one terminal goes out, never two
    cancelled = operation()
    cancelled.take(cancelled.partial({"type": "a"}))
    drop = cancelled.seal(
        cancelled.cancel(DropReason.PEER_CANCELLED, "client_cancelled", 2_000_000).terminal, 2_000_000
    )
    assert isinstance(drop, ResultDrop) and drop.sequence == 2
    assert orjson.loads(drop.diagnostic) == {"type": "response.cancelled", "reason": "client_cancelled"}


def test_diagnostics_go_into_the_terminal_with_the_time_it_was_sent():
    op = operation(diagnostics=True)
    push = op.seal(op.fail(ProfileError("backend_error", "boom", status=500)).terminal, now_ns=43_000_000)
    event = orjson.loads(push.event)
    assert event["error"]["code"] == "backend_error"
    assert event["diagnostics"]["schema"] == "vllm.diagnostics/1" and event["diagnostics"]["total_ms"] == 42.0
    assert op.elapsed_ms(43_000_000) == 42


def test_a_push_decided_before_a_peer_cancel_goes_out_as_the_cancel_drop():
    op = operation()
    queued = op.partial({"type": "a"})
    push = op.complete({"id": "x"}).terminal
    late = op.cancel(DropReason.PEER_CANCELLED, "client_cancelled", 2_000_000)
    assert late.terminal is None and late.effect == Effect.STOP | Effect.DROP and op.state is X
    assert op.take(queued) is None  # decided before the terminal, it never goes out after the cancel
    drop = op.seal(push, 3_000_000)
    assert isinstance(drop, ResultDrop) and drop.reason is DropReason.PEER_CANCELLED
    assert op.observation.outcome == "cancelled" and op.observation.cancel_source == "client"


# -- the documented table ---------------------------------------------------------------------------------------


def _rendered_table() -> str:
    """:data:`TRANSITIONS` as docs/architecture.md shows it: a row per input, a column per state."""

    def cell(state: State, event: Input) -> str:
        if (state, event) not in TRANSITIONS:
            return "—"
        effect, new = TRANSITIONS[state, event]
        names = " + ".join(e.name.lower() for e in Effect if e in effect and e is not Effect.NONE)
        return f"{names} → {new.name}"

    rows = ["| input | " + " | ".join(s.name for s in State) + " |", "|---|" + "---|" * len(State)]
    rows += [f"| {event.name} | " + " | ".join(cell(s, event) for s in State) + " |" for event in Input]
    return "\n".join(rows) + "\n"


def test_the_architecture_page_shows_the_lifecycle_table_the_code_runs():
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert _rendered_table() in page

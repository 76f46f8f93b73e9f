"""Deltas that wait to be sent merge (the profile's rule, :func:`vllm_nnrp_plugin.profile.events.merge`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_nnrp_plugin.core.operation import Operation
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile import events as ev


def test_text_deltas_of_one_choice_merge_and_nothing_else_does():
    a, b = ev.output_text_delta(0, "Hel"), ev.output_text_delta(0, "lo")
    assert ev.merge(a, b) == ev.output_text_delta(0, "Hello")
    assert a == ev.output_text_delta(0, "Hel")  # inputs unchanged
    assert ev.merge(a, ev.output_text_delta(1, "lo")) is None  # another choice
    assert ev.merge(a, ev.usage({"prompt_tokens": 1, "completion_tokens": 1})) is None
    assert ev.merge(a, {**b, "openai_chunk": {}}) is None  # extra keys never merge
    started = ev.tool_call_started(0, "tool_call_0_0_0", "call_1", "f")
    assert ev.merge(started, ev.tool_call_delta(0, "tool_call_0_0_0", "call_1", "{")) is None


def test_argument_fragments_of_one_call_merge_and_of_another_call_do_not():
    a = ev.tool_call_delta(0, "tool_call_0_0_0", "call_1", '{"x"')
    b = ev.tool_call_delta(0, "tool_call_0_0_0", "call_1", ": 1}")
    assert ev.merge(a, b) == ev.tool_call_delta(0, "tool_call_0_0_0", "call_1", '{"x": 1}')
    assert ev.merge(a, ev.tool_call_delta(0, "tool_call_0_1_0", "call_2", "{")) is None


def operation() -> Operation:
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


@given(st.lists(st.tuples(st.sampled_from(["delta0", "delta1", "usage", "take"]), st.text(max_size=3)), max_size=40))
def test_whatever_is_merged_the_client_reads_the_same_text_per_choice_in_order(steps):
    """A pump that takes events at random moments: the partial results sent, concatenated per choice, are the
    deltas decided, in order; numbered 1..n; each decided event is in exactly one of them."""
    op, queued, sent, decided = operation(), [], [], {0: "", 1: ""}
    for kind, text in steps:
        if kind == "take":
            sent += [op.take(p) for p in queued]
            queued.clear()
            continue
        event = ev.usage({}) if kind == "usage" else ev.output_text_delta(int(kind[-1]), text)
        if kind != "usage":
            decided[int(kind[-1])] += text
        action = op.partial(event)
        if action is not None and action.events == 1:  # a new partial result (else it joined the one queued)
            queued.append(action)
    sent += [op.take(p) for p in queued]
    assert [p.sequence for p in sent] == list(range(1, len(sent) + 1))
    assert sum(p.events for p in sent) == len([s for s in steps if s[0] != "take"])
    for index in (0, 1):
        text = "".join(
            p.event["delta"] for p in sent if p.event["type"] == ev.OUTPUT_TEXT_DELTA and p.event["index"] == index
        )
        assert text == decided[index]

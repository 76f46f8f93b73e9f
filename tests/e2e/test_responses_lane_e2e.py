"""The Responses lane inside a real ``vllm serve`` (every anchor): a streamed ``responses.create`` gives over NNRP
the events and completed Response that vLLM's own ``/v1/responses`` stream gives for the same request — its HTTP
events, read through the profile mapper (the path every Responses stream took before the lane) — on a plain
server, on a server with a tool-call parser (hermes: text, ``tool_choice`` auto, ``required``, a named function,
parallel calls refused, a call cut by ``max_output_tokens``, a conversation with a call in it) and on one with a
reasoning parser (olmo3: reasoning
items, whose vLLM events the profile carries whole). On 0.26–0.32 (and on 0.22 without a parser) the lane reads
the engine's outputs itself and drives vLLM's parser and processor state; elsewhere the streams take vLLM's
processor whole and the start-up log says why.

Normalised before comparing: runs of text deltas joined (:func:`merged`: how outputs are split into deltas
depends on timing), the ids vLLM makes anew per request (item ids, call ids, the Response id and clock), and the
sequence numbers of reasoning events when the two streams split their text differently (then they must still
count up)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import profile_client
from tests.e2e.test_engine_lane_e2e import merged, over_nnrp
from tests.e2e.test_responses import LOOKUP, TEXT, responses, stable, text_of
from vllm_nnrp_plugin.profile.responses_stream import ResponsesStreamMapper
from vllm_nnrp_plugin.profile.tool_calls import tools_without_required_arguments
from vllm_nnrp_plugin.vllm_binding.families import responses_stream_fails

pytestmark = pytest.mark.vllm

BASE = {**TEXT, "input": "Tell me about the sea.", "max_output_tokens": 40, "stream": True}
GET_TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Get the current time.",
    "parameters": {"type": "object", "properties": {}},
}
#: a conversation with one call of ``get_time`` and its output (the small model answers it with text)
GET_TIME_INPUT = [
    {"role": "user", "content": "Call the get_time tool."},
    {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    {"role": "user", "content": "Call the get_time tool again."},
]
REQUIRED = {
    **BASE,
    "input": "Tell me about Paris.",
    "max_output_tokens": 64,
    "tools": [LOOKUP],
    "tool_choice": "required",
}
TOOL_CASES = {
    "no-tools": BASE,
    "auto-text": {**BASE, "tools": [LOOKUP], "tool_choice": "auto"},
    "auto-after-a-call": {
        **BASE,
        "input": GET_TIME_INPUT,
        "max_output_tokens": 64,
        "tools": [GET_TIME],
        "tool_choice": "auto",
    },
    "required": REQUIRED,
    "required-budget": {**REQUIRED, "max_output_tokens": 12},
    "required-one-call": {**REQUIRED, "parallel_tool_calls": False},
    "named": {**REQUIRED, "tool_choice": {"type": "function", "name": "lookup"}},
}
PLAIN_CASES = {"text": BASE, "budget": {**BASE, "max_output_tokens": 5}}
REASONING_CASES = {"text": BASE, "budget": {**BASE, "max_output_tokens": 5}}
#: prefix-cache counts of a Response's usage (``cache_write_tokens``: 0.32)
PREFIX_CACHE = ("cached_tokens", "cache_write_tokens")
#: vLLM's ids made anew per request, in events and in the Response
ID_KEYS = ("id", "item_id", "call_id")


def over_http(server, body):
    """(events, completed Response) of ``body`` through vLLM's ``/v1/responses`` stream and the profile mapper."""
    with httpx.stream("POST", f"{server.http}/v1/responses", json=body, timeout=120) as response:
        assert response.status_code == 200
        items = [json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: ")]
    mapper = ResponsesStreamMapper(tools_without_required_arguments(body.get("tools")))
    events = [event for item in items for event in mapper.feed(item)]
    events.extend(mapper.finish())
    return events, mapper.completed_body()


def normal(events):
    """``events`` merged (:func:`merged`) with vLLM's per-request ids replaced by their order of appearance and
    the reasoning events' sequence numbers (carried whole, in ``openai_chunk``) left out: (events, sequence
    numbers)."""
    names: dict[str, str] = {}
    numbers: list[int] = []

    def rename(value):
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if key == "sequence_number":
                    numbers.append(item)
                elif key in ID_KEYS and isinstance(item, str):
                    out[key] = names.setdefault(item, f"id-{len(names)}")
                else:
                    out[key] = rename(item)
            return out
        if isinstance(value, list):
            return [rename(item) for item in value]
        return value

    return rename(merged(events)), numbers


def comparable(response):
    """:func:`~tests.e2e.test_responses.stable` of ``response`` without its prefix-cache counts (a request repeated
    on the same server hits the cache the first one filled)."""
    response = stable(response)
    details = response["usage"]["input_tokens_details"]
    response["usage"] = {
        **response["usage"],
        "input_tokens_details": {k: v for k, v in details.items() if k not in PREFIX_CACHE},
    }
    return response


def assert_same(server, client, body):
    """NNRP's events and completed Response for ``body`` are vLLM's own (module docstring); returns the events."""
    events, completed = over_nnrp(client, body, wrap=responses)
    reference_events, reference = over_http(server, body)
    ours, our_numbers = normal(events)
    theirs, their_numbers = normal(reference_events)
    assert ours == theirs
    if len(events) == len(reference_events):
        assert our_numbers == their_numbers
    assert our_numbers == sorted(set(our_numbers))
    assert comparable(completed) == comparable(reference)
    return events


@pytest.fixture
def tools_client(vllm_tools_server):
    with profile_client(vllm_tools_server) as client:
        yield client


@pytest.fixture
def reasoning_client(vllm_reasoning_server):
    with profile_client(vllm_reasoning_server) as client:
        yield client


@pytest.mark.binding_core
def test_the_start_up_log_says_which_path_responses_streams_take(vllm_server, vllm_tools_server, vllm_reasoning_server):
    family = tuple(vllm_server.family)
    plain = "NNRP Responses streams: text deltas straight from the engine" in vllm_server.output()
    assert plain == (family >= (0, 22)), vllm_server.output()
    for server in (vllm_tools_server, vllm_reasoning_server):
        if family >= (0, 26):
            assert "NNRP Responses streams: text and reasoning deltas straight from the engine" in server.output()
        else:
            assert (
                "NNRP Responses streams: vLLM's event objects for every event (Responses lane off: " in server.output()
            )


@pytest.mark.binding_core
@pytest.mark.parametrize("case", sorted(PLAIN_CASES))
def test_a_plain_responses_stream_gives_what_vllms_own_stream_gives(vllm_server, plain_client, case):
    events = assert_same(vllm_server, plain_client, PLAIN_CASES[case])
    assert any(e["type"] == "response.output_text.delta" and e["delta"] for e in events)


@pytest.mark.binding_core
@pytest.mark.parametrize("case", sorted(TOOL_CASES))
def test_a_responses_stream_on_a_tool_parser_server_gives_what_vllms_own_stream_gives(
    vllm_tools_server, tools_client, case
):
    body = TOOL_CASES[case]
    if responses_stream_fails(vllm_tools_server.family, body, tool_parser=True):
        pytest.skip("this line cannot stream it (tests/e2e/test_responses.py checks the refusal)")
    events = assert_same(vllm_tools_server, tools_client, body)
    kinds = {e["type"] for e in events}
    if case in ("required", "required-one-call", "named"):
        assert "response.tool_call.completed" in kinds, events


@pytest.mark.binding_core
@pytest.mark.parametrize("case", sorted(REASONING_CASES))
def test_a_responses_stream_on_a_reasoning_parser_server_gives_what_vllms_own_stream_gives(
    vllm_reasoning_server, reasoning_client, case
):
    events = assert_same(vllm_reasoning_server, reasoning_client, REASONING_CASES[case])
    reasoning = [e["openai_chunk"] for e in events if "openai_chunk" in e]
    assert any(chunk["type"] == "response.reasoning_text.delta" and chunk["delta"] for chunk in reasoning), events


def test_concurrent_responses_streams_on_the_lane_stream_what_their_responses_say(tools_client):
    """Eight streams at once on one session (the outputs of eight requests interleaved on vLLM's loop, batched, so
    greedy text may differ from a request run alone): each stream's text is its completed Response's, which vLLM
    makes from the request's own context, and its usage counts the tokens of that Response."""
    bodies = [{**BASE, "input": f"Tell me about the number {n}.", "max_output_tokens": 24} for n in range(8)]
    operations = [tools_client.submit(responses(body)) for body in bodies]
    for operation in operations:
        *partials, terminal = tools_client.events(operation, timeout_s=120)
        assert terminal.event["type"] == "response.completed", terminal.event
        events = [p.event for p in partials]
        completed = terminal.event["body"]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text and text == text_of(completed)
        (usage,) = [e["usage"] for e in events if e["type"] == "response.usage"]
        assert usage["output_tokens"] == completed["usage"]["output_tokens"] == 24

"""The engine lane inside a real ``vllm serve`` (every anchor): a plain chat stream's events (text deltas compared
joined, :func:`merged`) and completed body over NNRP are what vLLM's own stream gives for the same request — its
HTTP/SSE answer, read through the plugin's SSE parser and the profile mapper (the path every chat stream took
before the lane) —, for plain text, usage, a token budget, a stop string and ``echo``.
Cancels, dropped clients and concurrent streams on the lane are the binding core's tests on the same server
(``vllm_server``, which has no parser: every plain stream there takes the lane).

On a server with a tool-call parser (``vllm_tools_server``: hermes) the events of every stream — text, tool calls
for ``tool_choice`` auto, ``required`` and a named function, parallel calls refused, calls cut by ``max_tokens`` or
a stop string — are again what vLLM's own stream gives; on 0.26–0.32 the lane drives vLLM's parser, on 0.18 and
0.22 the streams take vLLM's generator and the start-up log says why. The same on a server with a reasoning parser
(``vllm_reasoning_server``: olmo3, where the small model's whole answer is reasoning): the reasoning and content
text, the finish reasons and usage are vLLM's, for plain text, a token budget, a stop string and usage.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import orjson
import pytest

from tests.e2e.conftest import SERVED_NAME, profile_client
from tests.e2e.test_level1 import LOOKUP, TOOL_REQUEST
from tests.e2e.test_tool_call_truth import get_time_request
from tests.support import envelope
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper, usage_asked
from vllm_nnrp_plugin.profile.tool_calls import tools_without_required_arguments
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import TokenBudget, vllm_chunks

pytestmark = pytest.mark.vllm

BASE = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Tell me about the sea."}],
    "max_tokens": 40,
    "temperature": 0,
    "stream": True,
}
CASES = {
    "text": BASE,
    "usage": {**BASE, "stream_options": {"include_usage": True}},
    "budget": {**BASE, "max_tokens": 5},
    "stop-string": {**BASE, "stop": ["."], "max_tokens": 60},
    "min-tokens-ignore-eos": {**BASE, "max_tokens": 24, "min_tokens": 24, "ignore_eos": True},
    "echo": {
        **BASE,
        "echo": True,
        "messages": [*BASE["messages"], {"role": "assistant", "content": "The sea"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
}
VOLATILE = ("id", "created")
TOOL_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]+")


def over_http(server, body):
    """(events, completed body) of ``body`` through vLLM's HTTP/SSE stream, the plugin's SSE parser (with the
    request's token budget, as the plugin reads vLLM's strings) and the profile mapper; vLLM is asked for usage as
    the plugin always asks it (``include_usage``)."""
    sent = {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
    with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=sent, timeout=120) as response:
        assert response.status_code == 200
        strings = [line + "\n\n" for line in response.iter_lines() if line.startswith("data: ")]

    async def parse():
        async def replay():
            for string in strings:
                yield string

        mapper = ChatStreamMapper(
            usage_events=usage_asked(body),  # as the adapter makes it for ``body``
            no_argument_tools=tools_without_required_arguments(body.get("tools")),
        )
        budget = TokenBudget(body.get("max_tokens"))  # the request's own budget: vLLM's default is not reached here
        events = [event async for chunk in vllm_chunks(replay(), budget) for event in mapper.feed(chunk)]
        return events, mapper.completed_body()

    return asyncio.run(parse())


def merged(events):
    """``events`` with each run of plain text deltas of one choice joined into one: how vLLM and the plugin split
    text into deltas depends on timing (a lagging consumer gets merged outputs; a delta waiting to be sent absorbs
    the next), the text, its order and every other event do not."""
    out = []
    for event in events:
        last = out[-1] if out else None
        if (
            last is not None
            and event["type"] == last["type"] == "response.output_text.delta"
            and event["index"] == last["index"]
            and "openai_chunk" not in event
            and "openai_chunk" not in last
        ):
            out[-1] = {**last, "delta": last["delta"] + event["delta"]}
        else:
            out.append(event)
    return out


def over_nnrp(client, body, wrap=envelope):
    """(events, completed body) of ``body`` (submitted as ``wrap(body)``: a chat envelope unless told) over NNRP;
    ``response.usage`` without the plugin's prefix-cache extension (``input_tokens_details``, which vLLM's streams
    do not carry: tests/e2e/test_runtime_controls_e2e.py checks it)."""
    *partials, terminal = client.events(client.submit(wrap(body)), timeout_s=120)
    assert terminal.event["type"] == "response.completed", terminal.event
    events = [p.event for p in partials]
    for event in events:
        if event["type"] == "response.usage":
            assert type(event["usage"].pop("input_tokens_details")["cached_tokens"]) is int
    return events, terminal.event["body"]


TOOL_CASES = {
    "no-tools": {**BASE, "max_tokens": 24},
    "auto-text": {**BASE, "tools": [LOOKUP], "max_tokens": 24},
    "auto-call": {**get_time_request("Call the get_time tool again."), "stream": True},
    "auto-call-stop": {**get_time_request("What time is it?"), "stream": True, "stop": ["2022"]},
    "required": {**TOOL_REQUEST, "stream": True},
    "required-budget": {**TOOL_REQUEST, "stream": True, "max_tokens": 20},
    "required-stop": {**TOOL_REQUEST, "stream": True, "stop": ["Paris"]},
    "required-one-call": {**TOOL_REQUEST, "stream": True, "parallel_tool_calls": False},
    "named": {
        **TOOL_REQUEST,
        "stream": True,
        "tool_choice": {"type": "function", "function": {"name": LOOKUP["function"]["name"]}},
    },
    "required-usage": {**TOOL_REQUEST, "stream": True, "stream_options": {"include_usage": True}},
}


def call_ids_in_order(events, body):
    """``events`` and ``body`` with vLLM's tool-call ids (random per request: ``chatcmpl-tool-<hex>``, also inside
    error messages) replaced by ``call-<n>``, n counting the distinct ids in the order they first appear."""
    names: dict[str, str] = {}
    text = TOOL_CALL_ID.sub(
        lambda m: names.setdefault(m.group(0), f"call-{len(names)}"), orjson.dumps([events, body]).decode()
    )
    return tuple(orjson.loads(text))


@pytest.fixture
def tools_lane_client(vllm_tools_server):
    with profile_client(vllm_tools_server) as client:
        yield client


@pytest.mark.binding_core
def test_the_start_up_log_says_which_path_chat_streams_take(vllm_server, vllm_tools_server, vllm_reasoning_server):
    assert "NNRP chat streams: text outputs straight from the engine" in vllm_server.output()
    for server in (vllm_tools_server, vllm_reasoning_server):
        if tuple(server.family) >= (0, 26):
            assert "through vLLM's own tool-call/reasoning parser object" in server.output()
        else:
            assert (
                "engine lane off: a tool-call or reasoning parser is configured and vLLM keeps this line's "
                "parser state in its stream generator" in server.output()
            )


@pytest.mark.binding_core
@pytest.mark.parametrize("case", sorted(TOOL_CASES))
def test_a_stream_on_a_tool_parser_server_gives_what_vllms_own_stream_gives(vllm_tools_server, tools_lane_client, case):
    body = TOOL_CASES[case]
    events, completed = call_ids_in_order(*over_nnrp(tools_lane_client, body))
    reference_events, reference = call_ids_in_order(*over_http(vllm_tools_server, body))
    assert merged(events) == merged(reference_events)
    assert {k: v for k, v in completed.items() if k not in VOLATILE} == {
        k: v for k, v in reference.items() if k not in VOLATILE
    }
    kinds = {e["type"] for e in events}
    if case.startswith(("required", "named")) or case == "auto-call":
        assert kinds & {"response.tool_call.completed", "response.tool_call.error"}, events
    if case == "required-budget":
        assert completed["choices"][0]["finish_reason"] == "length"


@pytest.mark.binding_core
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_plain_stream_gives_what_vllms_own_stream_gives(vllm_server, plain_client, case):
    body = CASES[case]
    events, completed = over_nnrp(plain_client, body)
    reference_events, reference = over_http(vllm_server, body)
    assert merged(events) == merged(reference_events)
    assert {k: v for k, v in completed.items() if k not in VOLATILE} == {
        k: v for k, v in reference.items() if k not in VOLATILE
    }
    assert any(e["type"] == "response.output_text.delta" and e["delta"] for e in events)
    if case == "usage":
        assert completed["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"] > 3
    if case == "budget":
        assert completed["choices"][0]["finish_reason"] == "length"
    if case == "min-tokens-ignore-eos":
        assert completed["usage"]["completion_tokens"] == 24


REASONING_CASES = {
    "text": BASE,
    "budget": {**BASE, "max_tokens": 5},
    "stop-string": {**BASE, "stop": ["."], "max_tokens": 60},
    "usage": {**BASE, "stream_options": {"include_usage": True}},
}


def texts(events):
    """(reasoning text, content text) of choice 0 over ``events``, each joined: how the deltas are split depends
    on timing (:func:`merged`); a reasoning delta carries vLLM's chunk (``openai_chunk``), whose ``delta`` says
    which it is."""
    reasoning, content = [], []
    for event in events:
        if event["type"] != "response.output_text.delta" or event["index"] != 0:
            continue
        delta = event["openai_chunk"]["choices"][0]["delta"] if "openai_chunk" in event else {"content": event["delta"]}
        reasoning.append(delta.get("reasoning") or "")
        content.append(delta.get("content") or "")
    return "".join(reasoning), "".join(content)


@pytest.fixture
def reasoning_lane_client(vllm_reasoning_server):
    with profile_client(vllm_reasoning_server) as client:
        yield client


@pytest.mark.binding_core
@pytest.mark.parametrize("case", sorted(REASONING_CASES))
def test_a_stream_on_a_reasoning_parser_server_gives_what_vllms_own_stream_gives(
    vllm_reasoning_server, reasoning_lane_client, case
):
    body = REASONING_CASES[case]
    events, completed = over_nnrp(reasoning_lane_client, body)
    reference_events, reference = over_http(vllm_reasoning_server, body)
    assert texts(events) == texts(reference_events)
    assert [e for e in events if e["type"] != "response.output_text.delta"] == [
        e for e in reference_events if e["type"] != "response.output_text.delta"
    ]
    assert {k: v for k, v in completed.items() if k not in VOLATILE} == {
        k: v for k, v in reference.items() if k not in VOLATILE
    }
    reasoning, _content = texts(events)
    assert reasoning and completed["choices"][0]["message"]["reasoning"] == reasoning
    if case == "budget":
        assert completed["choices"][0]["finish_reason"] == "length"

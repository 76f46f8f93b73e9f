"""Tool-call events and the streamed completed body tell the truth, inside real ``vllm serve`` on CPU over the
real NNRP client: a call cut by ``max_tokens`` or by a stop string ends with ``response.tool_call.error``
``tool_call_incomplete`` (never a ``completed`` with broken JSON), and the streamed ``response.completed`` body
equals vLLM's own non-streaming HTTP answer to the same request at temperature 0, field for field (content,
reasoning, tool calls, finish_reason, stop_reason, usage)."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from tests.e2e.conftest import SERVED_NAME
from tests.e2e.test_level1 import TOOL_REQUEST
from tests.support import envelope
from vllm_nnrp_plugin.client import ProfileClient

pytestmark = pytest.mark.vllm

TOOL_EVENTS = ("response.tool_call.started", "response.tool_call.delta", "response.tool_call.completed",
               "response.tool_call.error")
TEXT_REQUEST = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0,
                "max_tokens": 16}


@pytest.fixture
def client(vllm_tools_server):
    client = asyncio.run(ProfileClient.connect(vllm_tools_server.nnrp["tcp"]))
    yield client
    client.close()


def stream(client, request):
    """(partial events, completed body) of ``request`` streamed over NNRP."""
    *partials, terminal = client.events(client.submit(envelope({**request, "stream": True})), timeout_s=120)
    assert terminal.event["type"] == "response.completed", terminal.event
    return [p.event for p in partials], terminal.event["body"]


def over_http(server, request):
    """vLLM's own non-streaming answer to ``request`` (``stream: false``) over its HTTP API."""
    response = httpx.post(f"{server.http}/v1/chat/completions", json={**request, "stream": False}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def answer(body, content=True):
    """The fields both answers must share: per choice content, reasoning, tool calls (name, parsed
    arguments; ids are random), finish_reason, stop_reason; and the token usage. ``content=False`` leaves
    content out: for a call that does not parse, vLLM's non-streaming answer puts the model's raw text
    (``<tool_call>\n{"name": …``) into ``content``, text its streaming parser turned into the call's fragments
    and never streams as content."""
    choices = [
        {
            "index": c["index"],
            "content": c["message"].get("content") if content else None,
            "reasoning": c["message"].get("reasoning"),
            "tool_calls": [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                           for t in c["message"].get("tool_calls") or ()],
            "finish_reason": c["finish_reason"],
            "stop_reason": c.get("stop_reason"),
        }
        for c in body["choices"]
    ]
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return choices, usage


def tool_calls_by_id(events):
    """Tool events grouped per call_id, after checking the contract's order for each call."""
    per_call = collections.defaultdict(list)
    for e in events:
        if e["type"] in TOOL_EVENTS:
            per_call[e["call_id"]].append(e)
    for call_id, calls in per_call.items():
        kinds = [e["type"] for e in calls]
        assert kinds[0] == "response.tool_call.started" and kinds.count("response.tool_call.started") == 1
        assert set(kinds[1:-1]) <= {"response.tool_call.delta"}, kinds
        assert kinds[-1] in ("response.tool_call.completed", "response.tool_call.error"), kinds
    return per_call


def test_a_call_cut_by_max_tokens_is_a_tool_call_error_and_the_body_says_length(vllm_tools_server, client):
    request = {**TOOL_REQUEST, "max_tokens": 20}
    events, body = stream(client, request)
    per_call = tool_calls_by_id(events)
    assert per_call, events
    assert "response.tool_call.completed" not in {e["type"] for e in events}
    for calls in per_call.values():
        error = calls[-1]["error"]
        assert calls[-1]["type"] == "response.tool_call.error" and error["code"] == "tool_call_incomplete"
        assert error["type"] == "server_error" and error["message"]
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert body["usage"]["completion_tokens"] == 20  # the body has usage although the client did not ask...
    assert "response.usage" not in {e["type"] for e in events}  # ...and no usage event
    assert answer(body, content=False) == answer(over_http(vllm_tools_server, request), content=False)


def test_a_stop_string_inside_a_call_is_a_tool_call_error(vllm_tools_server, client):
    request = {**TOOL_REQUEST, "stop": ["Paris"]}
    events, body = stream(client, request)
    per_call = tool_calls_by_id(events)
    assert per_call and all(calls[-1]["type"] == "response.tool_call.error" for calls in per_call.values())
    assert {calls[-1]["error"]["code"] for calls in per_call.values()} == {"tool_call_incomplete"}
    (choice,) = body["choices"]
    assert choice["stop_reason"] == "Paris" and "tool_calls" not in choice["message"]
    assert answer(body, content=False) == answer(over_http(vllm_tools_server, request), content=False)


@pytest.mark.parametrize("request_", [TEXT_REQUEST, TOOL_REQUEST], ids=["text", "required-tool-call"])
def test_the_streamed_body_equals_vllms_non_streaming_body(vllm_tools_server, client, request_):
    events, body = stream(client, {**request_, "stream_options": {"include_usage": True}})
    reference = over_http(vllm_tools_server, request_)
    assert answer(body) == answer(reference)
    assert events[-1]["type"] == "response.usage"
    if "tools" in request_:
        (completed,) = [e for e in events if e["type"] == "response.tool_call.completed"]
        assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == completed["arguments"]
        assert body["choices"][0]["finish_reason"] == "tool_calls"
    else:
        assert body["choices"][0]["message"]["content"] == "".join(
            e["delta"] for e in events if e["type"] == "response.output_text.delta"
        )

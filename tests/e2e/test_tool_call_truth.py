"""Tool-call events and the streamed completed body tell the truth, inside real ``vllm serve`` on CPU over the
real NNRP client: a call cut by ``max_tokens`` or by a stop string ends with ``response.tool_call.error``
``tool_call_incomplete`` (never a ``completed`` with broken JSON), the body never says ``finish_reason:
"tool_calls"`` without listing a call, a call of a parameterless tool completes with ``{}`` (vLLM 0.18.1 streams
no argument text for it), and the streamed ``response.completed`` body equals vLLM's own non-streaming HTTP
answer to the same request at temperature 0, field for field (content, reasoning, tool calls, finish_reason,
stop_reason, usage; the one exception is named in
:func:`test_a_stop_string_inside_a_required_call_is_a_tool_call_error_and_the_body_says_stop`)."""

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

TOOL_EVENTS = (
    "response.tool_call.started",
    "response.tool_call.delta",
    "response.tool_call.completed",
    "response.tool_call.error",
)
TEXT_REQUEST = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Say hello."}],
    "temperature": 0,
    "max_tokens": 16,
}
GET_TIME = {
    "name": "get_time",
    "description": "Get the current time.",
    "parameters": {"type": "object", "properties": {}},
}


def get_time_request(question):
    """A chat request with the parameterless ``get_time`` (``tool_choice`` auto) after one example call of it
    in the conversation, which makes the small model call it (compat/fixtures/vllm/0.18.1/l-*, m-*)."""
    example = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Call the get_time tool."},
        {"role": "assistant", "content": "", "tool_calls": [example]},
        {"role": "user", "content": question},
    ]
    return {
        "model": SERVED_NAME,
        "messages": messages,
        "temperature": 0,
        "max_tokens": 64,
        "tools": [{"type": "function", "function": GET_TIME}],
    }


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
            "tool_calls": [
                (t["function"]["name"], json.loads(t["function"]["arguments"]))
                for t in c["message"].get("tool_calls") or ()
            ],
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
    for calls in per_call.values():
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


def test_a_stop_string_inside_a_required_call_is_a_tool_call_error_and_the_body_says_stop(vllm_tools_server, client):
    """vLLM streams ``finish_reason: "tool_calls"`` here, and its non-streaming answer says ``"tool_calls"`` too
    while listing no call (``is_finish_reason_tool_calls`` in ``chat_completion_full_generator``,
    ``vllm/entrypoints/openai/chat_completion/serving.py``, is true for ``tool_choice: "required"`` whenever the
    engine stopped, on every anchor); the profile's body says ``stop``, the rest is vLLM's answer."""
    request = {**TOOL_REQUEST, "stop": ["Paris"]}
    events, body = stream(client, request)
    per_call = tool_calls_by_id(events)
    assert per_call and all(calls[-1]["type"] == "response.tool_call.error" for calls in per_call.values())
    assert {calls[-1]["error"]["code"] for calls in per_call.values()} == {"tool_call_incomplete"}
    (choice,) = body["choices"]
    assert choice["stop_reason"] == "Paris" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    choices, usage = answer(over_http(vllm_tools_server, request), content=False)
    assert [(c["tool_calls"], c["finish_reason"]) for c in choices] == [([], "tool_calls")]
    assert answer(body, content=False) == ([{**choices[0], "finish_reason": "stop"}], usage)


def test_a_stop_string_inside_an_auto_call_gives_vllms_non_streaming_finish_reason(vllm_tools_server, client):
    """``tool_choice`` auto (the hermes parser), cut by a stop string inside the arguments: vLLM streams
    ``"tool_calls"``, its non-streaming answer finds no call and says ``stop`` — and so does the body."""
    request = {**get_time_request("What time is it?"), "stop": ["2022"]}
    events, body = stream(client, request)
    reference = over_http(vllm_tools_server, request)
    if reference["choices"][0]["stop_reason"] != "2022":
        pytest.skip(f"vLLM {vllm_tools_server.version}: the model's answer does not reach the stop string")
    per_call = tool_calls_by_id(events)
    assert all(calls[-1]["error"]["code"] == "tool_call_incomplete" for calls in per_call.values()), per_call
    assert body["choices"][0]["finish_reason"] == "stop"
    assert answer(body, content=False) == answer(reference, content=False)


def test_a_parameterless_call_completes_with_the_arguments_of_vllms_non_streaming_answer(vllm_tools_server, client):
    """On 0.18.1 vLLM's hermes stream sends the name of this call and no argument text; later lines stream
    ``{}``. Either way the call completes with ``{}``, as in vLLM's non-streaming answer. (Content is left out:
    the stream's role delta makes it ``""`` where vLLM's non-streaming answer with a call has ``null``.)"""
    request = get_time_request("Call the get_time tool again.")
    events, body = stream(client, request)
    reference = over_http(vllm_tools_server, request)
    if not reference["choices"][0]["message"].get("tool_calls"):
        pytest.skip(f"vLLM {vllm_tools_server.version}: the model answers without calling get_time")
    (calls,) = tool_calls_by_id(events).values()
    assert calls[-1]["type"] == "response.tool_call.completed" and calls[-1]["arguments"] == "{}"
    assert "".join(e["arguments_delta"] for e in calls[1:-1]) == "{}"
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert answer(body, content=False) == answer(reference, content=False)
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_a_parameterless_responses_call_completes_with_the_arguments_of_vllms_response(vllm_tools_server, client):
    """``responses.create``: on 0.18.1 vLLM's stream never ends this call (no ``output_item.done`` without
    argument text); the events complete it with ``{}``, the function call of vLLM's non-streaming Response."""
    example = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}
    turns = [
        {"role": "user", "content": "Call the get_time tool."},
        example,
        {"role": "user", "content": "Call the get_time tool again."},
    ]
    body = {
        "model": SERVED_NAME,
        "temperature": 0,
        "max_output_tokens": 64,
        "input": turns,
        "tools": [{"type": "function", **GET_TIME}],
    }
    reply = httpx.post(f"{vllm_tools_server.http}/v1/responses", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    reference = [(i["name"], i["arguments"]) for i in reply.json()["output"] if i["type"] == "function_call"]
    if not reference:
        pytest.skip(f"vLLM {vllm_tools_server.version}: the model answers without calling get_time")
    *partials, terminal = client.events(
        client.submit({**envelope({**body, "stream": True}), "operation": "responses.create"}), timeout_s=120
    )
    assert terminal.event["type"] == "response.completed", terminal.event
    (calls,) = tool_calls_by_id([p.event for p in partials]).values()
    assert calls[-1]["type"] == "response.tool_call.completed"
    assert [(calls[-1]["name"], json.loads(calls[-1]["arguments"]))] == [(n, json.loads(a)) for n, a in reference]


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

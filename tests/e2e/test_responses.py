"""``responses.create`` (Level 2) inside a real ``vllm serve`` on CPU over the real NNRP client, with vLLM's own
HTTP ``/v1/responses`` on the same server as the reference: the same greedy request gives the same text, the same
function calls and the same usage; a non-streaming call returns vLLM's Response object; a cancelled or timed-out
stream aborts vLLM's request; the trace context is the parent of vLLM's span; bad bodies get typed errors and the
session keeps serving; the capability document claims Level 2, with tool calls only where vLLM parses them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.e2e.conftest import SERVED_NAME
from tests.e2e.test_vllm_serve import wait_idle
from tests.support import envelope
from tests.unit.test_responses_stream import one_lookup_call
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.vllm_binding.families import responses_stream_fails

pytestmark = pytest.mark.vllm

TEXT = {"model": SERVED_NAME, "input": "Tell me about Paris.", "temperature": 0, "max_output_tokens": 24}
LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look up current information about a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TOOL = {**TEXT, "max_output_tokens": 64, "tools": [LOOKUP], "tool_choice": "required"}
LONG = {
    "model": SERVED_NAME,
    "input": "Write a long story about the sea.",
    "max_output_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
}
#: fields of a Response made anew for every request (ids, clock)
VOLATILE = ("id", "created_at")


def responses(body, **extra):
    return {**envelope(body, **extra), "operation": "responses.create"}


def connect(server):
    return asyncio.run(ProfileClient.connect(server.nnrp["tcp"]))


@pytest.fixture
def client(vllm_server):
    client = connect(vllm_server)
    yield client
    client.close()


@pytest.fixture
def tools_client(vllm_tools_server):
    client = connect(vllm_tools_server)
    yield client
    client.close()


def over_nnrp(client, body):
    """(partial events, terminal event) of ``body`` over NNRP."""
    *partials, terminal = client.events(client.submit(responses(body)), timeout_s=120)
    return [p.event for p in partials], terminal.event


def over_http(server, body):
    """vLLM's own answer on ``/v1/responses``: the Response object, or the list of streamed event objects."""
    response = httpx.post(f"{server.http}/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return response.json()
    return [json.loads(line[len("data: ") :]) for line in response.text.splitlines() if line.startswith("data: ")]


def text_of(response):
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def calls_of(response):
    return [
        (item["name"], json.loads(item["arguments"])) for item in response["output"] if item["type"] == "function_call"
    ]


def profile_usage(response):
    return {key: response["usage"][key] for key in ("input_tokens", "output_tokens", "total_tokens")}


def usage_event_usage(response):
    """What ``response.usage`` carries for ``response``: its usage in the profile's names, with the prefix-cache
    hits of the extension equal to vLLM's own ``input_tokens_details.cached_tokens``."""
    cached = response["usage"]["input_tokens_details"]["cached_tokens"]
    return {**profile_usage(response), "input_tokens_details": {"cached_tokens": cached}}


def stable(response):
    """A Response without what is new per request: its id and clock, its output items' ids and call ids."""
    response = {k: v for k, v in response.items() if k not in VOLATILE}
    response["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return response


def test_the_capability_document_claims_level_2_and_tool_calls_only_with_a_parser(client, tools_client):
    for each, tool_calls in ((client, False), (tools_client, True)):
        document = each.capabilities()
        assert document["compatibility_levels"][:2] == [1, 2]
        (operation,) = [op for op in document["operations"] if op["name"] == "responses.create"]
        assert operation == {
            "name": "responses.create",
            "streaming": True,
            "non_streaming": True,
            "tool_calls": tool_calls,
            "cancellation": True,
        }


@pytest.mark.binding_core
def test_streamed_text_and_usage_equal_vllms_http_stream(vllm_server, client):
    body = {**TEXT, "stream": True}
    events, terminal = over_nnrp(client, body)
    *deltas, usage = events
    assert all(e["type"] == "response.output_text.delta" and e["index"] == 0 for e in deltas), events
    http = over_http(vllm_server, body)
    http_text = "".join(e["delta"] for e in http if e["type"] == "response.output_text.delta")
    assert "".join(e["delta"] for e in deltas) == http_text and http_text
    assert terminal["type"] == "response.completed"
    completed = terminal["body"]
    assert completed["object"] == "response" and completed["id"].startswith("resp_nnrp-")
    assert text_of(completed) == http_text
    assert usage == {"type": "response.usage", "usage": usage_event_usage(completed)}
    assert stable(completed) == stable(http[-1]["response"])  # vLLM's response.completed on HTTP


@pytest.mark.binding_core
def test_non_streaming_returns_vllms_response_object(vllm_server, client):
    events, terminal = over_nnrp(client, TEXT)
    assert events == [] and terminal["type"] == "response.completed"
    http = over_http(vllm_server, TEXT)
    assert stable(terminal["body"]) == stable(http)
    assert text_of(terminal["body"]) and profile_usage(terminal["body"]) == profile_usage(http)


@pytest.mark.binding_core
def test_a_required_function_call_streams_as_tool_call_events_like_vllms_http_stream(
    vllm_version, vllm_tools_server, tools_client
):
    body = {**TOOL, "stream": True}
    events, terminal = over_nnrp(tools_client, body)
    if responses_stream_fails(vllm_version[1], body, tool_parser=True):
        # vLLM's own stream of it is a 200 whose body ends before its first event: NNRP refuses it, typed
        assert events == [] and terminal["type"] == "response.error", terminal
        assert terminal["error"]["code"] == "invalid_request" and "stream" in terminal["error"]["message"]
        try:
            http = over_http(vllm_tools_server, body)
        except httpx.RemoteProtocolError:  # the chunked body is cut before its end
            http = []
        assert http == []
        return
    ids, arguments, usage = one_lookup_call(events)
    assert ids["index"] == 0
    http = over_http(vllm_tools_server, body)
    (http_done,) = [e["item"] for e in http if e["type"] == "response.output_item.done"]
    assert (http_done["type"], http_done["name"], http_done["arguments"]) == ("function_call", "lookup", arguments)
    assert json.loads(arguments) == {"city": "Paris"}
    response = terminal["body"]
    assert calls_of(response) == calls_of(http[-1]["response"]) == [("lookup", {"city": "Paris"})]
    assert usage["usage"] == usage_event_usage(response)
    assert profile_usage(response) == profile_usage(http[-1]["response"])


def test_a_non_streaming_function_call_is_vllms_response(vllm_tools_server, tools_client):
    events, terminal = over_nnrp(tools_client, TOOL)
    assert events == [] and terminal["type"] == "response.completed"
    http = over_http(vllm_tools_server, TOOL)
    assert stable(terminal["body"]) == stable(http)
    assert calls_of(terminal["body"]) == [("lookup", {"city": "Paris"})]


def test_without_a_tool_parser_a_required_call_is_answered_as_vllm_answers_it_with_no_tool_events(vllm_server, client):
    """``tool_calls: false`` tells the truth: vLLM's Responses object has no parser to find calls with, so what it
    generates is text on both APIs."""
    body = {**TOOL, "stream": True}
    events, terminal = over_nnrp(client, body)
    assert not [e for e in events if e["type"].startswith("response.tool_call.")]
    http = over_http(vllm_server, body)
    assert not [e for e in http if e["type"].startswith("response.function_call")]
    http_text = "".join(e["delta"] for e in http if e["type"] == "response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == http_text
    assert calls_of(terminal["body"]) == calls_of(http[-1]["response"]) == []


@pytest.mark.binding_core
def test_cancelling_a_streamed_response_aborts_vllms_request(vllm_server, client):
    assert wait_idle(vllm_server)
    tokens_before = vllm_server.metric("vllm:generation_tokens_total")
    op = client.submit(responses(LONG, nnrp={"diagnostics": True}))
    stream = client.events(op, timeout_s=120)
    for _ in range(3):
        assert next(stream).event["type"] == "response.output_text.delta"
    client.cancel(op)
    terminal = list(stream)[-1]
    assert terminal.frame == "result_drop" and terminal.event["type"] == "response.cancelled"
    diagnostics = terminal.event["diagnostics"]
    assert diagnostics["request_id"].startswith("resp_nnrp-") and diagnostics["request_id"].endswith("_0")
    assert diagnostics["cancel"] == {"source": "client", "reason": "client_cancelled"}
    assert wait_idle(vllm_server), "vLLM still runs the cancelled Responses request"
    time.sleep(1)  # a second more in which tokens of a request vLLM failed to abort would be counted
    assert vllm_server.metric("vllm:generation_tokens_total") - tokens_before < 200  # far from 1000


def test_a_timed_out_response_aborts_vllms_request(vllm_server, client):
    assert wait_idle(vllm_server)
    tokens_before = vllm_server.metric("vllm:generation_tokens_total")
    *_, last = client.events(client.submit(responses(LONG, nnrp={"timeout_ms": 1500})), timeout_s=120)
    assert last.frame == "result_push" and last.event["error"]["code"] == "request_timeout"
    assert wait_idle(vllm_server), "vLLM still runs the timed-out Responses request"
    time.sleep(1)  # a second more in which tokens of a request vLLM failed to abort would be counted
    assert vllm_server.metric("vllm:generation_tokens_total") - tokens_before < 300  # far from 1000


def test_trace_context_is_the_parent_of_vllms_span_for_the_engine_request(vllm_tools_server, tools_client):
    """vLLM's ``llm_request`` span names the engine request (``gen_ai.request.id``): the id the plugin records
    and aborts (diagnostics ``request_id``), ``<Response id>_0``."""
    trace_id, span_id = 0x5EED_0000_0000_0093, 0x0000_0000_0000_0094
    tools_client.trace_context(trace_id, span_id, parent_span_id=0x90, stage_code=5, flags=1)
    op = tools_client.submit(responses({**TEXT, "max_output_tokens": 4}, nnrp={"diagnostics": True}))
    (terminal,) = [e.event for e in tools_client.events(op, timeout_s=120)]
    engine_request_id = terminal["diagnostics"]["request_id"]
    assert engine_request_id == terminal["body"]["id"] + "_0"
    span = vllm_tools_server.collector.wait_for(
        lambda s: (
            s.name == "llm_request"
            and any(a.key == "gen_ai.request.id" and a.value.string_value == engine_request_id for a in s.attributes)
        )
    )
    assert span.trace_id == bytes(8) + trace_id.to_bytes(8, "big")
    assert span.parent_span_id == span_id.to_bytes(8, "big")


@pytest.mark.binding_core
@pytest.mark.parametrize(
    "body, code",
    [
        ({"model": SERVED_NAME}, "invalid_request"),  # no input
        ({"model": SERVED_NAME, "input": 5}, "invalid_request"),
        ({**TEXT, "max_output_tokens": "many"}, "invalid_request"),
        ({**TEXT, "stream": True, "background": True}, "invalid_request"),
        ({**TEXT, "model": "nope"}, "model_not_found"),
        ({**TEXT, "model": "nope", "stream": True}, "model_not_found"),
        ({**TEXT, "previous_response_id": "resp_unknown"}, "invalid_request"),
    ],
)
def test_bad_bodies_get_typed_errors_and_leave_nothing_running(vllm_server, client, body, code):
    events, terminal = over_nnrp(client, body)
    assert events == [] and terminal["type"] == "response.error", terminal
    assert terminal["error"]["code"] == code and terminal["error"]["message"]
    assert wait_idle(vllm_server)
    _, again = over_nnrp(client, {**TEXT, "max_output_tokens": 2})
    assert again["type"] == "response.completed"

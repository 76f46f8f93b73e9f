"""Level 1 beyond text, inside real ``vllm serve`` 0.26 on CPU over the real NNRP client: tool calls (with and
without a tool parser), timeouts (envelope and DEADLINE), trace context into vLLM's own span, and the
capability document."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import orjson
import pytest

from tests.e2e.conftest import SERVED_NAME
from tests.e2e.test_vllm_serve import LONG, wait_idle
from tests.support import envelope
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.client.conformance.suite import Suite, locate_suite

pytestmark = pytest.mark.vllm

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up current information about a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOL_REQUEST = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Tell me about Paris."}],
    "temperature": 0,
    "max_tokens": 64,
    "tools": [LOOKUP],
    "tool_choice": "required",
}


def connect(uri):
    return asyncio.run(ProfileClient.connect(uri))


def run(client, env, timeout_s=120, **submit):
    return list(client.events(client.submit(env, **submit), timeout_s=timeout_s))


@pytest.fixture
def tools_client(vllm_tools_server):
    client = connect(vllm_tools_server.nnrp["tcp"])
    yield client
    client.close()


# -- tool calls --------------------------------------------------------------------------------------------


@pytest.mark.binding_core
def test_streamed_tool_call_has_started_deltas_completed_with_vllms_call_id(vllm_tools_server, tools_client):
    events = run(tools_client, envelope({**TOOL_REQUEST, "stream": True}))
    *partials, terminal = events
    assert all(e.frame == "partial_result" for e in partials)
    tool = [e.event for e in partials if e.event["type"].startswith("response.tool_call.")]
    assert tool, [e.event for e in partials]
    started, *deltas, completed = tool
    assert started["type"] == "response.tool_call.started" and started["name"] == "lookup"
    assert started["call_id"].startswith("chatcmpl-tool-")  # the id vLLM assigned
    assert deltas and {d["type"] for d in deltas} == {"response.tool_call.delta"}
    assert {e["call_id"] for e in tool} == {started["call_id"]}
    assert completed["type"] == "response.tool_call.completed"
    assert completed["arguments"] == "".join(d["arguments_delta"] for d in deltas)
    assert orjson.loads(completed["arguments"]) == {"city": "Paris"}
    body = terminal.event["body"]
    assert terminal.event["type"] == "response.completed" and body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["id"] == started["call_id"]
    # the same request over vLLM's HTTP API calls the same function with the same arguments
    reference = httpx.post(f"{vllm_tools_server.http}/v1/chat/completions", json=TOOL_REQUEST, timeout=120).json()
    (call,) = reference["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup" and orjson.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.binding_core
def test_non_streaming_tool_calls_are_in_the_body_as_vllm_returns_them(tools_client):
    (terminal,) = run(tools_client, envelope(TOOL_REQUEST))
    message = terminal.event["body"]["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "lookup" and orjson.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("tool_choice", ["required", None])  # None: implicit "auto", as the suite's recipe
def test_without_a_tool_parser_tools_get_vllms_refusal_and_no_tool_calls_capability(plain_client, tool_choice):
    body = {**TOOL_REQUEST, "stream": True, "tool_choice": tool_choice}
    if tool_choice is None:
        del body["tool_choice"]
    (terminal,) = run(plain_client, envelope(body))
    error = terminal.event["error"]
    assert terminal.event["type"] == "response.error" and error["code"] == "invalid_request"
    assert "--tool-call-parser" in error["message"]  # vLLM's own message
    assert plain_client.capabilities()["operations"][0]["tool_calls"] is False


# -- capability document -----------------------------------------------------------------------------------


def test_capability_document_says_what_each_server_supports(plain_client, tools_client):
    for client, tool_calls in ((plain_client, False), (tools_client, True)):
        document = client.capabilities()
        assert document["models"] == [{"id": SERVED_NAME, "owned_by": "vllm"}]
        names = [op["name"] for op in document["operations"]]
        assert names == ["chat.completions.create", "responses.create", "models.list"]
        assert document["compatibility_levels"] == [1, 2]  # models.list alone is not Level 3 (needs embeddings)
        operation = document["operations"][0]
        assert operation == {
            "name": "chat.completions.create",
            "streaming": True,
            "non_streaming": True,
            "tool_calls": tool_calls,
            "cancellation": True,
        }


def test_cli_prints_the_document_and_a_manifest_valid_for_the_suite(vllm_server):
    cli = [sys.executable, "-m", "vllm_nnrp_plugin.client.cli", "capabilities", "--endpoint", vllm_server.nnrp["tcp"]]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["models"][0]["id"] == SERVED_NAME
    done = subprocess.run([*cli, "--conformance"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    try:
        suite = Suite(locate_suite())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    suite.validate(json.loads(done.stdout), "capabilities")
    unreachable = subprocess.run([*cli[:-1], "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert unreachable.returncode == 2


# -- timeouts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["timeout_ms", "deadline"])
def test_a_timeout_aborts_the_vllm_request_with_one_request_timeout_terminal(vllm_server, plain_client, how):
    assert wait_idle(vllm_server)
    tokens_before = vllm_server.metric("vllm:generation_tokens_total")
    if how == "timeout_ms":
        events = run(plain_client, envelope(LONG, nnrp={"timeout_ms": 1500}))
    else:
        events = run(plain_client, envelope(LONG), deadline_ms=1500)
    *partials, terminal = events
    assert all(e.frame == "partial_result" for e in partials)
    assert terminal.frame == "result_push" and terminal.event["error"]["code"] == "request_timeout"
    assert wait_idle(vllm_server), "vLLM still runs the timed-out request"
    time.sleep(1)  # a second more in which tokens of a request vLLM failed to abort would be counted
    assert vllm_server.metric("vllm:generation_tokens_total") - tokens_before < 300  # far from max_tokens=1000
    (again,) = run(
        plain_client, envelope({"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    )
    assert again.event["type"] == "response.completed"


# -- trace context -----------------------------------------------------------------------------------------


def test_trace_context_becomes_the_parent_of_vllms_llm_request_span(vllm_tools_server, tools_client):
    trace_id, span_id = 0x5EED_0000_0000_0091, 0x0000_0000_0000_0092
    tools_client.trace_context(trace_id, span_id, parent_span_id=0x90, stage_code=5, flags=1, attributes=b"k=v")
    (terminal,) = run(
        tools_client,
        envelope(
            {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            request_id="traced",
        ),
    )
    request_id = terminal.event["body"]["id"]
    span = vllm_tools_server.collector.wait_for(
        lambda s: (
            s.name == "llm_request"
            and any(a.key == "gen_ai.request.id" and a.value.string_value == request_id for a in s.attributes)
        )
    )
    assert span.trace_id == bytes(8) + trace_id.to_bytes(8, "big")  # zero-extended into the low 64 bits
    assert span.parent_span_id == span_id.to_bytes(8, "big")
    assert "k=v" not in vllm_tools_server.output()  # opaque attributes are never logged

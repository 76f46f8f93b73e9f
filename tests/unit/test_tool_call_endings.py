"""How tool calls end, on streams recorded from real vLLM 0.18.1 (compat/fixtures/vllm/0.18.1/, each beside
vLLM's non-streaming answer to the same request) through the production path: the chunk normaliser
(:class:`VLLMStream` with the request's budget) and the stream mapper the adapter makes from the request body
(:data:`STREAM_MAPPERS`).

* ``l``: a call of the parameterless ``get_time`` (``tool_choice`` auto, hermes parser; the model was shown one
  such call earlier in the conversation). vLLM's stream sends the name delta alone, never the ``{}`` its
  non-streaming answer gives as the arguments.
* ``m``: the same tool in auto mode, cut by the stop string ``"2022"`` inside the arguments: vLLM streams
  ``finish_reason: "tool_calls"``; its non-streaming answer lists no call and says ``stop``.
* ``n``: ``tool_choice: "required"`` cut by the stop string ``"Paris"``: vLLM streams ``"tool_calls"``, and its
  non-streaming answer says ``"tool_calls"`` too while listing no call (``is_finish_reason_tool_calls`` in
  ``chat_completion_full_generator``, ``vllm/entrypoints/openai/chat_completion/serving.py``, is true for
  ``required`` whenever the engine stopped); the profile's body says ``stop``.
"""

from __future__ import annotations

import json

import orjson
import pytest

from tests.support import FIXTURES, recorded_chunks
from tests.unit.test_responses_stream import recorded_events
from vllm_nnrp_plugin.core.adapter import STREAM_MAPPERS
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, RESPONSES_CREATE
from vllm_nnrp_plugin.profile.tool_calls import tools_without_required_arguments

LEGACY = "0.18.1"


def recorded(name: str) -> dict:
    return orjson.loads((FIXTURES.parent / LEGACY / name).read_bytes())


def replay_chat(case: str, request: dict | None = None):
    """(tool-call events, completed body) of a recorded 0.18.1 chat stream, mapped as production maps
    ``request`` (by default the recorded request)."""
    mapper = STREAM_MAPPERS[CHAT_COMPLETIONS_CREATE](request or recorded(f"{case}.request.json"))
    events = [e for chunk in recorded_chunks(case, LEGACY) for e in mapper.feed(chunk)]
    events += mapper.finish()
    return [e for e in events if e["type"].startswith("response.tool_call.")], mapper.completed_body()


def answer(body: dict) -> tuple:
    """What the streamed body and vLLM's non-streaming body share (ids are random; ``content`` differs where
    vLLM's non-streaming answer keeps the raw text of a call it could not parse)."""
    (choice,) = body["choices"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or ()]
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return calls, choice["finish_reason"], choice["stop_reason"], usage


@pytest.mark.parametrize(
    "parameters",
    [
        None,
        {},
        {"type": "object"},
        {"type": "object", "properties": {}},
        {
            "type": "object",
            "properties": {"tz": {"type": "string"}},
            "required": [],
            "additionalProperties": False,
            "title": "t",
            "description": "d",
        },
    ],
)
def test_declarations_that_accept_an_empty_object(parameters):
    function = {"name": "f"} if parameters is None else {"name": "f", "parameters": parameters}
    assert tools_without_required_arguments([{"type": "function", "function": function}]) == {"f"}  # chat
    assert tools_without_required_arguments([{"type": "function", **function}]) == {"f"}  # Responses


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        {"type": "object", "minProperties": 1},
        {"anyOf": [{"type": "object"}]},
        {"$ref": "#/$defs/x"},
        {"type": "string"},
        {"type": "object", "properties": []},
        "{}",
    ],
)
def test_declarations_that_do_not(parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    assert tools_without_required_arguments(tools) == set()


def test_a_tool_declared_twice_accepts_empty_arguments_only_if_both_declarations_do():
    both = [{"type": "function", "name": "f"}, {"type": "function", "name": "f", "parameters": {"type": "string"}}]
    assert tools_without_required_arguments(both) == set()
    assert tools_without_required_arguments(None) == tools_without_required_arguments([{"type": "mcp"}]) == set()


def test_a_parameterless_call_whose_arguments_never_arrive_completes_with_vllms_non_streaming_arguments():
    chunks = recorded_chunks("l-stream-tool-parameterless", LEGACY)
    assert not [
        c
        for c in chunks
        for d in c["choices"]
        for t in d["delta"].get("tool_calls", ())
        if t["function"].get("arguments")
    ]  # the shape: vLLM streamed no argument text at all
    events, body = replay_chat("l-stream-tool-parameterless")
    started, delta, completed = events
    assert started["type"] == "response.tool_call.started" and started["name"] == "get_time"
    assert delta["type"] == "response.tool_call.delta" and delta["arguments_delta"] == "{}"
    assert completed["type"] == "response.tool_call.completed" and completed["arguments"] == "{}"
    reference = recorded("l2-nonstream-tool-parameterless.json")
    assert answer(body) == answer(reference) == ([("get_time", "{}")], "tool_calls", None, answer(reference)[3])


def test_without_a_declaration_that_accepts_an_empty_object_the_call_stays_invalid_and_the_body_says_stop():
    request = recorded("l-stream-tool-parameterless.request.json")
    required = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
    request["tools"] = [{"type": "function", "function": {**request["tools"][0]["function"], "parameters": required}}]
    events, body = replay_chat("l-stream-tool-parameterless", request)
    assert [e["type"] for e in events] == ["response.tool_call.started", "response.tool_call.error"]
    assert events[-1]["error"]["code"] == "tool_call_invalid"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


def test_a_stop_string_inside_an_auto_call_gives_the_finish_reason_of_vllms_non_streaming_answer():
    chunks = recorded_chunks("m-stream-tool-auto-stop", LEGACY)
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"  # what vLLM streams
    events, body = replay_chat("m-stream-tool-auto-stop")
    (error,) = [e for e in events if e["type"] == "response.tool_call.error"]
    assert error["error"]["code"] == "tool_call_incomplete"
    assert answer(body) == answer(recorded("m2-nonstream-tool-auto-stop.json"))
    assert answer(body)[:3] == ([], "stop", "2022")


def test_a_stop_string_inside_a_required_call_says_stop_where_vllms_non_streaming_answer_says_tool_calls():
    events, body = replay_chat("n-stream-tool-required-stop")
    assert events[-1]["type"] == "response.tool_call.error" and events[-1]["error"]["code"] == "tool_call_incomplete"
    calls, finish_reason, stop_reason, usage = answer(recorded("n2-nonstream-tool-required-stop.json"))
    assert (calls, finish_reason) == ([], "tool_calls")  # vLLM: a finish reason naming calls it does not list
    assert answer(body) == ([], "stop", stop_reason, usage)


def test_a_responses_parameterless_call_vllm_never_ends_completes_with_its_completed_responses_arguments():
    """0.18.1's Responses stream adds the function call item and never sends its ``output_item.done`` (no
    argument text); vLLM's completed Response lists the call with ``{}``."""
    items = recorded_events("responses-l-stream-tool-parameterless", LEGACY)
    assert not [i for i in items if i["type"] == "response.output_item.done" and i["item"]["type"] == "function_call"]
    mapper = STREAM_MAPPERS[RESPONSES_CREATE](recorded("responses-l-stream-tool-parameterless.request.json"))
    events = [e for item in items for e in mapper.feed(item)] + mapper.finish()
    started, delta, completed, usage = events
    assert started["type"] == "response.tool_call.started" and started["name"] == "get_time"
    assert (delta["type"], delta["arguments_delta"]) == ("response.tool_call.delta", "{}")
    assert (completed["type"], completed["arguments"]) == ("response.tool_call.completed", "{}")
    assert usage["type"] == "response.usage"
    reference = recorded("responses-l2-nonstream-tool-parameterless.json")
    calls = [(i["name"], json.loads(i["arguments"])) for i in reference["output"] if i["type"] == "function_call"]
    assert calls == [("get_time", {})] == [(completed["name"], json.loads(completed["arguments"]))]
    assert [(i["name"], i["arguments"]) for i in mapper.completed_body()["output"]] == [("get_time", "{}")]

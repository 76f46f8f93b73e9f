"""vLLM's /v1/responses server-sent events rebuilt from profile events (vllm_nnrp_plugin.client.openai.responses_sse):
streams recorded from real vLLM (compat/fixtures/vllm/<version>/responses-*) go through the production mapper
(ResponsesStreamMapper), then through ResponsesEventStream, then through the ``openai`` SDK's own parser and
``responses.stream()`` accumulator; the result is compared with what vLLM itself streamed."""

from __future__ import annotations

import orjson
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from tests.unit.test_responses_stream import VERSIONS, recorded_events, run
from vllm_nnrp_plugin.client.openai.responses_sse import ResponsesEventStream
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events

REQUEST = {"model": "example-model", "input": "Tell me about Paris.", "temperature": 0, "stream": True}


def blocks(sse_bytes: bytes) -> list[tuple[str, dict]]:
    """(``event:`` name, ``data:`` object) of each server-sent event."""
    out = []
    for block in sse_bytes.decode().split("\n\n"):
        if block.strip():
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            out.append((name[len("event: ") :], orjson.loads(data[len("data: ") :])))
    return out


def through_profile(case: str, version: str) -> list[tuple[str, dict]]:
    profile_events, body = run(recorded_events(case, version))
    stream = ResponsesEventStream(response_id="resp_nnrp-x", created_at=1, request=REQUEST)
    return blocks(b"".join(stream.feed(e) for e in profile_events) + stream.finish(body))


def sdk_final(sse: list[tuple[str, dict]]):
    """What ``client.responses.stream(...).get_final_response()`` assembles from these events."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for _, data in sse:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
    return state._completed_response


@pytest.mark.parametrize("version", VERSIONS)
def test_text_stream_is_vllms_event_sequence_and_the_sdk_assembles_vllms_text(version):
    ours = through_profile("responses-a-stream-text", version)
    vllm = [(d["type"], d) for d in recorded_events("responses-a-stream-text", version)]
    assert [name for name, _ in ours] == [name for name, _ in vllm]
    assert [d["sequence_number"] for _, d in ours] == list(range(len(ours)))
    assert all(name == data["type"] for name, data in ours)
    deltas = [d["delta"] for name, d in ours if name == "response.output_text.delta"]
    assert deltas == [d["delta"] for name, d in vllm if name == "response.output_text.delta"]
    created, completed = ours[0][1]["response"], ours[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["model"] == "example-model"
    assert completed == {**vllm[-1][1]["response"], "id": created["id"]}
    final = sdk_final(ours)
    assert final.output_text == "".join(deltas) and final.id == "resp_nnrp-x"
    assert final.usage.output_tokens == vllm[-1][1]["response"]["usage"]["output_tokens"]


@pytest.mark.parametrize("version", VERSIONS)
def test_tool_call_stream_has_vllms_function_call_events_and_the_sdk_assembles_the_call(version):
    ours = through_profile("responses-d-stream-tool-required", version)
    vllm = recorded_events("responses-d-stream-tool-required", version)
    names = [name for name, _ in ours]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added, done = ours[2][1]["item"], ours[-2][1]["item"]
    streamed = next(d["item"] for d in vllm if d["type"] == "response.output_item.done")
    assert {k: done[k] for k in ("id", "call_id", "name", "arguments", "status")} == {
        k: streamed[k] for k in ("id", "call_id", "name", "arguments", "status")
    }
    assert added["arguments"] == "" and added["status"] == "in_progress"
    assert (
        "".join(d["delta"] for n, d in ours if n == "response.function_call_arguments.delta") == streamed["arguments"]
    )
    final = sdk_final(ours)
    (call,) = [item for item in final.output if item.type == "function_call"]
    expected = vllm[-1]["response"]["output"][0]  # the completed Response's own item
    assert (call.call_id, call.name, call.arguments) == (expected["call_id"], expected["name"], expected["arguments"])


def test_a_tool_call_error_ends_its_item_incomplete_so_the_stream_still_completes():
    stream = ResponsesEventStream(response_id="resp_x", created_at=1, request=REQUEST)
    err = E.ProfileError(E.TOOL_CALL_INCOMPLETE, "cut", E.SERVER_ERROR)
    out = stream.feed(events.tool_call_started(0, "fc_1", "call_1", "lookup"))
    out += stream.feed(events.tool_call_delta(0, "fc_1", "call_1", '{"city": '))
    out += stream.feed(events.tool_call_error(0, "fc_1", "call_1", err))
    body = {
        "id": "resp_vllm",
        "object": "response",
        "status": "incomplete",
        "output": [
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "call_2",
                "name": "lookup",
                "arguments": '{"city": ',
                "status": "incomplete",
            }
        ],
    }
    sse = blocks(out + stream.finish(body))
    assert sse[-2][1]["item"] == {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "lookup",
        "arguments": '{"city": ',
        "status": "incomplete",
    }
    assert sdk_final(sse).status == "incomplete"


def test_an_error_after_the_stream_began_is_an_error_event_with_vllms_error_body():
    stream = ResponsesEventStream(response_id="resp_x", created_at=1, request=REQUEST)
    out = stream.feed(events.output_text_delta(0, "Hi"))
    out += stream.fail({"type": "response.error", "error": {"code": "backend_error", "message": "engine died"}}, 500)
    name, data = blocks(out)[-1]
    assert name == "error"
    assert data == {
        "error": {"message": "engine died", "type": "InternalServerError", "param": None, "code": "backend_error"}
    }


def test_the_in_progress_response_repeats_the_requests_fields():
    stream = ResponsesEventStream(
        response_id="resp_x",
        created_at=7,
        request={
            **REQUEST,
            "max_output_tokens": 9,
            "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "f"}],
        },
    )
    (_, created), (_, in_progress), _ = blocks(stream.feed(events.output_text_delta(0, "Hi")))[:3]
    assert created["response"] == in_progress["response"]
    assert {
        k: created["response"][k]
        for k in ("id", "created_at", "max_output_tokens", "instructions", "tools", "tool_choice")
    } == {
        "id": "resp_x",
        "created_at": 7,
        "max_output_tokens": 9,
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "f"}],
        "tool_choice": "auto",
    }

"""The OpenAI wire shapes made from profile events (vllm_nnrp_plugin.client.openai.sse), checked against what real
vLLM 0.26.0 sent over HTTP for the same requests (compat/fixtures)."""

import orjson
import pytest

from tests.support import FIXTURES, recorded_chunks, recorded_json
from vllm_nnrp_plugin.client.openai import sse
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper


def items(sse_bytes: bytes) -> list:
    """The ``data:`` items of an SSE byte stream, JSON-decoded (``[DONE]`` kept as the string)."""
    out = []
    for block in sse_bytes.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: ")
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def accumulate(chunks: list) -> dict:
    """What an OpenAI client assembles from a chunk stream: per choice text, tool calls, finish_reason; usage."""
    choices: dict = {}
    usage = None
    for chunk in chunks:
        if chunk == "[DONE]":
            continue
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            state = choices.setdefault(
                choice["index"], {"role": None, "content": "", "tool_calls": {}, "finish_reason": None}
            )
            delta = choice["delta"]
            state["role"] = delta.get("role") or state["role"]
            state["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                slot = state["tool_calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] += (call.get("function") or {}).get("name") or ""
                slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
            state["finish_reason"] = choice.get("finish_reason") or state["finish_reason"]
    return {"choices": choices, "usage": usage}


def through_profile(case: str, include_usage: bool) -> bytes:
    """The recorded stream through the real mapper, then through ChatChunkStream."""
    mapper = ChatStreamMapper(usage_events=include_usage)
    stream = sse.ChatChunkStream(
        completion_id="chatcmpl-x", created=1, model="example-model", include_usage=include_usage
    )
    out = b"".join(stream.feed(e) for chunk in recorded_chunks(case) for e in mapper.feed(chunk))
    mapper.finish()
    return out + stream.finish(mapper.completed_body())


@pytest.mark.parametrize(
    "case, include_usage",
    [
        ("a-stream-text", False),
        ("b-stream-text-usage", True),
        ("d-stream-tool-required", False),
        ("d2-stream-tool-required-b", False),
        ("e-stream-tool-named", False),
        ("j2-stream-n2-seeded", False),
    ],
)
def test_a_stream_through_the_profile_assembles_to_what_vllm_sent_over_http(case, include_usage):
    ours = items(through_profile(case, include_usage))
    vllm = items((FIXTURES / f"{case}.sse").read_bytes())
    assert accumulate(ours) == accumulate(vllm)
    assert ours[-1] == vllm[-1] == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "example-model" for c in ours[:-1])
    first_of_choice = {}
    for c in ours[:-1]:
        for choice in c["choices"]:
            first_of_choice.setdefault(choice["index"], choice["delta"])
    assert all(d == {"role": "assistant", "content": ""} for d in first_of_choice.values())


def test_usage_chunk_only_when_asked_and_after_every_finish():
    asked = items(through_profile("b-stream-text-usage", True))
    assert asked[-2]["choices"] == [] and asked[-2]["usage"] == {
        "prompt_tokens": 33,
        "total_tokens": 49,
        "completion_tokens": 16,
    }
    assert asked[-3]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in items(through_profile("b-stream-text-usage", False))[:-1])


def test_tool_call_chunks_have_vllms_shape():
    chunks = [c for c in items(through_profile("d-stream-tool-required", False))[:-1] if c["choices"]]
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert calls[0] == {
        "id": "chatcmpl-tool-89caae1990ad0bd5",
        "type": "function",
        "index": 0,
        "function": {"name": "lookup"},
    }
    assert all(set(call) == {"index", "function"} and set(call["function"]) == {"arguments"} for call in calls[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "case, status, kind",
    [
        ("g2-unknown-model-nonstream", 404, "NotFoundError"),
        ("h2-max-tokens-too-large-nonstream", 400, "BadRequestError"),
    ],
)
def test_error_reply_has_vllms_status_type_and_message_and_the_profile_code(case, status, kind):
    recorded = recorded_json(case)["error"]
    code = E.MODEL_NOT_FOUND if status == 404 else E.INVALID_REQUEST
    event = events.error(E.ProfileError(code, recorded["message"], status=status))
    assert sse.error_reply(event, status) == (
        status,
        {"error": {"message": recorded["message"], "type": kind, "param": None, "code": code}},
    )


@pytest.mark.parametrize(
    "err, status, kind",
    [
        (E.backend_error("engine died"), 500, "InternalServerError"),
        (E.too_many_requests("full"), 429, "TooManyRequestsError"),
        (E.server_shutdown(), 503, "ServiceUnavailableError"),
        (E.ProfileError(E.REQUEST_TIMEOUT, "late", E.SERVER_ERROR, 504), 504, "GatewayTimeoutError"),
    ],
)
def test_error_status_comes_from_the_result_push_status_else_from_the_code(err, status, kind):
    event = events.error(err)
    assert sse.error_reply(event, err.status)[0] == status
    assert sse.error_reply(event, None) == (
        status,
        {"error": {"message": err.message, "type": kind, "param": None, "code": err.code}},
    )
    assert sse.error_reply(event, 200)[0] == status  # not an error status: by code


def test_an_error_after_the_stream_began_is_vllms_in_stream_error_item():
    stream = sse.ChatChunkStream(completion_id="c", created=1, model="m", include_usage=True)
    out = items(
        stream.feed(events.output_text_delta(0, "Hi")) + stream.fail(events.error(E.backend_error("boom")), 500)
    )
    assert [c["choices"][0]["delta"] for c in out[:2]] == [{"role": "assistant", "content": ""}, {"content": "Hi"}]
    assert out[2:] == [
        {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": "backend_error"}},
        "[DONE]",
    ]


def test_routes_vllm_does_not_serve_get_fastapis_answers():
    assert sse.route_reply("/v1/completions", "POST") == (404, {"detail": "Not Found"})
    assert sse.route_reply("/v1/chat/completions", "GET") == (405, {"detail": "Method Not Allowed"})


def test_model_list_from_the_capability_document():
    document = {"models": [{"id": "example-model", "owned_by": "vllm"}]}
    assert sse.model_list(document, 7) == {
        "object": "list",
        "data": [{"id": "example-model", "object": "model", "created": 7, "owned_by": "vllm"}],
    }

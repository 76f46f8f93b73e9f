"""Chunk-to-event mapping on streams recorded from real vLLM 0.26.0 (compat/fixtures)."""

import pytest

from tests.support import recorded_chunks, recorded_json
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper
from vllm_nnrp_plugin.profile.errors import ProfileError


def run(case):
    mapper = ChatStreamMapper()
    events = [event for chunk in recorded_chunks(case) for event in mapper.feed(chunk)]
    return events, mapper.completed_body()


def test_text_stream_becomes_ordered_deltas_and_the_same_answer_as_non_streaming():
    events, body = run("a-stream-text")
    assert {e["type"] for e in events} == {"response.output_text.delta"}
    assert all(e["index"] == 0 and e["delta"] for e in events)
    reference = recorded_json("c-nonstream-text")  # same request, stream: false
    text = "".join(e["delta"] for e in events)
    assert text == reference["choices"][0]["message"]["content"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"] == "length"
    assert "system_fingerprint" not in body  # names the vLLM build: the normaliser strips it
    assert "usage" not in body  # not asked for


def test_usage_chunk_becomes_response_usage_with_profile_names():
    events, body = run("b-stream-text-usage")
    assert events[-1] == {
        "type": "response.usage",
        "usage": {"input_tokens": 33, "output_tokens": 16, "total_tokens": 49},
    }
    assert [e["type"] for e in events[:-1]] == ["response.output_text.delta"] * 16
    assert body["usage"] == {"prompt_tokens": 33, "total_tokens": 49, "completion_tokens": 16}


def test_interleaved_choices_keep_their_index():
    events, body = run("j2-stream-n2-seeded")
    by_index = {}
    for e in events:
        by_index.setdefault(e["index"], []).append(e["delta"])
    assert set(by_index) == {0, 1}
    assert [c["message"]["content"] for c in body["choices"]] == ["".join(by_index[0]), "".join(by_index[1])]


def test_tool_call_stream_is_folded_into_the_completed_body():
    events, body = run("d-stream-tool-required")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["function"]["name"] == "lookup"
    assert call["function"]["arguments"].replace(" ", "").replace("\n", "") == '{"city":"Paris"}'
    assert all(e["type"] != "response.output_text.delta" for e in events)


def test_midstream_error_object_is_a_backend_error():
    mapper = ChatStreamMapper()
    mapper.feed(recorded_chunks("a-stream-text")[1])
    with pytest.raises(ProfileError) as info:
        mapper.feed({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
    assert info.value.code == "backend_error" and info.value.status == 500

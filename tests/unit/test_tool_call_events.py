"""Tool-call events from tool-call streams recorded from real vLLM (compat/fixtures/vllm/<version>/):
started / delta / completed per call_id, in the contract's order (profile-contract.md §3)."""

import collections

import orjson

from tests.support import recorded_chunks, recorded_json
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper
from vllm_nnrp_plugin.profile.errors import BACKEND_ERROR, ProfileError

TOOL_TYPES = ("response.tool_call.started", "response.tool_call.delta", "response.tool_call.completed",
              "response.tool_call.error")


def run(chunks):
    mapper = ChatStreamMapper()
    events = [event for chunk in chunks for event in mapper.feed(chunk)]
    events += mapper.finish()
    return events, mapper.completed_body()


def assert_contract_order(events):
    """Per call_id: started exactly once and first, then deltas, then exactly one completed/error, last."""
    per_call = collections.defaultdict(list)
    for e in events:
        if e["type"] in TOOL_TYPES:
            per_call[e["call_id"]].append(e["type"])
    for call_id, kinds in per_call.items():
        assert kinds[0] == "response.tool_call.started", call_id
        assert kinds.count("response.tool_call.started") == 1
        assert kinds[-1] in ("response.tool_call.completed", "response.tool_call.error")
        assert kinds.count("response.tool_call.completed") + kinds.count("response.tool_call.error") == 1
        assert set(kinds[1:-1]) <= {"response.tool_call.delta"}
    return per_call


def test_required_tool_choice_stream_gives_started_deltas_completed_with_vllms_call_id():
    chunks = recorded_chunks("d-stream-tool-required")
    events, body = run(chunks)
    per_call = assert_contract_order(events)
    (call_id,) = per_call
    assert call_id == "chatcmpl-tool-89caae1990ad0bd5"  # the id vLLM assigned
    started, *deltas, completed = events
    assert started == {"type": "response.tool_call.started", "index": 0, "item_id": "tool_call_0_0",
                       "call_id": call_id, "name": "lookup"}
    fragments = [c["choices"][0]["delta"]["tool_calls"][0]["function"].get("arguments")
                 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert [d["arguments_delta"] for d in deltas] == [f for f in fragments if f]
    assert completed["type"] == "response.tool_call.completed" and completed["name"] == "lookup"
    assert orjson.loads(completed["arguments"]) == {"city": "Paris"}
    assert completed["arguments"] == "".join(fragments[1:])
    assert body["choices"][0]["message"]["tool_calls"] == [
        {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": completed["arguments"]}}
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_the_completed_arguments_equal_vllms_non_streaming_answer():
    events, _ = run(recorded_chunks("d2-stream-tool-required-b"))
    assert_contract_order(events)
    completed = [e for e in events if e["type"] == "response.tool_call.completed"]
    reference = recorded_json("f-nonstream-tool-required")["choices"][0]["message"]["tool_calls"]
    assert [orjson.loads(c["arguments"]) for c in completed] == [orjson.loads(r["function"]["arguments"]) for r in reference]


def test_named_tool_choice_completes_on_finish_reason_stop():
    events, body = run(recorded_chunks("e-stream-tool-named"))
    assert_contract_order(events)
    assert [e["type"] for e in events] == ["response.tool_call.started"] + ["response.tool_call.delta"] * 2 + [
        "response.tool_call.completed"
    ]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_arguments_riding_in_the_name_chunk_give_started_then_delta():
    # vLLM 0.22.1: the first fragment comes in the same chunk as id + name; two calls
    events, body = run(recorded_chunks("d2-stream-tool-required-b", "0.22.1"))
    per_call = assert_contract_order(events)
    assert len(per_call) == 2
    assert [e["type"] for e in events[:2]] == ["response.tool_call.started", "response.tool_call.delta"]
    assert events[1]["arguments_delta"] == '{"'
    assert [e["index"] for e in events if e["type"] == "response.tool_call.started"] == [0, 1]
    assert len(body["choices"][0]["message"]["tool_calls"]) == 2


def test_interleaved_calls_keep_their_own_order():
    chunks = recorded_chunks("d2-stream-tool-required-b", "0.22.1")
    tool = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    first = [c for c in tool if c["choices"][0]["delta"]["tool_calls"][0]["index"] == 0]
    second = [c for c in tool if c["choices"][0]["delta"]["tool_calls"][0]["index"] == 1]
    mixed = [c for pair in zip(first, second) for c in pair]
    events, _ = run([chunks[0], *mixed, chunks[-1]])
    per_call = assert_contract_order(events)
    assert len(per_call) == 2
    # they really interleave: the second call starts before the first completes
    kinds = [(e["type"], e["index"]) for e in events]
    assert kinds.index(("response.tool_call.started", 1)) < kinds.index(("response.tool_call.completed", 0))
    completed = {e["index"]: orjson.loads(e["arguments"]) for e in events if e["type"] == "response.tool_call.completed"}
    assert completed == {0: {"city": "Paris"}, 1: {"city": "Paris"}}


def test_token_limit_inside_the_arguments_is_a_tool_call_error():
    chunks = recorded_chunks("d-stream-tool-required")
    cut = chunks[:5] + [{**chunks[-1], "choices": [{**chunks[-1]["choices"][0], "finish_reason": "length"}]}]
    events, _ = run(cut)
    assert_contract_order(events)
    assert events[-1]["type"] == "response.tool_call.error"
    assert events[-1]["error"]["code"] == "tool_call_incomplete" and events[-1]["error"]["message"]


def test_a_mid_stream_error_ends_open_calls_with_tool_call_error():
    mapper = ChatStreamMapper()
    chunks = recorded_chunks("d-stream-tool-required")
    events = [e for c in chunks[:4] for e in mapper.feed(c)]
    events += mapper.fail_open_calls(ProfileError(BACKEND_ERROR, "engine died", "server_error", 500))
    assert_contract_order(events)
    assert events[-1]["error"] == {"type": "server_error", "code": "backend_error", "message": "engine died"}
    assert mapper.finish() == []  # nothing more for a call that already ended

"""Tool-call events from tool-call streams recorded from real vLLM (compat/fixtures/vllm/<version>/), and from
the shapes public vLLM bug reports show: started / delta / completed-or-error per call_id, in the contract's
order (the profile's tool-call ordering rule), completed only for a named call with complete JSON arguments."""

import collections

import orjson
import pytest

from tests.support import recorded_chunks, recorded_json
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper
from vllm_nnrp_plugin.profile.errors import BACKEND_ERROR, ProfileError
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import TokenBudget, VLLMStream

TOOL_TYPES = (
    "response.tool_call.started",
    "response.tool_call.delta",
    "response.tool_call.completed",
    "response.tool_call.error",
)


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
    assert started == {
        "type": "response.tool_call.started",
        "index": 0,
        "item_id": "tool_call_0_0",
        "call_id": call_id,
        "name": "lookup",
    }
    fragments = [
        c["choices"][0]["delta"]["tool_calls"][0]["function"].get("arguments")
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("tool_calls")
    ]
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
    assert [orjson.loads(c["arguments"]) for c in completed] == [
        orjson.loads(r["function"]["arguments"]) for r in reference
    ]


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
    mixed = [c for pair in zip(first, second, strict=False) for c in pair]
    events, _ = run([chunks[0], *mixed, chunks[-1]])
    per_call = assert_contract_order(events)
    assert len(per_call) == 2
    # they really interleave: the second call starts before the first completes
    kinds = [(e["type"], e["index"]) for e in events]
    assert kinds.index(("response.tool_call.started", 1)) < kinds.index(("response.tool_call.completed", 0))
    completed = {
        e["index"]: orjson.loads(e["arguments"]) for e in events if e["type"] == "response.tool_call.completed"
    }
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
    assert mapper.fail_open_calls(ProfileError(BACKEND_ERROR, "again", "server_error", 500)) == []  # ended once


# -- shapes vLLM bug reports show (normaliser + mapper, from vLLM's SSE strings) ----------------------------


def sse(*chunks):
    return [f"data: {orjson.dumps(c).decode()}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def chunk(delta=None, finish_reason=None, stop_reason=None, usage=None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    if finish_reason is not None:
        choices[0]["stop_reason"] = stop_reason
    out = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices}
    return {**out, "usage": usage} if usage else out


def through_binding(items, budget=TokenBudget(20, 2048), usage_events=False):
    stream, mapper = VLLMStream(budget), ChatStreamMapper(usage_events=usage_events)
    events = [e for item in items for c in stream.feed(item) for e in mapper.feed(c)]
    return events + mapper.finish(), mapper.completed_body()


ROLE = chunk({"role": "assistant", "content": ""})
NAME = {"id": "chatcmpl-tool-a", "type": "function", "index": 0, "function": {"name": "lookup"}}


def test_a_call_cut_by_the_budget_is_incomplete_although_vllm_streams_tool_calls():
    """vLLM 0.26 live: max_tokens 20 gives arguments '{' and finish_reason 'tool_calls' in the stream."""
    items = sse(
        ROLE,
        chunk({"content": None, "tool_calls": [NAME]}),
        chunk({"content": None, "tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}),
        chunk({}, finish_reason="tool_calls"),
        chunk(usage={"prompt_tokens": 196, "completion_tokens": 20, "total_tokens": 216}),
    )
    events, body = through_binding(items)
    assert [e["type"] for e in events] == [
        "response.tool_call.started",
        "response.tool_call.delta",
        "response.tool_call.error",
    ]
    assert events[-1]["error"]["code"] == "tool_call_incomplete"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "" and body["usage"]["completion_tokens"] == 20


def test_a_stop_string_inside_a_call_is_incomplete_and_the_body_says_stop_with_its_stop_reason():
    """vLLM streams ``finish_reason: "tool_calls"`` here; the body lists no call, so it says ``stop``."""
    fragment = {"index": 0, "function": {"arguments": '{"city": "'}}
    items = sse(
        ROLE,
        chunk({"tool_calls": [NAME]}),
        chunk({"tool_calls": [fragment]}),
        chunk({}, finish_reason="tool_calls", stop_reason="Paris"),
    )
    events, body = through_binding(items)
    assert events[-1]["error"]["code"] == "tool_call_incomplete"
    (choice,) = body["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "Paris")
    assert "tool_calls" not in choice["message"]


def test_a_name_entry_with_arguments_and_the_next_fragment_in_one_chunk_keep_their_order():
    """0.18/0.22 shape: the normaliser must not move the first fragment behind the next one."""
    entries = [
        {**NAME, "function": {"name": "lookup", "arguments": '{"city": '}},
        {"index": 0, "function": {"name": None, "arguments": '"Paris"}'}},
    ]
    events, body = through_binding(sse(ROLE, chunk({"tool_calls": entries}), chunk({}, finish_reason="tool_calls")))
    assert [e.get("arguments_delta") for e in events[1:3]] == ['{"city": ', '"Paris"}']
    assert events[-1]["type"] == "response.tool_call.completed" and events[-1]["arguments"] == '{"city": "Paris"}'


def test_a_new_call_id_on_a_reused_index_is_a_new_call():
    second = {"id": "chatcmpl-tool-b", "type": "function", "index": 0, "function": {"name": "search"}}
    items = sse(
        ROLE,
        chunk({"tool_calls": [NAME, {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}),
        chunk({"tool_calls": [second, {"index": 0, "function": {"arguments": '{"q": "x"}'}}]}),
        chunk({}, finish_reason="tool_calls"),
    )
    events, body = through_binding(items)
    per_call = assert_contract_order(events)
    assert list(per_call) == ["chatcmpl-tool-a", "chatcmpl-tool-b"]
    completed = [
        (e["name"], e["arguments"], e["item_id"]) for e in events if e["type"] == "response.tool_call.completed"
    ]
    assert completed == [("lookup", '{"city": "Paris"}', "tool_call_0_0"), ("search", '{"q": "x"}', "tool_call_0_0_1")]
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["lookup", "search"]


def test_a_call_waits_for_its_name_and_ends_invalid_without_one():
    nameless = {"id": "chatcmpl-tool-a", "type": "function", "index": 0, "function": {"arguments": "{"}}
    named_later = {"index": 0, "function": {"name": "lookup", "arguments": "}"}}
    events, _ = through_binding(
        sse(
            ROLE,
            chunk({"tool_calls": [nameless]}),
            chunk({"tool_calls": [named_later]}),
            chunk({}, finish_reason="tool_calls"),
        )
    )
    assert [(e["type"], e.get("name"), e.get("arguments_delta")) for e in events] == [
        ("response.tool_call.started", "lookup", None),
        ("response.tool_call.delta", None, "{"),
        ("response.tool_call.delta", None, "}"),
        ("response.tool_call.completed", "lookup", None),
    ]
    events, body = through_binding(sse(ROLE, chunk({"tool_calls": [nameless]}), chunk({}, finish_reason="tool_calls")))
    assert [e["type"] for e in events] == ["response.tool_call.started", "response.tool_call.error"]
    assert events[-1]["error"]["code"] == "tool_call_invalid" and "tool_calls" not in body["choices"][0]["message"]


def test_a_stream_without_a_finish_reason_is_a_backend_error():
    """vLLM's role chunk, then [DONE]: the engine failed before the first token and vLLM swallowed it."""
    stream, mapper = VLLMStream(), ChatStreamMapper()
    for item in sse(ROLE):
        for c in stream.feed(item):
            mapper.feed(c)
    with pytest.raises(ProfileError) as info:
        mapper.finish()
    assert info.value.code == "backend_error"

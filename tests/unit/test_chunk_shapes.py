"""Chunk shapes across the anchors: the outputs recorded from every tested anchor's real vLLM (same model, same
requests; compat/fixtures/vllm/<anchor>/), through the real SSE parser, the normaliser and the profile mapper, give
identical profile events where the model output is identical."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from tests.support import ROOT, as_dict
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import normalise_body, normalise_chunk, vllm_chunks
from vllm_nnrp_plugin.vllm_binding.families import family_of

#: the anchors with recorded outputs (compat/record-fixtures.sh)
ANCHORS = ("0.18.1", "0.22.1", "0.26.0", "0.27.1", "0.32.0")
#: seeded sampling (j2, temperature 0.8) is reproducible up to 0.26 only: 0.27.1 and later lines sampled other text
SEEDED_ANCHORS = ("0.18.1", "0.22.1", "0.26.0")
FIXTURES = ROOT / "compat" / "fixtures" / "vllm"
VOLATILE = ("id", "created")


def sse_items(anchor, case):
    text = (FIXTURES / anchor / f"{case}.sse").read_text()
    return [block + "\n\n" for block in text.split("\n\n") if block.strip()]


def chunks(anchor, case, normalise=True):
    """The chunk dicts of a recording as the backend yields them: vLLM's SSE strings through
    :func:`vllm_chunks`, text-only chunks as the dicts they stand for (or, with ``normalise=False``, only parsed as
    JSON)."""
    if not normalise:
        return [orjson.loads(item[len("data: ") :]) for item in sse_items(anchor, case) if "[DONE]" not in item]

    async def collect():
        async def replay():
            for item in sse_items(anchor, case):
                yield item

        return [as_dict(c) async for c in vllm_chunks(replay())]

    return asyncio.run(collect())


def body(anchor, case):
    return normalise_body(orjson.loads((FIXTURES / anchor / f"{case}.json").read_bytes()))


def profile(chunk_list):
    """(events, completed body without id/created) the profile mapper makes of a chunk stream."""
    mapper = ChatStreamMapper()
    events = [event for chunk in chunk_list for event in mapper.feed(chunk)]
    completed = {k: v for k, v in mapper.completed_body().items() if k not in VOLATILE}
    return events, completed


def strip_volatile(chunk_list):
    return [{k: v for k, v in c.items() if k not in VOLATILE} for c in chunk_list]


def _drop_tool_ids(value):
    if isinstance(value, dict):
        return {
            k: ("<id>" if k in ("id", "call_id") and str(v).startswith("chatcmpl-tool-") else _drop_tool_ids(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_drop_tool_ids(v) for v in value]
    return value


@pytest.mark.parametrize(
    "case, anchors",
    [("a-stream-text", ANCHORS), ("b-stream-text-usage", ANCHORS), ("j2-stream-n2-seeded", SEEDED_ANCHORS)],
)
def test_text_streams_are_identical_chunk_by_chunk_and_event_by_event(case, anchors):
    normalised = [strip_volatile(chunks(a, case)) for a in anchors]
    assert all(n == normalised[0] for n in normalised)
    profiles = [profile(chunks(a, case)) for a in anchors]
    assert all(p == profiles[0] for p in profiles)
    events, completed = profiles[-1]
    assert events and "system_fingerprint" not in completed


def test_without_the_normaliser_the_anchors_differ():
    """The rules are needed: the raw recordings differ in exactly the fields the normaliser rewrites."""
    raw = {a: strip_volatile(chunks(a, "b-stream-text-usage", normalise=False)) for a in ANCHORS}
    assert raw["0.18.1"] != raw["0.22.1"] != raw["0.26.0"]
    assert any(c.get("system_fingerprint") for c in raw["0.26.0"])
    assert any(ch["delta"].get("tool_calls") == [] for c in raw["0.22.1"] for ch in c["choices"])


@pytest.mark.parametrize("case", ["d-stream-tool-required", "d2-stream-tool-required-b", "e-stream-tool-named"])
def test_tool_call_streams_match_where_the_model_output_matches(case):
    """0.18.1 and 0.22.1 generated the same arguments text: identical chunks and profile results (tool-call
    ids aside, random per run)."""
    old, transition = (_drop_tool_ids(strip_volatile(chunks(a, case))) for a in ("0.18.1", "0.22.1"))
    assert old == transition
    assert _drop_tool_ids(profile(chunks("0.18.1", case))) == _drop_tool_ids(profile(chunks("0.22.1", case)))


def delta_shapes(chunk_list):
    """The sequence of delta shapes, consecutive argument fragments collapsed into one."""
    shapes = []
    for c in chunk_list:
        for choice in c["choices"]:
            delta = choice["delta"]
            calls = delta.get("tool_calls") or []
            shape = (
                tuple(sorted(k for k in delta if k != "tool_calls")),
                tuple((tuple(sorted(call)), tuple(sorted(call.get("function", {})))) for call in calls),
                choice.get("finish_reason"),
            )
            if not shapes or shape != shapes[-1] or shape[2] is not None:
                shapes.append(shape)
    return shapes


@pytest.mark.parametrize("case", ["d-stream-tool-required", "e-stream-tool-named"])
def test_tool_call_streams_have_the_same_shape_on_every_anchor(case):
    """0.26.0 generated other whitespace inside the arguments, so compare shapes: the name delta alone (no
    arguments, no ``content``), then argument fragments, then the finish chunk; and the same arguments JSON."""
    shapes = {a: delta_shapes(chunks(a, case)) for a in ANCHORS}
    assert all(shape == shapes["0.26.0"] for shape in shapes.values())
    name_delta = shapes["0.32.0"][1][1][0]
    assert name_delta == (("function", "id", "index", "type"), ("name",))
    for anchor in ANCHORS:
        _, completed = profile(chunks(anchor, case))
        (call,) = completed["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_name_delta_with_arguments_is_split_in_two():
    chunk = {
        "id": "c",
        "choices": [
            {
                "index": 0,
                "finish_reason": None,
                "delta": {
                    "tool_calls": [
                        {
                            "id": "chatcmpl-tool-1",
                            "type": "function",
                            "index": 0,
                            "function": {"name": "lookup", "arguments": "{"},
                        }
                    ]
                },
            }
        ],
    }
    first, second = normalise_chunk(chunk)
    assert first["choices"][0]["delta"] == {
        "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "index": 0, "function": {"name": "lookup"}}]
    }
    assert second["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == "{"  # input untouched


def test_normal_form_is_a_fixed_point():
    for anchor in ANCHORS:
        for case in ("b-stream-text-usage", "d-stream-tool-required", "e-stream-tool-named"):
            once = chunks(anchor, case)
            assert [out for c in once for out in normalise_chunk(c)] == once


@pytest.mark.parametrize("case", ["c-nonstream-text", "f-nonstream-tool-required"])
def test_non_streaming_bodies_are_identical(case):
    bodies = {a: _drop_tool_ids({k: v for k, v in body(a, case).items() if k not in VOLATILE}) for a in ANCHORS}
    assert bodies["0.18.1"] == bodies["0.22.1"] == bodies["0.26.0"]
    assert "system_fingerprint" not in bodies["0.26.0"]
    reference = bodies["0.26.0"]
    for anchor in ANCHORS:
        newer = bodies[anchor]
        if case.startswith("f-") and family_of(anchor) >= (0, 27):  # 10 more prompt tokens for the tools from 0.27
            assert set(newer["usage"]) == set(reference["usage"])
            assert newer["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"] + 10
            newer = {k: v for k, v in newer.items() if k != "usage"}
            assert newer == {k: v for k, v in reference.items() if k != "usage"}, anchor
        else:
            assert newer == reference, anchor


@pytest.mark.parametrize("anchor", [a for a in ANCHORS if family_of(a) >= (0, 28)])
def test_from_0_28_non_streaming_usage_loses_its_null_completion_tokens_details(anchor):
    raw = orjson.loads((FIXTURES / anchor / "c-nonstream-text.json").read_bytes())
    assert raw["usage"]["completion_tokens_details"] is None
    normal = normalise_body(raw)
    assert "completion_tokens_details" not in normal["usage"] and "prompt_tokens_details" in normal["usage"]
    assert raw["usage"]["completion_tokens_details"] is None  # input untouched
    details = {**raw, "usage": {**raw["usage"], "completion_tokens_details": {"reasoning_tokens": 3}}}
    assert normalise_body(details)["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}  # kept when set


def test_no_tool_calls_means_no_tool_calls_key():
    message = body("0.18.1", "c-nonstream-text")["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"]


def test_closing_the_normalised_stream_closes_vllms_stream():
    closed = []

    async def vllm_stream():
        try:
            for item in sse_items("0.26.0", "a-stream-text"):
                yield item
        finally:
            closed.append(True)

    async def take_one():
        stream = vllm_chunks(vllm_stream())
        await anext(stream)
        await stream.aclose()

    asyncio.run(take_one())
    assert closed == [True]


@pytest.mark.parametrize("text", ["a\x85b", "line\u2028separator", "para\u2029graph", "cr\rlf"])
def test_text_with_unicode_line_breaks_is_one_chunk(text):
    """vLLM's JSON leaves U+0085, U+2028 and U+2029 unescaped: they are inside the ``data:`` line, not ends of it."""
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    raw = json.dumps(chunk, ensure_ascii=False)  # as pydantic's model_dump_json writes them
    assert ("\r" in text) == ("\\r" in raw)  # a real CR is escaped in JSON; the others are not

    async def strings():
        yield f"data: {raw}\n\n"
        yield "data: [DONE]\n\n"

    async def collect():
        return [c async for c in vllm_chunks(strings())]

    (parsed,) = asyncio.run(collect())
    assert parsed["choices"][0]["delta"]["content"] == text

"""vLLM's text-only chunks are handed to the mapper as :class:`TextDelta` without building their dict
(:class:`vllm_nnrp_plugin.vllm_binding.chunk_shapes.VLLMStream`'s text lane): on every anchor's recordings it
stands for exactly the chunk the full parse gives, for any text vLLM's JSON can carry; a string that only looks
like one (the same bytes around something that is not one JSON string) takes the full parse; and the mapper
gives the same events and body for a :class:`TextDelta` as for its chunk."""

from __future__ import annotations

import json

import orjson
import pydantic_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_chunk_shapes import ANCHORS, FIXTURES, sse_items
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper, TextDelta
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import VLLMStream, normalise_chunk

TEXT_CASES = (
    "a-stream-text",
    "b-stream-text-usage",
    "p-stream-logprobs",
    "r-stream-reasoning",
    "j2-stream-n2-seeded",
    "d-stream-tool-required",
    "e-stream-tool-named",
)


def full_parse(item: str) -> list[dict]:
    return normalise_chunk(orjson.loads(item[len("data: ") :]))


@pytest.mark.parametrize("anchor", ANCHORS)
@pytest.mark.parametrize("case", TEXT_CASES)
def test_on_every_recording_a_text_delta_is_the_chunk_the_full_parse_gives(anchor, case):
    if not (FIXTURES / anchor / f"{case}.sse").exists():
        pytest.skip(f"{case} is not recorded on {anchor}")
    stream, lanes = VLLMStream(), 0
    for item in sse_items(anchor, case):
        for chunk in stream.feed(item):
            if isinstance(chunk, TextDelta):
                lanes += 1
                assert [chunk.chunk()] == full_parse(item)
    if case in ("a-stream-text", "b-stream-text-usage"):  # plain text streams: every chunk after the first text one
        assert lanes >= 3
    if case == "p-stream-logprobs":  # every chunk carries its token's logprobs: never text-only
        assert lanes == 0


def recorded_text_item(anchor: str) -> str:
    """The first text-only chunk string of the anchor's plain text recording."""
    return next(i for i in sse_items(anchor, "a-stream-text") if '"content":"Hello"' in i)


ENCODERS = {
    "pydantic": lambda text: pydantic_core.to_json(text).decode(),  # what vLLM's model_dump_json writes
    "ascii": lambda text: json.dumps(text),
    "orjson": lambda text: orjson.dumps(text).decode(),
}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ANCHORS), st.sampled_from(sorted(ENCODERS)), st.text())
def test_any_text_in_vllms_shape_reads_back_exactly(anchor, encoder, text):
    template = recorded_text_item(anchor)
    item = template.replace('"content":"Hello"', '"content":' + ENCODERS[encoder](text), 1)
    stream = VLLMStream()
    stream.feed(template)  # the stream learns its shape
    (chunk,) = stream.feed(item)
    if text:
        assert isinstance(chunk, TextDelta) and chunk.content == text
        assert [chunk.chunk()] == full_parse(item)
    else:  # an empty content is no text delta: the full parse drops it
        assert chunk == full_parse(item)[0]


LOOKALIKES = [
    '"a","tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f"}}]',  # another key after it
    '"a"},"extra":{"content":"b"',  # the delta closes early
    "null",
    "123",
    '["a"]',
    '""',
]


@pytest.mark.parametrize("anchor", ANCHORS)
@pytest.mark.parametrize("middle", LOOKALIKES)
def test_a_string_with_the_same_bytes_around_something_else_takes_the_full_parse(anchor, middle):
    template = recorded_text_item(anchor)
    item = template.replace('"Hello"', middle, 1)
    stream = VLLMStream()
    stream.feed(template)
    out = stream.feed(item)
    assert not any(isinstance(c, TextDelta) for c in out)
    assert out == full_parse(item)


def test_a_corrupted_string_still_raises_as_the_full_parse_does():
    template = recorded_text_item("0.26.0")
    stream = VLLMStream()
    stream.feed(template)
    with pytest.raises(orjson.JSONDecodeError):
        stream.feed(template.replace('"Hello"', '"Hel', 1))


@pytest.mark.parametrize("anchor", ANCHORS)
def test_the_mapper_gives_the_same_events_and_body_for_a_text_delta_and_its_chunk(anchor):
    stream = VLLMStream()
    items = [c for item in sse_items(anchor, "a-stream-text") for c in stream.feed(item)] + stream.end()
    assert any(isinstance(c, TextDelta) for c in items)
    lane, dicts = ChatStreamMapper(), ChatStreamMapper()
    assert [e for c in items for e in lane.feed(c)] == [
        e for c in items for e in dicts.feed(c.chunk() if isinstance(c, TextDelta) else c)
    ]
    assert lane.completed_body() == dicts.completed_body()


def test_a_text_delta_before_any_chunk_of_its_stream_is_mapped_through_its_chunk():
    template = full_parse(recorded_text_item("0.26.0"))[0]
    mapper = ChatStreamMapper()
    assert mapper.feed(TextDelta(0, "Hi", template)) == ChatStreamMapper().feed(TextDelta(0, "Hi", template).chunk())
    assert mapper.completed_body()["id"] == template["id"]

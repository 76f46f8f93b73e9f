"""The ``vllm.openai_chunk`` extension (:mod:`vllm_nnrp_plugin.profile.events`): streams recorded from real vLLM
with token logprobs (``p-stream-logprobs``: ``logprobs: true, top_logprobs: 2``) and with a reasoning parser
(``r-stream-reasoning``, ``responses-r-stream-reasoning``: ``--reasoning-parser olmo3``, which reads the small
model's whole answer as reasoning because it never writes ``</think>``) go through the production mappers, the
operation's merging outbox and the SDK-side renderers; the SDK's chunks carry vLLM's logprobs and reasoning as
vLLM sent them, a client that ignores ``openai_chunk`` reads today's events, and other streams carry none.

Recorded into ``compat/fixtures/vllm/<version>/`` like the other fixtures: each ``<case>.request.json`` replayed
against a plain ``vllm serve`` of the anchor (the launcher's flags; ``p-*`` on the tool-calling server of the
other chat fixtures, ``--enable-auto-tool-choice --tool-call-parser hermes --chat-template
compat/tool_chat_template_hermes.jinja``; ``r-*`` and ``responses-r-*`` on a server with ``--reasoning-parser
olmo3`` and the model's own chat template), the body stored byte for byte.
"""

from __future__ import annotations

import pytest

from tests.support import FIXTURES, recorded_chunks
from tests.unit.test_merge import operation
from tests.unit.test_openai_responses_sse import blocks, sdk_final
from tests.unit.test_openai_sse import items
from tests.unit.test_responses_stream import recorded_events, run
from vllm_nnrp_plugin.client.openai import sse
from vllm_nnrp_plugin.client.openai.responses_sse import ResponsesEventStream
from vllm_nnrp_plugin.profile import events as ev
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper


def versions(case: str) -> list[str]:
    """The anchors with a recording of ``case`` (at least 0.26.0's)."""
    found = sorted(p.parent.name for p in FIXTURES.parent.glob(f"*/{case}.sse"))
    assert FIXTURES.name in found
    return found


def mapped(chunks: list[dict]) -> tuple[list[dict], dict]:
    mapper = ChatStreamMapper(usage_events=False)
    out = [e for chunk in chunks for e in mapper.feed(chunk)] + mapper.finish()
    return out, mapper.completed_body()


def rendered(profile_events: list[dict], body: dict) -> list[dict]:
    """The chunks the SDK transport writes for these events (``[DONE]`` left out)."""
    stream = sse.ChatChunkStream(completion_id="chatcmpl-x", created=1, model="example-model", include_usage=False)
    return [c for c in items(b"".join(stream.feed(e) for e in profile_events) + stream.finish(body)) if c != "[DONE]"]


def token_entries(chunks: list[dict]) -> list[dict]:
    """Every ``choices[].logprobs.content`` entry of a chunk stream, in order."""
    return [t for c in chunks for ch in c["choices"] for t in (ch.get("logprobs") or {}).get("content") or ()]


def carried(chunks: list[dict], key: str) -> list:
    """``delta[key]`` of every chunk that has it non-empty, in order."""
    return [ch["delta"][key] for c in chunks for ch in c["choices"] if ch["delta"].get(key)]


def without_logprobs(chunks: list[dict]) -> list[dict]:
    """The same chunks as a request without ``logprobs`` gets them (vLLM's ``logprobs: null``)."""
    return [{**c, "choices": [{**ch, "logprobs": None} for ch in c["choices"]]} for c in chunks]


@pytest.mark.parametrize("version", versions("p-stream-logprobs"))
def test_logprob_stream_reaches_the_sdk_with_vllms_logprobs_and_top_logprobs(version):
    chunks = recorded_chunks("p-stream-logprobs", version)
    vllm_tokens = token_entries(chunks)
    assert len(vllm_tokens) == 16 and all(len(t["top_logprobs"]) == 2 for t in vllm_tokens)  # max_tokens 16
    profile_events, body = mapped(chunks)
    assert all("openai_chunk" in e for e in profile_events)  # every token chunk carried logprobs
    sdk_chunks = rendered(profile_events, body)
    assert token_entries(sdk_chunks) == vllm_tokens
    assert carried(sdk_chunks, "content") == carried(chunks, "content")
    # each of vLLM's token chunks is one SDK chunk with its text and its logprobs, in order
    with_logprobs = [ch for c in sdk_chunks for ch in c["choices"] if ch["logprobs"] is not None]
    vllm_with = [ch for c in chunks for ch in c["choices"] if ch["logprobs"] is not None]
    assert [(c["delta"], c["logprobs"]) for c in with_logprobs] == [(c["delta"], c["logprobs"]) for c in vllm_with]
    assert [ch["finish_reason"] for c in sdk_chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    assert body["choices"][0]["logprobs"] == {"content": vllm_tokens}


@pytest.mark.parametrize("version", versions("p-stream-logprobs"))
def test_a_client_ignoring_openai_chunk_reads_the_events_of_the_same_stream_without_logprobs(version):
    chunks = recorded_chunks("p-stream-logprobs", version)
    with_chunk = mapped(chunks)[0]
    plain = mapped(without_logprobs(chunks))[0]
    assert not any("openai_chunk" in e for e in plain)
    ignored = [{k: v for k, v in e.items() if k != "openai_chunk"} for e in with_chunk]
    assert [e for e in ignored if e["type"] != ev.OUTPUT_TEXT_DELTA or e["delta"]] == plain


@pytest.mark.parametrize("case", ["a-stream-text", "d-stream-tool-required", "j2-stream-n2-seeded"])
def test_streams_without_logprobs_or_reasoning_carry_no_openai_chunk(case):
    for version in versions(case):
        assert not any("openai_chunk" in e for e in mapped(recorded_chunks(case, version))[0])


@pytest.mark.parametrize("version", versions("r-stream-reasoning"))
def test_reasoning_stream_reaches_the_sdk_as_vllms_delta_reasoning(version):
    chunks = recorded_chunks("r-stream-reasoning", version)
    reasoning = carried(chunks, "reasoning")
    assert reasoning and not carried(chunks, "content")  # the small model never closes its <think>
    profile_events, body = mapped(chunks)
    deltas = [e for e in profile_events if e["type"] == ev.OUTPUT_TEXT_DELTA]
    assert deltas and all(e["delta"] == "" and "openai_chunk" in e for e in deltas)
    sdk_chunks = rendered(profile_events, body)
    assert carried(sdk_chunks, "reasoning") == reasoning
    assert not carried(sdk_chunks, "content")
    assert body["choices"][0]["message"]["reasoning"] == "".join(reasoning)


@pytest.mark.parametrize(("case", "key"), [("p-stream-logprobs", "logprobs"), ("r-stream-reasoning", "reasoning")])
def test_deltas_carrying_openai_chunk_never_merge_in_a_backed_up_outbox(case, key):
    """The client reads slower than vLLM: every event waits. Deltas with ``openai_chunk`` stay one event each, so
    every chunk (and its logprob list) arrives once, in order."""
    for version in versions(case):
        profile_events = mapped(recorded_chunks(case, version))[0]
        op = operation()
        queued = [p for p in map(op.partial, profile_events) if p is not None]
        sent = [op.take(p).event for p in queued]
        assert sent == profile_events and len(sent) > 1


def of_reasoning(event: dict) -> bool:
    """An event of a reasoning item (vLLM's ``response.reasoning_*`` and a ``reasoning`` item's added/done)."""
    kind = event["type"]
    return kind.startswith("response.reasoning_") or (
        kind.startswith("response.output_item.") and event["item"]["type"] == "reasoning"
    )


def strip(event: dict) -> dict:
    return {k: v for k, v in event.items() if k != "sequence_number"}


@pytest.mark.parametrize("version", versions("responses-r-stream-reasoning"))
def test_responses_reasoning_items_reach_the_sdk_as_vllm_streamed_them(version):
    vllm = recorded_events("responses-r-stream-reasoning", version)
    reasoning = [d for d in vllm if of_reasoning(d)]
    assert any(d["type"] == "response.reasoning_text.delta" for d in reasoning)
    profile_events, body = run(vllm)
    replayed = [e for e in profile_events if "openai_chunk" in e]
    assert [e["openai_chunk"] for e in replayed] == reasoning and all(e["delta"] == "" for e in replayed)
    stream = ResponsesEventStream(response_id="resp_nnrp-x", created_at=1, request={"model": "example-model"})
    ours = blocks(b"".join(stream.feed(e) for e in profile_events) + stream.finish(body))
    assert [d["sequence_number"] for _, d in ours] == list(range(len(ours)))
    assert [strip(d) for _, d in ours if of_reasoning(d)] == [strip(d) for d in reasoning]
    # the SDK's accumulator takes every event; its final Response is vLLM's completed one (where vLLM's
    # non-streaming parse of the same text, without ``</think>``, lists a message instead of the reasoning)
    completed = vllm[-1]["response"]
    assert sdk_final(ours).output_text == "".join(
        part["text"] for item in completed["output"] if item["type"] == "message" for part in item["content"]
    )

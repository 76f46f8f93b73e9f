"""Property tests (hypothesis) for tool-call streams: generated sequences of vLLM tool-call chunks, in the
shapes real vLLM streams them (compat/fixtures/vllm/<anchor>/d*, e*.sse: 0.26's name delta alone with
``content: null``; 0.18/0.22's name delta carrying the first fragment and later fragments with
``name: null``), as the SSE strings vLLM's generator yields, through the real parser and normaliser
(:class:`VLLMStream`) and the profile mapper (:class:`ChatStreamMapper`).

Generated: random splits of JSON arguments into fragments, several calls, indexes reused by new call ids,
name and arguments in one entry, several entries per chunk, calls without a name, calls with no argument text
at all (0.18's hermes stream of a parameterless call: a name delta alone, or with ``arguments: ""``) of tools
declared in the request with or without required arguments (the declaration shapes of
:func:`tools_without_required_arguments`), cuts by the token budget (vLLM still streams ``finish_reason:
"tool_calls"``) and by a stop string. Invariants: per ``call_id`` ``started`` once and first, deltas in vLLM's
order, exactly one ``completed`` or ``error`` last; ``completed`` only with a name and arguments that are one
JSON value, equal to the concatenated deltas, or — a call of a tool that accepts ``{}``, with no argument text,
not cut — with one delta ``"{}"`` and ``"{}"``; the error code says why; the completed body holds exactly the
completed calls; ``finish_reason`` is ``length`` when the budget ran out, else ``tool_calls`` exactly when the
body lists a call, else ``stop``.
"""

from __future__ import annotations

import collections
import json

import orjson
import pytest

pytest.importorskip("hypothesis", reason="hypothesis (test extra) is not installed in this environment")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper  # noqa: E402
from vllm_nnrp_plugin.profile.tool_calls import tools_without_required_arguments  # noqa: E402
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import TokenBudget, VLLMStream  # noqa: E402

BUDGET = TokenBudget(max_tokens=50, max_model_len=2048)
PROMPT_TOKENS = 196
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=6)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
arguments_text = st.builds(
    lambda value, indent: json.dumps(value, indent=indent),
    st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    st.sampled_from([None, 1]),
)


@st.composite
def fragments(draw, text: str) -> list[str]:
    """``text`` split at random points into non-empty fragments."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6)))
    points = [0, *[c for c in cuts if 0 < c < len(text)], len(text)]
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


#: declarations of a tool that accept ``{}`` as its arguments, and of one that does not
ACCEPTS_EMPTY = [
    None,
    {},
    {"type": "object"},
    {"type": "object", "properties": {}},
    {"type": "object", "properties": {"tz": {"type": "string"}}, "required": [], "additionalProperties": False},
]
REFUSES_EMPTY = [
    {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    {"type": "object", "minProperties": 1},
    {"anyOf": [{"type": "object"}]},
    {"type": "string"},
]
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": REFUSES_EMPTY[0]}}


@st.composite
def tool_call_streams(draw):
    """(SSE items, the calls as vLLM began them, how generation ended, the request's tools)."""
    shape = draw(st.sampled_from(["0.26", "0.22"]))
    empty_ok = draw(st.booleans())
    get_time = {"name": "get_time"}
    parameters = draw(st.sampled_from(ACCEPTS_EMPTY if empty_ok else REFUSES_EMPTY))
    if parameters is not None or draw(st.booleans()):
        get_time["parameters"] = parameters
    tools = [LOOKUP, {"type": "function", "function": get_time}]
    calls, entries, used = [], [], []
    for number in range(draw(st.integers(1, 4))):
        index = draw(st.sampled_from(used)) if used and draw(st.booleans()) else len(used)
        used.append(index) if index not in used else None
        name = draw(st.sampled_from(["lookup", "search", "get_time", None]))
        parts = [] if draw(st.integers(0, 3)) == 0 else draw(fragments(draw(arguments_text)))
        call = {
            "id": f"chatcmpl-tool-{number}",
            "index": index,
            "name": name,
            "fragments": parts,
            "empty_ok": name == "get_time" and empty_ok,
        }
        calls.append(call)
        first = {"id": call["id"], "type": "function", "index": index, "function": {}}
        if name:
            first["function"]["name"] = name
        rest = [{"index": index, "function": {"arguments": p}} for p in parts]
        if shape == "0.22":  # the first fragment rides in the name delta; later ones carry "name": null
            first["function"]["arguments"] = parts[0] if parts else ""  # "": 0.18's parameterless call
            rest = rest[1:]
            for entry in rest:
                entry["function"]["name"] = None
        entries.append((number, first))
        entries.extend((number, e) for e in rest)
    ending = draw(st.sampled_from(["complete", "budget", "stop"]))
    if ending != "complete":
        entries = entries[: draw(st.integers(1, len(entries)))]
    emitted = collections.defaultdict(list)  # call number -> the fragments vLLM sent
    for number, entry in entries:
        if entry["function"].get("arguments"):
            emitted[number].append(entry["function"]["arguments"])
    for number, call in enumerate(calls):
        call["emitted"] = emitted[number]
        call["began"] = any(n == number for n, _ in entries)
    items = [_chunk({"role": "assistant", "content": ""})]
    position = 0
    while position < len(entries):
        size = draw(st.integers(1, 3))  # several entries per chunk
        group = [e for _, e in entries[position : position + size]]
        position += size
        delta = {"tool_calls": group}
        if shape == "0.26":
            delta = {"content": None, **delta}
        items.append(_chunk(delta))
    items.append(_chunk({}, finish_reason="tool_calls", stop_reason="Paris" if ending == "stop" else None))
    completion_tokens = BUDGET.max_tokens if ending == "budget" else BUDGET.max_tokens - 7
    usage = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion_tokens,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
    }
    items.append(
        "data: "
        + orjson.dumps(
            {
                "id": "chatcmpl-x",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": usage,
            }
        ).decode()
        + "\n\n"
    )
    items.append("data: [DONE]\n\n")
    return items, [c for c in calls if c["began"]], ending, tools


def _chunk(delta, finish_reason=None, stop_reason=None) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return "data: " + orjson.dumps(chunk).decode() + "\n\n"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run(items, tools=None):
    stream = VLLMStream(BUDGET)
    mapper = ChatStreamMapper(usage_events=False, no_argument_tools=tools_without_required_arguments(tools))
    events = [event for item in items for chunk in stream.feed(item) for event in mapper.feed(chunk)]
    assert stream.done
    events += mapper.finish()
    return events, mapper.completed_body()


@SETTINGS
@given(tool_call_streams())
def test_generated_tool_call_streams_keep_every_invariant(generated):
    items, calls, ending, tools = generated
    events, body = run(items, tools)
    per_call = collections.defaultdict(list)
    for event in events:
        assert event["type"].startswith("response.tool_call.")  # no text, no usage event (not asked)
        per_call[event["call_id"]].append(event)
    assert sorted(per_call) == sorted(c["id"] for c in calls)  # a new id is a new call, even on a reused index
    assert len({e[0]["item_id"] for e in per_call.values()}) == len(per_call)
    completed_calls = []
    for call in calls:
        started, *deltas, last = per_call[call["id"]]
        assert started["type"] == "response.tool_call.started" and started["name"] == (call["name"] or "")
        assert last["type"] in ("response.tool_call.completed", "response.tool_call.error")
        assert all(e["index"] == call["index"] and e["item_id"] == started["item_id"] for e in per_call[call["id"]])
        text = "".join(call["emitted"])
        reused = any(c["index"] == call["index"] for c in calls[calls.index(call) + 1 :])
        cut = ending != "complete" and not reused
        no_arguments = call["empty_ok"] and text == "" and not cut  # completes with "{}" as vLLM's parser gives it
        if last["type"] == "response.tool_call.completed":
            assert {d["type"] for d in deltas} <= {"response.tool_call.delta"}
            assert last["name"] == call["name"]
            completed_calls.append(last)
            if no_arguments:
                assert [d["arguments_delta"] for d in deltas] == ["{}"] and last["arguments"] == "{}"
                continue
            assert [d["arguments_delta"] for d in deltas] == call["emitted"]  # vLLM's order, exactly
            assert call["name"] and _is_json(last["arguments"]) and last["arguments"] == text
        else:
            assert not (call["name"] and _is_json(text)) and not no_arguments
            assert last["error"]["code"] == ("tool_call_incomplete" if cut else "tool_call_invalid")
            if call["name"]:
                assert [d["arguments_delta"] for d in deltas] == call["emitted"]
    (choice,) = body["choices"]
    claimed = [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls", ())
    ]
    assert claimed == [(e["call_id"], e["name"], e["arguments"]) for e in completed_calls]
    assert choice["finish_reason"] == ("length" if ending == "budget" else "tool_calls" if claimed else "stop")
    assert choice["stop_reason"] == ("Paris" if ending == "stop" else None)
    assert body["usage"]["completion_tokens"] == (50 if ending == "budget" else 43)


@SETTINGS
@given(tool_call_streams(), st.integers(1, 40))
def test_the_parser_gives_the_same_chunks_however_vllms_strings_are_split(generated, width):
    """vLLM yields one ``data:`` item per string; a string holding several items parses the same."""
    items, _, _, _ = generated
    blocks = ["".join(items[i : i + width]) for i in range(0, len(items), width)]
    merged, separate = VLLMStream(BUDGET), VLLMStream(BUDGET)
    assert [c for b in blocks for c in merged.feed(b)] == [c for item in items for c in separate.feed(item)]
    assert merged.done and separate.done

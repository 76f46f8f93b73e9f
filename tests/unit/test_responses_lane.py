"""The Responses lane (:mod:`vllm_nnrp_plugin.vllm_binding.responses_lane`): a Responses stream's text and reasoning
deltas reach the mapper straight from the engine's outputs, vLLM's processor emits the rest, and the events —
sequence numbers, the item texts of the ``*.done`` events and the parser's calls included — are the ones vLLM's
processor gives alone.

The serving object here is a stand-in with the calling shape of vLLM 0.26–0.32's ``OpenAIServingResponses``
(``responses_stream_generator`` numbering what ``_process_simple_streaming_events`` yields) and a stand-in of
``SimpleStreamingEventProcessor`` with vLLM's state rules (``vllm/entrypoints/openai/responses/streaming_events.py``:
``resolve_target_state``, ``needs_transition``, ``split_delta``; a delta of the open item changes only
``accumulated_text``). Its parser replays deltas taken from real vLLM's Responses streams (the anchors' recordings
in compat/fixtures/vllm/) or generated ones. Real vLLM is exercised end to end
(tests/e2e/test_responses_lane_e2e.py)."""

from __future__ import annotations

import asyncio
import enum
import glob
import os
import types

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_engine_lane_parser import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from vllm_nnrp_plugin.vllm_binding.responses import _event_dicts
from vllm_nnrp_plugin.vllm_binding.responses_lane import request_fits, responses_lane_serving

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "compat", "fixtures", "vllm")
#: Responses stream recordings of the lines the lane serves
RECORDINGS = sorted(
    p
    for p in glob.glob(os.path.join(FIXTURES, "*", "responses-*-stream-*.sse"))
    if not p.split(os.sep)[-2].startswith("0.18")
)


class _StateType(enum.Enum):
    NONE = enum.auto()
    CONTENT = enum.auto()
    REASONING = enum.auto()
    TOOL_CALL = enum.auto()


class SimpleStreamingState:
    def __init__(self):
        self.output_index, self.current_item_id, self.content_index, self.accumulated_text = 0, "", 0, ""
        self.tool_call_index, self.current_state, self.items = None, _StateType.NONE, 0


class Event:
    """An event object: its fields as attributes, ``model_dump`` as openai's models dump them (sorted fields)."""

    def __init__(self, type, **fields):
        self.type, self.sequence_number = type, -1
        self.__dict__.update(fields)

    def model_dump(self, mode="json", by_alias=True):
        return dict(sorted(self.__dict__.items()))


class SimpleStreamingEventProcessor:
    """vLLM's processor (0.26): open/delta/done events per state."""

    def __init__(self):
        self.state = SimpleStreamingState()

    def resolve_target_state(self, delta):
        if delta.tool_calls and delta.tool_calls[0].function is not None:
            return _StateType.TOOL_CALL, delta.tool_calls[0]
        if delta.reasoning is not None:
            return _StateType.REASONING, None
        if delta.content:
            return _StateType.CONTENT, None
        return _StateType.NONE, None

    def needs_transition(self, target, tool_call):
        state = self.state
        if state.current_state != target:
            return True
        return (
            target == _StateType.TOOL_CALL
            and tool_call is not None
            and state.tool_call_index is not None
            and tool_call.index is not None
            and state.tool_call_index != tool_call.index
        )

    def close_current(self):
        state = self.state
        if state.current_state == _StateType.NONE:
            return []
        done = Event(
            "response.output_item.done",
            output_index=state.output_index,
            item_id=state.current_item_id,
            text=state.accumulated_text,
            kind=state.current_state.name,
        )
        state.output_index += 1
        state.current_state = _StateType.NONE
        return [done]

    def open(self, target, tool_call=None):
        state = self.state
        state.current_state, state.items = target, state.items + 1
        state.current_item_id, state.accumulated_text = f"item-{state.items}", ""
        if target == _StateType.TOOL_CALL:
            state.tool_call_index = tool_call.index
        return [
            Event(
                "response.output_item.added",
                output_index=state.output_index,
                item_id=state.current_item_id,
                kind=target.name,
                name=tool_call.function.name if tool_call else None,
            )
        ]

    def emit_delta(self, delta, output, get_logprobs=None):
        state = self.state
        if state.current_state == _StateType.TOOL_CALL:
            arguments = "".join(
                tc.function.arguments for tc in delta.tool_calls if tc.function is not None and tc.function.arguments
            )
            if not arguments:
                return []
            state.accumulated_text += arguments
            return [
                Event(
                    "response.function_call_arguments.delta",
                    output_index=state.output_index,
                    item_id=state.current_item_id,
                    delta=arguments,
                )
            ]
        if state.current_state == _StateType.REASONING:
            state.accumulated_text += delta.reasoning
            return [
                Event(
                    "response.reasoning_text.delta",
                    content_index=state.content_index,
                    delta=delta.reasoning,
                    item_id=state.current_item_id,
                    output_index=state.output_index,
                )
            ]
        state.accumulated_text += delta.content
        return [
            Event(
                "response.output_text.delta",
                content_index=state.content_index,
                delta=delta.content,
                item_id=state.current_item_id,
                output_index=state.output_index,
                logprobs=get_logprobs(output),
            )
        ]


def split_delta(delta):
    has_reasoning, has_content, has_tools = (
        delta.reasoning is not None,
        delta.content is not None,
        bool(delta.tool_calls),
    )
    if int(has_reasoning) + int(has_content) + int(has_tools) <= 1 and (
        not has_tools or len({tc.index for tc in delta.tool_calls}) <= 1
    ):
        return [delta]
    parts = []
    if has_reasoning:
        parts.append(DeltaMessage(reasoning=delta.reasoning))
    if has_content:
        parts.append(DeltaMessage(content=delta.content))
    if has_tools:
        groups = {}
        for tc in delta.tool_calls:
            groups.setdefault(tc.index, []).append(tc)
        parts.extend(DeltaMessage(tool_calls=tcs) for tcs in groups.values())
    return parts


class ScriptedParser:
    """vLLM's parser object: one scripted delta per ``parse_delta`` call, every call recorded."""

    def __init__(self, deltas, fail_at=None):
        self.deltas, self.fail_at, self.calls = list(deltas), fail_at, []

    def parse_delta(self, delta_text, delta_token_ids, request, prompt_token_ids=None, *, finished):
        self.calls.append((delta_text, list(delta_token_ids), prompt_token_ids, finished))
        if len(self.calls) - 1 == self.fail_at:
            raise ValueError("the parser failed")
        return self.deltas[len(self.calls) - 1]


class Serving:
    """``OpenAIServingResponses``' calling shape for one request's script: ``texts`` the engine's outputs (one
    token id each, the last with a finish reason), ``parser`` the context's parser (``None``: a server without
    one, whose processor streams the text as it is). ``engine_error``: raised after that many outputs."""

    def __init__(self, texts, parser, engine_error=None):
        self.parser = object() if parser is not None else None
        self.texts, self.engine_error = texts, engine_error
        self.context = types.SimpleNamespace(last_output=None, response_parser=parser)
        self.closed = {"engine": False, "processor": False}
        self.seen = []  # the outputs vLLM's processor read

    async def _contexts(self):
        try:
            for n, text in enumerate(self.texts):
                if n == self.engine_error:
                    raise RuntimeError("the engine failed")
                finish = "stop" if n == len(self.texts) - 1 else None
                completion = types.SimpleNamespace(text=text, token_ids=(100 + n,), finish_reason=finish)
                self.context.last_output = types.SimpleNamespace(outputs=[completion], prompt_token_ids=[1, 2])
                yield self.context
        finally:
            self.closed["engine"] = True

    async def _process_simple_streaming_events(
        self,
        request,
        sampling_params,
        result_generator,
        context,
        model_name,
        tokenizer,
        request_metadata,
        created_time,
        _increment_sequence_number_and_return,
    ):
        processor = SimpleStreamingEventProcessor()
        number = _increment_sequence_number_and_return
        try:
            async for ctx in result_generator:
                if ctx.last_output is None or not ctx.last_output.outputs:
                    continue
                output = ctx.last_output.outputs[0]
                self.seen.append(output.text)
                if ctx.response_parser:
                    delta = ctx.response_parser.parse_delta(
                        delta_text=output.text,
                        delta_token_ids=list(output.token_ids),
                        request=request,
                        prompt_token_ids=ctx.last_output.prompt_token_ids,
                        finished=output.finish_reason is not None,
                    )
                else:
                    delta = DeltaMessage(content=output.text)
                if not delta:
                    continue
                for dm in split_delta(delta):
                    target, tool_call = processor.resolve_target_state(dm)
                    if target == _StateType.NONE:
                        continue
                    if processor.needs_transition(target, tool_call):
                        for event in processor.close_current():
                            yield number(event)
                        for event in processor.open(target, tool_call):
                            yield number(event)
                    for event in processor.emit_delta(dm, output, lambda output: []):
                        yield number(event)
            for event in processor.close_current():
                yield number(event)
        finally:
            self.closed["processor"] = True

    async def responses_stream_generator(self, request):
        sequence_number = 0

        def number(event):
            nonlocal sequence_number
            if hasattr(event, "sequence_number"):
                event.sequence_number = sequence_number
            sequence_number += 1
            return event

        yield number(Event("response.created"))
        async for event in self._process_simple_streaming_events(
            request, None, self._contexts(), self.context, "m", None, None, 0, number
        ):
            yield event
        yield number(Event("response.completed"))


def request(logprobs=False):
    return types.SimpleNamespace(is_include_output_logprobs=lambda: logprobs)


def stream(serving, lane=True, req=None, limit=None):
    """The event dicts of ``serving``'s stream, through the lane's view (``lane``) or vLLM's object itself."""
    target = responses_lane_serving(serving)(None) if lane else serving

    async def run():
        events = _event_dicts(target.responses_stream_generator(req or request()))
        out = []
        async for event in events:
            out.append(event)
            if limit is not None and len(out) == limit:
                await events.aclose()
                break
        return out

    return asyncio.run(run())


def both(texts, deltas, **kw):
    """(vLLM's events, its parser's calls), (the lane's events, its parser's calls) for one script."""
    results = []
    for lane in (False, True):
        parser = None if deltas is None else ScriptedParser(deltas)
        serving = Serving(texts, parser, **kw)
        results.append((stream(serving, lane), parser and parser.calls, serving))
    return results


def script_of(path):
    """(engine output texts, parser deltas) of a recorded Responses stream: one output per delta event (text,
    reasoning, a call's name when its item is added, its argument fragments), then a finish output."""
    with open(path, encoding="utf-8") as f:
        items = [orjson.loads(line[len("data: ") :]) for line in f.read().splitlines() if line.startswith("data: ")]
    texts, deltas, calls = [], [], {}
    for item in items:
        kind = item.get("type")
        if kind == "response.output_text.delta":
            deltas.append(DeltaMessage(content=item["delta"]))
        elif kind == "response.reasoning_text.delta":
            deltas.append(DeltaMessage(reasoning=item["delta"]))
        elif kind == "response.output_item.added" and item["item"]["type"] == "function_call":
            calls[item["item"]["id"]] = index = len(calls)
            deltas.append(
                DeltaMessage(
                    tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(name=item["item"]["name"]))]
                )
            )
        elif kind == "response.function_call_arguments.delta":
            deltas.append(
                DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(index=calls[item["item_id"]], function=DeltaFunctionCall(arguments=item["delta"]))
                    ]
                )
            )
        else:
            continue
        texts.append(f"t{len(texts)}")
    deltas.append(None)
    texts.append("")
    return texts, deltas


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: "/".join(p.split(os.sep)[-2:]))
def test_the_lane_gives_vllms_events_for_every_recorded_stream(path):
    texts, deltas = script_of(path)
    (vllm_events, vllm_calls, _), (lane_events, lane_calls, _) = both(texts, deltas)
    assert lane_events == vllm_events
    assert lane_calls == vllm_calls and len(lane_calls) == len(texts)


def test_the_lane_takes_the_deltas_of_an_open_item_and_vllm_opens_and_closes_items():
    deltas = [
        DeltaMessage(content="a"),
        DeltaMessage(content="b"),
        None,
        DeltaMessage(content=""),
        DeltaMessage(reasoning="r"),
        DeltaMessage(reasoning="s"),
        DeltaMessage(content="c"),
        None,
    ]
    texts = [f"t{n}" for n in range(len(deltas))]
    (vllm_events, _, _), (lane_events, _, serving) = both(texts, deltas)
    assert lane_events == vllm_events
    assert serving.seen == ["t0", "t4", "t6", "t7"]  # the first output, the two that open an item, the finish
    kinds = [e["type"] for e in lane_events]
    assert kinds == [
        "response.created",
        "response.output_item.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.done",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.output_item.done",
        "response.output_item.added",
        "response.output_text.delta",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["text"] for e in lane_events if e["type"] == "response.output_item.done"] == ["ab", "rs", "c"]
    assert [e["sequence_number"] for e in lane_events if "sequence_number" in e] == [0, 1, 4, 5, 6, 7, 8, 9, 11, 12]


def test_the_lanes_own_text_delta_is_the_mappers_dict_and_its_reasoning_delta_is_vllms_whole_event():
    deltas = [
        DeltaMessage(content="a"),
        DeltaMessage(content="b"),
        DeltaMessage(reasoning="r"),
        DeltaMessage(reasoning="s"),
        None,
    ]
    texts = [f"t{n}" for n in range(len(deltas))]
    lane_events = both(texts, deltas)[1][0]
    assert lane_events[3] == {"type": "response.output_text.delta", "output_index": 0, "delta": "b"}
    assert lane_events[7] == {
        "content_index": 0,
        "delta": "s",
        "item_id": "item-2",
        "output_index": 1,
        "sequence_number": 7,
        "type": "response.reasoning_text.delta",
    }


def test_a_server_without_a_parser_streams_the_output_text():
    texts = ["Hello", ",", "", " world", "!"]
    (vllm_events, _, _), (lane_events, _, _) = both(texts, None)
    assert lane_events == vllm_events
    assert "".join(e.get("delta", "") for e in lane_events) == "Hello, world!"


def test_a_parser_that_raises_on_the_lane_is_raised_from_the_stream_and_everything_is_closed():
    deltas = [DeltaMessage(content="a"), DeltaMessage(content="b"), DeltaMessage(content="c"), None]
    serving = Serving(["x"] * 4, ScriptedParser(deltas, fail_at=2))
    with pytest.raises(ValueError, match="the parser failed"):
        stream(serving)
    assert serving.closed == {"engine": True, "processor": True}


def test_an_engine_error_is_raised_from_vllms_processor():
    serving = Serving(["a", "b", "c", "d"], None, engine_error=3)
    with pytest.raises(RuntimeError, match="the engine failed"):
        stream(serving)
    assert serving.closed == {"engine": True, "processor": True}


def test_closing_the_stream_closes_vllms_processor_and_the_engines_generator():
    serving = Serving([f"t{n}" for n in range(10)], None)
    assert len(stream(serving, limit=4)) == 4
    assert serving.closed == {"engine": True, "processor": True}


def test_a_request_for_output_logprobs_takes_vllms_processor_whole():
    assert request_fits(request()) and not request_fits(request(logprobs=True))
    parser = ScriptedParser([DeltaMessage(content="a"), DeltaMessage(content="b"), None])
    serving = Serving(["x", "y", "z"], parser)
    stream(serving, req=request(logprobs=True))
    assert serving.context.response_parser is parser  # not handed over: vLLM's processor asked it itself


def test_vllms_object_is_unchanged_and_each_request_gets_its_own_view():
    serving = Serving(["a"], None)
    make = responses_lane_serving(serving)
    first, second = make(None), make(None)
    assert first is not second and first.__dict__ is serving.__dict__
    assert type(serving)._process_simple_streaming_events is Serving._process_simple_streaming_events
    assert "_process_simple_streaming_events" not in serving.__dict__


TEXT = st.text(alphabet='ab<>{}" ', max_size=3)
DELTA = st.one_of(
    st.none(),
    st.builds(lambda t: DeltaMessage(content=t), TEXT),
    st.builds(lambda t: DeltaMessage(reasoning=t), TEXT),
    st.builds(lambda r, c: DeltaMessage(reasoning=r, content=c), TEXT, TEXT),
    st.builds(lambda t: DeltaMessage(content=t, tool_calls=[]), TEXT),
    st.builds(
        lambda i, name, args: DeltaMessage(
            tool_calls=[DeltaToolCall(index=i, function=DeltaFunctionCall(name=name, arguments=args))]
        ),
        st.integers(0, 2),
        st.one_of(st.none(), st.just("lookup")),
        st.one_of(st.none(), TEXT),
    ),
    st.builds(
        lambda c, a: DeltaMessage(
            content=c,
            tool_calls=[
                DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=a)),
                DeltaToolCall(index=1, function=DeltaFunctionCall(name="lookup")),
            ],
        ),
        TEXT,
        TEXT,
    ),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(DELTA, min_size=1, max_size=24), st.booleans())
def test_any_sequence_of_parser_deltas_gives_vllms_events(deltas, without_parser):
    texts = [f"t{n}" for n in range(len(deltas))]
    if without_parser:
        texts = [d.content if d is not None and d.content is not None else "" for d in deltas]
        deltas = None
    (vllm_events, vllm_calls, _), (lane_events, lane_calls, _) = both(texts, deltas)
    assert lane_events == vllm_events
    assert lane_calls == vllm_calls

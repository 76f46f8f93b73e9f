"""The engine lane on a server with a tool-call or reasoning parser (:mod:`vllm_nnrp_plugin.vllm_binding.engine_lane`):
the lane calls the parser object vLLM's generator created, once per output and in order, and gives the chunks
vLLM's generator would have given.

The serving object is a stand-in with the calling shape of vLLM 0.26–0.32's ``OpenAIServingChat``: its stream
generator creates its parser through ``self.parser_cls(tokenizer, tools, …)``, hands each output to
``parser.parse_delta(…, finished=…)``, skips an output whose delta is ``None``, sets ``tools_streamed`` from the
deltas it saw and names the finish reason from it, and counts ``len(output.token_ids)``. Its parser replays the
deltas real vLLM streamed (the anchors' recordings in compat/fixtures/vllm/), one per call, and for each output it
is asked about, its generator yields the string real vLLM yielded — so the lane's chunks (built from the deltas)
and vLLM's strings must give the same events. Real vLLM's parser and generator are exercised end to end
(tests/e2e/test_engine_lane_e2e.py, on the hermes tool server)."""

from __future__ import annotations

import asyncio
import types

import orjson
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_chunk_shapes import profile, sse_items
from tests.unit.test_engine_lane import RecordedServing, completion, request
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper, TextDelta
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import vllm_chunks
from vllm_nnrp_plugin.vllm_binding.engine_lane import EngineStream, lane_serving, request_fits, serving_fits
from vllm_nnrp_plugin.vllm_binding.families import binding_for

#: the lines whose stream generator drives one parser object (recordings of a required call, a named call and a
#: reasoning stream)
CASES = [
    ("0.26.0", "d-stream-tool-required"),
    ("0.26.0", "e-stream-tool-named"),
    ("0.26.0", "r-stream-reasoning"),
    ("0.27.1", "d-stream-tool-required"),
    ("0.27.1", "e-stream-tool-named"),
    ("0.32.0", "d-stream-tool-required"),
    ("0.32.0", "e-stream-tool-named"),
    ("0.32.0", "r-stream-reasoning"),
]

#: the binding of the lines whose calling shape the stand-ins have
LINE = binding_for((0, 26))


class DeltaFunctionCall(pydantic.BaseModel):  # vLLM's, vllm/entrypoints/openai/engine/protocol.py
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(pydantic.BaseModel):
    id: str | None = None
    type: str | None = None
    index: int
    function: DeltaFunctionCall | None = None


class DeltaMessage(pydantic.BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = pydantic.Field(default_factory=list)


def script_of(anchor, case, control_tokens=True, preamble=None):
    """(outputs, deltas): one ``RequestOutput`` stand-in per recorded chunk after the role chunk (one token
    id each; the first also carries the role chunk's string), with a "control token" output (a delta of ``None``,
    no string) after each tool-call delta when ``control_tokens``; and the delta
    the parser gives for each output, in order. The finish output's engine finish reason is vLLM's ``stop`` or
    ``length``: ``tool_calls`` is the generator's to name. ``preamble``: text the model streams first, as one more
    chunk of the recording's middle shape (a call announced after some text, as ``tool_choice`` auto gives)."""
    items = sse_items(anchor, case)
    body = [i for i in items if "[DONE]" not in i and '"choices":[]' not in i]
    if preamble is not None:
        chunk = orjson.loads(body[1][len("data: ") :])
        chunk["choices"][0]["delta"] = {"content": preamble}
        body.insert(1, "data: " + orjson.dumps(chunk).decode() + "\n\n")
    outputs, deltas, token = [], [], 100
    for position, item in enumerate(body[1:], start=1):
        choice = orjson.loads(item[len("data: ") :])["choices"][0]
        finish = choice.get("finish_reason")
        engine_finish = None if finish is None else ("stop" if finish == "tool_calls" else finish)
        strings = [body[0], item] if position == 1 else [item]
        outputs.append(
            types.SimpleNamespace(
                outputs=[completion("x", [token], engine_finish)], strings=strings, prompt_token_ids=[1, 2, 3]
            )
        )
        deltas.append(choice["delta"])
        token += 1
        if control_tokens and finish is None and choice["delta"].get("tool_calls"):
            outputs.append(
                types.SimpleNamespace(outputs=[completion("", [token], None)], strings=[], prompt_token_ids=[1, 2, 3])
            )
            deltas.append(None)
            token += 1
    return outputs, deltas


class ParserServing(RecordedServing):
    """vLLM 0.26–0.32's chat serving object's calling shape with a parser (see the module docstring); the engine and
    ``create_chat_completion`` are :class:`~tests.unit.test_engine_lane.RecordedServing`'s."""

    def __init__(self, outputs, deltas, raise_at=None):
        super().__init__(outputs, [])
        self.deltas = deltas
        self.parsed_ids = []  # the token ids the parser was given, in order
        serving = self

        class ReplayParser:
            def __init__(self, tokenizer, tools, *, chat_template_kwargs=None, model_config=None):
                self.calls = 0

            def parse_delta(self, delta_text, delta_token_ids, request, prompt_token_ids=None, *, finished):
                assert prompt_token_ids == [1, 2, 3]
                serving.parsed_ids.extend(delta_token_ids)
                self.calls += 1
                if self.calls == raise_at:
                    raise ValueError("the parser failed")
                delta = serving.deltas[self.calls - 1]
                return None if delta is None else DeltaMessage(**delta)

        self.parser_cls = ReplayParser

    async def chat_completion_stream_generator(
        self, request, result_generator, request_id, model_name, conversation, tokenizer, request_metadata
    ):
        completion_tokens, tools_streamed = 0, False
        try:
            parser = self.parser_cls(tokenizer, request.tools, chat_template_kwargs=None, model_config=None)
            async for res in result_generator:
                self.seen.append(res)
                output = res.outputs[0]
                completion_tokens += len(output.token_ids)
                delta = parser.parse_delta(
                    delta_text=output.text,
                    delta_token_ids=list(output.token_ids),
                    request=request,
                    prompt_token_ids=res.prompt_token_ids,
                    finished=output.finish_reason is not None,
                )
                if delta is not None and delta.tool_calls:
                    tools_streamed = True
                if delta is None and output.finish_reason is None:
                    continue
                strings = res.strings
                if strings is None:  # generated: vLLM's chunk for the delta (and its role chunk first)
                    strings = [
                        *([ROLE] if len(self.seen) == 1 else []),
                        self._dumped(res, delta, tools_streamed, request),
                    ]
                for string in strings:
                    if output.finish_reason is not None and not tools_streamed:
                        string = string.replace('"finish_reason":"tool_calls"', '"finish_reason":"stop"')
                    yield string
            usage = {"prompt_tokens": 3, "completion_tokens": completion_tokens, "total_tokens": 3 + completion_tokens}
            chunk = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": 1,
                "model": model_name,
                "choices": [],
                "usage": usage,
            }  # include_usage, as the plugin always asks
            yield "data: " + orjson.dumps(chunk).decode() + "\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield "data: " + orjson.dumps({"error": {"message": str(exc), "code": 500}}).decode() + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.closed["vllm"] = True

    @staticmethod
    def _dumped(res, delta, tools_streamed, request):
        """The string vLLM 0.26 yields for ``res`` (no recording): its chunk, the delta dumped with ``exclude_unset``
        after ``maybe_filter_parallel_tool_calls``."""
        finish = res.outputs[0].finish_reason
        delta = delta or DeltaMessage()
        if request.parallel_tool_calls is False and delta.tool_calls:
            delta.tool_calls = [call for call in delta.tool_calls if call.index == 0]
        choice = {
            "index": 0,
            "delta": delta.model_dump(mode="json", exclude_unset=True),
            "logprobs": None,
            "finish_reason": None if finish is None else ("tool_calls" if tools_streamed else finish),
            "token_ids": None,
        }
        if finish is not None:
            choice["stop_reason"] = None
        chunk = {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "example-model",
            "choices": [choice],
        }
        return "data: " + orjson.dumps(chunk).decode() + "\n\n"


#: vLLM's role chunk, before the first generated delta's
ROLE = (
    'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"example-model",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
)


def tool_request(**fields):
    return request(**{"tools": [{"type": "function"}], "parallel_tool_calls": None, **fields})


async def lane_items(serving, req=None):
    stream = await lane_serving(serving)().create_chat_completion(req or tool_request())
    assert isinstance(stream, EngineStream)
    items = [item async for item in stream.items()]
    assert serving.closed == {"engine": True, "vllm": True}  # by the lane, not by asyncio.run's shutdown
    return items


async def string_items(serving, req=None):
    return [item async for item in vllm_chunks(await serving.create_chat_completion(req or tool_request()))]


@pytest.mark.parametrize("anchor, case", CASES)
def test_the_lane_drives_vllms_parser_and_gives_the_events_of_vllms_strings(anchor, case):
    outputs, deltas = script_of(anchor, case)
    serving = ParserServing(outputs, deltas)
    lane = asyncio.run(lane_items(serving))
    reference = asyncio.run(string_items(ParserServing(outputs, deltas)))
    assert profile(lane) == profile(reference)
    events, body = profile(lane)
    assert body["usage"]["completion_tokens"] == len(outputs)  # vLLM counted the outputs the lane took
    # the parser was given every output's token ids once, in order: the lane's and vLLM's calls together
    assert serving.parsed_ids == [100 + n for n in range(len(outputs))]
    # vLLM's generator read the first output (the role chunk and the stream's first delta) and the finish output
    assert len(serving.seen) == 2 < len(outputs)
    if case.startswith("d-"):
        assert body["choices"][0]["finish_reason"] == "tool_calls"  # vLLM's generator saw the first call
        assert any(e["type"] == "response.tool_call.completed" for e in events)
    if case.startswith("r-"):
        assert any(isinstance(i, dict) and i["choices"][0]["delta"].get("reasoning") for i in lane[2:])


@pytest.mark.parametrize("anchor", ["0.26.0", "0.32.0"])
def test_the_first_tool_call_after_text_goes_to_vllms_generator(anchor):
    """vLLM's generator names the finish reason from the deltas it saw (``tools_streamed``): the first delta with a
    tool call is handed to it (parsed once, by the lane), later ones are the lane's."""
    outputs, deltas = script_of(anchor, "d-stream-tool-required", preamble="Let me look that up.")
    serving = ParserServing(outputs, deltas)
    lane = asyncio.run(lane_items(serving))
    assert profile(lane) == profile(asyncio.run(string_items(ParserServing(outputs, deltas))))
    assert serving.seen[:2] == outputs[:2] and len(serving.seen) == 3  # the text, the first call, the finish
    assert serving.parsed_ids == [100 + n for n in range(len(outputs))]
    events, body = profile(lane)
    assert body["choices"][0]["finish_reason"] == "tool_calls" and events[0]["delta"] == "Let me look that up."


@pytest.mark.parametrize("anchor, case", [("0.26.0", "d-stream-tool-required"), ("0.32.0", "r-stream-reasoning")])
def test_a_text_only_delta_is_a_text_delta_and_other_deltas_are_chunks(anchor, case):
    outputs, deltas = script_of(anchor, case, control_tokens=False)
    lane = asyncio.run(lane_items(ParserServing(outputs, deltas)))
    middle = lane[2:-2]
    assert middle and all(
        isinstance(i, TextDelta) == (set(d) == {"content"}) for i, d in zip(middle, deltas[1:], strict=False)
    )


def test_a_parser_that_raises_on_the_lane_is_vllms_error_chunk_and_a_backend_error():
    outputs, deltas = script_of("0.26.0", "d-stream-tool-required")
    serving = ParserServing(outputs, deltas, raise_at=6)
    items = asyncio.run(lane_items(serving))
    assert items[-1] == {"error": {"message": "the parser failed", "code": 500}}
    assert serving.seen[-1] is not outputs[-1]  # the failing output reached vLLM's generator, which reported it
    mapper = ChatStreamMapper()
    with pytest.raises(E.ProfileError) as raised:
        for item in items:
            mapper.feed(item)
    assert raised.value.code == E.BACKEND_ERROR


def test_parallel_calls_refused_keeps_only_the_first_calls_fragments():
    outputs, deltas = script_of("0.26.0", "d-stream-tool-required", control_tokens=False)
    second = {"tool_calls": [{"index": 1, "function": {"arguments": "x"}}]}
    deltas = [*deltas[:4], {"tool_calls": [*deltas[4]["tool_calls"], *second["tool_calls"]]}, *deltas[5:]]
    lane = asyncio.run(lane_items(ParserServing(outputs, deltas), tool_request(parallel_tool_calls=False)))
    both = asyncio.run(lane_items(ParserServing(outputs, deltas)))
    calls = [
        c for i in lane if isinstance(i, dict) for ch in i.get("choices", ()) for c in ch["delta"].get("tool_calls", ())
    ]
    assert calls and {c["index"] for c in calls} == {0}
    assert {
        c["index"]
        for i in both
        if isinstance(i, dict)
        for ch in i.get("choices", ())
        for c in ch["delta"].get("tool_calls", ())
    } == {0, 1}


def test_a_parser_server_takes_the_lane_and_requests_with_tools_fit():
    serving = ParserServing([], [])
    assert serving_fits(serving, LINE) is None
    assert request_fits(tool_request(), parser=True) and not request_fits(tool_request())
    assert not request_fits(tool_request(n=2), parser=True)


def test_each_request_gets_its_own_view_and_vllms_object_is_unchanged():
    serving = ParserServing([], [])
    views = lane_serving(serving)
    first, second = views(), views()
    assert first is not second and first.__dict__ is second.__dict__ is serving.__dict__
    assert first.parser_cls is serving.parser_cls  # before its stream generator was created: vLLM's own class
    assert type(serving).chat_completion_stream_generator is ParserServing.__dict__["chat_completion_stream_generator"]


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def parser_scripts(draw):
    """(outputs, deltas): a first output vLLM's generator formats (role chunk and a first delta), then middle outputs
    whose deltas are drawn from what vLLM's parsers give — ``None``, content, reasoning (alone or beside content), the
    name or an argument fragment of a call on index 0 or 1 (``content: null`` beside it, as 0.26 sets it) — and a
    finish output (``stop`` or ``length``) with a delta of its own."""
    kinds = st.sampled_from(["none", "content", "reasoning", "both", "name", "arguments"])
    deltas, names = [], 0
    for kind in [draw(st.sampled_from(["content", "reasoning", "name"])), *draw(st.lists(kinds, max_size=25))]:
        index = draw(st.integers(0, 1))
        if kind == "none":
            deltas.append(None)
        elif kind == "content":
            deltas.append({"content": draw(TEXT)})
        elif kind == "reasoning":
            deltas.append({"reasoning": draw(TEXT)})
        elif kind == "both":
            deltas.append({"reasoning": draw(TEXT), "content": draw(TEXT)})
        elif kind == "name":
            names += 1
            deltas.append(
                {
                    "content": None,
                    "tool_calls": [
                        {"id": f"call-{names}", "type": "function", "index": index, "function": {"name": "lookup"}}
                    ],
                }
            )
        else:
            deltas.append({"content": None, "tool_calls": [{"index": index, "function": {"arguments": draw(TEXT)}}]})
    deltas.append(
        draw(st.sampled_from([{}, {"content": "."}, {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]))
    )
    finish = draw(st.sampled_from(["stop", "length"]))
    outputs = []
    for position in range(len(deltas)):
        last = position == len(deltas) - 1
        outputs.append(
            types.SimpleNamespace(
                outputs=[completion("x", [100 + position], finish if last else None)],
                strings=None,
                prompt_token_ids=[1, 2, 3],
            )
        )
    return outputs, deltas


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser_scripts(), st.sampled_from([None, False]))
def test_any_sequence_of_parser_deltas_gives_the_events_of_vllms_strings(script, parallel):
    outputs, deltas = script
    serving = ParserServing(outputs, deltas)
    req = tool_request(parallel_tool_calls=parallel)
    lane = asyncio.run(lane_items(serving, req))
    assert profile(lane) == profile(asyncio.run(string_items(ParserServing(outputs, deltas), req)))
    assert serving.parsed_ids == [100 + n for n in range(len(outputs))]


def test_a_line_whose_generator_keeps_parser_state_keeps_vllms_generator():
    """0.22.x: ``parse_delta`` has no ``finished`` (vLLM's generator keeps text, token and reasoning state of its
    own beside the parser); 0.18.x: no ``parser_cls`` at all, ``tool_parser`` / ``reasoning_parser_cls``. (A generator
    that does not create its parser through ``parser_cls`` fails the start-up self-check:
    tests/unit/test_self_check.py.)"""
    older = ParserServing([], [])

    class NoFinished:
        def parse_delta(self, delta_text, delta_token_ids, request, prompt_token_ids=None):
            return None

    older.parser_cls = NoFinished
    assert "parse_delta has no finished argument" in serving_fits(older, LINE)
    eldest = ParserServing([], [])
    eldest.parser_cls, eldest.tool_parser = None, object
    assert "no parser_cls" in serving_fits(eldest, LINE)

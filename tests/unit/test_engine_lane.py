"""The engine lane (:mod:`vllm_nnrp_plugin.vllm_binding.engine_lane`): a plain chat stream's text outputs reach the
mapper straight from the engine, vLLM's own generator formats the rest, and the profile events and body are the
ones vLLM's strings give.

The serving object here is a stand-in with vLLM's calling shape (``create_chat_completion`` starts the engine and
returns ``chat_completion_stream_generator(request, result_generator, request_id, model_name, …)``); its generator
yields, for each ``RequestOutput`` it reads, the strings real vLLM yielded for it (the anchors' recordings in
compat/fixtures/vllm/), and counts completion tokens as vLLM does (``len(output.token_ids)`` per output it saw).
The real generator of every anchor is exercised end to end (tests/e2e/test_engine_lane_e2e.py)."""

from __future__ import annotations

import asyncio
import types

import orjson
import pytest

from tests.support import as_dict
from tests.unit.test_chunk_shapes import ANCHORS, profile, sse_items
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper, TextDelta
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import vllm_chunks
from vllm_nnrp_plugin.vllm_binding.engine_lane import EngineStream, lane_serving, request_fits, serving_fits
from vllm_nnrp_plugin.vllm_binding.families import binding_for

PLAIN_CASES = ("a-stream-text", "b-stream-text-usage")

#: the binding of the lines whose calling shape the stand-ins have
LINE = binding_for((0, 26))


def request(**fields):
    base = {
        "n": None,
        "tools": None,
        "logprobs": False,
        "return_token_ids": False,
        "use_beam_search": False,
        "stream_options": types.SimpleNamespace(include_usage=True, continuous_usage_stats=False),
    }
    return types.SimpleNamespace(**{**base, **fields})


def completion(text, token_ids, finish_reason=None):
    return types.SimpleNamespace(index=0, text=text, token_ids=token_ids, finish_reason=finish_reason, stop_reason=None)


def outputs_of(anchor, case):
    """The ``RequestOutput`` stand-ins of a recording: one per output vLLM turned into chunks (the first one gave
    the role chunk and the first text chunk), each carrying the strings vLLM yielded for it (``strings``) and one
    token id per chunk; and the strings vLLM yielded after the last output (usage chunk, ``[DONE]``)."""
    items = sse_items(anchor, case)
    body = [i for i in items if "[DONE]" not in i and '"choices":[]' not in i]
    tail = [i for i in items if i not in body]
    outputs, token = [], 100
    for position, item in enumerate(body[1:], start=1):
        choice = orjson.loads(item[len("data: ") :])["choices"][0]
        strings = [body[0], item] if position == 1 else [item]
        output = types.SimpleNamespace(
            outputs=[completion(choice["delta"].get("content", ""), [token], choice.get("finish_reason"))],
            strings=strings,
        )
        outputs.append(output)
        token += 1
    return outputs, tail


class RecordedServing:
    """vLLM's chat serving object's calling shape, answering with a recording (see the module docstring)."""

    parser_cls = None
    enable_log_outputs = False
    enable_force_include_usage = False

    def __init__(self, outputs, tail, fail_after=None, wait_inside=False):
        self.outputs, self.tail, self.fail_after, self.wait_inside = outputs, tail, fail_after, wait_inside
        self.seen = []  # the outputs vLLM's generator read
        self.closed = {"engine": False, "vllm": False}

    async def create_chat_completion(self, request, raw_request=None):
        return self.chat_completion_stream_generator(
            request, self._engine(), "chatcmpl-x", "example-model", [], None, None
        )

    async def _engine(self):
        try:
            for n, output in enumerate(self.outputs):
                if n == self.fail_after:
                    raise RuntimeError("engine died")
                await asyncio.sleep(0)
                yield output
        finally:
            self.closed["engine"] = True

    async def chat_completion_stream_generator(
        self, request, result_generator, request_id, model_name, conversation, tokenizer, request_metadata
    ):
        completion_tokens = 0
        try:
            async for output in result_generator:
                if self.wait_inside:
                    await asyncio.sleep(0)  # a real wait inside vLLM's generator
                self.seen.append(output)
                completion_tokens += len(output.outputs[0].token_ids)
                for string in output.strings:
                    yield string
            for string in self.tail:
                if '"usage"' in string:
                    usage = orjson.loads(string[len("data: ") :])
                    usage["usage"]["completion_tokens"] = completion_tokens
                    string = "data: " + orjson.dumps(usage).decode() + "\n\n"
                    yield string
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield "data: " + orjson.dumps({"error": {"message": str(exc), "code": 500}}).decode() + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.closed["vllm"] = True


async def lane_items(serving, req=None):
    stream = await lane_serving(serving)().create_chat_completion(req or request())
    assert isinstance(stream, EngineStream)
    items = [item async for item in stream.items()]
    assert serving.closed == {"engine": True, "vllm": True}  # by the lane, not by asyncio.run's shutdown
    return items


async def string_items(outputs, tail):
    serving = RecordedServing(outputs, tail)
    strings = await serving.create_chat_completion(request())
    return [item async for item in vllm_chunks(strings)]


@pytest.mark.parametrize("anchor", ANCHORS)
@pytest.mark.parametrize("case", PLAIN_CASES)
def test_the_lane_gives_the_events_and_body_of_vllms_strings(anchor, case):
    outputs, tail = outputs_of(anchor, case)
    serving = RecordedServing(outputs, tail)
    lane, strings = asyncio.run(lane_items(serving)), asyncio.run(string_items(outputs, tail))
    assert profile(lane) == profile(strings)
    taken = [i for i in lane if isinstance(i, TextDelta)]
    # vLLM formatted the role chunk, the first text chunk (which showed the text-only shape) and the finish chunk
    assert len(serving.seen) == 2 and len(taken) == len(outputs) - 2 > 0
    assert [as_dict(i) for i in lane] == [as_dict(i) for i in strings]
    assert serving.closed == {"engine": True, "vllm": True}


@pytest.mark.parametrize("anchor", ANCHORS)
def test_vllm_counts_the_tokens_of_the_outputs_the_lane_took(anchor):
    outputs, tail = outputs_of(anchor, "b-stream-text-usage")
    serving = RecordedServing(outputs, tail)
    (usage,) = [i["usage"] for i in asyncio.run(lane_items(serving)) if isinstance(i, dict) and i.get("usage")]
    assert usage["completion_tokens"] == len(outputs)
    finish = serving.seen[-1].outputs[0]
    assert finish.token_ids == [100 + n for n in range(1, len(outputs))]  # the taken ones, then its own
    assert outputs[-1].outputs[0].token_ids == [100 + len(outputs) - 1]  # the engine's object is not changed


def test_a_real_wait_inside_vllms_generator_goes_to_the_event_loop():
    outputs, tail = outputs_of("0.26.0", "b-stream-text-usage")
    lane = asyncio.run(lane_items(RecordedServing(outputs, tail, wait_inside=True)))
    assert profile(lane) == profile(asyncio.run(string_items(outputs, tail)))


def test_an_engine_failure_mid_stream_is_vllms_error_chunk_and_a_backend_error():
    outputs, tail = outputs_of("0.26.0", "a-stream-text")
    serving = RecordedServing(outputs, tail, fail_after=4)
    items = asyncio.run(lane_items(serving))
    assert items[-1] == {"error": {"message": "engine died", "code": 500}}
    mapper = ChatStreamMapper()
    with pytest.raises(E.ProfileError) as raised:
        for item in items:
            mapper.feed(item)
    assert raised.value.code == E.BACKEND_ERROR
    assert serving.closed == {"engine": True, "vllm": True}


def test_closing_mid_stream_closes_vllms_generator_and_the_engines():
    outputs, tail = outputs_of("0.26.0", "a-stream-text")
    serving = RecordedServing(outputs, tail)

    async def main():
        stream = await lane_serving(serving)().create_chat_completion(request())
        items = stream.items()
        got = [await items.__anext__() for _ in range(4)]
        await items.aclose()
        assert isinstance(got[-1], TextDelta)  # closed while vLLM's generator waited for an output
        assert serving.closed == {"engine": True, "vllm": True}  # by the close, not by asyncio.run's shutdown

    asyncio.run(main())


def test_a_cancel_while_waiting_for_the_engine_closes_both():
    outputs, tail = outputs_of("0.26.0", "a-stream-text")
    serving = RecordedServing(outputs, tail)
    stalled, engine_closed = asyncio.Event(), []

    async def engine():
        try:
            yield outputs[0]
            yield outputs[1]
            stalled.set()
            await asyncio.Event().wait()
        finally:
            engine_closed.append(True)

    async def main():
        stream = lane_serving(serving)().chat_completion_stream_generator(
            request(), engine(), "chatcmpl-x", "m", [], None, None
        )
        consumer = asyncio.ensure_future(_drain(stream.items()))
        await stalled.wait()
        await asyncio.sleep(0)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        assert serving.closed["vllm"] is True and engine_closed == [True]  # before asyncio.run's shutdown

    asyncio.run(main())


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 2},
        {"tools": [{"type": "function"}]},
        {"logprobs": True},
        {"return_token_ids": True},
        {"use_beam_search": True},
        {"stream_options": types.SimpleNamespace(include_usage=True, continuous_usage_stats=True)},
    ],
)
def test_a_request_that_does_not_fit_gets_vllms_own_generator(fields):
    assert not request_fits(request(**fields))
    outputs, tail = outputs_of("0.26.0", "a-stream-text")
    serving = RecordedServing(outputs, tail)
    result = asyncio.run(lane_serving(serving)().create_chat_completion(request(**fields)))
    assert not isinstance(result, EngineStream)
    assert asyncio.run(_drain(result)) == [s for o in outputs for s in o.strings] + ["data: [DONE]\n\n"]


async def _drain(strings):
    return [s async for s in strings]


def test_fitting_requests():
    assert request_fits(request())
    assert request_fits(request(n=1, stream_options=None))


@pytest.mark.parametrize(
    "attributes, reason",
    [
        ({"parser_cls": object}, "parser"),
        ({"tool_parser": object}, "parser"),
        ({"reasoning_parser_cls": object}, "parser"),
        ({"use_harmony": True}, "harmony"),
        ({"enable_log_outputs": True}, "--enable-log-outputs"),
        ({"enable_force_include_usage": True}, "--enable-force-include-usage"),
    ],
)
def test_a_server_configured_beyond_plain_text_keeps_vllms_generator(attributes, reason):
    serving = RecordedServing([], [])
    serving.__dict__.update(attributes)
    assert reason in serving_fits(serving, LINE)
    assert serving_fits(RecordedServing([], []), LINE) is None


def test_a_stream_generator_of_another_shape_is_refused():
    class Other(RecordedServing):
        async def chat_completion_stream_generator(self, result_generator, request):  # type: ignore[override]
            yield ""

    assert "parameters begin" in serving_fits(Other([], []), LINE)


def test_the_view_shares_the_serving_objects_state_and_leaves_it_unchanged():
    serving = RecordedServing([], [])
    view = lane_serving(serving)()
    serving.default_sampling_params = {"max_tokens": 7}  # set on vLLM's object after the view was made
    assert view.default_sampling_params == {"max_tokens": 7}
    assert isinstance(view, RecordedServing) and type(serving) is RecordedServing
    own = RecordedServing.__dict__["chat_completion_stream_generator"]
    assert type(serving).chat_completion_stream_generator is own

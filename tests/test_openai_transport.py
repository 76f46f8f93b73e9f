"""The openai SDK over NNRPTransport / AsyncNNRPTransport against the real NNRP path (the plugin's own wire core
on loopback, the project's asyncio client) around the adapter, with a backend replaying streams recorded from real vLLM
0.26.0: chat (:class:`tests.support.RecordedBackend`), and ``responses.create``, ``models.list``, ``embeddings.create``
(:class:`EveryOperationBackend`, vLLM's recorded ``/v1/responses`` events and bodies, ``/v1/models`` list and
``/v1/embeddings`` bodies)."""

from __future__ import annotations

import asyncio
import base64
import random
import struct
import threading

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider

from tests.support import FIXTURES, RecordedBackend, ServedNNRP, error_response, free_port, recorded_json, wait_until
from tests.test_cli_loopback import ScriptedBackend
from tests.unit.test_openai_sse import accumulate, items
from tests.unit.test_responses_stream import recorded_events
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport
from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, MODELS_LIST
from vllm_nnrp_plugin.vllm_binding.serving import error_from_response

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), fault_injection_backend_error_model="backend-error")
    yield server
    server.stop()


class EveryOperationBackend(ScriptedBackend):
    """Every profile operation (:class:`ScriptedBackend`'s capability document): chat from
    :class:`RecordedBackend`; ``models.list`` the recorded ``models-a-list``; ``embeddings.create`` and
    ``responses.create`` the recording named by ``body["model"]`` (a ``.sse`` one replayed as vLLM's event
    objects, ``body["pace_s"]`` seconds apart; a ``.json`` one the body or the error it holds); Responses model
    ``midstream-error``: a recorded start, then vLLM's mid-stream error."""

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        if operation == CHAT_COMPLETIONS_CREATE:
            return await RecordedBackend.create(self, operation, body, request_id, traceparent)
        self.started.append(request_id)
        if operation == MODELS_LIST:
            return Call(body=recorded_json("models-a-list"))
        case = body["model"]
        if case == "midstream-error":  # six recorded events, then vLLM's mid-stream error object
            died = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
            return Call(stream=self._recorded_events([*recorded_events("responses-a-stream-text")[:6], died], 0.0))
        if (FIXTURES / f"{case}.sse").exists():
            return Call(stream=self._recorded_events(recorded_events(case), float(body.get("pace_s", 0.0))))
        if "error" in recorded_json(case):
            raise error_from_response(error_response(case))
        return Call(body=recorded_json(case))

    async def _recorded_events(self, events, pace_s):
        self.open_streams += 1
        try:
            for event in events:
                await asyncio.sleep(pace_s)
                yield event
        finally:
            self.open_streams -= 1


@pytest.fixture(scope="module")
def every_operation():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), backend=EveryOperationBackend())
    yield server
    server.stop()


@pytest.fixture
def sdk_all(every_operation):
    with httpx.Client(transport=NNRPTransport(every_operation.bound[0])) as http:
        yield openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture
def transport(served):
    transport = NNRPTransport(served.bound[0])
    yield transport
    transport.close()


@pytest.fixture
def sdk(transport):
    with httpx.Client(transport=transport) as http:
        yield openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)


def async_sdk(uri: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=AsyncNNRPTransport(uri))
    return openai.AsyncOpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)


def recorded_stream(case: str) -> dict:
    return accumulate(items((FIXTURES / f"{case}.sse").read_bytes()))


def test_non_streaming_answer_is_vllms_body(sdk):
    answer = sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
    assert answer.model_dump(exclude_unset=True) == openai.types.chat.ChatCompletion.model_validate(
        recorded_json("c-nonstream-text")
    ).model_dump(exclude_unset=True)


def test_stream_assembles_to_what_vllm_streamed(sdk):
    chunks = list(
        sdk.chat.completions.create(
            model="b-stream-text-usage", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    recorded = recorded_stream("b-stream-text-usage")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == recorded["choices"][0]["content"]
    assert chunks[-1].usage.model_dump() == {
        **recorded["usage"],
        "completion_tokens_details": None,
        "prompt_tokens_details": None,
    }


def test_streamed_tool_calls_assemble_with_the_sdks_own_helper(sdk):
    with sdk.chat.completions.stream(model="d-stream-tool-required", messages=MESSAGES) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    expected = recorded_stream("d-stream-tool-required")["choices"][0]["tool_calls"][0]
    assert (call.id, call.function.name, call.function.arguments) == (
        expected["id"],
        expected["name"],
        expected["arguments"],
    )
    assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "model, stream, error, status, code",
    [
        ("g2-unknown-model-nonstream", False, openai.NotFoundError, 404, "model_not_found"),
        ("h2-max-tokens-too-large-nonstream", True, openai.BadRequestError, 400, "invalid_request"),
        ("backend-error", False, openai.InternalServerError, 500, "backend_error"),
    ],
)
def test_response_error_is_the_sdks_typed_exception(sdk, model, stream, error, status, code):
    with pytest.raises(error) as caught:
        sdk.chat.completions.create(model=model, messages=MESSAGES, stream=stream)
    assert caught.value.status_code == status and caught.value.code == code
    if model.startswith(("g2", "h2")):
        assert caught.value.body["message"] == recorded_json(model)["error"]["message"]


def test_an_answer_silent_for_the_sdks_timeout_is_an_api_timeout_error_and_aborted(served, sdk):
    # not streamed: nothing comes before the whole answer, 2 s here (tests/test_timeouts.py: the rule in full)
    with pytest.raises(openai.APITimeoutError):
        sdk.chat.completions.create(
            model="a-stream-text", messages=MESSAGES, timeout=0.3, extra_body={"pace_s": 0.2, "repeat": 5}
        )
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)


def test_closing_a_stream_after_the_first_chunk_cancels_the_operation(served, sdk):
    stream = sdk.chat.completions.create(
        model="a-stream-text", messages=MESSAGES, stream=True, extra_body={"pace_s": 0.2, "repeat": 20}
    )
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    request_id = served.backend.started[-1]
    stream.close()
    assert wait_until(lambda: request_id in served.backend.aborted)
    # the session keeps serving
    assert sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES).choices[0].message.content


def test_models_come_from_the_capability_document_and_other_routes_are_fastapis(sdk):
    assert [(m.id, m.owned_by) for m in sdk.models.list()] == [("example-model", "recorded")]
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.completions.create(model="example-model", prompt="x")
    assert caught.value.status_code == 404 and caught.value.body == {"detail": "Not Found"}


def test_a_dead_server_is_an_api_connection_error():
    with httpx.Client(transport=NNRPTransport(f"tcp://127.0.0.1:{free_port()}")) as http:
        sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)


def test_concurrent_threads_share_one_transport(sdk):
    expected = recorded_stream("a-stream-text")["choices"][0]["content"]
    texts: list[str] = []

    def one():
        stream = sdk.chat.completions.create(
            model="a-stream-text", messages=MESSAGES, stream=True, extra_body={"pace_s": 0.001}
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert texts == [expected] * 16


def test_async_tasks_share_one_transport_and_cancelling_a_task_cancels_its_operation(served):
    expected = recorded_stream("a-stream-text")["choices"][0]["content"]

    async def main():
        sdk = async_sdk(served.bound[0])

        async def one():
            stream = await sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        texts = await asyncio.gather(*(one() for _ in range(16)))

        streaming = asyncio.Event()

        async def slow():
            stream = await sdk.chat.completions.create(
                model="a-stream-text", messages=MESSAGES, stream=True, extra_body={"pace_s": 0.2, "repeat": 20}
            )
            async for _ in stream:
                streaming.set()

        task = asyncio.create_task(slow())
        await streaming.wait()  # its first chunk came: the stream runs on the server
        request_id = served.backend.started[-1]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sdk.close()
        return texts, request_id

    texts, request_id = asyncio.run(main())
    assert texts == [expected] * 16
    assert wait_until(lambda: request_id in served.backend.aborted)


#: streams raced against a cancel; against a transport that loses cancels just as an event is ready (Python
#: 3.11's ``asyncio.wait_for``) about 7 % of them were swallowed, so this many leave next to no chance to miss it
RACES = 150


def test_cancelling_a_task_iterating_a_busy_stream_always_raises_cancelled_error_and_cancels_the_operation(served):
    """Each of :data:`RACES` tasks iterates a stream whose events come in bursts of 20 every 2 ms (at least
    0.17 s in all) and is cancelled 0–4 ms and 0–9 loop iterations after its first chunk, often while events
    are arriving; the first task that does not raise ``CancelledError`` fails the test. Every operation is
    then aborted on the server."""
    rng = random.Random(24)

    async def main():
        sdk = async_sdk(served.bound[0])
        try:
            for n in range(RACES):
                stream = await sdk.chat.completions.create(
                    model="a-stream-text",
                    messages=MESSAGES,
                    stream=True,
                    timeout=30,
                    extra_body={"pace_s": 0.002, "burst": 20, "repeat": 100},
                    extra_headers={"X-Request-Id": f"race-{n}"},
                )
                first = asyncio.get_running_loop().create_future()

                async def iterate(stream=stream, first=first):
                    async for _ in stream:
                        if not first.done():
                            first.set_result(None)
                    return "it read the stream to its end"

                task = asyncio.create_task(iterate())
                await first
                await asyncio.sleep(rng.uniform(0, 0.004))
                for _ in range(rng.randrange(10)):
                    await asyncio.sleep(0)
                assert not task.done()
                task.cancel()
                try:
                    ended = await task
                except asyncio.CancelledError:
                    continue
                pytest.fail(f"race {n}: the cancel was swallowed: {ended}")
        finally:
            await sdk.close()

    asyncio.run(main())
    races = [f"nnrp-race-{n}-" for n in range(RACES)]
    assert wait_until(lambda: all(any(a.startswith(r) for a in served.backend.aborted) for r in races))


def test_the_callers_span_is_the_operations_trace_context(served, sdk):
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller") as span:
        sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
        context = span.get_span_context()
    low = context.trace_id & ((1 << 64) - 1)
    assert served.backend.traceparents[served.backend.started[-1]] == f"00-{low:032x}-{context.span_id:016x}-01"
    sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
    assert served.backend.traceparents[served.backend.started[-1]] is None  # no span, no context


def test_concurrent_callers_each_get_their_own_span_as_trace_context(served, sdk):
    tracer = TracerProvider().get_tracer("test")
    seen: dict[str, str] = {}

    def one(n):
        with tracer.start_as_current_span(f"caller-{n}") as span:
            answer = sdk.chat.completions.create(
                model="c-nonstream-text", messages=MESSAGES, extra_headers={"X-Request-Id": f"traced-{n}"}
            )
            context = span.get_span_context()
        assert answer.choices[0].message.content
        seen[f"traced-{n}"] = f"00-{context.trace_id & ((1 << 64) - 1):032x}-{context.span_id:016x}-01"

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got = {rid: tp for rid, tp in served.backend.traceparents.items() for key in seen if key in rid}
    assert len(got) == 8
    for request_id, traceparent in got.items():
        assert traceparent == next(seen[key] for key in seen if key in request_id)


def test_a_sync_client_works_inside_a_running_event_loop(served):
    async def main():  # agent frameworks call sync SDK clients from async code
        with httpx.Client(transport=NNRPTransport(served.bound[0])) as http:
            sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)
            return sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES).choices[0].message.content

    assert asyncio.run(main()) == recorded_json("c-nonstream-text")["choices"][0]["message"]["content"]


def test_a_stream_the_server_ends_with_an_error_raises_the_sdks_api_error(sdk):
    stream = sdk.chat.completions.create(model="midstream-error", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            pass
    assert caught.value.code == "backend_error"


def recorded_response(case: str) -> dict:
    return recorded_events(case)[-1]["response"]


def test_non_streaming_responses_create_is_vllms_response(sdk_all):
    answer = sdk_all.responses.create(model="responses-c-nonstream-text", input="Tell me about Paris.")
    assert answer.to_dict() == recorded_json("responses-c-nonstream-text")
    assert answer.output_text


def test_streamed_responses_create_events_and_the_sdks_accumulator_give_vllms_text(sdk_all):
    streamed = list(sdk_all.responses.create(model="responses-a-stream-text", input="x", stream=True))
    kinds, recorded_kinds = [e.type for e in streamed], [e["type"] for e in recorded_events("responses-a-stream-text")]
    # the same sequence; the adapter may merge adjacent deltas (output cadence), so there may be fewer of them
    assert kinds[:5] == recorded_kinds[:5] and kinds[-4:] == recorded_kinds[-4:]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    expected = recorded_response("responses-a-stream-text")
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert text == expected["output"][0]["content"][0]["text"]
    with sdk_all.responses.stream(model="responses-a-stream-text", input="x") as stream:
        final = stream.get_final_response()
    assert final.output_text == text and final.usage.total_tokens == expected["usage"]["total_tokens"]
    assert final.status == expected["status"] == "incomplete"


def test_streamed_responses_tool_call_assembles_with_the_sdks_helper(sdk_all):
    with sdk_all.responses.stream(model="responses-d-stream-tool-required", input="x") as stream:
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in seen
    (call,) = [item for item in final.output if item.type == "function_call"]
    expected = recorded_response("responses-d-stream-tool-required")["output"][0]
    assert (call.name, call.arguments, call.call_id) == (expected["name"], expected["arguments"], expected["call_id"])


def test_async_streamed_responses_create(every_operation):
    async def main():
        sdk = async_sdk(every_operation.bound[0])
        try:
            stream = await sdk.responses.create(model="responses-a-stream-text", input="x", stream=True)
            return "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        finally:
            await sdk.close()

    assert asyncio.run(main()) == recorded_response("responses-a-stream-text")["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_refusal_is_the_sdks_not_found_error(sdk_all, stream):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk_all.responses.create(model="responses-g-unknown-model-nonstream", input="x", stream=stream)
    assert caught.value.code == "model_not_found"
    assert caught.value.body["message"] == recorded_json("responses-g-unknown-model-nonstream")["error"]["message"]


def test_a_responses_stream_the_server_ends_with_an_error_raises_the_sdks_api_error(sdk_all):
    stream = sdk_all.responses.create(model="midstream-error", input="x", stream=True)
    seen = []
    with pytest.raises(openai.APIError) as caught:
        for event in stream:
            seen.append(event.type)
    assert caught.value.code == "backend_error" and "response.output_text.delta" in seen


def test_closing_a_responses_stream_cancels_the_operation(every_operation, sdk_all):
    stream = sdk_all.responses.create(
        model="responses-a-stream-text", input="x", stream=True, extra_body={"pace_s": 0.2}
    )
    assert next(iter(stream)).type == "response.created"
    request_id = every_operation.backend.started[-1]
    stream.close()
    assert wait_until(lambda: request_id in every_operation.backend.aborted)
    assert wait_until(lambda: every_operation.backend.open_streams == 0)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_embeddings_are_vllms_vectors(sdk_all, encoding_format):
    # the SDK asks for base64 when no format is given and decodes it itself
    case = "embeddings-a-float" if encoding_format == "float" else "embeddings-b-base64"
    extra = {"encoding_format": encoding_format} if encoding_format else {}
    answer = sdk_all.embeddings.create(model=case, input=["The quick brown fox", "jumps over the lazy dog"], **extra)
    expected = recorded_json("embeddings-a-float")
    assert [d.index for d in answer.data] == [0, 1] and answer.usage.to_dict() == expected["usage"]
    for got, want in zip(answer.data, expected["data"], strict=True):
        vector = got.embedding
        if encoding_format == "base64":  # asked for by the caller: the SDK leaves it encoded
            raw = base64.b64decode(vector)
            vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert vector == pytest.approx(want["embedding"], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize(
    "case, error, status, code",
    [
        ("embeddings-c-unknown-model", openai.NotFoundError, 404, "model_not_found"),
        ("embeddings-f-empty-input", openai.BadRequestError, 400, "invalid_request"),
    ],
)
def test_embeddings_refusals_are_the_sdks_typed_exceptions(sdk_all, case, error, status, code):
    with pytest.raises(error) as caught:
        sdk_all.embeddings.create(model=case, input="x", encoding_format="float")
    assert caught.value.status_code == status and caught.value.code == code
    assert caught.value.body["message"] == recorded_json(case)["error"]["message"]


def test_an_operation_the_server_does_not_serve_is_a_not_found_error(sdk):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.embeddings.create(model="example-model", input="x")
    assert caught.value.code == "unsupported_operation"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="example-model", input="x")


def test_models_list_is_vllms_own_list_where_served(sdk_all):
    page = sdk_all.models.list()
    assert [m.to_dict() for m in page] == recorded_json("models-a-list")["data"]
    assert page.data[0].max_model_len == 2048  # vLLM's own field, kept


def test_other_methods_on_served_paths_are_fastapis_405(sdk_all):
    for path in ("/responses", "/embeddings", "/chat/completions"):
        with pytest.raises(openai.APIStatusError) as caught:
            sdk_all.get(path, cast_to=object)
        assert caught.value.status_code == 405

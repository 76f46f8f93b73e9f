"""The openai SDK over NNRPTransport / AsyncNNRPTransport against the real NNRP path (nnrp-py native server and
client on loopback) around the adapter, with a backend replaying streams recorded from real vLLM 0.26.0."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider

from tests.support import FIXTURES, ServedNNRP, free_port, recorded_json, wait_until
from tests.unit.test_openai_sse import accumulate, items
from vllm_nnrp_plugin.openai_transport import AsyncNNRPTransport, NNRPTransport

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), fault_injection_backend_error_model="backend-error")
    yield server
    server.stop()


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
        recorded_json("c-nonstream-text")).model_dump(exclude_unset=True)


def test_stream_assembles_to_what_vllm_streamed(sdk):
    chunks = list(sdk.chat.completions.create(model="b-stream-text-usage", messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}))
    recorded = recorded_stream("b-stream-text-usage")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == recorded["choices"][0]["content"]
    assert chunks[-1].usage.model_dump() == {**recorded["usage"], "completion_tokens_details": None, "prompt_tokens_details": None}


def test_streamed_tool_calls_assemble_with_the_sdks_own_helper(sdk):
    with sdk.chat.completions.stream(model="d-stream-tool-required", messages=MESSAGES) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    expected = recorded_stream("d-stream-tool-required")["choices"][0]["tool_calls"][0]
    assert (call.id, call.function.name, call.function.arguments) == (expected["id"], expected["name"], expected["arguments"])
    assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("model, stream, error, status, code", [
    ("g2-unknown-model-nonstream", False, openai.NotFoundError, 404, "model_not_found"),
    ("h2-max-tokens-too-large-nonstream", True, openai.BadRequestError, 400, "invalid_request"),
    ("backend-error", False, openai.InternalServerError, 500, "backend_error"),
])
def test_response_error_is_the_sdks_typed_exception(sdk, model, stream, error, status, code):
    with pytest.raises(error) as caught:
        sdk.chat.completions.create(model=model, messages=MESSAGES, stream=stream)
    assert caught.value.status_code == status and caught.value.code == code
    if model.startswith(("g2", "h2")):
        assert caught.value.body["message"] == recorded_json(model)["error"]["message"]


def test_too_many_requests_is_a_rate_limit_error():
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_in_flight_per_session=1)
    try:
        with httpx.Client(transport=NNRPTransport(served.bound[0])) as http:
            sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)
            with sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True,
                                             extra_body={"pace_s": 0.2, "repeat": 20}):
                with pytest.raises(openai.RateLimitError) as caught:
                    sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
            assert caught.value.status_code == 429 and caught.value.code == "too_many_requests"
    finally:
        served.stop()


def test_the_sdks_timeout_is_nnrp_timeout_ms_and_its_expiry_an_api_timeout_error(served, sdk):
    with pytest.raises(openai.APITimeoutError):
        sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, timeout=0.3,
                                    extra_body={"pace_s": 0.2, "repeat": 5})
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)


def test_closing_a_stream_after_the_first_chunk_cancels_the_operation(served, sdk):
    stream = sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True,
                                         extra_body={"pace_s": 0.2, "repeat": 20})
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
    assert caught.value.body == {"detail": "Not Found"} or caught.value.status_code == 404


def test_a_dead_server_is_an_api_connection_error():
    with httpx.Client(transport=NNRPTransport(f"tcp://127.0.0.1:{free_port()}")) as http:
        sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)


def test_concurrent_threads_share_one_transport(sdk):
    expected = recorded_stream("a-stream-text")["choices"][0]["content"]
    texts: list[str] = []

    def one():
        stream = sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True, extra_body={"pace_s": 0.001})
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

        async def slow():
            stream = await sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True,
                                                       extra_body={"pace_s": 0.2, "repeat": 20})
            async for _ in stream:
                pass

        task = asyncio.create_task(slow())
        await asyncio.sleep(0.5)
        request_id = served.backend.started[-1]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sdk.close()
        return texts, request_id

    texts, request_id = asyncio.run(main())
    assert texts == [expected] * 16
    assert wait_until(lambda: request_id in served.backend.aborted)


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
            answer = sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES,
                                                 extra_headers={"X-Request-Id": f"traced-{n}"})
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

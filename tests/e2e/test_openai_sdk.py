"""The official ``openai`` SDK against a real ``vllm serve``: the same temperature-0 requests once over HTTP and
once over NNRP (``NNRPTransport`` / ``AsyncNNRPTransport``) give the same answers, usage, tool calls, streamed
logprobs and reasoning (a second server runs ``--reasoning-parser olmo3``) and exceptions —
``chat.completions``, ``responses`` (streamed through the SDK's own ``responses.stream()`` accumulator too),
``models.list`` and, on a pooling server, ``embeddings``; closing a stream aborts the vLLM request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import TOOL_TEMPLATE, SERVED_NAME, VLLMServer, attach_options, model_dir
from tests.e2e.test_vllm_serve import wait_idle
from tests.support import free_port
from vllm_nnrp_plugin.openai_transport import AsyncNNRPTransport, NNRPTransport

pytestmark = pytest.mark.vllm

FAULT_MODEL = "backend-error"
HELLO = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0, "max_tokens": 24}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up current information about a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
}}  # fmt: skip
TOOLS = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Tell me about Paris."}], "temperature": 0,
         "max_tokens": 64, "tools": [LOOKUP], "tool_choice": "required"}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_version):
    """Tool calling (hermes) and the test-only backend-error model, NNRP on TCP next to HTTP."""
    workdir = tmp_path_factory.mktemp("vllm-openai")
    tcp = f"tcp://127.0.0.1:{free_port()}"
    env, args = attach_options(vllm_version[1])
    config = {"nnrp": {"enabled": True, "listen": [tcp], "fault_injection_backend_error_model": FAULT_MODEL}}
    server = VLLMServer(model_dir(), workdir, env=env, extra_args=(
        *args, "--additional-config", json.dumps(config),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TOOL_TEMPLATE),
    ))  # fmt: skip
    server.nnrp = tcp
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def transport(server):
    transport = NNRPTransport(server.nnrp)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def sdks(server, transport):
    """{"http": the SDK over vLLM's HTTP API, "nnrp": the SDK over NNRP}."""
    over_http = httpx.Client(timeout=120)
    yield sdk_pair(server.http, over_http, httpx.Client(transport=transport, timeout=120))
    over_http.close()


def sdk_pair(http: str, over_http: httpx.Client, over_nnrp: httpx.Client) -> dict:
    """{"http": the SDK on ``over_http`` to vLLM's base URL ``http``, "nnrp": the SDK on ``over_nnrp``}."""
    return {
        "http": openai.OpenAI(base_url=f"{http}/v1", api_key="unused", http_client=over_http, max_retries=0),
        "nnrp": openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=over_nnrp, max_retries=0),
    }


def both(sdks, call):
    return call(sdks["http"]), call(sdks["nnrp"])


def comparable(message) -> dict:
    """The message's set fields; tool call ids blanked (vLLM makes new ones per request) and an empty
    ``tool_calls`` dropped (0.18/0.22 send ``[]`` over HTTP, the profile's body omits it as 0.26 does)."""
    data = message.model_dump(exclude_none=True)
    if not data.get("tool_calls"):
        data.pop("tool_calls", None)
    for call in data.get("tool_calls") or ():
        call["id"] = None
    return data


def test_non_streaming_message_and_usage_are_the_same(sdks):
    http, nnrp = both(sdks, lambda sdk: sdk.chat.completions.create(**HELLO))
    assert comparable(nnrp.choices[0].message) == comparable(http.choices[0].message)
    assert http.choices[0].message.content and nnrp.choices[0].finish_reason == http.choices[0].finish_reason
    assert nnrp.usage.model_dump(exclude_none=True) == http.usage.model_dump(exclude_none=True)


def test_streamed_text_and_usage_are_the_same(sdks):
    def stream(sdk):
        chunks = list(sdk.chat.completions.create(**HELLO, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, finish, chunks[-1].usage.model_dump(exclude_none=True)

    http, nnrp = both(sdks, stream)
    assert nnrp == http and http[0]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_the_same(sdks, stream):
    def call(sdk):
        if not stream:
            return sdk.chat.completions.create(**TOOLS).choices[0]
        with sdk.chat.completions.stream(**TOOLS) as events:
            return events.get_final_completion().choices[0]

    http, nnrp = both(sdks, call)
    assert http.message.tool_calls and json.loads(http.message.tool_calls[0].function.arguments)
    assert comparable(nnrp.message) == comparable(http.message)
    assert nnrp.finish_reason == http.finish_reason
    assert [c.id.startswith("chatcmpl-tool-") for c in nnrp.message.tool_calls] == [True] * len(nnrp.message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("change, error, status", [
    ({"model": "nope"}, openai.NotFoundError, 404),
    ({"max_tokens": 100_000}, openai.BadRequestError, 400),
])
def test_refusals_raise_the_same_exception(sdks, change, error, status, stream):
    def refused(sdk):
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.chat.completions.create(**{**HELLO, **change}, stream=stream)
        return caught.value

    http, nnrp = both(sdks, refused)
    assert type(nnrp) is type(http) is error and nnrp.status_code == http.status_code == status
    assert nnrp.body["message"] == http.body["message"]
    assert nnrp.code in ("model_not_found", "invalid_request")


def test_backend_error_is_an_internal_server_error(sdks):
    with pytest.raises(openai.InternalServerError) as caught:
        sdks["nnrp"].chat.completions.create(**{**HELLO, "model": FAULT_MODEL})
    assert caught.value.status_code == 500 and caught.value.code == "backend_error"


def test_models_are_vllms_model_list(sdks):
    def models(sdk):  # all of vLLM's fields but those made anew per call (clock, permission ids)
        return [{k: v for k, v in m.to_dict().items() if k not in ("created", "permission")} for m in sdk.models.list()]

    http, nnrp = both(sdks, models)
    assert nnrp == http and [(m["id"], m["object"], m["owned_by"]) for m in http] == [(SERVED_NAME, "model", "vllm")]
    assert http[0]["max_model_len"]


def test_unknown_routes_get_the_same_status(sdks):
    def missing(sdk):
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.get("/no/such/route", cast_to=object)
        return type(caught.value), caught.value.status_code, caught.value.body

    http, nnrp = both(sdks, missing)
    assert nnrp == http and http[1] == 404


LONG = {**HELLO, "messages": [{"role": "user", "content": "Write a long story about the sea."}], "max_tokens": 1000}


def test_closing_a_stream_after_the_first_chunk_aborts_the_vllm_request(server, sdks):
    stream = sdks["nnrp"].chat.completions.create(**LONG, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    assert server.metric("vllm:num_requests_running") + server.metric("vllm:num_requests_waiting") == 1
    started = time.monotonic()
    stream.close()
    assert wait_idle(server, 10.0), "vLLM still runs the request of the closed stream"
    assert time.monotonic() - started < 10.0  # 1000 tokens take far longer on CPU


def test_sixteen_concurrent_async_streams_on_one_transport_match_http(server, sdks):
    reference = sdks["http"].chat.completions.create(**HELLO).choices[0].message.content

    async def main():
        http = httpx.AsyncClient(transport=AsyncNNRPTransport(server.nnrp), timeout=300)
        sdk = openai.AsyncOpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)

        async def one():
            stream = await sdk.chat.completions.create(**HELLO, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            texts = await asyncio.gather(*(one() for _ in range(16)))
            # create() returns once the first event arrived: vLLM runs the request
            stream = await sdk.chat.completions.create(**LONG, stream=True, extra_body={"ignore_eos": True})
            reader = asyncio.create_task(consume(stream))
            await asyncio.sleep(0.5)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await stream.close()
            return texts
        finally:
            await sdk.close()

    async def consume(stream):
        async for _ in stream:
            pass

    texts = asyncio.run(main())
    assert texts == [reference] * 16
    assert wait_idle(server, 10.0), "vLLM still runs the request of the cancelled task"


# -- responses ----------------------------------------------------------------------------------------------

RTEXT = {"model": SERVED_NAME, "input": "Tell me about Paris.", "temperature": 0, "max_output_tokens": 24}
RLOOKUP = {"type": "function", "name": "lookup", "description": "Look up current information about a city.",
           "parameters": LOOKUP["function"]["parameters"], "strict": True}  # fmt: skip
RTOOL = {**RTEXT, "max_output_tokens": 64, "tools": [RLOOKUP], "tool_choice": "required"}


def summary(response) -> tuple:
    """What a caller reads from a Response: status, text, function calls, usage (ids are made per request)."""
    calls = [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]
    usage = (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens)
    return response.status, response.output_text, calls, usage


@pytest.mark.parametrize("body", [RTEXT, RTOOL], ids=["text", "tool"])
def test_responses_are_the_same(sdks, body):
    http, nnrp = both(sdks, lambda sdk: summary(sdk.responses.create(**body)))
    assert nnrp == http and (http[1] or http[2])


@pytest.mark.parametrize("body", [RTEXT, RTOOL], ids=["text", "tool"])
def test_streamed_responses_assemble_the_same_with_the_sdks_helper(sdks, body):
    def streamed(sdk):
        with sdk.responses.stream(**body) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        return summary(final), kinds[:3], kinds[-1]

    http, nnrp = both(sdks, streamed)
    assert nnrp == http
    if body is RTOOL:
        assert http[0][2] == [("lookup", {"city": "Paris"})]


def test_streamed_responses_deltas_are_the_same(sdks):
    def deltas(sdk):
        events = list(sdk.responses.create(**RTEXT, stream=True))
        return "".join(e.delta for e in events if e.type == "response.output_text.delta"), events[-1].response.usage.total_tokens

    http, nnrp = both(sdks, deltas)
    assert nnrp == http and http[0]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_refusals_raise_the_same_exception(sdks, stream):
    def refused(sdk):
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.responses.create(**{**RTEXT, "model": "nope"}, stream=stream)
        return caught.value

    http, nnrp = both(sdks, refused)
    assert type(nnrp) is type(http) is openai.NotFoundError and nnrp.body["message"] == http.body["message"]


def test_closing_a_responses_stream_aborts_the_vllm_request(server, sdks):
    stream = sdks["nnrp"].responses.create(model=SERVED_NAME, input="Write a long story about the sea.",
                                           max_output_tokens=1000, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert next(iter(stream)).type == "response.created"
    assert server.metric("vllm:num_requests_running") + server.metric("vllm:num_requests_waiting") == 1
    stream.close()
    assert wait_idle(server, 10.0), "vLLM still runs the request of the closed Responses stream"


def test_streamed_logprobs_are_vllms_token_logprobs_and_top_logprobs(sdks):
    """``logprobs`` asked: every token's logprob and its top 2 reach the SDK over NNRP as over HTTP (the
    ``vllm.openai_chunk`` extension)."""
    def stream(sdk):
        chunks = list(sdk.chat.completions.create(**HELLO, stream=True, logprobs=True, top_logprobs=2))
        tokens = [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
                  for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content or ()]  # fmt: skip
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), tokens

    http, nnrp = both(sdks, stream)
    assert nnrp == http and len(http[1]) > 1 and all(len(top) == 2 for _, _, top in http[1])


def test_embeddings_on_a_generate_server_are_not_found(sdks):
    def refused(sdk):
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.embeddings.create(model=SERVED_NAME, input="x")
        return caught.value

    http, nnrp = both(sdks, refused)
    assert type(nnrp) is type(http) is openai.NotFoundError and nnrp.code == "unsupported_operation"


# -- embeddings (pooling server) ----------------------------------------------------------------------------

INPUTS = ["The quick brown fox", "jumps over the lazy dog"]


@pytest.fixture(scope="module")
def pooling_sdks(vllm_pooling_server):
    over_http = httpx.Client(timeout=120)
    over_nnrp = httpx.Client(transport=NNRPTransport(vllm_pooling_server.nnrp["tcp"]), timeout=120)
    yield sdk_pair(vllm_pooling_server.http, over_http, over_nnrp)
    over_http.close()
    over_nnrp.close()


@pytest.mark.parametrize("encoding_format", [None, "float"])  # None: the SDK asks for base64 and decodes it
def test_embeddings_are_the_same_vectors(pooling_sdks, encoding_format):
    extra = {"encoding_format": encoding_format} if encoding_format else {}
    http, nnrp = both(pooling_sdks, lambda sdk: sdk.embeddings.create(model=SERVED_NAME, input=INPUTS, **extra))
    assert [d.index for d in nnrp.data] == [d.index for d in http.data] == [0, 1]
    for ours, theirs in zip(nnrp.data, http.data):
        assert len(ours.embedding) == len(theirs.embedding) > 1
        assert ours.embedding == pytest.approx(theirs.embedding, rel=1e-4, abs=1e-5)
    assert nnrp.usage == http.usage and nnrp.model == http.model


def test_embeddings_refusals_and_models_match_http(pooling_sdks):
    def refused(sdk):
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.embeddings.create(model="nope", input=INPUTS)
        return caught.value

    http, nnrp = both(pooling_sdks, refused)
    assert type(nnrp) is type(http) is openai.NotFoundError and nnrp.body["message"] == http.body["message"]
    http, nnrp = both(pooling_sdks, lambda sdk: [(m.id, m.max_model_len) for m in sdk.models.list()])
    assert nnrp == http == [(SERVED_NAME, http[0][1])]


# -- reasoning (a server with a reasoning parser) -----------------------------------------------------------

#: vLLM's ``olmo3`` parser works on the text (``<think>`` … ``</think>``, no special tokens) and starts inside the
#: reasoning block, so the small model's answer, which never writes ``</think>``, streams as ``delta.reasoning``
REASONING_ARGS = ("--reasoning-parser", "olmo3")


@pytest.fixture(scope="module")
def reasoning_sdks(tmp_path_factory, vllm_version):
    """{"http", "nnrp"}: the SDK over HTTP and over NNRP to a server that runs a reasoning parser."""
    workdir = tmp_path_factory.mktemp("vllm-reasoning")
    tcp = f"tcp://127.0.0.1:{free_port()}"
    env, args = attach_options(vllm_version[1])
    config = {"nnrp": {"enabled": True, "listen": [tcp]}}
    server = VLLMServer(model_dir(), workdir, env=env,
                        extra_args=(*args, "--additional-config", json.dumps(config), *REASONING_ARGS))  # fmt: skip
    transport = NNRPTransport(tcp)
    over_http, over_nnrp = httpx.Client(timeout=120), httpx.Client(transport=transport, timeout=120)
    try:
        server.wait_ready()
        yield sdk_pair(server.http, over_http, over_nnrp)
    finally:
        over_http.close()
        transport.close()
        server.stop()


def test_streamed_reasoning_is_vllms_delta_reasoning(reasoning_sdks):
    def stream(sdk):
        chunks = list(sdk.chat.completions.create(**HELLO, stream=True))
        deltas = [ch.delta for c in chunks for ch in c.choices]
        return [getattr(d, "reasoning", None) for d in deltas if getattr(d, "reasoning", None)], \
            "".join(d.content or "" for d in deltas)

    http, nnrp = both(reasoning_sdks, stream)
    assert nnrp == http and len(http[0]) > 1


def test_streamed_responses_reasoning_items_are_vllms(reasoning_sdks):
    def stream(sdk):
        events = list(sdk.responses.create(**RTEXT, stream=True))
        reasoning = [(e.type, getattr(e, "delta", None), getattr(e, "text", None)) for e in events
                     if "reasoning" in e.type or getattr(getattr(e, "item", None), "type", "") == "reasoning"]
        return reasoning, [i.type for i in events[-1].response.output]

    http, nnrp = both(reasoning_sdks, stream)
    assert nnrp == http and any(kind == "response.reasoning_text.delta" for kind, _, _ in http[0])

"""The official ``openai`` SDK against a real ``vllm serve``: the same temperature-0 requests once over HTTP and
once over NNRP (``NNRPTransport`` / ``AsyncNNRPTransport``) give the same answers, usage, tool calls, streamed
logprobs and reasoning (a second server runs ``--reasoning-parser olmo3``) and exceptions —
``chat.completions``, ``responses`` (streamed through the SDK's own ``responses.stream()`` accumulator too),
``models.list`` and, on a pooling server, ``embeddings``; closing a stream aborts the vLLM request. Fan-out:
16/64/128 concurrent calls on one client complete as over HTTP (``httpx`` and ``httpx2`` clients), a closed or
abandoned client leaves no session and prints nothing; an openai-agents run (tool loop, streamed and not) is the
same over NNRP, and cancelling it aborts the vLLM request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import httpx2
import openai
import pytest

from tests.e2e.conftest import SERVED_NAME, TOOL_TEMPLATE, VLLMServer, attach_options, model_dir, running
from tests.e2e.test_vllm_serve import wait_idle
from tests.support import free_port, wait_until
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport

pytestmark = pytest.mark.vllm

FAULT_MODEL = "backend-error"
#: the SDK's own HTTP library: httpx2 from openai 3 (0.18.1's vLLM pins openai < 2.25, whose SDK takes httpx)
SDK_HTTPX = httpx2 if int(openai.__version__.split(".")[0]) >= 3 else httpx
HELLO = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Say hello."}],
    "temperature": 0,
    "max_tokens": 24,
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up current information about a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Tell me about Paris."}],
    "temperature": 0,
    "max_tokens": 64,
    "tools": [LOOKUP],
    "tool_choice": "required",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_version):
    """Tool calling (hermes) and the test-only backend-error model, NNRP on TCP next to HTTP."""
    workdir = tmp_path_factory.mktemp("vllm-openai")
    tcp = f"tcp://127.0.0.1:{free_port()}"
    env, args = attach_options(vllm_version[1])
    config = {"nnrp": {"enabled": True, "listen": [tcp], "fault_injection_backend_error_model": FAULT_MODEL}}
    server = VLLMServer(
        model_dir(),
        workdir,
        env=env,
        extra_args=(
            *args,
            "--additional-config",
            json.dumps(config),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--chat-template",
            str(TOOL_TEMPLATE),
        ),
    )
    server.nnrp = tcp
    yield from running(server)


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


@pytest.fixture(scope="module")
def core_sdks(vllm_server):
    """The same pair on the session's plain generate server, which every anchor's binding core starts."""
    transport = NNRPTransport(vllm_server.nnrp["tcp"])
    over_http = httpx.Client(timeout=120)
    yield sdk_pair(vllm_server.http, over_http, httpx.Client(transport=transport, timeout=120))
    over_http.close()
    transport.close()


def sdk_pair(http: str, over_http: httpx.Client, over_nnrp: httpx.Client) -> dict:
    """{"http": the SDK on ``over_http`` to vLLM's base URL ``http``, "nnrp": the SDK on ``over_nnrp``}."""
    return {
        "http": openai.OpenAI(base_url=f"{http}/v1", api_key="unused", http_client=over_http, max_retries=0),
        "nnrp": openai.OpenAI(
            base_url="http://nnrp.invalid/v1", api_key="unused", http_client=over_nnrp, max_retries=0
        ),
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
@pytest.mark.parametrize(
    "change, error, status",
    [
        ({"model": "nope"}, openai.NotFoundError, 404),
        ({"max_tokens": 100_000}, openai.BadRequestError, 400),
    ],
)
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


#: the short answer of the fan-out cases (tokens are what costs on CPU)
SHORT = {**HELLO, "max_tokens": 8}


#: concurrent calls per fan-out case
FAN_OUT_SIZES = (16, 64, 128)


async def fan_out(sdk: openai.AsyncOpenAI, n: int) -> list[str]:
    """``n`` SHORT calls at once on ``sdk``, half streamed, half not; their texts."""

    async def streamed():
        stream = await sdk.chat.completions.create(**SHORT, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def whole():
        return (await sdk.chat.completions.create(**SHORT)).choices[0].message.content

    return await asyncio.gather(*(streamed() for _ in range(n // 2)), *(whole() for _ in range(n - n // 2)))


@pytest.mark.binding_core
def test_concurrent_async_calls_on_one_client_complete_as_over_http(vllm_server):
    """One ``AsyncOpenAI`` client on the SDK's own HTTP library (httpx2; httpx for openai < 3) per side, SDK
    retries off: every fan-out case completes over NNRP as over HTTP, with answers HTTP also gave; the NNRP client
    used more than one session for more calls than a session's in-flight limit (the shared server's 16) and leaves
    none open once closed (the server's ``nnrp_sessions_active``). On the session's plain generate server, which
    every anchor's binding core starts.

    The answers of one fan-out are not one text: on the CPU the greedy answer of a request depends on the batch
    it ran in (seen: "Hello! I'm here to help with" beside "Hello there, welcome to my world!" among 16 HTTP
    calls), so the two sides' lists differ in how often each text comes; each side must give texts of the other."""
    server = vllm_server
    baseline = server.metric("nnrp_sessions_active")  # sessions other tests' clients still hold

    async def main():
        over_http = openai.AsyncOpenAI(
            base_url=f"{server.http}/v1",
            api_key="unused",
            max_retries=0,
            http_client=SDK_HTTPX.AsyncClient(timeout=300),
        )
        over_nnrp = openai.AsyncOpenAI(
            base_url="http://nnrp.invalid/v1",
            api_key="unused",
            max_retries=0,
            http_client=SDK_HTTPX.AsyncClient(transport=AsyncNNRPTransport(server.nnrp["tcp"]), timeout=300),
        )
        results = {}
        try:
            for n in FAN_OUT_SIZES:
                results[n] = (await fan_out(over_http, n), await fan_out(over_nnrp, n))
            peak_sessions = server.metric("nnrp_sessions_active") - baseline
        finally:
            await over_nnrp.close()
            await over_http.close()
        return results, peak_sessions

    results, peak_sessions = asyncio.run(main())
    for n, (http, nnrp) in results.items():
        assert len(nnrp) == n and all(nnrp), n
        assert set(nnrp) & set(http), (n, sorted(set(nnrp)), sorted(set(http)))
    assert peak_sessions >= 2  # more calls than a session's limit: more than one session
    assert wait_until(lambda: server.metric("nnrp_sessions_active") == baseline)
    assert wait_idle(server, 10.0)


def test_concurrent_threads_on_one_sync_client_complete_as_over_http(sdks):
    """16 threads (streamed and not) on the module's sync ``httpx`` clients: all complete, with answers the other
    side also gave (concurrent calls' greedy answers depend on their batch on the CPU: see the fan-out test)."""

    def run(sdk) -> list[str]:
        def one(stream: bool) -> str:
            if not stream:
                return sdk.chat.completions.create(**SHORT).choices[0].message.content
            return "".join(
                c.choices[0].delta.content or "" for c in sdk.chat.completions.create(**SHORT, stream=True) if c.choices
            )

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            return list(pool.map(one, [n % 2 == 0 for n in range(16)]))

    http, nnrp = both(sdks, run)
    assert len(nnrp) == 16 and all(nnrp) and all(http)
    assert set(nnrp) & set(http), (sorted(set(nnrp)), sorted(set(http)))


EXIT_SCRIPT = """
import asyncio, httpx, openai
{lib_import}
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport
body = dict(model={model!r}, messages=[{{"role": "user", "content": "Say hello."}}], max_tokens=4, temperature=0)
sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="x",
                    http_client={lib}.Client(transport=NNRPTransport({uri!r})))
assert sdk.chat.completions.create(**body).choices[0].message.content
async def main():
    sdk = openai.AsyncOpenAI(base_url="http://nnrp.invalid/v1", api_key="x",
                             http_client=httpx.AsyncClient(transport=AsyncNNRPTransport({uri!r})))
    async for _ in await sdk.chat.completions.create(**body, stream=True):
        pass
asyncio.run(main())
"""


@pytest.mark.binding_core
def test_a_program_that_never_closes_its_clients_prints_nothing_at_exit(vllm_server):
    """Sync (the SDK's library) and async (httpx) clients, never closed, in a process of their own: its stderr is empty
    (every ResourceWarning shown) and its sessions are gone from the server once it exited."""
    server = vllm_server
    baseline = server.metric("nnrp_sessions_active")
    run = subprocess.run(
        [
            sys.executable,
            "-W",
            "always::ResourceWarning",
            "-c",
            EXIT_SCRIPT.format(
                model=SERVED_NAME,
                uri=server.nnrp["tcp"],
                lib=SDK_HTTPX.__name__,
                lib_import=f"import {SDK_HTTPX.__name__}",
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode, run.stderr) == (0, "")
    assert wait_until(lambda: server.metric("nnrp_sessions_active") == baseline)


# -- an agent framework on the SDK (openai-agents, extra "agents"; compat/vllm-*/test-extras) ------------------


def guide_agent(sdk: openai.AsyncOpenAI, calls: list[str]):
    """An openai-agents ``Agent`` on ``sdk`` with one tool; its run ends at the first tool call, whose result
    is the final output (the tool-calling loop: model → tool call → tool run → output)."""
    agents = pytest.importorskip("agents", reason="openai-agents is installed where compat/vllm-*/test-extras says")
    agents.set_tracing_disabled(True)  # its default exporter posts to api.openai.com

    @agents.function_tool
    def lookup(city: str) -> str:
        """Look up current information about a city."""
        calls.append(city)
        return f"{city}: sunny, 21 C"

    settings = agents.ModelSettings(temperature=0, max_tokens=64, tool_choice="required")
    model = agents.OpenAIChatCompletionsModel(model=SERVED_NAME, openai_client=sdk)
    return agents.Agent(
        name="guide",
        instructions="Use the lookup tool.",
        model=model,
        tools=[lookup],
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )


def agent_sdks(server) -> dict[str, openai.AsyncOpenAI]:
    return {
        "http": openai.AsyncOpenAI(
            base_url=f"{server.http}/v1",
            api_key="unused",
            max_retries=0,
            http_client=SDK_HTTPX.AsyncClient(timeout=120),
        ),
        "nnrp": openai.AsyncOpenAI(
            base_url="http://nnrp.invalid/v1",
            api_key="unused",
            max_retries=0,
            http_client=SDK_HTTPX.AsyncClient(transport=AsyncNNRPTransport(server.nnrp), timeout=120),
        ),
    }


@pytest.mark.parametrize("stream", [False, True])
def test_an_agents_tool_calling_run_is_the_same_over_nnrp(server, stream):
    async def run(sdk) -> tuple[list[str], object]:
        import agents

        calls: list[str] = []
        agent = guide_agent(sdk, calls)
        if stream:
            result = agents.Runner.run_streamed(agent, "Tell me about Paris.")
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "Tell me about Paris.")
        return calls, result.final_output

    async def main():
        sdks = agent_sdks(server)
        try:
            return await run(sdks["http"]), await run(sdks["nnrp"])
        finally:
            for sdk in sdks.values():
                await sdk.close()

    http, nnrp = asyncio.run(main())
    assert http[0] and nnrp == http


@pytest.mark.parametrize("stream", [False, True])
def test_cancelling_a_running_agent_aborts_the_vllm_request(server, stream):
    """A long agent turn (1000 tokens, ``ignore_eos``) cancelled while vLLM runs it: vLLM's running requests go
    back to 0 in far less time than the turn would take."""

    async def main() -> None:
        import agents

        sdk = agent_sdks(server)["nnrp"]
        agent = guide_agent(sdk, []).clone(
            tools=[],
            tool_use_behavior="run_llm_again",
            model_settings=agents.ModelSettings(temperature=0, max_tokens=1000, extra_body={"ignore_eos": True}),
        )
        try:
            if stream:
                result = agents.Runner.run_streamed(agent, "Write a long story about the sea.")
                task = asyncio.create_task(_drain(result.stream_events()))
            else:
                task = asyncio.create_task(agents.Runner.run(agent, "Write a long story about the sea."))
            for _ in range(200):  # vLLM runs it
                if await asyncio.to_thread(server.metric, "vllm:num_requests_running") == 1:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("vLLM never ran the agent's request")
            if stream:  # the streamed run goes on in the framework's own task: its documented stop
                result.cancel()
                await task
            else:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        finally:
            await sdk.close()

    asyncio.run(main())
    started = time.monotonic()
    assert wait_idle(server, 10.0), "vLLM still runs the cancelled agent's request"
    assert time.monotonic() - started < 10.0


async def _drain(events) -> None:
    async for _ in events:
        pass


# -- responses ----------------------------------------------------------------------------------------------

RTEXT = {"model": SERVED_NAME, "input": "Tell me about Paris.", "temperature": 0, "max_output_tokens": 24}
RLOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look up current information about a city.",
    "parameters": LOOKUP["function"]["parameters"],
    "strict": True,
}
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
        return "".join(e.delta for e in events if e.type == "response.output_text.delta"), events[
            -1
        ].response.usage.total_tokens

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
    stream = sdks["nnrp"].responses.create(
        model=SERVED_NAME,
        input="Write a long story about the sea.",
        max_output_tokens=1000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert next(iter(stream)).type == "response.created"
    assert server.metric("vllm:num_requests_running") + server.metric("vllm:num_requests_waiting") == 1
    stream.close()
    assert wait_idle(server, 10.0), "vLLM still runs the request of the closed Responses stream"


@pytest.mark.binding_core
def test_streamed_logprobs_are_vllms_token_logprobs_and_top_logprobs(core_sdks):
    """``logprobs`` asked: every token's logprob and its top 2 reach the SDK over NNRP as over HTTP (the
    ``vllm.openai_chunk`` extension)."""
    sdks = core_sdks

    def stream(sdk):
        chunks = list(sdk.chat.completions.create(**HELLO, stream=True, logprobs=True, top_logprobs=2))
        tokens = [
            (t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
            for c in chunks
            for ch in c.choices
            if ch.logprobs
            for t in ch.logprobs.content or ()
        ]
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
    for ours, theirs in zip(nnrp.data, http.data, strict=True):
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


@pytest.fixture(scope="module")
def reasoning_sdks(vllm_reasoning_server):
    """{"http", "nnrp"}: the SDK over HTTP and over NNRP to a server that runs a reasoning parser."""
    transport = NNRPTransport(vllm_reasoning_server.nnrp["tcp"])
    over_http, over_nnrp = httpx.Client(timeout=120), httpx.Client(transport=transport, timeout=120)
    try:
        yield sdk_pair(vllm_reasoning_server.http, over_http, over_nnrp)
    finally:
        over_http.close()
        transport.close()


def test_streamed_reasoning_is_vllms_delta_reasoning(reasoning_sdks):
    def stream(sdk):
        chunks = list(sdk.chat.completions.create(**HELLO, stream=True))
        deltas = [ch.delta for c in chunks for ch in c.choices]
        return [getattr(d, "reasoning", None) for d in deltas if getattr(d, "reasoning", None)], "".join(
            d.content or "" for d in deltas
        )

    http, nnrp = both(reasoning_sdks, stream)
    assert nnrp == http and len(http[0]) > 1


def test_streamed_responses_reasoning_items_are_vllms(reasoning_sdks):
    def stream(sdk):
        events = list(sdk.responses.create(**RTEXT, stream=True))
        reasoning = [
            (e.type, getattr(e, "delta", None), getattr(e, "text", None))
            for e in events
            if "reasoning" in e.type or getattr(getattr(e, "item", None), "type", "") == "reasoning"
        ]
        return reasoning, [i.type for i in events[-1].response.output]

    http, nnrp = both(reasoning_sdks, stream)
    assert nnrp == http and any(kind == "response.reasoning_text.delta" for kind, _, _ in http[0])

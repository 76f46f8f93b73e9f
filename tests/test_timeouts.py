"""Timeouts over NNRP mean what they mean over HTTP (loopback, streams recorded from vLLM): the openai SDK's
``timeout`` (httpx's read timeout) bounds the silence between two events, not the whole operation — a stream
that keeps producing for longer than the timeout completes, one that stalls for longer raises
``APITimeoutError`` and its vLLM request is aborted; a bound on the whole operation only when asked
(``X-NNRP-Timeout-Ms``, the transport's ``operation_timeout_s``). The asyncio client (``read_timeout_s``) and
``vllm-nnrp`` (``--timeout``, ``--max-time``) follow the same rule."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.support import RecordedBackend, ServedNNRP, envelope, free_port, recorded_budget, sse_items, wait_until
from vllm_nnrp_plugin.client import connect
from vllm_nnrp_plugin.client.errors import ClientTimeout
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport
from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import vllm_chunks

MESSAGES = [{"role": "user", "content": "hi"}]
TIMEOUT_S = 0.4
#: a stream of about 1.6 s whose chunks come every 0.1 s: four times the timeout, never silent for it
FLOWING = {"pace_s": 0.1, "repeat": 2}
#: two chunks, then silence for three times the timeout
STALLING = {"stall_after": 2, "stall_s": 3 * TIMEOUT_S}


class StallingBackend(RecordedBackend):
    """:class:`RecordedBackend`, and a chat stream that stops after ``body["stall_after"]`` items for
    ``body["stall_s"]`` seconds (then goes on); models ``flowing`` and ``stalling`` are ``a-stream-text`` with
    :data:`FLOWING` and :data:`STALLING` (for callers that cannot add body fields: ``vllm-nnrp``)."""

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        named = {"flowing": FLOWING, "stalling": STALLING}.get(body.get("model"))
        if named is not None:
            body = {**body, "model": "a-stream-text", **named}
        if "stall_after" not in body:
            return await super().create(operation, body, request_id, traceparent, controls)
        self.started.append(request_id)
        items = sse_items("a-stream-text")
        after, stall_s = int(body["stall_after"]), float(body["stall_s"])

        async def generator():
            self.open_streams += 1
            try:
                for index, item in enumerate(items):
                    if index == after:
                        await asyncio.sleep(stall_s)
                    yield item
            finally:
                self.open_streams -= 1

        return Call(stream=vllm_chunks(generator(), recorded_budget("a-stream-text")))


@pytest.fixture(scope="module")
def served():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), StallingBackend())
    yield server
    server.stop()


@pytest.fixture
def sdk(served):
    with httpx.Client(transport=NNRPTransport(served.bound[0])) as http:
        yield openai.OpenAI(
            base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0, timeout=TIMEOUT_S
        )


def test_a_stream_longer_than_the_timeout_completes_while_it_flows(sdk):
    started = time.monotonic()
    chunks = list(
        sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True, extra_body=FLOWING)
    )
    assert time.monotonic() - started > 2 * TIMEOUT_S
    assert chunks[-1].choices[0].finish_reason == "length"  # the recorded stream's end
    # not streamed: the answer is one event, and the silence before it is what the timeout bounds (as over HTTP)
    answer = sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, extra_body={"pace_s": 0.02})
    assert answer.choices[0].message.content


def test_a_stream_silent_for_longer_than_the_timeout_raises_and_is_aborted(served, sdk):
    stream = sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True, extra_body=STALLING)
    request_id = served.backend.started[-1]
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        for _ in stream:
            pass
    assert TIMEOUT_S * 0.9 < time.monotonic() - started < 2 * TIMEOUT_S + 0.5
    assert wait_until(lambda: request_id in served.backend.aborted)  # FRAME_CANCEL: vLLM aborts the request


def test_an_answer_that_does_not_come_within_the_timeout_raises_and_is_aborted(served, sdk):
    with pytest.raises(openai.APITimeoutError):
        sdk.chat.completions.create(
            model="a-stream-text", messages=MESSAGES, extra_body={"stall_after": 0, "stall_s": 3 * TIMEOUT_S}
        )
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)


def test_a_bound_on_the_whole_operation_only_when_asked(served, sdk):
    with pytest.raises(openai.APITimeoutError):  # the header: nnrp.timeout_ms, the server's request_timeout
        list(
            sdk.chat.completions.create(
                model="a-stream-text",
                messages=MESSAGES,
                stream=True,
                extra_body=FLOWING,
                extra_headers={"X-NNRP-Timeout-Ms": "500"},
            )
        )
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(
            model="a-stream-text", messages=MESSAGES, extra_headers={"X-NNRP-Timeout-Ms": "soon"}
        )
    with httpx.Client(transport=NNRPTransport(served.bound[0], operation_timeout_s=0.5)) as http:
        bounded = openai.OpenAI(
            base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0, timeout=30
        )
        with pytest.raises(openai.APITimeoutError):
            list(
                bounded.chat.completions.create(
                    model="a-stream-text", messages=MESSAGES, stream=True, extra_body=FLOWING
                )
            )
    with pytest.raises(ValueError):
        NNRPTransport(served.bound[0], operation_timeout_s=0)


def test_the_async_transport_follows_the_same_rule(served):
    async def main() -> None:
        async with httpx.AsyncClient(transport=AsyncNNRPTransport(served.bound[0])) as http:
            sdk = openai.AsyncOpenAI(
                base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0, timeout=TIMEOUT_S
            )
            stream = await sdk.chat.completions.create(
                model="a-stream-text", messages=MESSAGES, stream=True, extra_body=FLOWING
            )
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].choices[0].finish_reason == "length"
            stream = await sdk.chat.completions.create(
                model="a-stream-text", messages=MESSAGES, stream=True, extra_body=STALLING
            )
            with pytest.raises(openai.APITimeoutError):
                async for _ in stream:
                    pass

    asyncio.run(main())
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)


def test_the_asyncio_clients_read_timeout_bounds_the_silence(served):
    flowing = envelope({"model": "a-stream-text", "messages": [], "stream": True, **FLOWING})
    stalling = envelope({"model": "a-stream-text", "messages": [], "stream": True, **STALLING})

    async def main() -> None:
        conn = await connect(served.bound[0])
        try:
            session = await conn.open_session()
            events = [event async for event in session.submit(flowing, read_timeout_s=TIMEOUT_S)]
            assert events[-1]["type"] == "response.completed"
            op = session.submit(stalling, read_timeout_s=TIMEOUT_S)
            with pytest.raises(ClientTimeout):
                async for _ in op:
                    pass
            with pytest.raises(ClientTimeout):  # result() waits the same way
                await session.submit(stalling, read_timeout_s=TIMEOUT_S).result()
            with pytest.raises(ValueError):
                session.submit(flowing, read_timeout_s=0)
        finally:
            await conn.close()

    asyncio.run(main())
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)


def _cli(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_nnrp_plugin.client.cli", args[0], "--endpoint", endpoint, *args[1:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_the_cli_timeout_is_the_silence_and_max_time_the_whole_operation(served):
    endpoint, timeout = served.bound[0], str(TIMEOUT_S)
    started = time.monotonic()
    flowing = _cli(endpoint, "chat", "--model", "flowing", "--timeout", timeout, "hi")
    assert flowing.returncode == 0, flowing.stderr
    assert time.monotonic() - started > 2 * TIMEOUT_S and flowing.stdout.strip()
    stalled = _cli(endpoint, "chat", "--model", "stalling", "--timeout", timeout, "hi")
    assert stalled.returncode == 3 and "--timeout" in stalled.stderr, stalled.stderr
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)
    bounded = _cli(endpoint, "chat", "--model", "flowing", "--timeout", "30", "--max-time", "0.5", "hi")
    assert bounded.returncode == 3 and "request_timeout" in bounded.stderr, bounded.stderr

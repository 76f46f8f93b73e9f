"""Many concurrent openai SDK calls on one client over NNRP (the fan-out of :mod:`vllm_nnrp_plugin.client.aio.pool`)
against the real server path on loopback (the plugin's own wire core, :class:`tests.support.ServedNNRP`) with
vLLM 0.26.0's recorded streams: every call completes as over HTTP, within the server's per-session and
per-process limits (no refusal is provoked), a refusal caused by another client is resubmitted, closing leaves
no session, a restarted server is reconnected, nothing is printed at exit; ``httpx`` and ``httpx2`` clients
alike."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import httpx2
import openai
import prometheus_client
import pytest

from tests.support import RecordedBackend, ServedNNRP, free_port, recorded_json, wait_until
from tests.test_openai_transport import recorded_stream
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.client.openai import exchange
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport
from vllm_nnrp_plugin.profile import errors as E

MESSAGES = [{"role": "user", "content": "hi"}]
#: the HTTP libraries whose clients this SDK takes (openai < 3 takes only httpx's)
LIBRARIES = {"httpx": httpx, "httpx2": httpx2} if int(openai.__version__.split(".")[0]) >= 3 else {"httpx": httpx}
SDK_LIB = LIBRARIES.get("httpx2", httpx)  # the SDK's own library where it has one
TEXT = recorded_stream("a-stream-text")["choices"][0]["content"]
NONSTREAM_TEXT = recorded_json("c-nonstream-text")["choices"][0]["message"]["content"]


class PeakBackend(RecordedBackend):
    """:class:`RecordedBackend` that keeps the most streams it had open at once (``peak``)."""

    peak = 0

    @property
    def open_streams(self) -> int:
        return self._open

    @open_streams.setter
    def open_streams(self, value: int) -> None:
        self._open = value
        self.peak = max(self.peak, value)


def refusals() -> float:
    """``too_many_requests`` answers the servers of this process gave so far (their metrics)."""
    labels = {"code": E.TOO_MANY_REQUESTS, "family": E.SERVER_ERROR}
    return prometheus_client.REGISTRY.get_sample_value("nnrp_errors_total", labels) or 0.0


def sync_sdk(lib, transport) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://nnrp.invalid/v1", api_key="unused", max_retries=0, http_client=lib.Client(transport=transport)
    )


def async_sdk(lib, transport) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://nnrp.invalid/v1",
        api_key="unused",
        max_retries=0,
        http_client=lib.AsyncClient(transport=transport),
    )


async def fan_out(sdk: openai.AsyncOpenAI, n: int, **extra) -> list[str]:
    """``n`` streamed and ``n`` non-streamed calls at once; their texts, streamed first."""

    async def streamed():
        stream = await sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True, **extra)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def whole():
        answer = await sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
        return answer.choices[0].message.content

    return await asyncio.gather(*(streamed() for _ in range(n)), *(whole() for _ in range(n)))


@pytest.mark.parametrize("lib", LIBRARIES)
def test_128_concurrent_async_calls_on_one_client_all_complete_without_a_refusal(lib):
    """128 streams + 128 whole answers at once, 16 operations per session allowed: the transport opens the
    sessions it needs (16 × 16 = the server's 256 in flight) instead of submitting into refusals."""
    backend = PeakBackend()
    served = ServedNNRP(
        (f"tcp://127.0.0.1:{free_port()}",), backend=backend, max_in_flight_per_session=16, max_in_flight=256
    )
    refused = refusals()

    async def main():
        sdk = async_sdk(LIBRARIES[lib], AsyncNNRPTransport(served.bound[0]))
        try:
            texts = await fan_out(sdk, 128, extra_body={"pace_s": 0.002})
            return texts, served.service.sessions
        finally:
            await sdk.close()

    try:
        texts, sessions = asyncio.run(main())
        assert texts == [TEXT] * 128 + [NONSTREAM_TEXT] * 128
        assert refusals() == refused
        assert sessions > 1 and backend.peak > 16  # more than one session's worth ran at once
        assert wait_until(lambda: served.service.sessions == 0)  # the client's close ended every session
    finally:
        served.stop()


@pytest.mark.parametrize("lib", LIBRARIES)
def test_threads_over_the_per_session_limit_share_one_sync_client(lib):
    """32 threads, 2 operations per session allowed: every call completes on a session of its own fan-out."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_in_flight_per_session=2)
    refused = refusals()
    try:
        with sync_sdk(LIBRARIES[lib], NNRPTransport(served.bound[0])) as sdk:

            def one(_n: int) -> str:
                stream = sdk.chat.completions.create(
                    model="a-stream-text", messages=MESSAGES, stream=True, extra_body={"pace_s": 0.005}
                )
                return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

            with concurrent.futures.ThreadPoolExecutor(32) as threads:
                texts = list(threads.map(one, range(32), timeout=60))
            assert served.service.sessions >= 2
        assert texts == [TEXT] * 32 and refusals() == refused
        assert wait_until(lambda: served.service.sessions == 0)
    finally:
        served.stop()


def test_calls_over_the_process_limit_wait_for_a_slot_instead_of_being_refused():
    """``nnrp.max_in_flight`` 3, from the capability document: 12 concurrent calls all complete, the client
    submitting at most 3 at a time. (A client that submitted all 12 would get 9 refusals at once. The server
    gives a process slot back when the operation's task ended, which can be an iteration after its terminal
    went out, so a call submitted right after a terminal may still meet a refusal, which is resubmitted.)"""
    backend = PeakBackend()
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), backend=backend, max_in_flight=3)
    refused = refusals()

    async def main():
        sdk = async_sdk(httpx, AsyncNNRPTransport(served.bound[0]))
        try:
            return await fan_out(sdk, 6, extra_body={"pace_s": 0.01})
        finally:
            await sdk.close()

    try:
        assert asyncio.run(main()) == [TEXT] * 6 + [NONSTREAM_TEXT] * 6
        assert refusals() - refused < 9 and 1 <= backend.peak <= 3, (refusals() - refused, backend.peak)
    finally:
        served.stop()


async def _held_by_another_client(uri: str, pace_s: float) -> tuple[ProfileClient, object]:
    """A native client (it ignores credit) holding the server's one process slot with a stream."""
    other = await ProfileClient.connect(uri)
    op = other.submit(
        {
            "schema_version": "openai-compatible/1",
            "operation": "chat.completions.create",
            "body": {"model": "a-stream-text", "messages": MESSAGES, "stream": True, "pace_s": pace_s},
        }
    )
    return other, op


def test_a_refusal_from_slots_another_client_holds_is_resubmitted_until_it_runs():
    """``nnrp.max_in_flight`` 1, taken by another client's stream for ~0.4 s: the SDK call (no SDK retries)
    is refused, waits, is submitted again and completes; vLLM saw it once."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_in_flight=1)
    refused = refusals()
    try:
        other, op = asyncio.run(_held_by_another_client(served.bound[0], 0.03))
        assert wait_until(lambda: len(served.backend.started) == 1)
        with sync_sdk(SDK_LIB, NNRPTransport(served.bound[0])) as sdk:
            answer = sdk.chat.completions.create(
                model="c-nonstream-text", messages=MESSAGES, extra_headers={"X-Request-Id": "resubmitted"}
            )
        assert answer.choices[0].message.content == NONSTREAM_TEXT
        assert refusals() > refused
        assert len([r for r in served.backend.started if "resubmitted" in r]) == 1
        assert [e.terminal for e in other.events(op, timeout_s=10)][-1]
        other.close()
    finally:
        served.stop()


def test_a_refusal_that_outlasts_the_retries_is_a_rate_limit_error(monkeypatch):
    monkeypatch.setattr(exchange, "REFUSAL_RETRIES", 2)
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), max_in_flight=1)
    try:
        other, op = asyncio.run(_held_by_another_client(served.bound[0], 0.2))
        assert wait_until(lambda: len(served.backend.started) == 1)
        with sync_sdk(httpx, NNRPTransport(served.bound[0])) as sdk:
            with pytest.raises(openai.RateLimitError) as caught:
                sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
        assert caught.value.status_code == 429 and caught.value.code == "too_many_requests"
        assert len(served.backend.started) == 1  # the refused call never reached the backend
        other.close()
    finally:
        served.stop()


@pytest.mark.parametrize("lib", LIBRARIES)
def test_a_restarted_server_is_reconnected(lib):
    """The server goes away (the call then is an ``APIConnectionError``) and comes back on the same address:
    the same client's next call connects again."""
    uri = f"tcp://127.0.0.1:{free_port()}"
    served = ServedNNRP((uri,))
    with sync_sdk(LIBRARIES[lib], NNRPTransport(uri)) as sdk:
        assert sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES).choices[0].message.content
        served.stop()
        with pytest.raises(openai.APIConnectionError):
            sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
        served = ServedNNRP((uri,))
        try:
            answer = sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
            assert answer.choices[0].message.content == NONSTREAM_TEXT
        finally:
            served.stop()


def test_a_lost_connection_fails_the_calls_in_flight_with_api_connection_error():
    """The server's side of the connection is dropped mid-stream: the stream raises ``APIConnectionError``;
    the next call connects again."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    try:
        with sync_sdk(SDK_LIB, NNRPTransport(served.bound[0])) as sdk:
            stream = sdk.chat.completions.create(
                model="a-stream-text", messages=MESSAGES, stream=True, extra_body={"pace_s": 0.1, "repeat": 20}
            )
            next(iter(stream))
            for connection in list(served.service._listener._connections):
                served.loop.call_soon_threadsafe(connection.abort)
            with pytest.raises(openai.APIConnectionError):
                for _ in stream:
                    pass
            assert sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES).choices[0].message.content
    finally:
        served.stop()


EXIT_SCRIPT = """
import asyncio, httpx, httpx2, openai
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport
URI = {uri!r}
body = dict(model="c-nonstream-text", messages=[{{"role": "user", "content": "hi"}}])
for lib in {libraries}:
    sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="x",
                        http_client=lib.Client(transport=NNRPTransport(URI)))
    assert sdk.chat.completions.create(**body).choices[0].message.content
    async def main():
        sdk = openai.AsyncOpenAI(base_url="http://nnrp.invalid/v1", api_key="x",
                                 http_client=lib.AsyncClient(transport=AsyncNNRPTransport(URI)))
        stream = await sdk.chat.completions.create(**{{**body, "model": "a-stream-text"}}, stream=True)
        async for _ in stream:
            pass
    asyncio.run(main())
print("done")
"""


def test_a_program_that_never_closes_its_clients_prints_nothing_at_exit():
    """Sync and async clients of both libraries, never closed, in a subprocess with every ResourceWarning
    shown: its stderr stays empty and the server sees its sessions end."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-W",
                "always::ResourceWarning",
                "-c",
                textwrap.dedent(EXIT_SCRIPT.format(uri=served.bound[0], libraries="(" + ", ".join(LIBRARIES) + ",)")),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parents[1],
        )
        assert (run.returncode, run.stdout, run.stderr) == (0, "done\n", "")
        assert wait_until(lambda: served.service.sessions == 0)  # the exit dropped the connections
    finally:
        served.stop()


@pytest.mark.parametrize("lib", LIBRARIES)
def test_traced_and_untraced_calls_share_one_session(lib):
    from opentelemetry.sdk.trace import TracerProvider

    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    tracer = TracerProvider().get_tracer("test")
    try:
        with sync_sdk(LIBRARIES[lib], NNRPTransport(served.bound[0])) as sdk:
            with tracer.start_as_current_span("caller") as span:
                sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
            sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
            assert served.service.sessions == 1
        traced, untraced = served.backend.started
        context = span.get_span_context()
        low = context.trace_id & ((1 << 64) - 1)
        assert served.backend.traceparents[traced] == f"00-{low:032x}-{context.span_id:016x}-01"
        assert served.backend.traceparents[untraced] is None
    finally:
        served.stop()

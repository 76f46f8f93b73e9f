"""A fleet of replicas for the NNRP clients: the sans-IO policy (:mod:`vllm_nnrp_plugin.client.fleet.policy`) with plain
data, and its asyncio shell (:mod:`vllm_nnrp_plugin.client.fleet.pool`) through the ``openai`` SDK against two real
plugin servers on two loopback addresses (127.0.0.2 and 127.0.0.3, the same port) with vLLM 0.26.0's recorded
streams: placement by granted credit, the server's drain (:meth:`vllm_nnrp_plugin.service.NNRPService.drain`) as
the client sees it, a lost replica (its connections aborted: what ``kill -9`` leaves) with unstarted calls moved and
started streams failed, host names resolved into several replicas."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.support import ServedNNRP, free_port, until
from tests.test_openai_fanout import NONSTREAM_TEXT, SDK_LIB, TEXT
from vllm_nnrp_plugin.client.aio.connection import connect
from vllm_nnrp_plugin.client.errors import (
    ClientAddressError,
    ClientConnectionError,
    ClientTimeout,
    SessionOpenError,
)
from vllm_nnrp_plugin.client.fleet import policy
from vllm_nnrp_plugin.client.fleet.pool import FleetPool
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport
from vllm_nnrp_plugin.contract import draining

MESSAGES = [{"role": "user", "content": "hi"}]
A, B = "tcp://127.0.0.2:1", "tcp://127.0.0.3:1"


# -- the policy, plain data --------------------------------------------------------------------------------------


def test_addresses_of_a_list_or_a_comma_separated_string():
    assert policy.addresses_of("tcp://a:1, tcp://b:2,tcp://a:1") == ("tcp://a:1", "tcp://b:2")
    assert policy.addresses_of(["tcp://a:1"]) == ("tcp://a:1",)
    for bad in ("", " , ", [], ["tcp://a:1", ""], 7):
        with pytest.raises(ClientAddressError):
            policy.addresses_of(bad)


def test_names_are_resolved_for_tcp_and_ws_only():
    assert policy.resolvable("tcp://replicas.internal:9400") == ("replicas.internal", 9400)
    assert policy.resolvable("ws://replicas.internal:9400/nnrp") == ("replicas.internal", 9400)
    for kept in ("tcp://127.0.0.2:9400", "tcp://[::1]:9400", "nnrps://replicas.internal:9400", "unix:///tmp/s.sock"):
        assert policy.resolvable(kept) is None
    assert policy.with_host("ws://replicas.internal:9400/nnrp", "10.0.0.7") == "ws://10.0.0.7:9400/nnrp"
    assert policy.with_host("tcp://replicas.internal:9400", "fd00::7") == "tcp://[fd00::7]:9400"


def test_a_new_call_goes_to_the_replica_with_the_most_free_capacity():
    fleet = policy.Fleet([A, B])
    loads = {A: policy.Load(granted=4, in_flight=3), B: policy.Load(granted=16, in_flight=3)}
    assert fleet.choose(0.0, loads) == B
    loads = {A: policy.Load(granted=4, in_flight=0), B: policy.Load(granted=16, in_flight=13)}
    assert fleet.choose(0.0, loads) == A
    # a replica whose sessions are all held by a BACKPRESSURE has nothing free
    loads = {A: policy.Load(granted=16, in_flight=1, held=True), B: policy.Load(granted=4, in_flight=3)}
    assert fleet.choose(0.0, loads) == B
    # equal: the one chosen least recently
    loads = {A: policy.Load(granted=8), B: policy.Load(granted=8)}
    first = fleet.choose(1.0, loads)
    assert fleet.choose(2.0, loads) != first


def test_a_replica_out_is_tried_again_after_its_backoff_by_one_call():
    fleet = policy.Fleet([A, B])
    fleet.failed(A, 10.0, "refused")
    assert [fleet.choose(10.1, {}) for _ in range(3)] == [B, B, B]
    assert fleet.choose(10.0 + policy.BACKOFF_FIRST_S, {}) == A  # probed by one call
    assert fleet.choose(10.0 + policy.BACKOFF_FIRST_S, {}) == B  # the others go on elsewhere meanwhile
    fleet.abandoned(A)  # that call gave up waiting: the next one probes
    assert fleet.choose(10.0 + policy.BACKOFF_FIRST_S, {}) == A
    fleet.failed(A, 11.0, "refused")  # the probe failed: the backoff doubles
    assert fleet.replicas[A].retry_at == pytest.approx(11.0 + 2 * policy.BACKOFF_FIRST_S)
    fleet.reached(A)
    assert fleet.replicas[A].state == policy.UP and fleet.replicas[A].failures == 0
    for _ in range(20):
        fleet.failed(B, 0.0, "refused")
    assert fleet.replicas[B].retry_at == policy.BACKOFF_MAX_S


def test_a_draining_replica_gets_no_call_and_every_address_excluded_is_none():
    fleet = policy.Fleet([A, B])
    fleet.draining(A, 0.0)
    assert fleet.choose(0.5, {A: policy.Load(granted=64), B: policy.Load(granted=1, in_flight=5)}) == B
    assert fleet.choose(0.5, {}, exclude=[A, B]) is None
    assert fleet.choose(0.5, {}, exclude=[B]) == A  # nothing else: the one tried again soonest
    fleet2 = policy.Fleet([A, B])
    assert fleet2.set_addresses([B, "tcp://127.0.0.4:1"]) == (["tcp://127.0.0.4:1"], [A])
    assert fleet2.set_addresses([]) == ([], [])  # a resolution that found nothing keeps the set
    assert fleet2.addresses == (B, "tcp://127.0.0.4:1")


def test_which_first_reads_leave_a_call_safe_to_submit_again():
    assert policy.unstarted_failure(ClientConnectionError("lost"))
    assert not policy.unstarted_failure(ClientTimeout("silent"))
    shutdown = {"type": "response.error", "error": {"code": "server_shutdown", "message": "stopping"}}
    assert policy.unstarted_failure(shutdown)
    assert not policy.unstarted_failure(shutdown, terminal=False)
    assert not policy.unstarted_failure({"type": "response.error", "error": {"code": "model_not_found"}})
    assert policy.unstarted_failure({"type": "response.cancelled"}, drop_reason=policy.DROP_TRANSPORT_CLOSED)
    assert not policy.unstarted_failure({"type": "response.cancelled"}, drop_reason=3)  # peer_cancelled
    assert not policy.unstarted_failure({"type": "response.output_text.delta", "delta": "x"}, terminal=False)
    assert [policy.max_attempts(n) for n in (1, 2, 3, 9)] == [2, 3, 4, 4]


def test_a_call_moves_while_unstarted_and_under_its_attempts_and_not_to_a_replica_it_tried():
    shutdown = {"type": "response.error", "error": {"code": "server_shutdown", "message": "stopping"}}
    attempts = policy.Attempts()
    attempts.submitted(A)
    assert attempts.may_move(ClientConnectionError("lost"), 2)
    assert attempts.may_move(shutdown, 2)
    assert not attempts.may_move(shutdown, 2, terminal=False)  # more events follow: not the replica going away
    assert not attempts.may_move(ClientTimeout("silent"), 2)
    assert attempts.excluded({A: 1, B: 2}) == [A]
    assert attempts.excluded({A: 1}) == []  # one address: a fresh connection may land elsewhere
    attempts.submitted(B)
    assert attempts.excluded({B: 2, "tcp://127.0.0.4:1": 3}) == [B]  # A is no replica any more
    assert attempts.may_move(ClientConnectionError("lost"), 2)
    attempts.submitted(A)
    assert attempts.count == 3 and not attempts.may_move(ClientConnectionError("lost"), 2)  # max_attempts(2)
    for flag in ("started", "cancelled"):
        assert not policy.Attempts([A], **{flag: True}).may_move(ClientConnectionError("lost"), 2)


# -- against two real servers ------------------------------------------------------------------------------------


@pytest.fixture
def replicas():
    """Two plugin servers on 127.0.0.2 and 127.0.0.3, same port; the first grants 2 operations per session,
    the second 8."""
    port = free_port()
    served = [
        ServedNNRP((f"tcp://127.0.0.{n}:{port}",), max_in_flight_per_session=grant) for n, grant in ((2, 2), (3, 8))
    ]
    yield served
    for one in served:
        if one._thread.is_alive():
            one.stop()


def async_sdk(transport) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://nnrp.invalid/v1",
        api_key="unused",
        max_retries=0,
        http_client=SDK_LIB.AsyncClient(transport=transport),
    )


async def streamed(sdk, **extra) -> str:
    stream = await sdk.chat.completions.create(model="a-stream-text", messages=MESSAGES, stream=True, **extra)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def test_calls_spread_by_the_credit_each_replica_granted(replicas):
    """10 concurrent slow streams on a fleet of a replica granting 2 per session and one granting 8: every one
    completes, and the bigger replica runs most of them."""
    low, high = replicas

    async def main():
        async with async_sdk(AsyncNNRPTransport([low.bound[0], high.bound[0]])) as sdk:
            await streamed(sdk)  # both replicas' grants are known after a call or two
            await streamed(sdk)
            return await asyncio.gather(*(streamed(sdk, extra_body={"pace_s": 0.05}) for _ in range(10)))

    assert asyncio.run(main()) == [TEXT] * 10
    assert len(high.backend.started) >= 7 and len(low.backend.started) >= 1


def test_a_sync_client_takes_a_comma_separated_string(replicas):
    uris = ",".join(one.bound[0] for one in replicas)
    with openai.OpenAI(
        base_url="http://nnrp.invalid/v1",
        api_key="unused",
        max_retries=0,
        http_client=SDK_LIB.Client(transport=NNRPTransport(uris)),
    ) as sdk:
        for _ in range(4):
            assert (
                sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES).choices[0].message.content
                == NONSTREAM_TEXT
            )
    assert all(one.backend.started for one in replicas)


def test_a_draining_replica_finishes_its_streams_and_new_calls_go_elsewhere(replicas):
    """Streams running on a replica when it drains complete there; calls made during the drain all complete
    on the other one; the drained replica's vLLM gets no new request."""
    low, high = replicas

    async def main():
        async with async_sdk(AsyncNNRPTransport([low.bound[0], high.bound[0]])) as sdk:
            running = [asyncio.ensure_future(streamed(sdk, extra_body={"pace_s": 0.05, "repeat": 3})) for _ in range(8)]
            # every stream reached a replica
            assert await until(
                lambda: len(low.backend.started) + len(high.backend.started) >= 8 and low.backend.open_streams >= 1
            )
            started_on_low = len(low.backend.started)
            drained = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(low.service.drain(10.0), low.loop))
            later = await asyncio.gather(*(streamed(sdk) for _ in range(6)))
            texts = await asyncio.gather(*running)
            await drained
            return started_on_low, later, texts

    started_on_low, later, texts = asyncio.run(main())
    assert later == [TEXT] * 6
    assert len(set(texts)) == 1 and texts[0].startswith(TEXT) and len(texts[0]) > len(TEXT)  # 8 whole streams
    assert len(low.backend.started) == started_on_low  # nothing new reached the drained replica's vLLM
    assert low.backend.aborted == []  # its running streams finished: none was cut


def test_the_drain_on_the_wire(replicas):
    """What a client on a draining replica sees: the drain BACKPRESSURE on its open session, a new session
    refused, a new submit answered ``server_shutdown`` without reaching vLLM, a new connection refused, and the
    operation already running completed."""
    server = replicas[0]

    async def main():
        conn = await connect(server.bound[0])
        session = await conn.open_session()
        pressures = []
        pressed = asyncio.Event()
        session.on_pressure = lambda pressure: (pressures.append(pressure), pressed.set())
        running = session.submit(
            {
                "schema_version": "openai-compatible/1",
                "operation": "chat.completions.create",
                "body": {"model": "a-stream-text", "stream": True, "messages": MESSAGES, "pace_s": 0.05},
            }
        )
        first = await running.__anext__()
        drained = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.service.drain(10.0), server.loop))
        await pressed.wait()
        started = len(server.backend.started)
        late = await session.submit(
            {
                "schema_version": "openai-compatible/1",
                "operation": "chat.completions.create",
                "body": {"model": "c-nonstream-text", "messages": MESSAGES},
            }
        ).result()
        with pytest.raises(SessionOpenError):
            await conn.open_session()
        with pytest.raises(ClientConnectionError):
            await connect(server.bound[0])
        events = [first] + [event async for event in running]
        await drained
        return pressures, late, events, started

    pressures, late, events, started = asyncio.run(main())
    p = pressures[0]
    assert draining.is_drain_signal(True, p.credit_window, p.pressure_level, p.pressure_reason)
    assert p.retry_after_ms > 0
    assert late["type"] == "response.error" and late["error"]["code"] == "server_shutdown"
    assert events[-1]["type"] == "response.completed"
    assert len(server.backend.started) == started == 1


def test_the_drain_ends_what_outlasts_its_grace_with_server_shutdown(replicas):
    server = replicas[0]

    async def main():
        conn = await connect(server.bound[0])
        session = await conn.open_session()
        op = session.submit(
            {
                "schema_version": "openai-compatible/1",
                "operation": "chat.completions.create",
                "body": {"model": "a-stream-text", "stream": True, "messages": MESSAGES, "pace_s": 0.2, "repeat": 50},
            }
        )
        await op.__anext__()
        t0 = time.monotonic()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.service.drain(0.3), server.loop))
        took = time.monotonic() - t0
        terminal = await op.result()
        return took, terminal

    took, terminal = asyncio.run(main())
    assert 0.3 <= took < 5
    assert terminal["type"] == "response.error" and terminal["error"]["code"] == "server_shutdown"


def test_a_lost_replica_moves_unstarted_calls_and_fails_started_streams_at_once(replicas):
    """The connections of one replica are aborted and its address refuses (what ``kill -9`` leaves): calls there
    that had produced nothing complete on the other replica; streams that had produced events raise
    ``APIConnectionError`` within a second; nothing hangs."""
    low, high = replicas
    high_uri = high.bound[0]

    async def main():
        transport = AsyncNNRPTransport([low.bound[0], high_uri])
        async with async_sdk(transport) as sdk:
            # started streams on both replicas
            reading = []
            all_reading = asyncio.Event()

            async def started_stream():
                stream = await sdk.chat.completions.create(
                    model="a-stream-text", messages=MESSAGES, stream=True, extra_body={"pace_s": 0.02, "repeat": 10}
                )
                got = 0
                try:
                    async for _ in stream:
                        got += 1
                        if got == 1:
                            reading.append(1)
                            if len(reading) == 4:
                                all_reading.set()
                    return "completed", got, None
                except openai.APIConnectionError:
                    return "connection_error", got, time.monotonic()

            streams = [asyncio.ensure_future(started_stream()) for _ in range(4)]
            await all_reading.wait()  # every stream produced events
            assert low.backend.open_streams >= 1 and high.backend.open_streams >= 1
            # calls that will produce nothing for 1 s (the backend waits before the first chunk)
            unstarted = [asyncio.ensure_future(streamed(sdk, extra_body={"pace_s": 1.0})) for _ in range(6)]
            assert await until(lambda: len(low.backend.started) + len(high.backend.started) >= 10)
            on_low = len(low.backend.started)
            killed_at = time.monotonic()
            low.loop.call_soon_threadsafe(_kill, low)
            texts = await asyncio.wait_for(asyncio.gather(*unstarted), 30)
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 30)
            return on_low, killed_at, texts, outcomes, transport

    on_low, killed_at, texts, outcomes, transport = asyncio.run(main())
    assert on_low >= 2  # the kill hit calls of both kinds on that replica
    assert texts == [TEXT] * 6
    errors = [at - killed_at for outcome, _got, at in outcomes if outcome == "connection_error"]
    assert errors and all(delay < 1.0 for delay in errors)
    assert all(got > 0 for _outcome, got, _at in outcomes)
    assert sum(outcome == "completed" for outcome, _got, _at in outcomes) == 4 - len(errors)


def _kill(served: ServedNNRP) -> None:
    """On the server's loop: no listening socket, every connection's transport aborted (RST, nothing sent)."""
    listener = served.service._listener
    listener.stop_accepting()
    for connection in list(listener._connections):
        connection.abort()


def test_a_host_name_resolves_into_replicas_and_is_resolved_again(replicas, monkeypatch):
    low, high = replicas
    port = int(low.bound[0].rsplit(":", 1)[1])
    answers = [["127.0.0.2", "127.0.0.3"]]

    async def resolve(host, resolved_port):
        assert (host, resolved_port) == ("replicas.test", port)
        return answers[0]

    async def main():
        pool = FleetPool([f"tcp://replicas.test:{port}"], resolve=resolve)
        try:
            for _ in range(4):
                op = await pool.submit(
                    {
                        "schema_version": "openai-compatible/1",
                        "operation": "chat.completions.create",
                        "body": {"model": "c-nonstream-text", "messages": MESSAGES},
                    }
                )
                assert (await op.result())["type"] == "response.completed"
            first = pool.fleet.addresses
            answers[0] = ["127.0.0.3"]
            monkeypatch.setattr(policy, "RESOLVE_EVERY_S", 0.0)
            await pool.acquire(1.0)  # due: resolved again in the background
            assert await until(lambda: pool.fleet.addresses != first)
            return first, pool.fleet.addresses
        finally:
            await pool.aclose()

    first, later = asyncio.run(main())
    assert set(first) == {low.bound[0], high.bound[0]}
    assert later == (high.bound[0],)
    assert low.backend.started and high.backend.started


def test_no_replica_reachable_is_an_api_connection_error_naming_each():
    ports = free_port()
    transport = NNRPTransport([f"tcp://127.0.0.2:{ports}", f"tcp://127.0.0.3:{ports}"])
    with openai.OpenAI(
        base_url="http://nnrp.invalid/v1",
        api_key="unused",
        max_retries=0,
        http_client=SDK_LIB.Client(transport=transport),
    ) as sdk:
        with pytest.raises(openai.APIConnectionError) as caught:
            sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)
    assert "127.0.0.2" in str(caught.value.__cause__) and "127.0.0.3" in str(caught.value.__cause__)


def test_bad_fleet_addresses_are_value_errors():
    for bad in (["tcp://127.0.0.2:1", "http://x"], ["tcp://127.0.0.2"], "tcp://127.0.0.2:1,,http://x", []):
        with pytest.raises(ValueError):
            NNRPTransport(bad)


def test_a_stop_during_the_drain_waits_for_its_running_operations(replicas):
    """vLLM's SIGTERM also stops uvicorn, whose lifespan exit stops the service while vLLM's shutdown still
    drains: the stop waits for the drain, so the stream running completes instead of ending ``server_shutdown``."""
    server = replicas[0]

    async def main():
        conn = await connect(server.bound[0])
        session = await conn.open_session()
        op = session.submit(
            {
                "schema_version": "openai-compatible/1",
                "operation": "chat.completions.create",
                "body": {"model": "a-stream-text", "stream": True, "messages": MESSAGES, "pace_s": 0.02},
            }
        )
        await op.__anext__()
        drained = asyncio.run_coroutine_threadsafe(server.service.drain(10.0), server.loop)
        stopped = asyncio.run_coroutine_threadsafe(server.service.stop(), server.loop)
        terminal = await op.result()
        await asyncio.wrap_future(stopped)
        await asyncio.wrap_future(drained)
        return terminal

    assert asyncio.run(main())["type"] == "response.completed"


def test_the_command_takes_a_fleet_and_goes_past_a_replica_that_is_gone(replicas):
    """``vllm-nnrp chat --endpoint A,B`` with A stopped: the answer comes from B, exit status 0; with both
    stopped, exit status 2 naming the fleet."""
    import subprocess
    import sys

    low, high = replicas
    low.stop()
    endpoint = f"{low.bound[0]},{high.bound[0]}"

    def chat():
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "vllm_nnrp_plugin.client.cli",
                "chat",
                "--endpoint",
                endpoint,
                "--model",
                "c-nonstream-text",
                "--no-stream",
                "--timeout",
                "10",
                "hi",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = chat()
    assert done.returncode == 0, done.stderr
    assert NONSTREAM_TEXT in done.stdout
    high.stop()
    done = chat()
    assert done.returncode == 2 and "cannot reach the fleet" in done.stderr

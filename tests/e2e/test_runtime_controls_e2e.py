"""NNRP's runtime controls drive a real ``vllm serve`` (CPU) scheduling by priority with one sequence at a time
(``--scheduling-policy priority --max-num-seqs 1``, so that requests queue in vLLM's own waiting queue): a session's
priority class becomes vLLM's request priority (visible in the order vLLM runs queued requests), SUPERSEDE aborts
the vLLM request, a BUDGET_UPDATE ends a stream at the budget with vLLM's own finish chunk, an operation whose
deadline passed before it was dispatched — or while it waited in vLLM's queue — never reaches the engine, and
``response.usage`` carries the prefix-cache hits vLLM counted."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from tests.e2e.conftest import LONG, VLLMServer, attach_options, model_dir
from tests.support import envelope, free_port
from vllm_nnrp_plugin.client import connect

pytestmark = [pytest.mark.vllm, pytest.mark.binding_core]

#: a prompt of several of vLLM's KV blocks (128 tokens on CPU), so that a second request hits the prefix cache
SHARED_PROMPT = "Count the waves on the shore, one by one, and name each of them. " * 40


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory, vllm_version):
    workdir = tmp_path_factory.mktemp("vllm-priority")
    tcp = f"tcp://127.0.0.1:{free_port()}"
    env, args = attach_options(vllm_version[1])
    additional = orjson.dumps({"nnrp": {"max_in_flight_per_session": 8}}).decode()  # default: vLLM's max_num_seqs
    server = VLLMServer(
        model_dir(),
        workdir,
        env={**env, "VLLM_NNRP_LISTEN": tcp},
        extra_args=(
            *args,
            "--scheduling-policy",
            "priority",
            "--max-num-seqs",
            "1",
            "--additional-config",
            additional,
        ),
    )
    server.nnrp = {"tcp": tcp}
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def chat(max_tokens: int, content: str = "Write a long story about the sea.", **nnrp) -> dict:
    body = {
        **LONG,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
    }
    return envelope(body, nnrp=nnrp) if nnrp else envelope(body)


async def first_delta(op) -> None:
    async for event in op:
        if event["type"] == "response.output_text.delta":
            return
    raise AssertionError("no text delta")


async def events_of(op) -> list[dict]:
    return [event async for event in op]


def engine_idle(server: VLLMServer) -> bool:
    return server.metric("vllm:num_requests_running") + server.metric("vllm:num_requests_waiting") == 0


async def _until(check, failure: str) -> None:
    """Poll ``check`` (it reads vLLM's ``/metrics``: in a thread) every 50 ms for up to 10 s."""
    for _ in range(200):
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(failure)


async def wait_idle(server: VLLMServer) -> None:
    await _until(lambda: engine_idle(server), "vLLM still has requests")


async def wait_queued(server: VLLMServer, count: int) -> None:
    """Until vLLM's queue holds ``count`` requests (its ``vllm:num_requests_waiting`` gauge)."""
    await _until(lambda: server.metric("vllm:num_requests_waiting") >= count, f"vLLM never queued {count} request(s)")


def test_the_session_priority_class_orders_vllms_queue(priority_server):
    async def main():
        conn = await connect(priority_server.nnrp["tcp"])
        background = await conn.open_session(priority_class="background")
        interactive = await conn.open_session(priority_class="interactive")
        running = background.submit(chat(48))
        await first_delta(running)  # vLLM's one sequence is taken: the next two wait in its queue
        queued_background = background.submit(chat(4))
        await wait_queued(priority_server, 1)  # vLLM queued it before the interactive one comes
        queued_interactive = interactive.submit(chat(4))
        order: list[str] = []

        async def finish(name, op):
            await op.result()
            order.append(name)

        await asyncio.gather(
            finish("background", queued_background),
            finish("interactive", queued_interactive),
            finish("running", running),
        )
        await conn.close()
        return order

    order = asyncio.run(main())
    assert order.index("interactive") < order.index("background"), order


def test_a_priority_update_after_dispatch_is_recorded_not_applied(priority_server):
    async def main():
        conn = await connect(priority_server.nnrp["tcp"])
        session = await conn.open_session(priority_class="background")
        op = session.submit(chat(8, diagnostics=True))
        await first_delta(op)
        op.update_priority("interactive")
        terminal = await op.result()
        await conn.close()
        return terminal

    diagnostics = asyncio.run(main())["diagnostics"]
    assert diagnostics["priority"] == {"class": "background", "vllm_priority": 10, "late_updates": 1}


def test_supersede_aborts_the_vllm_request_and_the_new_operation_runs(priority_server):
    async def main():
        conn = await connect(priority_server.nnrp["tcp"])
        session = await conn.open_session()
        old = session.submit(chat(1000))
        await first_delta(old)
        new = session.submit(chat(4))
        old.supersede(new)
        stale, fresh = await asyncio.gather(old.result(), new.result())
        drop_code = old.drop_reason_code
        await wait_idle(priority_server)
        await conn.close()
        return stale, drop_code, fresh

    stale, drop_code, fresh = asyncio.run(main())
    assert stale == {"type": "response.cancelled", "reason": "superseded"} and drop_code == 2
    assert fresh["type"] == "response.completed"


def test_a_lowered_budget_ends_the_stream_at_the_budget_with_finish_length(priority_server):
    async def main():
        conn = await connect(priority_server.nnrp["tcp"])
        session = await conn.open_session()
        op = session.submit(chat(400))
        await first_delta(op)
        op.update_budget(30)
        events = await events_of(op)
        await wait_idle(priority_server)
        await conn.close()
        return events

    events = asyncio.run(main())
    body = events[-1]["body"]
    assert events[-1]["type"] == "response.completed" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 30
    assert [e for e in events if e["type"] == "response.usage"][0]["usage"]["output_tokens"] == 30


def test_an_operation_whose_deadline_passed_never_reaches_the_engine(priority_server):
    async def main():
        conn = await connect(priority_server.nnrp["tcp"])
        session = await conn.open_session()
        running = session.submit(chat(1000))
        await first_delta(running)
        prompts = await asyncio.to_thread(priority_server.metric, "vllm:prompt_tokens_total")
        late = session.submit(chat(8))
        late.deadline(int(time.time() * 1000) - 1)  # already passed when it arrives: never dispatched
        queued = session.submit(chat(8))
        queued.deadline(int(time.time() * 1000) + 300)  # passes while it waits behind ``running``
        expired = await asyncio.gather(late.result(), queued.result())
        codes = (late.drop_reason_code, queued.drop_reason_code)
        after = await asyncio.to_thread(priority_server.metric, "vllm:prompt_tokens_total")
        running.cancel()
        await running.result()
        await wait_idle(priority_server)
        await conn.close()
        return expired, codes, after - prompts

    expired, codes, prompt_tokens = asyncio.run(main())
    assert expired == [{"type": "response.cancelled", "reason": "deadline_expired"}] * 2 and codes == (1, 1)
    assert prompt_tokens == 0


def test_response_usage_carries_vllms_prefix_cache_hits(priority_server):
    async def main():
        conn = await connect(priority_server.nnrp["tcp"])
        session = await conn.open_session()
        usages = []
        for _ in range(2):
            hits = await asyncio.to_thread(priority_server.metric, "vllm:prefix_cache_hits_total")
            events = await events_of(session.submit(chat(4, SHARED_PROMPT)))
            usage = next(e for e in events if e["type"] == "response.usage")["usage"]
            usages.append(
                (usage, await asyncio.to_thread(priority_server.metric, "vllm:prefix_cache_hits_total") - hits)
            )
        await conn.close()
        return usages

    (first, _first_hits), (second, second_hits) = asyncio.run(main())
    assert second["input_tokens_details"]["cached_tokens"] == second_hits > 0
    assert first["input_tokens"] == second["input_tokens"]

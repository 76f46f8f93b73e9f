"""The NNRP stop runs before vLLM's engine shutdown (vllm_binding/shutdown.py), called the way vLLM's
launcher calls it: from an executor thread while the loop runs."""

from __future__ import annotations

import asyncio
import functools

import pytest

from vllm_nnrp_plugin.vllm_binding import shutdown as shutdown_module
from vllm_nnrp_plugin.vllm_binding.shutdown import KILL_MARGIN_S, drain_grace, stop_before_engine_shutdown


class EngineClient:
    def __init__(self, order):
        self.order = order

    def shutdown(self, timeout=None):
        self.order.append(f"engine shutdown timeout={timeout}")


def shut_down_like_vllm(stop, grace_s=0.0, vllm_timeout=0, killed_at_timeout=False):
    order = []

    async def main():
        loop = asyncio.get_running_loop()
        engine = EngineClient(order)
        undo = stop_before_engine_shutdown(
            engine, loop, lambda grace: stop(order, grace), grace_s=grace_s, killed_at_timeout=killed_at_timeout
        )
        # launcher.serve_http: engine_client.shutdown(timeout=vllm_config.shutdown_timeout) in an executor thread
        await loop.run_in_executor(None, functools.partial(engine.shutdown, timeout=vllm_timeout))
        undo()
        engine.shutdown(timeout=1)  # after the undo: vLLM's method, nothing in front
        return engine

    engine = asyncio.run(main())
    assert "shutdown" not in vars(engine)
    return order


def test_the_nnrp_stop_finishes_before_the_engine_shuts_down():
    async def stop(order, grace):
        order.append(f"nnrp stop begins grace={grace}")
        await asyncio.sleep(0.05)  # a stop that takes a while, well within the budget
        order.append("nnrp stop ends")

    assert shut_down_like_vllm(stop, grace_s=30.0) == [
        "nnrp stop begins grace=30.0",
        "nnrp stop ends",
        "engine shutdown timeout=0",
        "engine shutdown timeout=1",
    ]


def test_with_several_api_servers_the_drain_ends_before_vllms_process_manager_kills_the_process():
    async def stop(order, grace):
        order.append(f"nnrp stop grace={grace}")

    order = shut_down_like_vllm(stop, grace_s=30.0, vllm_timeout=10, killed_at_timeout=True)
    assert order[0] == f"nnrp stop grace={10 - KILL_MARGIN_S}"
    # one API server: vLLM does not kill it, the operator's grace holds
    assert shut_down_like_vllm(stop, grace_s=30.0, vllm_timeout=10)[0] == "nnrp stop grace=30.0"


@pytest.mark.parametrize(
    ("grace_s", "vllm_timeout", "killed", "expected"),
    [
        (30.0, 10, True, 10 - KILL_MARGIN_S),
        (5.0, 10, True, 5.0),  # the operator's grace is already shorter
        (30.0, 0, True, 0.0),  # vLLM's default: killed at once, so no drain (never negative)
        (30.0, None, True, 30.0),  # vLLM gave no timeout
        (30.0, 0, False, 30.0),
    ],
)
def test_drain_grace(grace_s, vllm_timeout, killed, expected):
    assert drain_grace(grace_s, vllm_timeout, killed_at_timeout=killed) == expected


def test_a_stop_that_hangs_does_not_hold_the_engine_shutdown_past_the_budget(monkeypatch):
    async def stop(order, grace):
        order.append("nnrp stop begins")
        await asyncio.sleep(60)  # a stop that hangs

    monkeypatch.setattr(shutdown_module, "STOP_BUDGET_S", 0.2)
    assert shut_down_like_vllm(stop) == [
        "nnrp stop begins",
        "engine shutdown timeout=0",
        "engine shutdown timeout=1",
    ]


def test_a_shutdown_called_on_the_loop_itself_does_not_wait_for_the_loop():
    order = []

    async def stop(grace):
        order.append("nnrp stop")

    async def main():
        engine = EngineClient(order)
        stop_before_engine_shutdown(engine, asyncio.get_running_loop(), stop, grace_s=5.0, killed_at_timeout=False)
        engine.shutdown(timeout=0)  # would deadlock if it waited for a coroutine on this very loop

    asyncio.run(main())
    assert order == ["engine shutdown timeout=0"]

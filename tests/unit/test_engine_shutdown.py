"""The NNRP stop runs before vLLM's engine shutdown (vllm_binding/shutdown.py), called the way vLLM's
launcher calls it: from an executor thread while the loop runs."""

from __future__ import annotations

import asyncio
import functools

from vllm_nnrp_plugin.vllm_binding.shutdown import stop_before_engine_shutdown


class EngineClient:
    def __init__(self, order):
        self.order = order

    def shutdown(self, timeout=None):
        self.order.append(f"engine shutdown timeout={timeout}")


def shut_down_like_vllm(stop, budget_s):
    order = []

    async def main():
        loop = asyncio.get_running_loop()
        engine = EngineClient(order)
        undo = stop_before_engine_shutdown(engine, loop, lambda: stop(order), budget_s=budget_s)
        await loop.run_in_executor(None, functools.partial(engine.shutdown, timeout=0))  # launcher.serve_http
        undo()
        engine.shutdown(timeout=1)  # after the undo: vLLM's method, nothing in front
        return engine

    engine = asyncio.run(main())
    assert "shutdown" not in vars(engine)
    return order


def test_the_nnrp_stop_finishes_before_the_engine_shuts_down():
    async def stop(order):
        order.append("nnrp stop begins")
        await asyncio.sleep(0.05)  # a stop that takes a while, well within the budget
        order.append("nnrp stop ends")

    assert shut_down_like_vllm(stop, budget_s=5) == [
        "nnrp stop begins", "nnrp stop ends", "engine shutdown timeout=0", "engine shutdown timeout=1",
    ]  # fmt: skip


def test_a_stop_that_hangs_does_not_hold_the_engine_shutdown_past_the_budget():
    async def stop(order):
        order.append("nnrp stop begins")
        await asyncio.sleep(60)  # a stop that hangs

    assert shut_down_like_vllm(stop, budget_s=0.2) == [
        "nnrp stop begins", "engine shutdown timeout=0", "engine shutdown timeout=1",
    ]  # fmt: skip


def test_a_shutdown_called_on_the_loop_itself_does_not_wait_for_the_loop():
    order = []

    async def stop():
        order.append("nnrp stop")

    async def main():
        engine = EngineClient(order)
        stop_before_engine_shutdown(engine, asyncio.get_running_loop(), stop, budget_s=5)
        engine.shutdown(timeout=0)  # would deadlock if it waited for a coroutine on this very loop

    asyncio.run(main())
    assert order == ["engine shutdown timeout=0"]

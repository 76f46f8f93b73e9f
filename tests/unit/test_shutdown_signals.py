"""The NNRP stop runs in front of vLLM's own SIGTERM handler (vllm_binding/shutdown.py), on a real loop and a
real signal."""

from __future__ import annotations

import asyncio
import os
import signal

from vllm_nnrp_plugin.vllm_binding.shutdown import stop_first_on_signals


def run_with_vllm_like_handler(stop, budget_s):
    order = []

    async def main():
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, lambda: (order.append("vllm"), done.set()))  # as serve_http does
        try:
            assert stop_first_on_signals(loop, lambda: stop(order), budget_s=budget_s)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(done.wait(), 10)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    asyncio.run(main())
    return order


def test_the_nnrp_stop_finishes_before_vllms_handler_runs():
    async def stop(order):
        order.append("nnrp stop begins")
        await asyncio.sleep(0.05)
        order.append("nnrp stop ends")

    assert run_with_vllm_like_handler(stop, budget_s=5) == ["nnrp stop begins", "nnrp stop ends", "vllm"]


def test_a_stop_that_hangs_does_not_hold_vllms_shutdown_past_the_budget():
    async def stop(order):
        order.append("nnrp stop begins")
        await asyncio.sleep(60)

    assert run_with_vllm_like_handler(stop, budget_s=0.2) == ["nnrp stop begins", "vllm"]


def test_without_loop_signal_handlers_nothing_is_chained():
    async def main():
        return stop_first_on_signals(asyncio.get_running_loop(), lambda: asyncio.sleep(0), budget_s=1)

    assert asyncio.run(main()) is False

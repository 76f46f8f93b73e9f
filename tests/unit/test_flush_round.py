"""The listener's flush round (:class:`vllm_nnrp_plugin.nnrp_binding.connection.FlushRound`): every
connection with packets decided in one loop iteration is flushed by one callback in the next, in order, and a
connection whose flush fails strands no other."""

from __future__ import annotations

import asyncio
import logging

from vllm_nnrp_plugin.nnrp_binding.connection import FlushRound


class Connection:
    def __init__(self, name: str, flushed: list[str], fails: bool = False) -> None:
        self.connection_id, self.name, self.flushed, self.fails = 0, name, flushed, fails
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def flush(self) -> None:
        self.flushed.append(self.name)
        if self.fails:
            raise RuntimeError("a bug")


def test_connections_of_one_iteration_are_flushed_by_one_callback_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        flushed: list[str] = []
        round_ = FlushRound(loop)
        scheduled = []  # the round's own callbacks (asyncio.sleep schedules through call_soon too)
        call_soon = loop.call_soon

        def counting(cb, *args, **kwargs):
            if getattr(cb, "__self__", None) is round_:
                scheduled.append(cb)
            return call_soon(cb, *args, **kwargs)

        loop.call_soon = counting  # type: ignore[method-assign]
        try:
            for name in ("a", "b", "c"):
                round_.add(Connection(name, flushed))
            assert flushed == []  # nothing is written in the iteration that decided it
            await asyncio.sleep(0)
            assert flushed == ["a", "b", "c"]
            assert len(scheduled) == 1
            round_.add(Connection("d", flushed))  # a later iteration schedules its own round
            await asyncio.sleep(0)
            assert flushed == ["a", "b", "c", "d"] and len(scheduled) == 2
        finally:
            loop.call_soon = call_soon  # type: ignore[method-assign]

    asyncio.run(main())


def test_a_failing_flush_is_logged_the_connection_ends_and_the_round_goes_on(caplog):
    """A connection whose flush failed is aborted (its encoded packets are never left stranded waiting for a
    wake-up that will not come); the others on the round are flushed."""

    async def main():
        round_ = FlushRound(asyncio.get_running_loop())
        flushed: list[str] = []
        bad, good = Connection("bad", flushed, fails=True), Connection("good", flushed)
        round_.add(bad)
        round_.add(good)
        await asyncio.sleep(0)
        assert flushed == ["bad", "good"]
        assert bad.aborted and not good.aborted
        round_.add(Connection("next", flushed))
        await asyncio.sleep(0)
        assert flushed == ["bad", "good", "next"]

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert "flush failed" in caplog.text

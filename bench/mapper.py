"""1. Profile mapper throughput: chunk streams recorded from real vLLM -> profile events, in-process.

Rows (events/s, one sample per repetition, single thread = one core):

* ``mapper.feed``: ``ChatStreamMapper.feed`` over parsed chunk dicts (the profile mapping alone);
* ``mapper.sse_to_partial``: what the server does per chunk before the transport — parse vLLM's
  ``data: …`` string (:func:`vllm_nnrp_plugin.vllm_binding.chat._chunks`' parsing), ``feed``, and encode each
  event as a numbered partial result (:class:`~vllm_nnrp_plugin.operation.OperationMachine`).

Input: every recorded ``.sse`` stream of compat/fixtures/vllm/0.26.0 (and shared fixtures of other vLLM lines
when present), replayed round-robin.
"""

from __future__ import annotations

import pathlib
import time

import orjson

from bench.results import Result, Target
from vllm_nnrp_plugin.operation import OperationMachine
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "compat" / "fixtures" / "vllm" / "0.26.0"
TARGET = Target("p50", ">=", 300_000)


def recorded_streams() -> list[list[str]]:
    """The ``data: …`` lines of every recorded stream (without ``[DONE]``)."""
    streams = []
    for path in sorted(FIXTURES.glob("*.sse")):
        lines = [line for line in path.read_text().splitlines() if line.startswith("data: ") and "[DONE]" not in line]
        streams.append(lines)
    return streams


def _feed_only(chunks: list[list[dict]]) -> int:
    events = 0
    for stream in chunks:
        mapper = ChatStreamMapper()
        for chunk in stream:
            events += len(mapper.feed(chunk))
        mapper.completed_body()
    return events


def _sse_to_partial(streams: list[list[str]]) -> int:
    events = 0
    for stream in streams:
        mapper = ChatStreamMapper()
        machine = OperationMachine()
        for line in stream:
            for event in mapper.feed(orjson.loads(line[6:])):
                machine.partial(event)
        machine.complete(mapper.completed_body())
        events += machine.events_sent
    return events


def run(repetitions: int = 30, rounds: int = 200) -> list[Result]:
    """``repetitions`` samples, each replaying every recorded stream ``rounds`` times."""
    streams = recorded_streams()
    chunks = [[orjson.loads(line[6:]) for line in s] for s in streams]
    rows = []
    for name, work, data in (("mapper.feed", _feed_only, chunks), ("mapper.sse_to_partial", _sse_to_partial, streams)):
        work(data)  # warm-up
        rates = []
        for _ in range(repetitions):
            start = time.perf_counter()
            events = sum(work(data) for _ in range(rounds))
            rates.append(events / (time.perf_counter() - start))
        rows.append(
            Result.of(
                name, "events/s", rates, targets=(TARGET,),
                parameters={"streams": len(streams), "events_per_sample": events, "threads": 1},
            )  # fmt: skip
        )
    return rows

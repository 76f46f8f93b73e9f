"""1. Profile mapper throughput: chunk streams recorded from real vLLM -> profile events, in-process.

Rows (events/s, one sample per repetition, single thread = one core):

* ``mapper.feed``: ``ChatStreamMapper.feed`` over the normal-form chunks production hands it (the profile
  mapping alone; the chunks are made once, before timing, by the binding's parser);
* ``mapper.sse_to_partial``: what the server does per chunk before the transport — vLLM's ``data: …``
  strings through :func:`vllm_nnrp_plugin.vllm_binding.chunk_shapes.vllm_chunks` (parsing, normalising, the
  one seam production uses), ``feed``, and encode each event as a numbered partial result
  (:class:`~vllm_nnrp_plugin.core.operation.Operation`, one per stream with its observation record).

Input: every recorded ``.sse`` stream of compat/fixtures/vllm/0.26.0 (and shared fixtures of other vLLM lines
when present), replayed round-robin.
"""

from __future__ import annotations

import asyncio
import pathlib
import time

from bench.results import Result, Target
from vllm_nnrp_plugin.core.operation import Operation
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import VLLMStream, vllm_chunks

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "compat" / "fixtures" / "vllm" / "0.26.0"
TARGET = Target("p50", ">=", 300_000)


def recorded_streams() -> list[list[str]]:
    """The strings vLLM's generator yielded for every recorded chat stream (``data: …\\n\\n`` each, ``[DONE]``
    last); the ``responses-*`` recordings are Responses streams, not this mapper's input."""
    return [
        [block + "\n\n" for block in path.read_text().split("\n\n") if block.strip()]
        for path in sorted(FIXTURES.glob("*.sse"))
        if not path.name.startswith("responses-")
    ]


def normal_form(stream: list[str]) -> list:
    """The chunks :func:`vllm_chunks` yields for ``stream`` (through its core, :class:`VLLMStream`): dicts, text-only
    ones as :class:`~vllm_nnrp_plugin.profile.chat_stream.TextDelta`."""
    parser = VLLMStream()
    return [chunk for item in stream for chunk in parser.feed(item)] + parser.end()


def _feed_only(chunks: list[list[dict]], rounds: int) -> int:
    events = 0
    for _ in range(rounds):
        for stream in chunks:
            mapper = ChatStreamMapper()
            for chunk in stream:
                events += len(mapper.feed(chunk))
            mapper.completed_body()
    return events


def _sse_to_partial(streams: list[list[str]], rounds: int) -> int:
    return asyncio.run(_sse_to_partial_async(streams, rounds))  # one event loop per sample, as the server's


async def _sse_to_partial_async(streams: list[list[str]], rounds: int) -> int:
    events = 0
    for _ in range(rounds):
        for stream in streams:
            mapper = ChatStreamMapper()
            operation = Operation(
                Observation(
                    connection_id=1,
                    session_id=1,
                    operation_id=1,
                    frame_id=1,
                    transport="tcp",
                    submitted_ns=0,
                    submitted_unix_ns=0,
                )
            )
            async for chunk in vllm_chunks(_replay(stream)):
                for event in mapper.feed(chunk):
                    operation.take(operation.partial(event))  # queued, then taken and encoded for sending
            operation.complete(mapper.completed_body())
            events += operation.events_sent
    return events


async def _replay(stream: list[str]):
    for item in stream:
        yield item


def run(repetitions: int = 30, rounds: int = 200) -> list[Result]:
    """``repetitions`` samples, each replaying every recorded stream ``rounds`` times."""
    streams = recorded_streams()
    chunks = [normal_form(s) for s in streams]
    rows = []
    for name, work, data in (("mapper.feed", _feed_only, chunks), ("mapper.sse_to_partial", _sse_to_partial, streams)):
        work(data, 1)  # warm-up
        rates = []
        for _ in range(repetitions):
            start = time.perf_counter()
            events = work(data, rounds)
            rates.append(events / (time.perf_counter() - start))
        rows.append(
            Result.of(
                name,
                "events/s",
                rates,
                targets=(TARGET,),
                parameters={"streams": len(streams), "events_per_sample": events, "threads": 1},
            )
        )
    return rows

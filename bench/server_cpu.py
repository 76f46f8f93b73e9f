"""The plugin's server path alone, per chunk: the CPU time :mod:`bench.server` (listener, wire core, session
policy, the operation's lifecycle table, adapter, profile mapper over vLLM's chunk shapes, in front of a paced
synthetic backend: no vLLM, no model) spends per backend chunk while clients in this process stream from it.

    python -m bench.server_cpu [--server-root DIR] [--streams 64] [--sessions 8] [--chunks 2000]
                               [--interval-us 4000] [--json FILE]

``streams`` operations at once over ``sessions`` sessions of one connection (the project's asyncio client,
:func:`vllm_nnrp_plugin.client.connect`), each ``chunks`` chunks one per ``interval_us`` µs; the server's CPU
time (s, every thread, from its exit line) over the chunks is ``us_per_chunk``. ``--server-root`` runs the server
from another checkout (a tree before a change: the wire protocol is the same, the client stays this one's), so two
trees can be alternated on one machine. One JSON object: ``streams``, ``sessions``, ``chunks`` (in all), ``events``
(received: one per chunk unless the server merged deltas, plus one terminal per stream), ``cpu_s``,
``us_per_chunk``. Results: docs/benchmarks/README.md (Load on an agent server).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys

import orjson

from bench.procs import ROOT, BenchServer
from compat.launcher import free_port
from vllm_nnrp_plugin.client import connect
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION


async def stream_all(uri: str, streams: int, sessions: int, chunks: int, interval_us: int) -> int:
    """Run ``streams`` paced streams over ``sessions`` sessions of one connection; the events received."""
    body = {"messages": [], "stream": True, "n": chunks, "interval_us": interval_us}
    envelope = {"schema_version": SCHEMA_VERSION, "operation": CHAT_COMPLETIONS_CREATE, "body": body}
    conn = await connect(uri)
    try:
        opened = [await conn.open_session() for _ in range(sessions)]

        async def one(session) -> int:
            return sum([1 async for _ in session.submit(envelope)])

        counts = await asyncio.gather(*(one(opened[i % sessions]) for i in range(streams)))
    finally:
        await conn.close()
    return sum(counts)


def run(
    server_root: pathlib.Path = ROOT,
    *,
    streams: int = 64,
    sessions: int = 8,
    chunks: int = 2000,
    interval_us: int = 4000,
) -> dict:
    with BenchServer(f"tcp://127.0.0.1:{free_port()}", root=server_root) as server:
        events = asyncio.run(stream_all(server.uri, streams, sessions, chunks, interval_us))
        server.stop()  # stdin closed: the server stops and reports its CPU time
    return {
        "server_root": str(server_root),
        "streams": streams,
        "sessions": sessions,
        "chunks": streams * chunks,
        "events": events,
        "cpu_s": round(server.cpu_s, 6),
        "us_per_chunk": round(server.cpu_s * 1e6 / (streams * chunks), 2),
    }


def parser() -> argparse.ArgumentParser:
    """The ``python -m bench.server_cpu`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m bench.server_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-root", type=pathlib.Path, default=ROOT, help="checkout the server runs from")
    parser.add_argument("--streams", type=int, default=64, help="operations at once")
    parser.add_argument("--sessions", type=int, default=8, help="sessions they share (one connection)")
    parser.add_argument("--chunks", type=int, default=2000, help="chunks per stream")
    parser.add_argument("--interval-us", type=int, default=4000, help="µs between a stream's chunks")
    parser.add_argument("--json", help="also write the result to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = run(
        args.server_root.resolve(),
        streams=args.streams,
        sessions=args.sessions,
        chunks=args.chunks,
        interval_us=args.interval_us,
    )
    text = orjson.dumps(result).decode()
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The plugin's server path alone, per chunk: the CPU time :mod:`bench.server` (listener, wire core, session
policy, the operation's lifecycle table, adapter, profile mapper over vLLM's chunk shapes, in front of a paced
synthetic backend: no vLLM, no model) spends per backend chunk while clients in this process stream from it.

    python -m bench.server_cpu [--server-root DIR ...] [--rounds 1] [--server-cpu N] [--instructions]
                               [--streams 64] [--sessions 8] [--chunks 2000] [--interval-us 4000] [--json FILE]

``streams`` operations at once over ``sessions`` sessions of one connection (the project's asyncio client,
:func:`vllm_nnrp_plugin.client.connect`), each ``chunks`` chunks one per ``interval_us`` µs; the server's CPU
time (s, every thread, from its exit line) over the chunks is ``us_per_chunk``. ``--server-root`` runs the server
from another checkout (a tree before a change: the wire protocol is the same, the client stays this one's).

Given several times, the trees are measured **side by side**: each round starts one server per tree and streams
the same load to all of them at the same time (the start order rotates from round to round), so the machine's
drift between runs (about ±10 % here) falls on every tree alike; ``--server-cpu N`` runs every server on CPU N and
this process on the others. The per-round difference to the first tree is the figure to read (``diff_us``: its
median and the rounds in which the tree was dearer).

``--instructions`` counts instead what the server executes per chunk, under valgrind's callgrind (installed
separately): each tree's server runs once with ``chunks`` and once with ``chunks // 5`` chunks per stream, and the
difference in instructions (``Ir``), data reads and writes, and first-level cache misses, over the difference in
chunks, is the cost of one chunk, start-up left out. Under valgrind the server runs about 50 times slower and no
longer keeps the pace, so this is the work of a chunk with the most batching the loop allows, free of timing noise.

One JSON object: ``streams``, ``sessions``, ``chunks`` (per server and round), ``rounds``, and ``servers``: per
tree ``server_root``, ``events`` (received per round: one per chunk unless the server merged deltas, plus one
terminal per stream), ``cpu_s`` and ``us_per_chunk`` per round, ``median_us_per_chunk``, ``diff_us`` (after the
first tree: ``median`` and ``dearer_rounds``); with ``--instructions``, per tree ``per_chunk`` (callgrind's event
names → count per chunk) instead. Results: docs/benchmarks/README.md (Load on an agent server).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import statistics
import sys
import tempfile
from collections.abc import Sequence

from bench.procs import ROOT, BenchServer
from bench.results import emit
from compat.launcher import free_port
from vllm_nnrp_plugin.client import connect
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION

#: callgrind's events with ``--cache-sim=yes``: instructions, data reads, data writes, and the misses of the first
#: level instruction cache, data reads and data writes
CALLGRIND_EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw")


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


def _round(
    roots: Sequence[pathlib.Path], streams: int, sessions: int, chunks: int, interval_us: int, server_cpu: int | None
) -> list[tuple[int, float]]:
    """One server per tree (started in ``roots``' order), the same load on each at once: per tree, the events
    received and the server's CPU time (s)."""
    with contextlib.ExitStack() as started:
        servers = [started.enter_context(BenchServer(f"tcp://127.0.0.1:{free_port()}", root=root)) for root in roots]
        if server_cpu is not None:
            for server in servers:
                os.sched_setaffinity(server.proc.pid, {server_cpu})

        async def all_at_once() -> list[int]:
            return await asyncio.gather(*(stream_all(s.uri, streams, sessions, chunks, interval_us) for s in servers))

        events = asyncio.run(all_at_once())
        for server in servers:
            server.stop()  # stdin closed: the server stops and reports its CPU time
    return [(n, server.cpu_s) for n, server in zip(events, servers, strict=True)]


def run(
    server_roots: Sequence[pathlib.Path] = (ROOT,),
    *,
    streams: int = 64,
    sessions: int = 8,
    chunks: int = 2000,
    interval_us: int = 4000,
    rounds: int = 1,
    server_cpu: int | None = None,
) -> dict:
    """``rounds`` rounds of every tree in ``server_roots`` side by side (module docstring); the JSON object."""
    if server_cpu is not None:
        os.sched_setaffinity(0, (os.sched_getaffinity(0) - {server_cpu}) or {server_cpu})
    roots = list(server_roots)
    per_root: dict[int, list[tuple[int, float]]] = {i: [] for i in range(len(roots))}
    for r in range(rounds):
        order = [(i + r) % len(roots) for i in range(len(roots))]  # who starts first rotates
        measured = _round([roots[i] for i in order], streams, sessions, chunks, interval_us, server_cpu)
        for i, one in zip(order, measured, strict=True):
            per_root[i].append(one)
    servers = []
    for i, root in enumerate(roots):
        us = [round(cpu_s * 1e6 / (streams * chunks), 2) for _, cpu_s in per_root[i]]
        server = {
            "server_root": str(root),
            "events": [n for n, _ in per_root[i]],
            "cpu_s": [round(cpu_s, 6) for _, cpu_s in per_root[i]],
            "us_per_chunk": us,
            "median_us_per_chunk": round(statistics.median(us), 2),
        }
        if i:
            diffs = [b - a for a, b in zip(servers[0]["us_per_chunk"], us, strict=True)]
            server["diff_us"] = {
                "median": round(statistics.median(diffs), 2),
                "dearer_rounds": sum(d > 0 for d in diffs),
            }
        servers.append(server)
    return {"streams": streams, "sessions": sessions, "chunks": streams * chunks, "rounds": rounds, "servers": servers}


def _callgrind_totals(path: pathlib.Path) -> dict[str, int]:
    """The ``events:`` names and ``summary:`` (or ``totals:``) counts of a callgrind output file."""
    names: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            return dict(zip(names, map(int, line.split()[1:]), strict=True))
    raise RuntimeError(f"{path}: no summary line")


def instructions(
    server_roots: Sequence[pathlib.Path] = (ROOT,),
    *,
    streams: int = 64,
    sessions: int = 8,
    chunks: int = 2000,
    interval_us: int = 4000,
) -> dict:
    """Per tree, what its server executes per chunk under callgrind (module docstring); the JSON object."""
    fewer = max(1, chunks // 5)
    servers = []
    with tempfile.TemporaryDirectory() as tmp:
        for root in server_roots:
            totals = []
            for n in (fewer, chunks):
                out = pathlib.Path(tmp) / f"callgrind-{len(servers)}-{n}.out"
                wrapper = ["valgrind", "-q", "--tool=callgrind", "--cache-sim=yes", f"--callgrind-out-file={out}"]
                with BenchServer(f"tcp://127.0.0.1:{free_port()}", root=root, wrapper=wrapper) as server:
                    asyncio.run(stream_all(server.uri, streams, sessions, n, interval_us))
                    server.stop(timeout_s=1800)
                totals.append(_callgrind_totals(out))
            per_chunk = {
                e: round((totals[1][e] - totals[0][e]) / (streams * (chunks - fewer)), 1) for e in CALLGRIND_EVENTS
            }
            servers.append({"server_root": str(root), "per_chunk": per_chunk})
    return {"streams": streams, "sessions": sessions, "chunks": [streams * fewer, streams * chunks], "servers": servers}


def parser() -> argparse.ArgumentParser:
    """The ``python -m bench.server_cpu`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m bench.server_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-root", type=pathlib.Path, action="append", help="checkout a server runs from (repeat: side by side)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every tree side by side")
    parser.add_argument("--server-cpu", type=int, help="run every server on this CPU and this process on the others")
    parser.add_argument("--instructions", action="store_true", help="count instructions per chunk (callgrind)")
    parser.add_argument("--streams", type=int, default=64, help="operations at once")
    parser.add_argument("--sessions", type=int, default=8, help="sessions they share (one connection)")
    parser.add_argument("--chunks", type=int, default=2000, help="chunks per stream")
    parser.add_argument("--interval-us", type=int, default=4000, help="µs between a stream's chunks")
    parser.add_argument("--json", help="also write the result to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    roots = [root.resolve() for root in args.server_root or [ROOT]]
    load = {"streams": args.streams, "sessions": args.sessions, "chunks": args.chunks, "interval_us": args.interval_us}
    if args.instructions:
        result = instructions(roots, **load)
    else:
        result = run(roots, rounds=args.rounds, server_cpu=args.server_cpu, **load)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

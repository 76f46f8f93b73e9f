"""2. Streaming event latency: backend chunk produced -> event received by a real NNRP client in another
process, over TCP and IPC, at a light and a heavy load.

The server is :mod:`bench.server` (the plugin's real server path before a paced synthetic backend); clients
are separate processes (``python -m bench.event_latency --client …``), each with nnrp-py client sessions
polled by one thread each (``max_events=1``). A sample is ``time.monotonic_ns()`` right after the client's
poll returned the partial result, minus the timestamp the backend wrote into the chunk (the host's monotonic
clock is shared by all processes); an event the server merged from several chunks gives one sample per chunk.

* light: 1 stream, one chunk every ``interval_us`` µs (default 2000: 500 events/s); over TCP also with the
  listener's TCP_NODELAY step disabled (nnrp-py alone, Nagle on);
* heavy: 64 concurrent streams whose paces add up to ``rate`` events/s (default 30 000), spread over client
  processes and sessions in two layouts — ``heavy``: 4 streams per session (2 processes × 8 sessions), and
  ``heavy_session_per_stream``: 64 sessions of one stream (4 processes × 16 sessions); ``heavy_8k`` is the
  first layout at 8 000 events/s, a rate a 2-CPU machine sustains. The achieved aggregate rate is reported
  next to the latencies: when it stays below the asked rate the server is saturated and the latencies are
  those of a growing backlog.

The first ``warmup`` events of each stream are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time

import orjson

from bench.procs import BenchServer, endpoint, run_clients
from bench.results import Result, Target, percentile
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION

LIGHT_P50, LIGHT_P95, HEAVY_P95 = Target("p50", "<=", 100), Target("p95", "<=", 300), Target("p95", "<=", 2000)


def stream_envelope(n: int, interval_us: int) -> dict:
    body = {"messages": [], "stream": True, "n": n, "interval_us": interval_us}
    return {"schema_version": SCHEMA_VERSION, "operation": CHAT_COMPLETIONS_CREATE, "body": body}


def client_main(uri: str, sessions: int, streams: int, n: int, interval_us: int, warmup: int) -> dict:
    """One client process: ``sessions`` sessions with ``streams`` streams each; returns latencies (ns) and
    the receive window."""
    clients = [asyncio.run(ProfileClient.connect(uri)) for _ in range(sessions)]
    latencies: list[list[int]] = [[] for _ in clients]
    window = [[0, 0] for _ in clients]
    start = threading.Barrier(len(clients))

    def pump(i: int) -> None:
        client, out = clients[i], latencies[i]
        start.wait()
        seen: dict[int, int] = {}
        ops = [client.submit(stream_envelope(n, interval_us)).operation_id for _ in range(streams)]
        open_ops = set(ops)
        first = 0
        deadline = time.monotonic() + 60 + n * interval_us / 1e6
        while open_ops and time.monotonic() < deadline:
            for operation_id, event in client.poll(100):
                received = time.monotonic_ns()
                if event.terminal:
                    open_ops.discard(operation_id)
                    continue
                for stamp in event.event["delta"].split():  # one per chunk the backend produced
                    count = seen[operation_id] = seen.get(operation_id, 0) + 1
                    if count > warmup:
                        out.append(received - int(stamp))
                        first = first or received
                        window[i][1] = received
        window[i][0] = first
        if open_ops:
            raise TimeoutError(f"{len(open_ops)} streams did not finish")

    threads = [threading.Thread(target=pump, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for client in clients:
        client.close()
    return {
        "latencies_ns": [x for per in latencies for x in per],
        "first_ns": min(w[0] for w in window if w[0]),
        "last_ns": max(w[1] for w in window),
    }


def measure(
    transport: str,
    *,
    streams: int,
    procs: int,
    sessions: int,
    n: int,
    interval_us: int,
    warmup: int,
    nodelay: bool = True,
) -> tuple[list[float], float, dict[str, float]]:
    """Latencies (µs), the achieved aggregate rate (events/s) and the server-side :func:`breakdown` of one
    configuration."""
    per_session = streams // (procs * sessions)
    assert per_session * procs * sessions == streams, "streams must divide evenly over processes and sessions"
    with tempfile.TemporaryDirectory() as tmp, BenchServer(endpoint(transport, tmp), nodelay=nodelay) as server:
        args = [
            "--client",
            server.uri,
            "--sessions",
            str(sessions),
            "--streams",
            str(per_session),
            "--n",
            str(n),
            "--interval-us",
            str(interval_us),
            "--warmup",
            str(warmup),
        ]
        outputs = run_clients("bench.event_latency", [args] * procs)
        server.stop()
    samples = [x / 1000 for out in outputs for x in out["latencies_ns"]]
    window_s = (max(o["last_ns"] for o in outputs) - min(o["first_ns"] for o in outputs)) / 1e9
    return samples, len(samples) / window_s if window_s > 0 else 0.0, breakdown(server, chunks=streams * n)


def breakdown(server: BenchServer, chunks: int) -> dict[str, float]:
    """The server's CPU time (µs, every thread: backend, adapter, pumps, senders) per chunk the backend produced
    and per event sent (fewer events than chunks when deltas merged while waiting), the events sent, and
    p50/p95 (µs) of the server-side parts of each event's latency: waiting in the session's outbox, and inside
    nnrp-py's native send."""
    return {
        "server_cpu_us_per_chunk": round(server.cpu_s * 1e6 / max(1, chunks), 1),
        "server_cpu_us_per_event": round(server.cpu_s * 1e6 / max(1, len(server.send_us)), 1),
        "events_sent": len(server.send_us),
        "pump_wait_us_p50": round(percentile(server.pump_wait_us, 0.5), 1),
        "pump_wait_us_p95": round(percentile(server.pump_wait_us, 0.95), 1),
        "sdk_send_us_p50": round(percentile(server.send_us, 0.5), 1),
        "sdk_send_us_p95": round(percentile(server.send_us, 0.95), 1),
    }


def run(
    *,
    light_events: int = 1500,
    interval_us: int = 2000,
    heavy_streams: int = 64,
    rate: int = 30_000,
    heavy_seconds: float = 3.0,
    layouts: tuple[tuple[str, int, int, int | None], ...] = (
        ("heavy", 2, 8, None),
        ("heavy_session_per_stream", 4, 16, None),
        ("heavy_8k", 2, 8, 8000),
    ),
    warmup: int = 20,
) -> list[Result]:
    """Light rows (TCP, TCP without NODELAY, IPC) then heavy rows (TCP, IPC) for each ``(name, client
    processes, sessions per process, rate or None for ``rate``)`` layout."""
    rows: list[Result] = []
    light = {"streams": 1, "interval_us": interval_us, "events_per_stream": light_events}
    for transport, nodelay in (("tcp", True), ("tcp", False), ("ipc", True)):
        samples, achieved, parts = measure(
            transport,
            streams=1,
            procs=1,
            sessions=1,
            n=light_events + warmup,
            interval_us=interval_us,
            warmup=warmup,
            nodelay=nodelay,
        )
        name = f"event_latency.light.{transport}" + ("" if nodelay else "_without_nodelay")
        rows.append(
            Result.of(
                name,
                "us",
                samples,
                targets=(LIGHT_P50, LIGHT_P95) if nodelay else (),
                parameters={**light, "achieved_events_per_s": round(achieved), **parts},
            )
        )
    for layout, procs, sessions, layout_rate in layouts:
        interval = round(heavy_streams * 1e6 / (layout_rate or rate))
        n = int(heavy_seconds * 1e6 / interval) + warmup
        for transport in ("tcp", "ipc"):
            samples, achieved, parts = measure(
                transport,
                streams=heavy_streams,
                procs=procs,
                sessions=sessions,
                n=n,
                interval_us=interval,
                warmup=warmup,
            )
            rows.append(
                Result.of(
                    f"event_latency.{layout}.{transport}",
                    "us",
                    samples,
                    targets=() if layout_rate else (HEAVY_P95,),
                    parameters={
                        "streams": heavy_streams,
                        "client_processes": procs,
                        "sessions": procs * sessions,
                        "interval_us": interval,
                        "target_events_per_s": layout_rate or rate,
                        "achieved_events_per_s": round(achieved),
                        **parts,
                    },
                )
            )
    by_id = {row.id: row for row in rows}
    by_id["event_latency.light.ipc"].versus(by_id["event_latency.light.tcp"])
    by_id["event_latency.light.tcp_without_nodelay"].versus(by_id["event_latency.light.tcp"])
    for layout, *_ in layouts:
        by_id[f"event_latency.{layout}.ipc"].versus(by_id[f"event_latency.{layout}.tcp"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="client process of bench.event_latency")
    parser.add_argument("--client", required=True)
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--interval-us", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    a = parser.parse_args()
    result = client_main(a.client, a.sessions, a.streams, a.n, a.interval_us, a.warmup)
    sys.stdout.buffer.write(orjson.dumps(result))


if __name__ == "__main__":
    main()

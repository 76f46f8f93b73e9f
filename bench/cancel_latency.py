"""3. Cancellation latency over the real NNRP path, client in another process than the server.

The client (``python -m bench.cancel_latency --client …``) starts a stream paced at one chunk every
``interval_us`` µs (so events keep coming while the cancel travels), reads ``after`` events, takes
``t_cancel = time.monotonic_ns()`` and sends FRAME_CANCEL, then reads until the terminal drop. The server's
observation records (:mod:`bench.server`) give, on the same monotonic clock:

* ``cancel.no_more_events``: t_cancel -> the last partial result the server sent (0 when it sent none after
  the cancel): how long events kept leaving after the client cancelled;
* ``cancel.server_saw_cancel``: t_cancel -> the session pump handled the cancel;
* ``cancel.abort_issued``: t_cancel -> the adapter issued the backend (vLLM) abort;
* ``cancel.client_terminal``: t_cancel -> the client received the terminal drop.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

import orjson

from bench.event_latency import stream_envelope
from bench.procs import BenchServer, endpoint, run_clients
from bench.results import Result, Target
from vllm_nnrp_plugin.client import ProfileClient

NO_MORE_EVENTS = Target("p95", "<=", 1000)


def client_main(uri: str, operations: int, after: int, interval_us: int) -> list[dict]:
    """Per operation: ``operation_id``, ``cancel_ns``, ``terminal_ns``, ``events`` received."""
    client = asyncio.run(ProfileClient.connect(uri))
    out = []
    try:
        for _ in range(operations):
            op = client.submit(stream_envelope(100_000, interval_us))
            stream = client.events(op, timeout_s=30)
            for _ in range(after):
                next(stream)
            cancel_ns = time.monotonic_ns()
            client.cancel(op)
            received = after
            for event in stream:
                received += 1
                if event.terminal:
                    out.append(
                        {
                            "operation_id": op.operation_id,
                            "cancel_ns": cancel_ns,
                            "terminal_ns": time.monotonic_ns(),
                            "events": received - 1,
                            "frame": event.frame,
                        }
                    )
    finally:
        client.close()
    return out


def run(*, operations: int = 200, after: int = 5, interval_us: int = 500) -> list[Result]:
    rows: list[Result] = []
    for transport in ("tcp", "ipc"):
        with tempfile.TemporaryDirectory() as tmp, BenchServer(endpoint(transport, tmp)) as server:
            args = [
                "--client",
                server.uri,
                "--operations",
                str(operations),
                "--after",
                str(after),
                "--interval-us",
                str(interval_us),
            ]
            (client,) = run_clients("bench.cancel_latency", [args])
            records = {r["operation_id"]: r for r in server.stop()}
        no_more, saw, abort, terminal = [], [], [], []
        for c in client:
            r = records[c["operation_id"]]
            assert c["frame"] == "result_drop" and r["outcome"] == "cancelled", (c, r)
            no_more.append(max(0, (r["last_event_ns"] or 0) - c["cancel_ns"]) / 1000)
            saw.append((r["cancel_ns"] - c["cancel_ns"]) / 1000)
            abort.append((r["abort_ns"] - c["cancel_ns"]) / 1000)
            terminal.append((c["terminal_ns"] - c["cancel_ns"]) / 1000)
        params = {"operations": operations, "cancel_after_events": after, "interval_us": interval_us}
        rows += [
            Result.of(
                f"cancel.no_more_events.{transport}", "us", no_more, targets=(NO_MORE_EVENTS,), parameters=params
            ),
            Result.of(f"cancel.server_saw_cancel.{transport}", "us", saw, parameters=params),
            Result.of(f"cancel.abort_issued.{transport}", "us", abort, parameters=params),
            Result.of(f"cancel.client_terminal.{transport}", "us", terminal, parameters=params),
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="client process of bench.cancel_latency")
    parser.add_argument("--client", required=True)
    parser.add_argument("--operations", type=int, required=True)
    parser.add_argument("--after", type=int, required=True)
    parser.add_argument("--interval-us", type=int, required=True)
    a = parser.parse_args()
    sys.stdout.buffer.write(orjson.dumps(client_main(a.client, a.operations, a.after, a.interval_us)))


if __name__ == "__main__":
    main()

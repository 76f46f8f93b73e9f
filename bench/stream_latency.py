"""Latency of a short stream through the real NNRP path, server and client in separate processes.

The server process runs the plugin's NNRPService (listener, session pumps, adapter) with a synthetic backend
that answers every request at once with N text deltas; the client process (this one) is the package's
nnrp-py client. Per operation it records submit -> terminal (whole operation) and first event -> terminal
(the burst of N-1 events plus the terminal, where Nagle shows), and reports median and p95.

Rows, run side by side in one invocation: TCP (TCP_NODELAY set by the listener, the shipped behaviour),
TCP with that step disabled (what nnrp-py does alone), and IPC.

    python bench/stream_latency.py [--ops 200] [--events 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_nnrp_plugin.adapter import ChatCall
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.config import NNRPConfig
from vllm_nnrp_plugin.nnrp_binding import nodelay
from vllm_nnrp_plugin.service import NNRPService


class SyntheticBackend:
    """Answers at once with ``body["n"]`` one-token deltas (no model: this measures the adapter + NNRP)."""

    async def create_chat_completion(self, body, request_id):
        async def chunks():
            for i in range(body["n"]):
                yield {"id": request_id, "created": 0, "model": "synthetic",
                       "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]}  # fmt: skip

        return ChatCall(stream=chunks())

    async def abort(self, request_id):
        pass


async def serve(uri: str, with_nodelay: bool) -> None:
    if not with_nodelay:
        nodelay.NoDelaySetter.apply = lambda self: 0
    loop = asyncio.get_running_loop()
    service = NNRPService(NNRPConfig(enabled=True, listen=(uri,)), SyntheticBackend(), loop)
    service.start()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await service.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(uri: str, ops: int, n_events: int) -> tuple[list[float], list[float]]:
    client = asyncio.run(ProfileClient.connect(uri))
    envelope = {
        "schema_version": "openai-compatible/1",
        "operation": "chat.completions.create",
        "body": {"messages": [], "stream": True, "n": n_events},
    }
    whole, burst = [], []
    try:
        for i in range(ops + 20):
            start = time.perf_counter()
            first = None
            for event in client.events(client.submit(envelope), timeout_s=10):
                first = first or time.perf_counter()
            end = time.perf_counter()
            if i >= 20:  # warm-up
                whole.append((end - start) * 1000)
                burst.append((end - first) * 1000)
    finally:
        client.close()
    return whole, burst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--events", type=int, default=5, help="text deltas per stream (the terminal comes after)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--no-nodelay", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, not args.no_nodelay))
        return

    tmp = tempfile.mkdtemp()
    rows = [
        ("TCP (listener sets TCP_NODELAY)", f"tcp://127.0.0.1:{free_port()}", []),
        ("TCP, TCP_NODELAY step disabled", f"tcp://127.0.0.1:{free_port()}", ["--no-nodelay"]),
        ("IPC (unix socket)", f"unix://{tmp}/bench.sock", []),
    ]
    print(f"{args.events}-event stream + terminal, {args.ops} operations each, server in another process\n")
    print("| carrier | submit -> terminal p50 / p95 (ms) | first event -> terminal p50 / p95 (ms) |")
    print("|---|---|---|")
    for name, uri, flags in rows:
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", uri, *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout.readline().strip() == "ready"
            whole, burst = measure(uri, args.ops, args.events)
        finally:
            server.stdin.close()
            server.wait(30)
        print(
            f"| {name} | {statistics.median(whole):.2f} / {percentile(whole, 0.95):.2f} "
            f"| {statistics.median(burst):.2f} / {percentile(burst, 0.95):.2f} |"
        )
    print(f"\nmachine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()

"""``python -m bench.carrier_probe``: each carrier's cancel path and threads, in one process, without vLLM.

A :class:`tests.support.ServedNNRP` (the service on its own event-loop thread, standing in for vLLM's loop, with
the recorded backend) listens on ``tcp://``, ``ws://`` and ``quic://``; nnrp-py's native client (the oracle,
:class:`vllm_nnrp_plugin.client.ProfileClient`) runs in the same process. Per carrier:

* ``cancel_to_abort_us``: ``operations`` streams paced at one chunk per ``pace_us`` µs; after ``after`` events the
  client takes ``time.monotonic_ns()`` and sends FRAME_CANCEL; the backend's ``abort`` records the same clock:
  client cancel -> backend (vLLM) abort called, µs, p50 / p95 / p99;
* ``threads``: the process's threads (``/proc/self/task``) with one session open, then with ``sessions`` open on
  one connection: what the server side adds per session (the client's native runtime keeps its own threads,
  the same for every count).

It runs against whatever the checkout holds, so the same command measures a runtime before and after a change
(``docs/benchmarks/carriers-probe*.json``). Prints one JSON object (and writes it to ``--json PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import tempfile
import time

from bench.results import emit, percentile
from tests.support import ServedNNRP, envelope, free_port, self_signed


def _stream(pace_us: int) -> dict:
    return envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": pace_us / 1e6, "repeat": 1000})


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def probe(uri: str, der: bytes, backend, *, operations: int, after: int, pace_us: int, sessions: int) -> dict:
    from nnrp.client import NativeClientSessionOptions

    from vllm_nnrp_plugin.client import ProfileClient

    aborted_ns: dict[str, int] = {}
    real_abort = backend.abort

    async def abort(operation, request_id):
        aborted_ns.setdefault(request_id, time.monotonic_ns())
        await real_abort(operation, request_id)

    backend.abort = abort
    client = asyncio.run(ProfileClient.connect(uri, trusted_cert_der=der))
    latencies = []
    try:
        for _ in range(operations):
            started = len(backend.started)
            op = client.submit(_stream(pace_us))
            events = client.events(op, timeout_s=30)
            for _ in range(after):
                next(events)
            cancel_ns = time.monotonic_ns()
            client.cancel(op)
            assert list(events)[-1].terminal
            request_id = backend.started[started]
            waited_until = time.monotonic() + 5  # the terminal may come before the abort (a runtime on threads)
            while request_id not in aborted_ns and time.monotonic() < waited_until:
                time.sleep(0.0002)
            latencies.append((aborted_ns[request_id] - cancel_ns) / 1000)
        one = _threads()

        async def open_more():
            return [await client.connection.open_session(NativeClientSessionOptions()) for _ in range(sessions - 1)]

        asyncio.run(open_more())
        time.sleep(0.5)
        many = _threads()
    finally:
        client.close()
        backend.abort = real_abort
    return {
        "cancel_to_abort_us": {
            "p50": percentile(latencies, 0.5),
            "p95": percentile(latencies, 0.95),
            "p99": percentile(latencies, 0.99),
            "samples": len(latencies),
        },
        "threads": {"one_session": one, f"{sessions}_sessions": many, "added": many - one},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.carrier_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--operations", type=int, default=200, help="cancelled streams per carrier")
    p.add_argument("--after", type=int, default=5, help="events read before each cancel")
    p.add_argument("--pace-us", type=int, default=500, help="µs between the chunks of a stream")
    p.add_argument("--sessions", type=int, default=256, help="sessions opened on one connection for the thread count")
    p.add_argument("--carriers", default="tcp,ws,quic", help="comma-separated: tcp, ws, wss, quic")
    p.add_argument("--json", help="also write the result to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cert, key, der = self_signed(pathlib.Path(tmp))
        carriers = args.carriers.split(",")
        listen = {
            "tcp": f"tcp://127.0.0.1:{free_port()}",
            "ws": f"ws://127.0.0.1:{free_port()}/nnrp",
            "wss": f"wss://127.0.0.1:{free_port()}/nnrp",
            "quic": f"quic://127.0.0.1:{free_port()}",
        }
        served = ServedNNRP(
            tuple(listen[c] for c in carriers),
            tls_cert_file=cert,
            tls_key_file=key,
            max_sessions=args.sessions + 8,
            max_connections=4096,
        )
        try:
            out = {
                carrier: probe(
                    uri,
                    der,
                    served.backend,
                    operations=args.operations,
                    after=args.after,
                    pace_us=args.pace_us,
                    sessions=args.sessions,
                )
                for carrier, uri in zip(carriers, served.bound, strict=True)
            }
        finally:
            served.stop()
    out["command"] = "python -m bench.carrier_probe " + " ".join(argv if argv is not None else sys.argv[1:])
    emit(out, args.json, indent=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

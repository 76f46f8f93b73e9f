"""6. Hostile clients: what a misbehaving client can make the server process hold, measured from outside.

    python -m bench.hostile [--json FILE] [--server-root DIR]

Starts :mod:`bench.server` (the plugin's real listener, sessions and adapter in front of a paced synthetic
backend, default settings) on a loopback TCP port and, one after the other:

* **slowloris**: 1000 connections that never complete CLIENT_HELLO (half silent, half with 7 bytes of a
  header); the server's open file descriptors (``/proc/<pid>/fd``) before, with them open, and once the
  handshake timeout (``nnrp.handshake_timeout_ms``, 10 s) has passed;
* **stalled packets**: 200 connections that open a session and then send 1.9 MB of a 2 MB FRAME_SUBMIT and
  stall (380 MB in all); the server's RSS (``VmRSS`` of ``/proc/<pid>/status``) before, with them stalled (how
  many the server ended: ``nnrp.max_buffered_bytes``, 256 MiB), and after they closed;
* **non-reading flood**: one client sends PINGs for 6 s and reads nothing; the server's RSS before and at the
  end, the bytes the client managed to send, and a well-behaved client's time for one streamed answer (8
  chunks) on its own connection, p50/max of 10 tries during the flood.

``--server-root`` runs the server from another checkout (``git worktree add DIR REV``): the same clients
against an earlier tree, for a before/after. Each figure is one run on a shared machine: a bound shows as a number that
stays flat whatever the client sends; absolute times are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import statistics
import sys
import threading
import time

from nnrp.core.enums import MessageType as T

from bench.procs import ROOT, BenchServer
from bench.results import emit
from compat.launcher import free_port
from vllm_nnrp_plugin.client.aio.connection import connect
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.nnrp_wire.framing import encode

STREAM = {
    "schema_version": "openai-compatible/1",
    "operation": "chat.completions.create",
    "body": {"model": "paced", "messages": [], "stream": True, "n": 8, "interval_us": 1000},
}


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def opened(port: int) -> tuple[socket.socket, int]:
    client = ClientConnection()
    client.open_session()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(client.data_to_send())
    sock.settimeout(10)
    events: list = []
    while not events:
        events = client.receive_data(sock.recv(65536))
    (accepted,) = events
    assert isinstance(accepted, ev.SessionOpenAccepted), accepted
    return sock, accepted.session_id


def answer_s(uri: str) -> float:
    async def main() -> float:
        started = time.monotonic()
        conn = await connect(uri)
        try:
            session = await conn.open_session()
            events = [event async for event in session.submit(STREAM)]
            assert events[-1]["type"] == "response.completed", events[-1]
        finally:
            await conn.close()
        return time.monotonic() - started

    return asyncio.run(asyncio.wait_for(main(), 30))


def slowloris(pid: int, port: int) -> dict:
    before = fds(pid)
    socks = []
    for n in range(1000):
        sock = socket.create_connection(("127.0.0.1", port))
        if n % 2:
            sock.sendall(b"NNRP\x01\x00\x01")
        socks.append(sock)
    time.sleep(2)
    held = fds(pid)
    time.sleep(11)
    after = fds(pid)
    for sock in socks:
        sock.close()
    return {"fds_before": before, "fds_with_1000_stalled": held, "fds_after_timeout": after}


def stalled_packets(pid: int, port: int) -> dict:
    before = rss_mb(pid)
    socks, ended = [], 0
    for _ in range(200):
        sock, sid = opened(port)
        packet = encode(T.FRAME_SUBMIT, sid, 1, b"\0" * 72, b"\0" * 2_000_000)
        try:
            sock.sendall(packet[:1_900_000])
        except OSError:
            ended += 1
        socks.append(sock)
    time.sleep(2)
    held = rss_mb(pid)
    for sock in socks:
        sock.settimeout(0.05)
        try:
            if sock.recv(1) == b"":
                ended += 1
        except TimeoutError:
            pass
        except OSError:  # reset: aborted by the server
            ended += 1
        sock.close()
    time.sleep(2)
    return {
        "rss_mb_before": round(before, 1),
        "rss_mb_with_200_stalled": round(held, 1),
        "connections_ended_by_the_budget": ended,
        "rss_mb_after_close": round(rss_mb(pid), 1),
    }


def non_reading_flood(pid: int, port: int) -> dict:
    before = rss_mb(pid)
    sock, sid = opened(port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    chunk = encode(T.PING, sid, 0) * 4096
    sent, stop = 0, threading.Event()

    def flood() -> None:
        nonlocal sent
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                sock.sendall(chunk)
                sent += len(chunk)
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=flood)
    thread.start()
    time.sleep(1)
    latencies = [answer_s(f"tcp://127.0.0.1:{port}") for _ in range(10)]
    time.sleep(max(0.0, 6 - 1 - sum(latencies)))
    end = rss_mb(pid)
    stop.set()
    thread.join(5)
    sock.close()
    return {
        "rss_mb_before": round(before, 1),
        "rss_mb_after_6s_flood": round(end, 1),
        "flood_bytes_sent": sent,
        "other_client_answer_ms_p50": round(statistics.median(latencies) * 1000, 1),
        "other_client_answer_ms_max": round(max(latencies) * 1000, 1),
    }


def run(server_root: pathlib.Path = ROOT) -> dict:
    port = free_port()
    with BenchServer(f"tcp://127.0.0.1:{port}", root=server_root) as server:
        pid = server.proc.pid
        results = {"baseline_answer_ms": round(answer_s(server.uri) * 1000, 1)}
        results["slowloris"] = slowloris(pid, port)
        results["stalled_packets"] = stalled_packets(pid, port)
        results["non_reading_flood"] = non_reading_flood(pid, port)
        server.stop()
        return results


def parser() -> argparse.ArgumentParser:
    """The ``python -m bench.hostile`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--server-root", type=pathlib.Path, default=ROOT, help="checkout the server runs from")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    emit(run(args.server_root.resolve()), args.json, indent=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

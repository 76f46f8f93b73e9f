"""Soak: many NNRP sessions with concurrent streams, random cancels, client timeouts, closed sessions and
killed client processes against a real ``vllm serve``; reports three numbers:

* **operations lost** (target 0): an operation a live client submitted that got no terminal. At the end of
  the run every client cancels what is still running and waits ``--drain-s`` for the drop; an operation
  still without a terminal then is lost (so is one without a terminal ``--lost-after-s`` after its submit).
* **vLLM requests still running after the load stops** (target 0): ``vllm:num_requests_running`` +
  ``vllm:num_requests_waiting`` from vLLM's own ``/metrics``, ``--settle-s`` after the last client exited.
* **RSS growth of the API-server process** (target < 5 %): VmRSS after the warm-up (first 10 % of the run, at
  most 60 s) against VmRSS after the load stopped.

Client behaviour per operation (chosen at random, seeded): read to the end; cancel (FRAME_CANCEL) after a
few deltas; client-side timeout (give up after 0.2–3 s and cancel; ``--deadline-ms N`` also puts the
server-side bound ``nnrp.timeout_ms: N`` in every envelope);
close the whole session with streams in flight (then reopen). Every ``--kill-every-s`` one client process
is SIGKILLed mid-stream and replaced. Clients are ``--workers`` processes with one thread per session.

Against a server that is already running::

    python -m bench.soak --nnrp tcp://127.0.0.1:9400,unix:///tmp/nnrp.sock --http http://127.0.0.1:8000 \\
        --pid <vllm serve pid> --model-name example-model --duration-s 600 --json out.json

or let it start one through :mod:`compat.launcher` (CPU, the small model, the installed line's attach path)::

    python -m bench.soak --start-server MODEL_DIR --duration-s 600 --json docs/benchmarks/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict, deque
from typing import Any

from bench import procs

PROMPTS = ["Say hello.", "Count to ten.", "Name three colours.", "Write one sentence about the sea."]


# -- client worker process ---------------------------------------------------------------------------------


def _plan(rng: random.Random) -> dict[str, Any]:
    roll = rng.random()
    if roll < 0.45:
        return {"kind": "complete"}
    if roll < 0.70:
        return {"kind": "cancel", "after_events": rng.randint(1, 6)}
    if roll < 0.95:
        return {"kind": "timeout", "after_s": rng.uniform(0.2, 3.0)}
    return {"kind": "close_session", "after_events": rng.randint(1, 4)}


class _Op:
    __slots__ = ("native", "plan", "submitted", "events", "cancelled_at")

    def __init__(self, native: Any, plan: dict[str, Any]) -> None:
        self.native = native
        self.plan = plan
        self.submitted = time.monotonic()
        self.events = 0
        self.cancelled_at: float | None = None


def _session_loop(uri: str, args: argparse.Namespace, seed: int, stop: threading.Event, out) -> None:
    from vllm_nnrp_plugin.client import ClientError, ProfileClient

    rng = random.Random(seed)

    def report(outcome: str, **extra: Any) -> None:
        out(json.dumps({"outcome": outcome, **extra}))

    def envelope() -> dict[str, Any]:
        body = {
            "model": args.model_name,
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(4, args.max_tokens),
            "stream": True,
        }
        env = {"schema_version": "openai-compatible/1", "operation": "chat.completions.create", "body": body}
        if args.deadline_ms:
            env["nnrp"] = {"timeout_ms": args.deadline_ms}
        return env

    while not stop.is_set():
        try:
            client = asyncio.run(ProfileClient.connect(uri))
        except ClientError as exc:  # counted: a session the server did not open
            report("open_failed", error=type(exc).__name__)
            time.sleep(0.5)
            continue
        ops: dict[int, _Op] = {}
        pending: defaultdict[int, deque] = defaultdict(deque)  # events polled, per operation id
        close_now = False
        try:
            while not close_now:
                draining = stop.is_set()
                while not draining and len(ops) < args.streams:
                    native = client.submit(envelope())
                    ops[native.operation_id] = _Op(native, _plan(rng))
                if not ops:
                    break
                for operation_id, polled in client.poll(5):
                    pending[operation_id].append(polled)
                now = time.monotonic()
                for op_id, op in list(ops.items()):
                    queue = pending.get(op_id)
                    while queue:
                        event = queue.popleft()
                        if not event.terminal:
                            op.events += 1
                            continue
                        del ops[op_id]
                        pending.pop(op_id, None)
                        kind = event.event.get("type") if event.event else event.frame
                        code = (event.event or {}).get("error", {}).get("code") if kind == "response.error" else None
                        report(
                            "terminal", plan=op.plan["kind"], type=kind, code=code, seconds=round(now - op.submitted, 3)
                        )
                        break
                    if op_id not in ops:
                        continue
                    plan = op.plan
                    should_cancel = draining or (
                        (plan["kind"] == "cancel" and op.events >= plan["after_events"])
                        or (plan["kind"] == "timeout" and now - op.submitted >= plan["after_s"])
                    )
                    if op.cancelled_at is None and should_cancel:
                        op.cancelled_at = now
                        try:
                            client.cancel(op.native)
                        except ClientError:
                            pass  # finished meanwhile: its terminal is on the way
                    if plan["kind"] == "close_session" and op.events >= plan["after_events"] and not draining:
                        close_now = True
                    waited = now - (op.cancelled_at if op.cancelled_at is not None else op.submitted)
                    limit = args.drain_s if op.cancelled_at is not None else args.lost_after_s
                    if waited > limit:
                        del ops[op_id]
                        report("lost", plan=plan["kind"], events=op.events, cancelled=op.cancelled_at is not None)
            for op in ops.values():  # the session closes with these in flight: the server must abort them
                report("abandoned", plan=op.plan["kind"])
        finally:
            client.close()
        if stop.is_set():
            return


def _worker(args: argparse.Namespace) -> None:
    uris = args.nnrp.split(",")
    stop = threading.Event()
    lock = threading.Lock()

    def out(line: str) -> None:
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [
        threading.Thread(
            target=_session_loop, args=(uris[i % len(uris)], args, args.seed * 1000 + i, stop, out), daemon=True
        )
        for i in range(args.worker_sessions)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out(json.dumps({"outcome": "worker_done"}))


# -- driver ------------------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def vllm_requests(http: str) -> float:
    """Running + waiting requests, from vLLM's own /metrics."""
    text = urllib.request.urlopen(f"{http}/metrics", timeout=10).read().decode()
    total = 0.0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        total += sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))
    return total


class _Worker:
    def __init__(self, args: argparse.Namespace, index: int, generation: int, counts: Counter, lock: threading.Lock):
        command = [
            sys.executable,
            "-m",
            "bench.soak",
            "--worker",
            "--nnrp",
            args.nnrp,
            "--model-name",
            args.model_name,
            "--worker-sessions",
            str(args.sessions // args.workers),
            "--streams",
            str(args.streams),
            "--max-tokens",
            str(args.max_tokens),
            "--seed",
            str(args.seed * 100 + index * 10 + generation),
            "--lost-after-s",
            str(args.lost_after_s),
            "--drain-s",
            str(args.drain_s),
            "--deadline-ms",
            str(args.deadline_ms),
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=procs.env(), cwd=procs.ROOT)
        self.done = False
        self._reader = threading.Thread(target=self._read, args=(counts, lock), daemon=True)
        self._reader.start()

    def _read(self, counts: Counter, lock: threading.Lock) -> None:
        for line in self.proc.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by SIGKILL
            if record["outcome"] == "worker_done":
                self.done = True
                continue
            key = record["outcome"]
            if key == "terminal":
                key = f"terminal:{record['type']}" + (f":{record['code']}" if record.get("code") else "")
            elif key == "lost":
                print("LOST", record, file=sys.stderr, flush=True)
            with lock:
                counts[key] += 1
                counts[f"plan:{record.get('plan')}"] += 1 if record["outcome"] == "terminal" else 0

    def join(self) -> None:
        self._reader.join()


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the load for ``args.duration_s`` seconds; returns the result document (also printed)."""
    counts: Counter = Counter()
    lock = threading.Lock()
    rng = random.Random(args.seed)
    workers = [_Worker(args, i, 0, counts, lock) for i in range(args.workers)]
    killed_procs: list[_Worker] = []
    start = time.monotonic()
    warmup_s = min(60.0, args.duration_s * 0.1)
    rss_warm = None
    rss_series = []
    next_kill = start + args.kill_every_s
    kills = 0
    while (now := time.monotonic()) < start + args.duration_s:
        if rss_warm is None and now - start >= warmup_s:
            rss_warm = rss_bytes(args.pid)
        if now >= next_kill and args.kill_every_s > 0:
            index = rng.randrange(len(workers))
            victim = workers[index]
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            killed_procs.append(victim)
            kills += 1
            workers[index] = _Worker(args, index, kills, counts, lock)
            next_kill = now + args.kill_every_s
        if int(now - start) % 30 == 0:
            rss_series.append((round(now - start), rss_bytes(args.pid)))
        time.sleep(1)
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(args.drain_s + 60)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            counts["worker_hung"] += 1
        w.join()
    for w in killed_procs:
        w.join()
    load_s = time.monotonic() - start
    deadline = time.monotonic() + args.settle_s
    still = vllm_requests(args.http)
    while still and time.monotonic() < deadline:
        time.sleep(0.5)
        still = vllm_requests(args.http)
    rss_end = rss_bytes(args.pid)
    rss_warm = rss_warm or rss_end
    terminals = sum(v for k, v in counts.items() if k.startswith("terminal:"))
    result = {
        "duration_s": round(load_s, 1),
        "sessions": args.sessions,
        "streams_per_session": args.streams,
        "workers": args.workers,
        "client_processes_killed": kills,
        "operations_with_terminal": terminals,
        "operations_lost": counts["lost"],
        "operations_abandoned_by_closed_sessions": counts["abandoned"],
        "sessions_not_opened": counts["open_failed"],
        "workers_hung": counts["worker_hung"],
        "outcomes": dict(sorted((k, v) for k, v in counts.items() if k.startswith("terminal:"))),
        "vllm_requests_after_load": still,
        "api_server_rss_after_warmup_mib": round(rss_warm / 2**20, 1),
        "api_server_rss_after_load_mib": round(rss_end / 2**20, 1),
        "api_server_rss_growth_pct": round(100.0 * (rss_end - rss_warm) / rss_warm, 2),
        "api_server_rss_series_mib": [(t, round(r / 2**20, 1)) for t, r in rss_series],
    }
    print(json.dumps(result, indent=2))
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nnrp", help="comma-separated NNRP URIs (sessions are spread over them)")
    p.add_argument("--http", help="vLLM's HTTP base URL (for /metrics)")
    p.add_argument("--pid", type=int, help="pid of the API-server process (for RSS)")
    p.add_argument("--start-server", metavar="MODEL_DIR", help="start vllm serve with the plugin on this model")
    p.add_argument("--model-name", default="example-model")
    p.add_argument("--duration-s", type=float, default=600)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--streams", type=int, default=4, help="concurrent streams per session")
    p.add_argument("--workers", type=int, default=4, help="client processes")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kill-every-s", type=float, default=20)
    p.add_argument("--lost-after-s", type=float, default=300)
    p.add_argument("--drain-s", type=float, default=30)
    p.add_argument("--settle-s", type=float, default=15)
    p.add_argument("--deadline-ms", type=int, default=0)
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-sessions", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        _worker(args)
        return
    server = None
    if args.start_server:
        import tempfile

        from compat.launcher import free_port, serve_with_nnrp

        workdir = tempfile.mkdtemp(prefix="nnrp-soak-")
        args.nnrp = f"tcp://127.0.0.1:{free_port()},unix://{workdir}/nnrp.sock"
        server = serve_with_nnrp(args.start_server, workdir, listen=args.nnrp.split(","))
        server.wait_ready()
        args.http, args.pid = server.http, server.pid
        print(f"vllm serve ready (pid {args.pid}, log {server.log})", file=sys.stderr, flush=True)
    try:
        result = run_soak(args)
        result["command"] = " ".join(sys.argv)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

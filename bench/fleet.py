"""Fleet: two real ``vllm serve`` replicas restarted one at a time (SIGTERM, start again), or one killed
(SIGKILL), while streams run through the NNRP client's fleet mode, through HAProxy (``mode tcp``) over NNRP, and
through the same HAProxy over HTTP/SSE (``mode http``). Loopback only, bounded in time and count.

    python -m bench.fleet [--model DIR] [--streams 64] [--max-tokens 32] [--modes fleet,haproxy-nnrp,...]
                          [--scenario rolling|kill|both] [--json FILE]

Replicas: the tiny random-weight model of :mod:`bench.tiny_model` (``--load-format dummy``), served with
:func:`compat.launcher.serve_with_nnrp`, NNRP on ``tcp://127.0.0.2:P`` and ``tcp://127.0.0.3:P`` (the whole
127/8 is loopback), HTTP on 127.0.0.1; ``nnrp.drain_timeout_ms`` :data:`DRAIN_MS`. HAProxy (Debian's package,
``haproxy`` on ``PATH``) listens on 127.0.0.4: NNRP in ``mode tcp`` with a TCP health check of each replica's
NNRP port, HTTP in ``mode http`` with ``GET /health`` checks (:data:`HAPROXY_CFG`); a mode whose HAProxy is missing
is skipped with a note.

Modes (each its own run of the scenario):

* ``fleet``: ``AsyncNNRPTransport([replica 1, replica 2])`` (the client's fleet mode, no balancer);
* ``haproxy-nnrp-fleet``: ``AsyncNNRPTransport(["tcp://127.0.0.4:P"])`` (fleet mode over one balancer address);
* ``haproxy-nnrp``: ``AsyncNNRPTransport("tcp://127.0.0.4:P")`` (the single-address client, for comparison);
* ``haproxy-http``: the SDK's own HTTP client to ``http://127.0.0.4:H/v1``.

Every worker (``--streams`` of them, one ``AsyncOpenAI`` with ``max_retries=0`` so that the SDK's own retries hide
nothing) streams ``chat.completions.create`` calls (``--max-tokens``, ``ignore_eos``) one after the other until the
scenario ends. Each call ends as: ``ok``; ``failed_unstarted`` (an error before its first chunk: what a client
that knew the fleet could have saved); ``cut`` (a typed error after chunks: ``APIConnectionError`` / ``APIError``);
``hung`` (no chunk for :data:`SILENCE_S`, or the call outlived :data:`CALL_S`). For ``kill`` the delay from the
SIGKILL to each cut stream's error is kept (``cut_after_kill_s``, the largest).

Scenarios: ``rolling`` — :data:`SETTLE_S` of load, then each replica in turn: SIGTERM, wait for its exit, start it
again on the same addresses, wait until it serves, :data:`SETTLE_S` more; ``kill`` — :data:`SETTLE_S` of load,
SIGKILL of replica 1, :data:`SETTLE_S` more (replica 1 is started again afterwards for the next mode);
``placement`` — replica 1 served with ``--slow-max-num-seqs`` (it grants that many operations per session),
replica 2 with ``--max-num-seqs``, :data:`PLACEMENT_S` of load through the fleet mode: the requests each replica's
vLLM finished (``vllm:request_success_total``) show the spread.

Prints one Markdown table (and writes JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import orjson

from bench import tiny_model
from compat.launcher import SERVED_NAME, free_port, serve_with_nnrp

#: ``nnrp.drain_timeout_ms`` of the replicas (ms)
DRAIN_MS = 20_000
#: load before, between and after the restarts (s)
SETTLE_S = 8.0
#: a stream silent this long is hung (s)
SILENCE_S = 30.0
#: a call running this long is hung (s)
CALL_S = 120.0
#: how long past the drain's grace a SIGTERM'd replica may take to exit before it is killed (s)
EXIT_WAIT_S = 40.0
#: load of the placement scenario (s)
PLACEMENT_S = 20.0
#: longest wait for a replica to serve after its start (s)
START_S = 600.0
MODES = ("fleet", "haproxy-nnrp-fleet", "haproxy-nnrp", "haproxy-http")
REPLICA_HOSTS = ("127.0.0.2", "127.0.0.3")
BALANCER_HOST = "127.0.0.4"

HAPROXY_CFG = """\
global
    log stdout format raw local0 warning
defaults
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    retries 3
    option redispatch
frontend nnrp
    bind {balancer}:{nnrp_port}
    mode tcp
    default_backend nnrp_replicas
backend nnrp_replicas
    mode tcp
    balance leastconn
    default-server check inter 500ms fall 1 rise 2
{nnrp_servers}
frontend http
    bind {balancer}:{http_port}
    mode http
    default_backend http_replicas
backend http_replicas
    mode http
    balance leastconn
    option httpchk GET /health
    default-server check inter 500ms fall 1 rise 2
{http_servers}
"""


class Replica:
    """One ``vllm serve`` of the tiny model: NNRP on ``nnrp`` (tcp URI), HTTP on 127.0.0.1:``http_port``."""

    def __init__(
        self, model: str, workdir: str, host: str, nnrp_port: int, http_port: int, max_num_seqs: int, cpu: int = 0
    ) -> None:
        self.model, self.workdir, self.max_num_seqs, self.cpu = model, workdir, max_num_seqs, cpu
        self.nnrp = f"tcp://{host}:{nnrp_port}"
        self.host, self.nnrp_port, self.http_port = host, nnrp_port, http_port
        self.server: Any = None
        self.starts = 0

    def start(self) -> None:
        config = {"nnrp": {"drain_timeout_ms": DRAIN_MS, "max_sessions": 1024}}
        self.starts += 1
        self.server = serve_with_nnrp(
            self.model,
            self.workdir,
            listen=(self.nnrp,),
            port=self.http_port,
            log=f"{self.workdir}/vllm-{self.host}-{self.starts}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": str(self.cpu)},  # one core per replica's engine
            extra_args=(
                "--load-format",
                "dummy",
                "--max-num-seqs",
                str(self.max_num_seqs),
                "--additional-config",
                orjson.dumps(config).decode(),
            ),
        )

    def wait_ready(self) -> None:
        self.server.wait_ready(START_S)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # NNRP listens just before vLLM's "startup complete"
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.nnrp_port), timeout=1):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{self.nnrp} does not accept connections")
        self.warm()

    def warm(self) -> None:
        """Two short chats over HTTP: the engine's first requests after a start are not measured."""
        body = orjson.dumps({"model": SERVED_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi."}]})
        for _ in range(2):
            request = urllib.request.Request(
                f"{self.server.http}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=START_S) as response:
                response.read()

    def terminate(self) -> tuple[float, bool]:
        """SIGTERM and wait for the exit: (the seconds it took, whether it exited by itself). A replica still up
        :data:`EXIT_WAIT_S` after the drain's grace (vLLM's HTTP server waits for every open HTTP connection,
        which a balancer may keep) is killed."""
        t0 = time.monotonic()
        self.server.proc.send_signal(signal.SIGTERM)
        try:
            self.server.proc.wait(DRAIN_MS / 1000 + EXIT_WAIT_S)
            exited = True
        except subprocess.TimeoutExpired:
            self.kill()
            return time.monotonic() - t0, False
        self.server._log_file.close()
        return time.monotonic() - t0, exited

    def kill(self) -> None:
        self.server.proc.send_signal(signal.SIGKILL)
        self.server.proc.wait(60)
        with contextlib.suppress(ProcessLookupError):  # the engine process the API server started
            for child in _children(self.server.pid):
                os.kill(child, signal.SIGKILL)
        self.server._log_file.close()

    def drain_lines(self) -> list[str]:
        """The NNRP drain lines of this replica's logs."""
        out = []
        for log in sorted(pathlib.Path(self.workdir).glob(f"vllm-{self.host}-*.log")):
            out += [
                line[line.index("NNRP drain") :]
                for line in log.read_text(errors="replace").splitlines()
                if "NNRP drain" in line
            ]
        return out

    def stop(self) -> None:
        if self.server is not None and self.server.proc.poll() is None:
            self.server.stop()


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


class Balancer:
    """HAProxy in front of the replicas (:data:`HAPROXY_CFG`)."""

    def __init__(self, workdir: str, replicas: list[Replica], nnrp_port: int, http_port: int) -> None:
        cfg = HAPROXY_CFG.format(
            balancer=BALANCER_HOST,
            nnrp_port=nnrp_port,
            http_port=http_port,
            nnrp_servers="\n".join(f"    server r{n} {r.host}:{r.nnrp_port}" for n, r in enumerate(replicas)),
            http_servers="\n".join(f"    server r{n} 127.0.0.1:{r.http_port}" for n, r in enumerate(replicas)),
        )
        path = pathlib.Path(workdir) / "haproxy.cfg"
        path.write_text(cfg)
        self.nnrp = f"tcp://{BALANCER_HOST}:{nnrp_port}"
        self.http = f"http://{BALANCER_HOST}:{http_port}/v1"
        self.proc = subprocess.Popen(["haproxy", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((BALANCER_HOST, nnrp_port), timeout=1):
                return
            time.sleep(0.1)
        raise RuntimeError("haproxy did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# -- the load ------------------------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.counts = {"ok": 0, "failed_unstarted": 0, "cut": 0, "hung": 0}
        self.errors: dict[str, int] = {}
        self.samples: dict[str, str] = {}  # one message per kind of error
        self.cut_at: list[float] = []

    def add(self, outcome: str, error: BaseException | None = None, at: float | None = None) -> None:
        self.counts[outcome] += 1
        if error is not None:
            name = f"{outcome}:{type(error).__name__}"
            self.errors[name] = self.errors.get(name, 0) + 1
            self.samples.setdefault(name, str(error)[:300])
        if outcome == "cut" and at is not None:
            self.cut_at.append(at)


def sdk_for(mode: str, replicas: list[Replica], balancer: Balancer | None) -> Any:
    import httpx
    import openai

    from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport

    lib = httpx
    with contextlib.suppress(ImportError):
        import httpx2

        if int(openai.__version__.split(".")[0]) >= 3:
            lib = httpx2
    if mode == "haproxy-http":
        return openai.AsyncOpenAI(
            base_url=balancer.http,
            api_key="unused",
            max_retries=0,
            http_client=lib.AsyncClient(limits=lib.Limits(max_connections=1000)),
        )
    target: Any = {
        "fleet": [r.nnrp for r in replicas],
        "haproxy-nnrp-fleet": [balancer.nnrp] if balancer else None,
        "haproxy-nnrp": balancer.nnrp if balancer else None,
    }[mode]
    return openai.AsyncOpenAI(
        base_url="http://nnrp.invalid/v1",
        api_key="unused",
        max_retries=0,
        http_client=lib.AsyncClient(transport=AsyncNNRPTransport(target)),
    )


async def one_call(sdk: Any, max_tokens: int, tally: Tally) -> None:
    got = 0
    t0 = time.monotonic()
    try:
        stream = await asyncio.wait_for(
            sdk.chat.completions.create(
                model=SERVED_NAME,
                messages=[{"role": "user", "content": "Count."}],
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            ),
            SILENCE_S,
        )
        iterator = stream.__aiter__()
        while True:
            remaining = CALL_S - (time.monotonic() - t0)
            try:
                await asyncio.wait_for(iterator.__anext__(), min(SILENCE_S, max(remaining, 0.001)))
            except StopAsyncIteration:
                break
            got += 1
        tally.add("ok")
    except TimeoutError as exc:
        tally.add("hung", exc)
    except Exception as exc:  # noqa: BLE001 — every typed error of the SDK is counted by its class
        tally.add("cut" if got else "failed_unstarted", exc, time.monotonic())


async def load(sdk: Any, streams: int, max_tokens: int, stop: asyncio.Event, tally: Tally) -> None:
    async def worker() -> None:
        while not stop.is_set():
            await one_call(sdk, max_tokens, tally)

    await asyncio.gather(*(worker() for _ in range(streams)))


async def scenario(
    kind: str, mode: str, replicas: list[Replica], balancer: Balancer | None, streams: int, max_tokens: int
) -> dict[str, Any]:
    sdk = sdk_for(mode, replicas, balancer)
    tally, stop = Tally(), asyncio.Event()
    started = time.monotonic()
    running = asyncio.ensure_future(load(sdk, streams, max_tokens, stop, tally))
    steps: list[str] = []
    killed_at = None
    await asyncio.sleep(SETTLE_S)
    counted = [_requests(r) for r in replicas]
    if kind == "placement":
        await asyncio.sleep(PLACEMENT_S)
    elif kind == "rolling":
        for replica in replicas:
            took, exited = await asyncio.to_thread(replica.terminate)
            steps.append(
                f"{replica.host} stopped in {took:.1f} s"
                if exited
                else f"{replica.host} still up {took:.0f} s after SIGTERM: killed"
            )
            await asyncio.to_thread(replica.start)
            await asyncio.to_thread(replica.wait_ready)
            await asyncio.sleep(SETTLE_S)
    else:
        killed_at = time.monotonic()
        await asyncio.to_thread(replicas[0].kill)
        await asyncio.sleep(SETTLE_S)
    stop.set()
    try:
        await asyncio.wait_for(running, CALL_S + 10)
    except TimeoutError:
        tally.add("hung")
    with contextlib.suppress(Exception):
        await sdk.close()
    if kind == "kill":
        await asyncio.to_thread(replicas[0].start)
        await asyncio.to_thread(replicas[0].wait_ready)
    row: dict[str, Any] = {
        "scenario": kind,
        "mode": mode,
        "streams": streams,
        "max_tokens": max_tokens,
        "seconds": round(time.monotonic() - started, 1),
        **tally.counts,
        "errors": tally.errors,
        "samples": tally.samples,
        "steps": steps,
    }
    if kind == "placement":
        row["per_replica"] = {
            f"{r.host} (--max-num-seqs {r.max_num_seqs})": _requests(r) - n
            for r, n in zip(replicas, counted, strict=True)
        }
    if killed_at is not None:
        late = [at - killed_at for at in tally.cut_at if at >= killed_at]
        row["cut_after_kill_s"] = round(max(late), 3) if late else None
    return row


def _requests(replica: Replica) -> float:
    """Requests the replica's vLLM finished so far (its ``vllm:request_success_total``); 0 when it is down."""
    try:
        return replica.server.metric("vllm:request_success_total")
    except Exception:  # noqa: BLE001 — a replica being restarted has no /metrics
        return 0.0


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | path | calls ok | failed before first chunk | cut mid-stream (typed error) | hung | errors | s |"
    )
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (
            f"; slowest cut after the kill {r['cut_after_kill_s']} s" if r.get("cut_after_kill_s") is not None else ""
        )
        if r.get("per_replica"):
            extra += "; requests per replica: " + ", ".join(f"{k} {v:.0f}" for k, v in r["per_replica"].items())
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"
        out.append(
            f"| {r['scenario']} | {r['mode']} | {r['ok']} | {r['failed_unstarted']} | {r['cut']} | {r['hung']} "
            f"| {errors}{extra} | {r['seconds']} |"
        )
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.fleet`` (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("VLLM_NNRP_TEST_MODEL"), help="source model directory")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--scenario", choices=["rolling", "kill", "both", "placement"], default="both")
    p.add_argument(
        "--slow-max-num-seqs",
        type=int,
        default=8,
        help="placement: the first replica's --max-num-seqs (the second has --max-num-seqs)",
    )
    p.add_argument("--json", help="write the rows there too")
    p.add_argument("--workdir", help="keep the replicas' logs there (default: a temporary directory)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.model:
        raise SystemExit("bench fleet: give --model or set VLLM_NNRP_TEST_MODEL")
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"bench fleet: unknown mode {mode!r}; use {', '.join(MODES)}")
    scenarios = ["rolling", "kill"] if args.scenario == "both" else [args.scenario]
    if args.scenario == "placement":
        modes = [m for m in modes if not m.startswith("haproxy")] or ["fleet"]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(workdir, exist_ok=True)
        tiny = str(tiny_model.build(args.model))
        nnrp_port = free_port()
        replicas = [
            Replica(tiny, workdir, host, nnrp_port, free_port(), args.max_num_seqs, n % (os.cpu_count() or 1))
            for n, host in enumerate(REPLICA_HOSTS)
        ]
        if args.scenario == "placement":
            replicas[0].max_num_seqs = args.slow_max_num_seqs
        balancer = None
        try:
            for replica in replicas:
                replica.start()
            for replica in replicas:
                replica.wait_ready()
            if any(m.startswith("haproxy") for m in modes):
                if shutil.which("haproxy"):
                    balancer = Balancer(workdir, replicas, free_port(), free_port())
                else:
                    print("bench fleet: haproxy is not installed; its modes are skipped", file=sys.stderr)
                    modes = [m for m in modes if not m.startswith("haproxy")]
            for kind in scenarios:
                for mode in modes:
                    print(f"bench fleet: {kind} / {mode} …", file=sys.stderr, flush=True)
                    row = asyncio.run(scenario(kind, mode, replicas, balancer, args.streams, args.max_tokens))
                    row["drain_lines"] = [line for r in replicas for line in r.drain_lines()][-4:]
                    print(orjson.dumps(row).decode(), file=sys.stderr, flush=True)
                    rows.append(row)
        finally:
            if balancer is not None:
                balancer.stop()
            for replica in replicas:
                replica.stop()
    print(table(rows))
    if args.json:
        pathlib.Path(args.json).write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""5. Load: many concurrent streams through one real ``vllm serve``, NNRP against vLLM's own HTTP/SSE.

The server serves the tiny model of :mod:`bench.tiny_model` (``--load-format dummy``: a forward pass that costs
almost nothing), so what is measured is the serving around the model: the API-server process (vLLM's HTTP
server and OpenAI layer, detokenisation, the plugin's NNRP sessions) and the engine. Started through
:func:`compat.launcher.serve_with_nnrp` with ``--max-num-seqs`` of at least 256 (enough for the largest
window) and NNRP on a TCP port and a unix socket (``transport`` picks which one the clients use;
``python -m bench load --load-transport ipc``), allowing 1536 NNRP sessions, 1024 in-flight operations and 64
per session (:data:`NNRP_CONFIG`) so that sessions of one window still closing on the server never refuse the
next window's. The NNRP load generator is :mod:`vllm_nnrp_plugin.client.aio.connection` on one event loop per client
process, one task per stream, as the HTTP one is aiohttp.

Per concurrency level (default 32, 128, 256) the same streamed chat request (``max_tokens`` tokens,
``ignore_eos``, ``temperature`` 0, ``include_usage``) runs over HTTP/SSE (``/v1/chat/completions``) and NNRP in
``rounds`` windows each, alternating A/B/B/A. A window is ``concurrency`` streams from
:data:`CLIENT_PROCESSES` client processes (:mod:`bench.load_client`), every stream on its own connection or
NNRP session, all opened before the window starts; it ends when the last stream ended. Levels in ``shared``
(default :data:`SHARED`: 128 as 8 sessions × 16 streams, 256 as 8 × 32) also run NNRP in the agent shape: few
connections, one session each, many operations per session. Rows (id ``load.c<N>.<metric>.<http|nnrp>``, the
agent shape ``load.c<N>.shared<K>.<metric>.nnrp`` for K streams per session):

* ``api_server_cpu_us_per_token``: utime + stime of the API-server process (all its threads, from
  ``/proc/<pid>/stat``) over the window, divided by the window's output tokens (the usages' completion
  tokens), µs; one sample per window;
* ``engine_cpu_us_per_token``: the same for the engine side (the API server's ``VLLM::EngineCore`` child and
  its descendants: the worker), µs;
* ``client_cpu_us_per_token``: the same for the client processes (they share the machine's CPUs with the
  server: a client that costs more leaves less to the server), µs;
* ``tokens_per_s``: the window's output tokens / its wall time; one sample per window;
* ``ttft``: request sent -> first non-empty text delta, ms, per request; ``gap``: between text deltas, ms
  (vLLM merges the pending tokens of a stream whose consumer lags into one chunk, so a slower path shows fewer,
  longer gaps: compare ``samples``);
* ``failed``: failed requests per window (the first error text in the row's note);
* ``…ratio.nnrp_over_http``: the NNRP row's p50 and p95 over the HTTP row's, with the targets;
* the floor (``load.c<N>.<metric>.floor``: ``api_server_cpu_us_per_token``, ``tokens_per_s``, ``failed``), in the
  same alternation: as many requests of the same ``max_tokens`` sent to :data:`bench.drain.PATH`, which the server
  (started with ``--middleware bench.drain.DrainMiddleware``) runs in vLLM's engine client and drains without
  formatting a chunk — what vLLM's own Python output path costs with nothing consuming the stream, under both
  protocols.

The same levels run again on a second server started with ``--stream-interval 8`` (vLLM then sends a chunk
every 8 tokens) where the installed vLLM has that flag (``load.stream_interval_8.c<N>.…``).

Cancel under load (``load.cancel.c<N>.*``): ``cancel_streams`` NNRP streams (default 256 as 8 sessions × 32)
of :data:`RUNNING_TOKENS` tokens, of which ``cancel_sample`` (default 32), spread evenly over them, are
cancelled (FRAME_CANCEL) 5 ms + k × 20 ms after their first text delta (:mod:`bench.load_client`);
``client_cancel_to_terminal_ms`` (at the client: FRAME_CANCEL handed to the transport -> its terminal received),
``server_cancel_to_abort_ms`` (in the API server: the operation's cancel recorded -> vLLM abort issued, the
``cancel_to_abort_ms`` of its log line, :func:`vllm_nnrp_plugin.observability.observation.log_fields`), both ms with p99
in the note; ``no_terminal_within_10s`` (must be 0) and ``failed``.

Connect burst (``load.burst.*``): ``burst_clients`` clients from the client processes released at once, each
connecting (NNRP: connect + open session) and sending one 8-token request; open and served times (ms) and
failures (not served within 10 s), over NNRP and, for comparison, HTTP; then both again while
``burst_load_streams`` NNRP streams (a session each) of :data:`RUNNING_TOKENS` tokens run
(``load.burst_under_load.*``, with ``load_failed`` for those streams).

Idle sessions (``load.idle.*``): the API server's CPU (% of one core, one sample per second) with no client
connected, then with ``idle_sessions`` (default 1000) NNRP sessions open and idle, one connection each; the
difference of the means is the cost of holding idle sessions; ``api_server_threads.sessions_open``: the API
server's thread count (``Threads:`` of ``/proc/<pid>/status``) with them open.

Threads (``load.threads.*``): the API server's thread count (5 readings, 0.5 s apart) with no client connected
(after the warm-up windows: vLLM's executors have started their threads), then with ``thread_sessions``
(default 256) NNRP sessions open and idle, one connection each; ``sessions_minus_no_sessions`` must be 0 (the
NNRP carriers of the project's wire core serve every connection on vLLM's event loop, no thread per session).

Agent server (``python -m bench load --load-tools``; :func:`run` ``tools=True``): the server runs a tool-call parser
as agent deployments do (``--enable-auto-tool-choice --tool-call-parser hermes`` and the Hermes chat template of
``compat/tool_chat_template_hermes.jinja``) and every request of the levels carries one function tool
(:data:`AGENT_TOOL`, ``tool_choice`` auto); ids start ``load.tools.``; the idle, thread, cancel and burst rows and the
``--stream-interval`` server are left out (they do not depend on the parser). vLLM's parser decides what each output
is on both paths: over HTTP/SSE in vLLM's stream generator, over NNRP in the engine lane where the line allows it
(:mod:`vllm_nnrp_plugin.vllm_binding.engine_lane`).

Responses (``python -m bench load --load-responses``, with or without ``--load-tools``; :func:`run`
``responses=True``): the levels as Responses streams — ``POST /v1/responses`` against the ``responses.create``
operation, the same prompt, budget and sampling (:func:`request_body`; the tool in the API's own shape) — ids
``load.responses.…`` / ``load.tools.responses.…``; tokens are the Response's ``usage.output_tokens``.

TLS (``python -m bench load --load-tls``; :func:`run` ``tls=True``): the same measurements with every byte
encrypted. One self-signed certificate (ECDSA P-256, for ``localhost`` and 127.0.0.1, :func:`self_signed`)
serves both protocols: vLLM's own HTTPS (``--ssl-certfile`` / ``--ssl-keyfile``; the HTTP rows are HTTPS/SSE)
and NNRP on ``nnrps://127.0.0.1:PORT`` only (``nnrp.tls_cert_file`` / ``tls_key_file`` in the ``nnrp`` block
of ``--additional-config``: TLS over TCP, :mod:`vllm_nnrp_plugin.nnrp_binding.listener`). The load clients
trust that certificate (``--ca-file``, :mod:`bench.load_client`): aiohttp with an ``ssl.SSLContext`` of it,
the package's client with ``connect(…, trusted_cert_der=…)``. Every id starts ``load.tls.`` instead of
``load.`` (``load.tls.c<N>.…``, ``load.tls.cancel.…``, ``load.tls.burst.…``, ``load.tls.threads.…``, …) and
``nnrp_transport`` is ``tls``. A stream that had to open a new HTTP(S) connection inside its window (vLLM
closes a kept-alive connection idle for 5 s, so a client process whose connections opened long before the
window's go reconnects, TLS handshake included) is counted in the note of the level's ``failed.http`` row.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import pathlib
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import attrs
import orjson

from bench import drain, tiny_model
from bench.e2e import START_TIMEOUT_S, chat_body
from bench.procs import ROOT, env
from bench.results import Result, Target, percentile
from compat.launcher import SERVED_NAME, ServeError, free_port, serve_with_nnrp

LEVELS = (32, 128, 256)
#: the tool every request of the agent-server shape carries (``--load-tools``)
AGENT_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up current information about a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def agent_fields(api: str) -> dict[str, Any]:
    """The fields every request of the agent-server shape adds for ``api`` (``chat`` or ``responses``):
    :data:`AGENT_TOOL` in that API's own tool shape (Responses: ``{"type": "function", "name", …}``) and
    ``tool_choice`` auto."""
    tool = AGENT_TOOL if api == "chat" else {"type": "function", **AGENT_TOOL["function"]}
    return {"tools": [tool], "tool_choice": "auto"}


#: ``vllm serve`` arguments of the agent-server shape
AGENT_SERVER_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--chat-template",
    str(ROOT / "compat" / "tool_chat_template_hermes.jinja"),
)
CLIENT_PROCESSES = 4
PROMPT = "Write a long story about the sea."
NNRP_CONFIG = {"nnrp": {"max_sessions": 1536, "max_in_flight": 1024, "max_in_flight_per_session": 64}}
#: output tokens of the streams that must still be running while others are cancelled or a burst connects
RUNNING_TOKENS = 256
#: the agent shape per level: streams per NNRP session (one session per connection)
SHARED = {128: 16, 256: 32}
CPU_RATIO = Target("p50", "<=", 0.8)
TPS_RATIO = Target("p50", ">=", 1.0)
TTFT_RATIO = Target("p50", "<=", 1.0)
GAP_RATIO = Target("p95", "<=", 1.0)
NO_FAILURE = Target("max", "<=", 0)
SLOWEST_OPEN = Target("max", "<=", 2000)
IDLE_COST = Target("p50", "<=", 2.0)
#: open idle sessions add no thread to the API server
NO_NEW_THREAD = Target("max", "<=", 0)
#: cancels under load: every cancelled stream gets its terminal (the load client gives each 10 s)
ALL_ANSWERED = Target("max", "<=", 0)
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of ``pid`` (every thread), s, from ``/proc/<pid>/stat``."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) * _TICK_S, int(fields[12]) * _TICK_S  # fields 14 and 15 of proc(5)


def cpu_s(pids: Sequence[int]) -> float:
    """utime + stime of ``pids`` (every thread of each), s."""
    return sum(sum(cpu_times(pid)) for pid in pids)


def threads(pid: int) -> int:
    """``pid``'s thread count (``Threads:`` of ``/proc/<pid>/status``)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise RuntimeError(f"no Threads: line in /proc/{pid}/status")


def _children(pid: int) -> list[int]:
    return [
        int(c) for task in pathlib.Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()
    ]


def engine_pids(api_pid: int) -> list[int]:
    """The engine side of a ``vllm serve`` API server: its children named ``VLLM::…`` (``VLLM::EngineCore``,
    set by vLLM with setproctitle) and all their descendants (``VLLM::Worker``). Raises ``RuntimeError``
    when there is none."""
    found = [c for c in _children(api_pid) if pathlib.Path(f"/proc/{c}/cmdline").read_bytes().startswith(b"VLLM::")]
    if not found:
        raise RuntimeError(f"no VLLM::EngineCore child of the API server {api_pid}")
    for pid in found:
        found += [c for c in _children(pid) if c not in found]
    return found


class Clients:
    """``python -m bench.load_client ARGS`` once per argument list, driven through its stdin/stdout handshake."""

    def __init__(self, argument_lists: Sequence[Sequence[str]], workdir: str) -> None:
        self.procs = []
        for args in argument_lists:
            err = tempfile.TemporaryFile(dir=workdir)
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.load_client", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env(),
                cwd=ROOT,
            )
            proc.err = err
            self.procs.append(proc)

    def read(self) -> list[bytes]:
        """Each client's next line. Raises ``RuntimeError`` with a client's stderr when it ended instead."""
        lines = []
        for proc in self.procs:
            line = proc.stdout.readline()
            if not line:
                proc.wait(30)
                proc.err.seek(0)
                raise RuntimeError(f"load client failed ({proc.returncode}): {proc.err.read().decode()[-2000:]}")
            lines.append(line)
        return lines

    def tell(self) -> None:
        for proc in self.procs:
            proc.stdin.write(b"\n")
            proc.stdin.flush()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()
                proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(10)
            proc.err.close()


@attrs.define
class Window:
    """One timed window: the requests' records (see :mod:`bench.load_client`), wall time (s) and the CPU time
    (s) of the API server, of the engine side and of the client processes in it."""

    requests: list[dict[str, Any]]
    wall_s: float
    api_cpu_s: float
    engine_cpu_s: float
    client_cpu_s: float

    @property
    def tokens(self) -> int:
        return sum(r["tokens"] for r in self.requests)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["error"] is not None]


def shares(total: int, parts: int = CLIENT_PROCESSES) -> list[int]:
    """``total`` split over at most ``parts`` client processes (no empty share)."""
    return [n for n in (total // parts + (i < total % parts) for i in range(parts)) if n]


def client_args(
    server: Any,
    mode: str,
    protocol: str,
    count: int,
    body: dict[str, Any],
    *,
    transport: str,
    per_session: int = 1,
    cancel: int = 0,
    api: str = "chat",
) -> list[list[str]]:
    """The :mod:`bench.load_client` argument lists of ``count`` streams (clients, sessions): whole sessions of
    ``per_session`` streams per process, and the ``cancel`` sample split in proportion. ``protocol`` ``floor``:
    HTTP requests to :data:`bench.drain.PATH`. ``api``: ``chat`` or ``responses`` (the client's ``--api``)."""
    target = server.nnrp[transport] if protocol == "nnrp" else server.http
    out = []
    for sessions in shares(-(-count // per_session)):
        n = min(sessions * per_session, count - sum(int(a[3]) for a in out))
        args = [mode, "nnrp" if protocol == "nnrp" else "http", target, str(n), orjson.dumps(body).decode()]
        if protocol == "floor":
            args += ["--path", drain.PATH]
        if api != "chat":
            args += ["--api", api]
        if per_session != 1:
            args += ["--per-session", str(per_session)]
        if cancel:
            args += ["--cancel", str(round(cancel * n / count))]
        out.append(args + _trust(server))
    return out


def _trust(server: Any) -> list[str]:
    """The load client's ``--ca-file`` for a TLS ``server`` (its ``ca_file``), else nothing."""
    ca_file = getattr(server, "ca_file", None)
    return ["--ca-file", ca_file] if ca_file else []


def window(
    server: Any,
    engine: Sequence[int],
    mode: str,
    protocol: str,
    count: int,
    body: dict[str, Any],
    *,
    transport: str,
    workdir: str,
    per_session: int = 1,
    cancel: int = 0,
    api: str = "chat",
) -> Window:
    """Open the clients' connections, then time one window of ``mode`` (``stream`` or ``burst``) of ``api``
    requests."""
    argument_lists = client_args(
        server, mode, protocol, count, body, transport=transport, per_session=per_session, cancel=cancel, api=api
    )
    with Clients(argument_lists, workdir) as clients:
        clients.read()  # ready
        sides = ([server.pid], engine, [p.pid for p in clients.procs])
        before, start = [cpu_s(pids) for pids in sides], time.perf_counter()
        clients.tell()
        outputs = [orjson.loads(line) for line in clients.read()]
        wall = time.perf_counter() - start
        used = [cpu_s(pids) - b for pids, b in zip(sides, before, strict=True)]
        clients.tell()  # close
    return Window([r for out in outputs for r in out["requests"]], wall, *used)


def _progress(what: str, started: float) -> None:
    """A progress line on stderr: ``what`` is done, after how long."""
    print(f"bench load: {what} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def _ratio(id: str, nnrp: Result, http: Result, target: Target | None, parameters: dict[str, Any]) -> Result:
    """``nnrp`` over ``http`` (p50 and p95 ratios; NaN where the HTTP row is 0) as a row of its own."""
    nnrp.versus(http)
    p50, p95 = (float("nan") if r is None else r for r in (nnrp.compare["p50_ratio"], nnrp.compare["p95_ratio"]))
    return Result(
        id=id,
        unit="ratio",
        samples=nnrp.samples,
        p50=p50,
        p95=p95,
        targets=(target,) if target else (),
        parameters=parameters,
    )


def _failed(id: str, windows: Sequence[Window], parameters: dict[str, Any]) -> Result:
    """Failed requests per window; the note has the first error and the count of each kind (the text before
    its first colon: ``TimeoutError``, ``ClientConnectionError``, ``terminal``, ``HTTP 503``, …)."""
    failed = [r for w in windows for r in w.failed]
    kinds: dict[str, int] = {}
    for r in failed:
        kind = r["error"].split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    by_kind = ", ".join(f"{kind} × {n}" for kind, n in kinds.items())
    return Result.of(
        id,
        "requests",
        [len(w.failed) for w in windows],
        targets=(NO_FAILURE,),
        parameters=parameters,
        note=f"first error: {failed[0]['error']}; by kind: {by_kind}" if failed else None,
    )


def request_body(api: str, max_tokens: int) -> dict[str, Any]:
    """The streamed request of the levels: :func:`bench.e2e.chat_body` for ``chat``; for ``responses`` the same
    prompt, budget and sampling as a ``ResponsesRequest`` (``input``, ``max_output_tokens``, vLLM's ``ignore_eos``)."""
    if api == "chat":
        return chat_body(PROMPT, max_tokens)
    return {
        "model": SERVED_NAME,
        "input": PROMPT,
        "max_output_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def levels_rows(
    server: Any,
    engine: Sequence[int],
    prefix: str,
    *,
    levels: Sequence[int],
    rounds: int,
    max_tokens: int,
    transport: str,
    workdir: str,
    parameters: dict[str, Any],
    shared: dict[int, int],
    body_extra: dict[str, Any] | None = None,
    api: str = "chat",
) -> list[Result]:
    """The per-level rows (module docstring), the shapes' windows alternating A/B/B/A: HTTP, NNRP with a
    session per stream and, for a level in ``shared`` (level -> streams per session), NNRP sessions of that
    many streams, and the floor; ``body_extra``: fields added to every request (the agent shape's tools);
    ``api``: ``chat`` or ``responses`` (:func:`request_body`)."""
    body = {**request_body(api, max_tokens), **(body_extra or {})}
    rows: list[Result] = []
    for c in levels:
        shapes = {"http": ("http", 1), "nnrp": ("nnrp", 1)}
        if c in shared:
            shapes[f"shared{shared[c]}"] = ("nnrp", shared[c])
        order = [*shapes, "floor"]
        got: dict[str, list[Window]] = {shape: [] for shape in order}
        started = time.perf_counter()
        for r in range(rounds):
            for shape in order if r % 2 == 0 else order[::-1]:
                protocol, per_session = shapes.get(shape, ("floor", 1))
                got[shape].append(
                    window(
                        server,
                        engine,
                        "stream",
                        protocol,
                        c,
                        body,
                        transport=transport,
                        workdir=workdir,
                        per_session=per_session,
                        api=api,
                    )
                )
        _progress(f"{prefix}.c{c}", started)
        params = {
            **parameters,
            "concurrency": c,
            "client_processes": len(shares(c)),
            "rounds": rounds,
            "max_tokens": max_tokens,
            "nnrp_transport": transport,
        }
        floor = got.pop("floor")
        floor_name = f"{prefix}.c{c}.{{}}.floor"
        rows += [
            Result.of(
                floor_name.format("api_server_cpu_us_per_token"),
                "us",
                [w.api_cpu_s * 1e6 / max(1, w.tokens) for w in floor],
                parameters=params,
            ),
            Result.of(
                floor_name.format("tokens_per_s"), "tokens/s", [w.tokens / w.wall_s for w in floor], parameters=params
            ),
            _failed(floor_name.format("failed"), floor, params),
        ]
        made: dict[tuple[str, str], Result] = {}
        for shape, windows in got.items():
            protocol, per_session = shapes[shape]
            shape_params = (
                params
                if per_session == 1
                else {**params, "streams_per_session": per_session, "sessions": -(-c // per_session)}
            )
            ok = [r for w in windows for r in w.requests if r["error"] is None and r["ttft_ms"] > 0]
            name = f"{prefix}.c{c}.{{}}.{protocol}" if per_session == 1 else f"{prefix}.c{c}.{shape}.{{}}.{protocol}"

            def row(metric: str, unit: str, values: list[float], name: str = name, p: dict = shape_params) -> Result:
                return Result.of(name.format(metric), unit, values, parameters=p)

            made["api", shape] = row(
                "api_server_cpu_us_per_token", "us", [w.api_cpu_s * 1e6 / max(1, w.tokens) for w in windows]
            )
            made["engine", shape] = row(
                "engine_cpu_us_per_token", "us", [w.engine_cpu_s * 1e6 / max(1, w.tokens) for w in windows]
            )
            made["client", shape] = row(
                "client_cpu_us_per_token", "us", [w.client_cpu_s * 1e6 / max(1, w.tokens) for w in windows]
            )
            made["tps", shape] = row("tokens_per_s", "tokens/s", [w.tokens / w.wall_s for w in windows])
            made["ttft", shape] = row("ttft", "ms", [r["ttft_ms"] for r in ok] or [0.0])
            made["gap", shape] = row("gap", "ms", [g for r in ok for g in r["gaps_ms"]] or [0.0])
            made["failed", shape] = _failed(name.format("failed"), windows, shape_params)
            reconnected = sum(1 for w in windows for r in w.requests if r.get("new_connection"))
            if reconnected:  # module docstring (TLS)
                made["failed", shape].note = "; ".join(
                    filter(
                        None,
                        [
                            made["failed", shape].note,
                            f"{reconnected} of {sum(len(w.requests) for w in windows)} streams opened a new connection "
                            "in their window",
                        ],
                    )
                )
        for metric, target in (
            ("api", CPU_RATIO),
            ("engine", None),
            ("client", None),
            ("tps", TPS_RATIO),
            ("ttft", TTFT_RATIO),
            ("gap", GAP_RATIO),
        ):
            http = made[metric, "http"]
            rows.append(http)
            for shape in list(shapes)[1:]:
                nnrp = made[metric, shape]
                rows += [
                    nnrp,
                    _ratio(
                        nnrp.id.removesuffix(".nnrp") + "_ratio.nnrp_over_http", nnrp, http, target, nnrp.parameters
                    ),
                ]
        rows += [made["failed", shape] for shape in shapes]
    return rows


def _server_cancel_to_abort_ms(log: pathlib.Path, offset: int) -> list[float]:
    """``cancel_to_abort_ms`` of the client-cancelled operations' log lines (the service logs every
    operation that did not complete at INFO: :func:`vllm_nnrp_plugin.observability.observation.log_line`) written to the
    API server's log after byte ``offset``."""
    with open(log, "rb") as f:
        f.seek(offset)
        return [float(m.group(1)) for m in _CANCEL_LINE.finditer(f.read())]


_CANCEL_LINE = re.compile(rb"nnrp operation [^\n]*?\bcancel_source=client\b[^\n]*?\bcancel_to_abort_ms=([0-9.]+)")


def cancel_rows(
    server: Any,
    engine: Sequence[int],
    *,
    streams: int,
    per_session: int,
    cancel: int,
    max_tokens: int,
    transport: str,
    workdir: str,
    prefix: str = "load",
    p99_target: Target | None = None,
) -> list[Result]:
    """``streams`` NNRP streams (``per_session`` per session) of which ``cancel``, spread over them, are
    cancelled shortly after their first token (:mod:`bench.load_client` ``--cancel``): client and server
    cancel latencies, and cancels left without a terminal; with ``p99_target``, also the server's cancel ->
    abort p99 (ms) as a row of its own held to it."""
    params = {
        "streams": streams,
        "streams_per_session": per_session,
        "cancelled": cancel,
        "max_tokens": max_tokens,
        "client_processes": len(shares(-(-streams // per_session))),
        "nnrp_transport": transport,
    }
    offset = server.log.stat().st_size
    w = window(
        server,
        engine,
        "stream",
        "nnrp",
        streams,
        chat_body(PROMPT, max_tokens),
        transport=transport,
        workdir=workdir,
        per_session=per_session,
        cancel=cancel,
    )
    time.sleep(1.0)  # the last operations' log lines
    measured = [r["cancel_ms"] for r in w.requests if r.get("cancel_ms") is not None]
    unanswered = [r for r in w.requests if r["error"] and "no terminal within" in r["error"]]
    server_ms = _server_cancel_to_abort_ms(server.log, offset)
    client = Result.of(
        f"{prefix}.cancel.c{streams}.client_cancel_to_terminal_ms.nnrp",
        "ms",
        measured or [0.0],
        parameters=params,
        note=f"FRAME_CANCEL written -> terminal received; p99 {percentile(measured or [0.0], 0.99):.2f} ms",
    )
    server_row = Result.of(
        f"{prefix}.cancel.c{streams}.server_cancel_to_abort_ms.nnrp",
        "ms",
        server_ms or [0.0],
        parameters=params,
        note=(
            "API server: cancel received -> vLLM abort issued (log lines); "
            f"p99 {percentile(server_ms or [0.0], 0.99):.2f} ms"
        ),
    )
    rows = [
        client,
        server_row,
        Result.of(
            f"{prefix}.cancel.c{streams}.no_terminal_within_10s.nnrp",
            "requests",
            [len(unanswered)],
            targets=(ALL_ANSWERED,),
            parameters=params,
        ),
        _failed(f"{prefix}.cancel.c{streams}.failed.nnrp", [w], params),
    ]
    if p99_target is not None:
        rows.append(
            Result.of(
                f"{prefix}.cancel.c{streams}.server_cancel_to_abort_p99_ms.nnrp",
                "ms",
                [percentile(server_ms or [0.0], 0.99)],
                targets=(p99_target,),
                parameters=params,
            )
        )
    return rows


def _burst_results(w: Window, prefix: str, protocol: str, params: dict[str, Any], tls: bool = False) -> list[Result]:
    """open_ms (of every client that got its connection, served in time or not: ``samples`` is how many did),
    served_ms (of those served) and the failures (not served within the load client's 10 s)."""
    opened = [r["open_ms"] for r in w.requests if r.get("open_ms") is not None]
    served = [r["served_ms"] for r in w.requests if r["error"] is None]
    what = "TCP + TLS connect" if tls else "TCP connect" if protocol == "http" else "connect"
    if protocol == "nnrp":
        what += " + open session"
    return [
        Result.of(
            f"{prefix}.open_ms.{protocol}",
            "ms",
            opened or [0.0],
            parameters=params,
            note=f"release -> {what}",
            targets=(SLOWEST_OPEN,) if protocol == "nnrp" else (),
        ),
        Result.of(f"{prefix}.served_ms.{protocol}", "ms", served or [0.0], parameters=params),
        _failed(f"{prefix}.failed.{protocol}", [w], params),
    ]


def burst_rows(
    server: Any,
    engine: Sequence[int],
    *,
    clients: int,
    load_streams: int,
    max_tokens: int,
    transport: str,
    workdir: str,
    prefix: str = "load",
) -> list[Result]:
    """``clients`` connecting at once, one 8-token request each: over NNRP then HTTP on the idle server
    (``load.burst.*``), then over NNRP again while ``load_streams`` NNRP streams of ``max_tokens`` tokens
    (a session each) run, and over HTTP under the same NNRP load (``load.burst_under_load.*``; skipped when
    ``load_streams`` is 0)."""
    body = chat_body(PROMPT, 8)
    rows: list[Result] = []
    params = {"clients": clients, "client_processes": len(shares(clients)), "nnrp_transport": transport}
    tls = bool(getattr(server, "ca_file", None))
    for protocol in ("nnrp", "http"):
        w = window(server, engine, "burst", protocol, clients, body, transport=transport, workdir=workdir)
        rows += _burst_results(w, f"{prefix}.burst", protocol, params, tls)
    rows[0].versus(rows[3])
    rows[1].versus(rows[4])
    if not load_streams:
        return rows
    under = {**params, "load_streams": load_streams, "load_max_tokens": max_tokens}
    for protocol in ("nnrp", "http"):  # the same NNRP load under both bursts: HTTP's shows the machine's floor
        background = client_args(
            server, "stream", "nnrp", load_streams, chat_body(PROMPT, max_tokens), transport=transport
        )
        with Clients(background, workdir) as load:
            load.read()  # the streams' sessions are open
            load.tell()
            time.sleep(0.5)  # the streams are running
            w = window(server, engine, "burst", protocol, clients, body, transport=transport, workdir=workdir)
            streams = [r for line in load.read() for r in orjson.loads(line)["requests"]]
            load.tell()
        running = Window(streams, w.wall_s, 0.0, 0.0, 0.0)
        rows += [
            *_burst_results(w, f"{prefix}.burst_under_load", protocol, under, tls),
            _failed(f"{prefix}.burst_under_load.load_failed.{protocol}", [running], under),
        ]
    rows[-8].versus(rows[-4])
    rows[-7].versus(rows[-3])
    return rows


def _cpu_pct(pid: int, seconds: float) -> list[float]:
    """``pid``'s CPU, % of one core, one sample per second for ``seconds`` s."""
    samples = []
    for _ in range(max(1, round(seconds))):
        cpu, start = cpu_s([pid]), time.perf_counter()
        time.sleep(1.0)
        samples.append((cpu_s([pid]) - cpu) / (time.perf_counter() - start) * 100)
    return samples


def _idle_sessions(server: Any, sessions: int, transport: str, workdir: str) -> Clients:
    """Client processes holding ``sessions`` idle NNRP sessions (one connection each); they are open when this
    returns, and close when the :class:`Clients` is left."""
    argument_lists = [["idle", "nnrp", server.nnrp[transport], str(n), *_trust(server)] for n in shares(sessions)]
    clients = Clients(argument_lists, workdir)
    try:
        clients.read()
    except BaseException:
        clients.__exit__(None, None, None)
        raise
    return clients


def _release(clients: Clients) -> None:
    clients.tell()
    clients.read()
    clients.tell()


def idle_rows(
    server: Any, *, sessions: int, seconds: float, transport: str, workdir: str, prefix: str = "load"
) -> list[Result]:
    """The API server's CPU with no client, then with ``sessions`` idle NNRP sessions open (and its thread
    count then)."""
    params = {"sessions": sessions, "seconds": seconds, "nnrp_transport": transport}
    quiet = Result.of(
        f"{prefix}.idle.api_server_cpu_pct.no_sessions", "%", _cpu_pct(server.pid, seconds), parameters=params
    )
    with _idle_sessions(server, sessions, transport, workdir) as clients:
        time.sleep(1.0)  # the sessions' opening settles
        held = Result.of(
            f"{prefix}.idle.api_server_cpu_pct.sessions_open", "%", _cpu_pct(server.pid, seconds), parameters=params
        )
        count = Result.of(
            f"{prefix}.idle.api_server_threads.sessions_open", "threads", [threads(server.pid)], parameters=params
        )
        _release(clients)
    cost = Result.of(
        f"{prefix}.idle.api_server_cpu_pct.sessions_minus_no_sessions",
        "%",
        [held.mean - quiet.mean],
        targets=(IDLE_COST,),
        parameters=params,
        note="mean CPU with the idle sessions open minus without",
    )
    return [quiet, held, cost, count]


def _thread_counts(pid: int, readings: int = 5, spacing_s: float = 0.5) -> list[float]:
    counts = []
    for i in range(readings):
        if i:
            time.sleep(spacing_s)
        counts.append(float(threads(pid)))
    return counts


def thread_rows(server: Any, *, sessions: int, transport: str, workdir: str, prefix: str = "load") -> list[Result]:
    """The API server's thread count with no client, then with ``sessions`` idle NNRP sessions open (module
    docstring)."""
    params = {"sessions": sessions, "nnrp_transport": transport}
    quiet = Result.of(
        f"{prefix}.threads.api_server.no_sessions", "threads", _thread_counts(server.pid), parameters=params
    )
    with _idle_sessions(server, sessions, transport, workdir) as clients:
        time.sleep(1.0)  # the sessions' opening settles
        held = Result.of(
            f"{prefix}.threads.api_server.sessions_open", "threads", _thread_counts(server.pid), parameters=params
        )
        _release(clients)
    added = Result.of(
        f"{prefix}.threads.api_server.sessions_minus_no_sessions",
        "threads",
        [held.max - quiet.max],
        targets=(NO_NEW_THREAD,),
        parameters=params,
        note="most threads with the idle sessions open minus without",
    )
    return [quiet, held, added]


def stream_interval_supported() -> bool:
    """Whether the installed vLLM's ``vllm serve`` has ``--stream-interval`` (asked in a subprocess)."""
    code = (
        "import dataclasses\nfrom vllm.engine.arg_utils import EngineArgs\n"
        "print('stream_interval' in {f.name for f in dataclasses.fields(EngineArgs)})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return done.stdout.strip().endswith("True")


def measure(
    server: Any,
    *,
    prefix: str = "load",
    levels: Sequence[int],
    rounds: int,
    max_tokens: int,
    shared: dict[int, int],
    burst_clients: int,
    burst_load_streams: int,
    cancel_streams: int,
    cancel_per_session: int,
    cancel_sample: int,
    idle_sessions: int,
    idle_seconds: float,
    transport: str,
    workdir: str,
    parameters: dict[str, Any] | None = None,
    thread_sessions: int = 0,
    body_extra: dict[str, Any] | None = None,
    api: str = "chat",
) -> list[Result]:
    """All rows on a ready ``server`` (an object with ``http``, ``nnrp`` {transport: URI}, ``pid``, ``log``
    and, when it serves TLS, ``ca_file``: the certificate the clients trust): a warm-up window per protocol,
    the thread rows (skipped when ``thread_sessions`` is 0), the idle rows (skipped when ``idle_sessions`` is
    0), the levels, the cancels under load (skipped when ``cancel_streams`` is 0), the bursts (skipped when
    ``burst_clients`` is 0); every id starts with ``prefix``; ``body_extra``: fields added to the warm-up's and
    the levels' requests; ``api``: the levels' and the warm-up's API (``chat`` or ``responses``)."""
    engine = engine_pids(server.pid)
    started = time.perf_counter()
    for protocol in ("http", "nnrp"):
        window(
            server,
            engine,
            "stream",
            protocol,
            4,
            {**request_body(api, 16), **(body_extra or {})},
            transport=transport,
            workdir=workdir,
            api=api,
        )
    rows = (
        thread_rows(server, sessions=thread_sessions, transport=transport, workdir=workdir, prefix=prefix)
        if thread_sessions
        else []
    )
    if idle_sessions:
        rows += idle_rows(
            server, sessions=idle_sessions, seconds=idle_seconds, transport=transport, workdir=workdir, prefix=prefix
        )
    _progress(f"{prefix} warm-up, threads and idle", started)
    rows += levels_rows(
        server,
        engine,
        prefix,
        levels=levels,
        rounds=rounds,
        max_tokens=max_tokens,
        transport=transport,
        workdir=workdir,
        parameters=parameters or {},
        shared=shared,
        body_extra=body_extra,
        api=api,
    )
    if cancel_streams:
        started = time.perf_counter()
        rows += cancel_rows(
            server,
            engine,
            streams=cancel_streams,
            per_session=cancel_per_session,
            cancel=cancel_sample,
            max_tokens=max(max_tokens, RUNNING_TOKENS),
            transport=transport,
            workdir=workdir,
            prefix=prefix,
        )
        _progress(f"{prefix}.cancel", started)
    if burst_clients:
        started = time.perf_counter()
        rows += burst_rows(
            server,
            engine,
            clients=burst_clients,
            load_streams=burst_load_streams,
            max_tokens=max(max_tokens, RUNNING_TOKENS),
            transport=transport,
            workdir=workdir,
            prefix=prefix,
        )
        _progress(f"{prefix}.burst", started)
    return rows


def self_signed(directory: str, name: str = "localhost") -> tuple[str, str]:
    """A self-signed PEM certificate (ECDSA P-256, valid for ``name`` and 127.0.0.1, one day) and its
    unencrypted PEM key in ``directory`` (the few lines of ``tests/support.py`` ``self_signed``); returns
    (certificate path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = pathlib.Path(directory, f"{name}.crt"), pathlib.Path(directory, f"{name}.key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def _wait_ready_tls(server: Any, ca_file: str, timeout_s: float) -> None:
    """:meth:`compat.launcher.VLLMServer.wait_ready` over HTTPS, trusting ``ca_file`` (the launcher's probe
    speaks plain HTTP)."""
    context = ssl.create_default_context(cafile=ca_file)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise ServeError(f"vllm serve exited with {server.proc.returncode} (log {server.log}):\n{server.tail()}")
        try:
            with urllib.request.urlopen(f"{server.http}/v1/models", timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except OSError as exc:  # refused, reset, HTTP errors: not up yet
            if isinstance(getattr(exc, "reason", exc), ssl.SSLCertVerificationError):
                raise  # the bench's own certificate is wrong: waiting does not help
        time.sleep(1)
    raise ServeError(f"vllm serve not ready after {timeout_s} s (log {server.log}):\n{server.tail()}")


def _serve(model: str, workdir: str, extra_args: Sequence[str], *, tls: bool = False, **kw: Any) -> list[Result]:
    """One ``vllm serve`` of ``model`` and :func:`measure` on it. ``tls``: vLLM's HTTPS and NNRP on
    ``nnrps://`` only, with one self-signed certificate (module docstring); else HTTP and NNRP on TCP and a
    unix socket."""
    seqs = max(256, *kw["levels"], kw["burst_clients"] + kw["burst_load_streams"], kw["cancel_streams"])
    config = NNRP_CONFIG
    if tls:
        cert, key = self_signed(workdir)
        nnrp = {"tls": f"nnrps://127.0.0.1:{free_port()}"}
        config = {"nnrp": {**NNRP_CONFIG["nnrp"], "tls_cert_file": cert, "tls_key_file": key}}
        extra_args = (*extra_args, "--ssl-keyfile", key, "--ssl-certfile", cert)
        kw["transport"] = "tls"
    else:
        nnrp = {"tcp": f"tcp://127.0.0.1:{free_port()}", "ipc": f"unix://{workdir}/load-{free_port()}.sock"}
    server = serve_with_nnrp(
        model,
        workdir,
        listen=tuple(nnrp.values()),
        log=f"{workdir}/vllm-{free_port()}.log",
        extra_args=(
            "--load-format",
            "dummy",
            "--max-num-seqs",
            str(seqs),
            "--additional-config",
            orjson.dumps(config).decode(),
            "--middleware",
            "bench.drain.DrainMiddleware",
            *extra_args,
        ),
    )
    server.nnrp = nnrp
    try:
        if tls:
            server.http = f"https://127.0.0.1:{server.port}"
            server.ca_file = cert
            _wait_ready_tls(server, cert, START_TIMEOUT_S)
        else:
            server.wait_ready(START_TIMEOUT_S)
        return measure(server, workdir=workdir, **kw)
    finally:
        served = server.log.stat().st_size  # what follows is the stop (vLLM logs its engine's end as errors)
        server.stop()
        _report_log(server, served)


#: lines of the API server's log worth a look after a run: errors, tracebacks, NNRP's warnings
_LOG_TROUBLE = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b|WARNING.*\bNNRP\b")


def _report_log(server: Any, size: int) -> None:
    """Print the lines of :data:`_LOG_TROUBLE` among the first ``size`` bytes of the API server's log (count and
    the first 20) to stderr: the rows count failed requests, not what the server said about them."""
    with contextlib.suppress(OSError), open(server.log, "rb") as f:
        found = [line for line in f.read(size).decode(errors="replace").splitlines() if _LOG_TROUBLE.search(line)]
        if found:
            print(
                f"bench load: {len(found)} error/warning lines in the log of vllm serve ({server.http}):",
                *found[:20],
                sep="\n  ",
                file=sys.stderr,
            )


def run(
    *,
    model: str | None = None,
    levels: Sequence[int] = LEVELS,
    rounds: int = 2,
    max_tokens: int = 256,
    shared: dict[int, int] = SHARED,
    burst_clients: int = 256,
    burst_load_streams: int = 256,
    cancel_streams: int = 256,
    cancel_per_session: int = 32,
    cancel_sample: int = 32,
    idle_sessions: int = 1000,
    idle_seconds: float = 10.0,
    thread_sessions: int = 256,
    stream_interval: int | None = 8,
    transport: str = "tcp",
    tls: bool = False,
    tools: bool = False,
    responses: bool = False,
) -> list[Result]:
    """Serve the tiny model made from ``model`` (default ``$VLLM_NNRP_TEST_MODEL``) and measure (module
    docstring); then the levels again with ``--stream-interval stream_interval`` unless it is ``None`` or the
    installed vLLM lacks the flag. ``tls``: HTTPS and ``nnrps://`` (``transport`` is then ignored), ids
    ``load.tls.…``. ``tools``: the agent-server shape (module docstring) instead, ids ``load.tools.…``.
    ``responses``: the levels as Responses streams (``responses.create``, ``/v1/responses``), ids
    ``load[.tools].responses.…``, without the rows that do not depend on the API (idle, threads, cancel, burst) and
    the ``--stream-interval`` server. Raises ``SystemExit`` without a model, ``compat.launcher.ServeError`` when
    ``vllm serve`` does not start, ``RuntimeError`` when a client process fails."""
    kw = {
        "levels": levels,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "shared": shared,
        "transport": transport,
        "tls": tls,
    }
    prefix = "load.tls" if tls else "load"
    model = model or os.environ.get("VLLM_NNRP_TEST_MODEL")
    if not model:
        raise SystemExit("load benchmark: give --model or set VLLM_NNRP_TEST_MODEL")
    with tempfile.TemporaryDirectory() as workdir:
        tiny = str(tiny_model.build(model))
        if tools or responses:
            api = "responses" if responses else "chat"
            prefix = ".".join(["load", *(["tools"] if tools else []), *(["responses"] if responses else [])])
            parameters = {"api": api, **({"server": "hermes tool parser", "tool_choice": "auto"} if tools else {})}
            return _serve(
                tiny,
                workdir,
                AGENT_SERVER_ARGS if tools else (),
                prefix=prefix,
                burst_clients=0,
                burst_load_streams=0,
                cancel_streams=0,
                cancel_per_session=1,
                cancel_sample=0,
                idle_sessions=0,
                idle_seconds=0,
                parameters=parameters,
                api=api,
                body_extra=agent_fields(api) if tools else None,
                **kw,
            )
        rows = _serve(
            tiny,
            workdir,
            (),
            prefix=prefix,
            burst_clients=burst_clients,
            burst_load_streams=burst_load_streams,
            cancel_streams=cancel_streams,
            cancel_per_session=cancel_per_session,
            cancel_sample=cancel_sample,
            idle_sessions=idle_sessions,
            idle_seconds=idle_seconds,
            thread_sessions=thread_sessions,
            **kw,
        )
        if stream_interval is None:
            return rows
        if not stream_interval_supported():
            print("bench load: this vLLM has no --stream-interval; its rows are skipped", file=sys.stderr)
            return rows
        rows += _serve(
            tiny,
            workdir,
            ("--stream-interval", str(stream_interval)),
            prefix=f"{prefix}.stream_interval_{stream_interval}",
            burst_clients=0,
            burst_load_streams=0,
            cancel_streams=0,
            cancel_per_session=1,
            cancel_sample=0,
            idle_sessions=0,
            idle_seconds=0,
            parameters={"stream_interval": stream_interval},
            **kw,
        )
    return rows

"""4. End to end on a real ``vllm serve`` (CPU, small model): NNRP against vLLM's own HTTP/SSE on the same
server, with the same requests, side by side in one run; plus the plugin's RSS in the API-server process.

Per concurrency level (default 1, 8, 32), ``rounds`` × (HTTP batch, NNRP batch) alternating ABBA so drift
hits both; a batch is ``concurrency`` × ``per_worker`` streamed chat requests (``max_tokens`` tokens,
``ignore_eos``, ``include_usage``), one connection / NNRP session per worker thread. Per request:
time to first token (send -> first non-empty text delta), inter-token latency (gaps between text deltas),
total time; per batch: output tokens/s (usage tokens / batch wall time).

RSS (``VmRSS`` of the ``vllm serve`` API-server process, MB): with the plugin serving NNRP, and — when
``baseline`` — of a second server without the plugin after the same HTTP load; the difference is the
plugin's cost. Only one ``vllm serve`` runs at a time.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import orjson

from bench.results import Result, Target
from compat.launcher import SERVED_NAME, VLLMServer, free_port, serve_with_nnrp
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION

START_TIMEOUT_S = 900  # a loaded 2-CPU machine may need longer than the tests' 600 s
TTFT_RATIO = Target("p50", "<=", 0.9)
RSS_COST = Target("p50", "<=", 50)


def rss_mb(pid: int) -> float:
    """``VmRSS`` of ``pid`` in MB (MiB)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@attrs.define
class Timing:
    """One request: ``ttft_ms``, ``gaps_ms`` between text deltas, ``total_ms``, ``tokens`` (usage); for NNRP
    also ``vllm_first_chunk_ms`` (from the operation's diagnostics: vLLM called -> its first chunk)."""

    ttft_ms: float = 0.0
    gaps_ms: list[float] = attrs.field(factory=list)
    total_ms: float = 0.0
    tokens: int = 0
    vllm_first_chunk_ms: float | None = None


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Clock:
    """Times one request from its construction (the request is sent): :meth:`text` at each non-empty text
    delta, :meth:`done` at its end with the usage's output tokens."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.timing = Timing()

    def text(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.timing.ttft_ms = (now - self.start) * 1000
        else:
            self.timing.gaps_ms.append((now - self.last) * 1000)
        self.last = now

    def done(self, tokens: int) -> Timing:
        self.timing.total_ms = (time.perf_counter() - self.start) * 1000
        self.timing.tokens = tokens
        return self.timing


def http_worker(base: str, body: dict[str, Any], count: int, ready: threading.Barrier | None = None) -> list[Timing]:
    """``count`` streamed requests over one keep-alive HTTP connection, opened before ``ready``."""
    out = []
    with httpx.Client(timeout=600) as http:
        http.get(f"{base}/health").raise_for_status()  # connect before the clock starts
        if ready is not None:
            ready.wait()
        for _ in range(count):
            clock, tokens = Clock(), 0
            with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                        clock.text()
                    if chunk.get("usage") and not chunk.get("choices"):
                        tokens = chunk["usage"]["completion_tokens"]
            out.append(clock.done(tokens))
    return out


def nnrp_worker(uri: str, body: dict[str, Any], count: int, ready: threading.Barrier | None = None) -> list[Timing]:
    """``count`` streamed operations over one NNRP session, opened before ``ready``."""
    import asyncio

    envelope = {
        "schema_version": SCHEMA_VERSION,
        "operation": CHAT_COMPLETIONS_CREATE,
        "body": body,
        "nnrp": {"diagnostics": True},
    }
    client = asyncio.run(ProfileClient.connect(uri))
    out = []
    try:
        if ready is not None:
            ready.wait()
        for _ in range(count):
            clock, tokens, first_chunk = Clock(), 0, None
            for event in client.events(client.submit(envelope), timeout_s=600):
                kind = event.event["type"] if event.event else None
                if kind == "response.output_text.delta" and event.event["delta"]:
                    clock.text()
                elif kind == "response.usage":
                    tokens = event.event["usage"]["output_tokens"]
                elif kind == "response.completed":
                    first_chunk = event.event["diagnostics"]["backend_first_chunk_ms"]
                elif event.terminal:
                    raise RuntimeError(f"NNRP request failed: {event}")
            timing = clock.done(tokens)
            timing.vllm_first_chunk_ms = first_chunk
            out.append(timing)
    finally:
        client.close()
    return out


def batch(
    worker: Callable[..., list[Timing]], target: str, body: dict[str, Any], concurrency: int, per_worker: int
) -> tuple[list[Timing], float]:
    """Run ``concurrency`` workers at once (connections are opened first, then all start together); returns
    all timings and the batch's output tokens/s."""
    results: list[list[Timing]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    ready = threading.Barrier(concurrency + 1, timeout=300)

    def run(i: int) -> None:
        try:
            results[i] = worker(target, body, per_worker, ready)
        except BaseException as exc:  # reported after the join
            errors.append(exc)
            ready.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    timings = [t for per in results for t in per]
    return timings, sum(t.tokens for t in timings) / wall


def compare(
    server: Any, *, levels: tuple[int, ...], per_worker: int, rounds: int, max_tokens: int, transport: str
) -> list[Result]:
    """NNRP vs HTTP/SSE rows for every concurrency level."""
    body = chat_body("Write a long story about the sea.", max_tokens)
    http_worker(server.http, body, 1)  # warm-up: compile paths, caches
    nnrp_worker(server.nnrp[transport], body, 1)
    rows: list[Result] = []
    for c in levels:
        timings: dict[str, list[Timing]] = {"http": [], "nnrp": []}
        rates: dict[str, list[float]] = {"http": [], "nnrp": []}
        for r in range(rounds):
            order = ("http", "nnrp") if r % 2 == 0 else ("nnrp", "http")
            for mode in order:
                worker, target = (http_worker, server.http) if mode == "http" else (nnrp_worker, server.nnrp[transport])
                got, rate = batch(worker, target, body, c, per_worker)
                timings[mode] += got
                rates[mode].append(rate)
        params = {
            "concurrency": c,
            "requests": c * per_worker * rounds,
            "max_tokens": max_tokens,
            "nnrp_transport": transport,
        }
        made: dict[tuple[str, str], Result] = {}
        for mode in ("http", "nnrp"):
            t = timings[mode]
            made["ttft", mode] = Result.of(f"e2e.c{c}.ttft.{mode}", "ms", [x.ttft_ms for x in t], parameters=params)
            made["itl", mode] = Result.of(
                f"e2e.c{c}.itl.{mode}", "ms", [g for x in t for g in x.gaps_ms] or [0.0], parameters=params
            )
            made["total", mode] = Result.of(f"e2e.c{c}.total.{mode}", "ms", [x.total_ms for x in t], parameters=params)
            made["tps", mode] = Result.of(f"e2e.c{c}.tokens_per_s.{mode}", "tokens/s", rates[mode], parameters=params)
        for metric in ("ttft", "itl", "total", "tps"):
            made[metric, "nnrp"].versus(made[metric, "http"])
            rows += [made[metric, "http"], made[metric, "nnrp"]]
        nnrp = timings["nnrp"]
        rows.append(
            Result.of(
                f"e2e.c{c}.ttft_minus_vllm_first_chunk.nnrp",
                "ms",
                [x.ttft_ms - x.vllm_first_chunk_ms for x in nnrp if x.vllm_first_chunk_ms is not None] or [0.0],
                parameters=params,
                note="NNRP time to first token minus vLLM's own time to its first chunk (from the operation's "
                "diagnostics): what the adapter, NNRP and the client add to TTFT",
            )
        )
        ttft = made["ttft", "nnrp"].compare
        rows.append(
            Result(
                id=f"e2e.c{c}.ttft_ratio.nnrp_over_http",
                unit="ratio",
                samples=len(timings["nnrp"]),
                p50=ttft["p50_ratio"],
                p95=ttft["p95_ratio"],
                targets=(TTFT_RATIO,),
                parameters=params,
            )
        )
    return rows


def run(
    *,
    model: str | None = None,
    levels: tuple[int, ...] = (1, 8, 32),
    per_worker: int = 2,
    rounds: int = 2,
    max_tokens: int = 32,
    transport: str = "ipc",
    baseline: bool = True,
    server: Any = None,
) -> list[Result]:
    """Start ``vllm serve`` with the plugin (or use ``server``: an object with ``http``, ``nnrp`` and
    ``pid``), compare, measure RSS; with ``baseline`` also start one without the plugin."""
    model = model or os.environ.get("VLLM_NNRP_TEST_MODEL")
    with tempfile.TemporaryDirectory() as workdir:
        own = server is None
        if own:
            if not model:
                raise SystemExit("e2e benchmark: give --model or set VLLM_NNRP_TEST_MODEL")
            nnrp = {"tcp": f"tcp://127.0.0.1:{free_port()}", "ipc": f"unix://{workdir}/bench-nnrp.sock"}
            server = serve_with_nnrp(model, workdir, listen=(nnrp["tcp"], nnrp["ipc"]), log=f"{workdir}/vllm-nnrp.log")
            server.nnrp = nnrp
        try:
            if own:
                server.wait_ready(START_TIMEOUT_S)
            idle = rss_mb(server.pid)
            rows = compare(
                server, levels=levels, per_worker=per_worker, rounds=rounds, max_tokens=max_tokens, transport=transport
            )
            loaded = rss_mb(server.pid)
        finally:
            if own:
                server.stop()
        rows.append(Result.of("e2e.rss.api_server_with_nnrp", "MB", [loaded], parameters={"idle_mb": round(idle, 1)}))
        if baseline:
            plain = VLLMServer(model, workdir, log=f"{workdir}/vllm-plain.log")
            try:
                plain.wait_ready(START_TIMEOUT_S)
                plain_idle = rss_mb(plain.pid)
                body = chat_body("Write a long story about the sea.", max_tokens)
                http_worker(plain.http, body, 1)
                for c in levels:
                    for _ in range(rounds):
                        batch(http_worker, plain.http, body, c, per_worker)
                plain_loaded = rss_mb(plain.pid)
            finally:
                plain.stop()
            rows.append(
                Result.of(
                    "e2e.rss.api_server_without_nnrp",
                    "MB",
                    [plain_loaded],
                    parameters={"idle_mb": round(plain_idle, 1)},
                )
            )
            rows.append(
                Result.of(
                    "e2e.rss.plugin_cost",
                    "MB",
                    [loaded - plain_loaded],
                    targets=(RSS_COST,),
                    parameters={"idle_difference_mb": round(idle - plain_idle, 1)},
                    note=(
                        "API-server VmRSS with the plugin (after HTTP + NNRP load) minus without it "
                        "(after the same HTTP load)"
                    ),
                )
            )
    return rows

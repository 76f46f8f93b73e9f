"""Client process of :mod:`bench.load`: drives one share of the load with the lightest client of its protocol.

    python -m bench.load_client stream http|nnrp TARGET STREAMS BODY_JSON
    python -m bench.load_client burst http|nnrp TARGET CLIENTS BODY_JSON
    python -m bench.load_client idle nnrp TARGET SESSIONS

A handshake over stdin/stdout keeps set-up and tear-down out of the parent's timed window: the process opens
its connections / sessions, prints ``ready``, waits for a line on stdin (go), runs, prints one JSON line of
results, waits for another line (close), then closes everything.

* ``stream``: ``STREAMS`` streamed requests at once, each on its own connection (HTTP: an aiohttp session of one
  keep-alive connection, opened with ``GET /health``; one asyncio task per stream) or its own NNRP session (one
  thread per session polling with ``max_events=1`` and a :data:`POLL_MS` timeout: a poll returns as soon as
  an event arrives). Per request: ``ttft_ms`` (sent -> first non-empty text delta), ``gaps_ms`` (between text
  deltas), ``total_ms``, ``tokens`` (the usage's output tokens) and ``error`` (``None``, or the first error's
  text).
* ``burst``: ``CLIENTS`` clients released together (after go) each connect and send one request. Per client:
  ``open_ms`` (NNRP: connect + open session; HTTP: TCP connect), ``served_ms`` (release -> the request's end)
  and ``error``; a client not served within :data:`BURST_TIMEOUT_S` is a failure.
* ``idle``: ``SESSIONS`` NNRP sessions opened, then left idle until go; results are empty.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from typing import Any

import attrs
import orjson

from bench.e2e import Clock
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION

POLL_MS = 100
STREAM_TIMEOUT_S = 600
BURST_TIMEOUT_S = 10.0


def _handshake(lines: Any) -> None:
    """Print ``lines`` (``ready`` or the results) and wait for the parent's next line."""
    sys.stdout.buffer.write(lines if isinstance(lines, bytes) else orjson.dumps(lines))
    sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()
    sys.stdin.readline()


def _record(clock: Clock, tokens: int, error: str | None) -> dict[str, Any]:
    return {**attrs.asdict(clock.done(tokens)), "error": error}


# -- HTTP/SSE: aiohttp, one task per stream --------------------------------------------------------------


async def _http_request(http: Any, body: bytes, clock: Clock, trace: dict | None = None) -> dict[str, Any]:
    """One streamed ``/v1/chat/completions`` request on ``http``; vLLM's SSE ``data:`` lines parsed as they come."""
    tokens, error = 0, None
    async with http.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"},
                         trace_request_ctx=trace) as response:  # fmt: skip
        if response.status != 200:
            return _record(clock, 0, f"HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            choices = chunk.get("choices")
            if choices and (choices[0].get("delta") or {}).get("content"):
                clock.text()
            elif chunk.get("usage") and not choices:
                tokens = chunk["usage"]["completion_tokens"]
            elif "error" in chunk:
                error = error or str(chunk["error"])[:300]
    return _record(clock, tokens, error)


async def _http_main(mode: str, base: str, count: int, body: bytes) -> None:
    import aiohttp

    async def connected(session: Any, trace_ctx: Any, params: Any) -> None:
        if trace_ctx.trace_request_ctx is not None:
            trace_ctx.trace_request_ctx["connected"] = time.perf_counter()

    trace = aiohttp.TraceConfig()  # the burst's open_ms: when aiohttp has the TCP connection
    trace.on_connection_create_end.append(connected)
    sessions = [
        aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace],
                              timeout=aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S))
        for _ in range(count)
    ]  # fmt: skip
    loop = asyncio.get_running_loop()
    if mode == "stream":  # every stream's connection open before go
        for response in await asyncio.gather(*(s.get("/health") for s in sessions)):
            response.raise_for_status()
            response.release()

    async def one(http: Any) -> dict[str, Any]:
        clock, ctx = Clock(), {}
        try:
            if mode == "stream":
                return await _http_request(http, body, clock)
            async with asyncio.timeout(BURST_TIMEOUT_S):  # not wait_for: before 3.12 it can swallow a cancel
                out = await _http_request(http, body, clock, ctx)
            opened = ctx.get("connected")
            return {**out, "open_ms": (opened - clock.start) * 1000 if opened else None, "served_ms": out["total_ms"]}
        except Exception as exc:  # reported as the request's failure
            return {**_record(clock, 0, f"{type(exc).__name__}: {exc}"[:300]), "open_ms": None}

    await loop.run_in_executor(None, _handshake, b"ready")
    results = await asyncio.gather(*(one(s) for s in sessions))
    await loop.run_in_executor(None, _handshake, {"requests": results})
    await asyncio.gather(*(s.close() for s in sessions))


# -- NNRP: one thread per session, max_events=1 polls --------------------------------------------------------


def _envelope(body: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "operation": CHAT_COMPLETIONS_CREATE, "body": body}


def _nnrp_request(client: ProfileClient, envelope: dict[str, Any], clock: Clock, timeout_s: float) -> dict[str, Any]:
    """One operation on ``client``'s session, polled until its terminal."""
    tokens, deadline = 0, time.monotonic() + timeout_s
    client.submit(envelope)
    while time.monotonic() < deadline:
        for _, event in client.poll(POLL_MS):
            kind = event.event.get("type") if event.event else None
            if event.terminal:
                error = None if kind == "response.completed" else f"{event.frame}: {event.event}"[:300]
                return _record(clock, tokens, error)
            if kind == "response.output_text.delta" and event.event["delta"]:
                clock.text()
            elif kind == "response.usage":
                tokens = event.event["usage"]["output_tokens"]
    return _record(clock, tokens, f"no terminal within {timeout_s} s")


def _nnrp_stream(uri: str, count: int, body: dict[str, Any]) -> None:
    async def connect_all() -> list[ProfileClient]:
        return list(await asyncio.gather(*(ProfileClient.connect(uri) for _ in range(count))))

    clients = asyncio.run(connect_all())
    go = threading.Event()
    results: list[dict[str, Any]] = [{} for _ in clients]

    def run(i: int) -> None:
        go.wait()
        clock = Clock()
        try:
            results[i] = _nnrp_request(clients[i], _envelope(body), clock, STREAM_TIMEOUT_S)
        except Exception as exc:  # reported as the request's failure
            results[i] = _record(clock, 0, f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    _handshake(b"ready")
    go.set()
    for t in threads:
        t.join()
    _handshake({"requests": results})
    for client in clients:
        client.close()


def _nnrp_burst(uri: str, count: int, body: dict[str, Any]) -> None:
    release = threading.Barrier(count + 1)
    results: list[dict[str, Any]] = [{"error": f"not served within {BURST_TIMEOUT_S} s", "open_ms": None}] * count

    def run(i: int) -> None:
        release.wait()
        clock, client = Clock(), None
        try:
            client = asyncio.run(ProfileClient.connect(uri))
            open_ms = (time.perf_counter() - clock.start) * 1000
            out = _nnrp_request(client, _envelope(body), clock, BURST_TIMEOUT_S - open_ms / 1000)
            results[i] = {**out, "open_ms": open_ms, "served_ms": out["total_ms"]}
        except Exception as exc:  # reported as the client's failure
            results[i] = {**_record(clock, 0, f"{type(exc).__name__}: {exc}"[:300]), "open_ms": None}
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    _handshake(b"ready")
    release.wait()
    deadline = time.monotonic() + BURST_TIMEOUT_S + 5
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    _handshake({"requests": results})


def _nnrp_idle(uri: str, count: int) -> None:
    async def connect_all() -> list[ProfileClient]:
        return list(await asyncio.gather(*(ProfileClient.connect(uri) for _ in range(count))))

    clients = asyncio.run(connect_all())
    _handshake(b"ready")
    _handshake({"requests": []})
    for client in clients:
        client.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.load_client", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["stream", "burst", "idle"])
    p.add_argument("protocol", choices=["http", "nnrp"])
    p.add_argument("target", help="HTTP base URL or NNRP URI")
    p.add_argument("count", type=int, help="streams, clients or sessions")
    p.add_argument("body", nargs="?", default="{}", help="the chat request body (JSON)")
    a = p.parse_args(argv)
    body = orjson.loads(a.body)
    if a.mode == "idle" and a.protocol != "nnrp":
        p.error("idle holds NNRP sessions only")
    if a.protocol == "http":
        asyncio.run(_http_main(a.mode, a.target, a.count, orjson.dumps(body)))
    elif a.mode == "stream":
        _nnrp_stream(a.target, a.count, body)
    elif a.mode == "burst":
        _nnrp_burst(a.target, a.count, body)
    else:
        _nnrp_idle(a.target, a.count)


if __name__ == "__main__":
    main()

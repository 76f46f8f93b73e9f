"""Client process of :mod:`bench.load`: drives one share of the load on one asyncio event loop, one task per
stream, with the lightest client of its protocol (HTTP: aiohttp; NNRP: :mod:`vllm_nnrp_plugin.client.aio.connection`).

    python -m bench.load_client stream http|nnrp TARGET STREAMS BODY_JSON [--per-session K] [--cancel M] [--ca-file PEM]
        [--api chat|responses] [--path PATH]
    python -m bench.load_client burst http|nnrp TARGET CLIENTS BODY_JSON [--ca-file PEM]
    python -m bench.load_client idle nnrp TARGET SESSIONS [--ca-file PEM]

A handshake over stdin/stdout keeps set-up and tear-down out of the parent's timed window: the process opens
its connections / sessions, prints ``ready``, waits for a line on stdin (go), runs, prints one JSON line of
results, waits for another line (close), then closes everything.

* ``stream``: ``STREAMS`` streamed requests at once. HTTP: each on its own aiohttp session of one keep-alive
  connection, opened with ``GET /health``. NNRP: ``--per-session 1`` (default) gives each stream its own
  connection and session; ``--per-session K`` puts K streams on each session, one session per connection
  (the agent shape: few connections, many operations each). Per request: ``ttft_ms`` (sent -> first
  non-empty text delta), ``gaps_ms`` (between text deltas), ``total_ms``, ``tokens`` (the usage's output
  tokens) and ``error`` (``None``, or the first error's text); ``--api responses`` makes them Responses streams
  (``/v1/responses`` events; the ``responses.create`` operation); HTTP also ``new_connection`` (the request had
  to open a connection: the server had closed the kept-alive one, vLLM's 5 s idle timeout). ``--cancel M``
  (NNRP) cancels M streams spread evenly over the share: the k-th of them :data:`CANCEL_AFTER_S` + k ×
  :data:`CANCEL_SPACING_S` after its first text delta (FRAME_CANCEL); it records ``cancel_ms`` (FRAME_CANCEL handed to
  the transport ->
  its terminal received, ms; ``None`` when the stream had ended first) and is a failure unless that terminal
  is ``response.cancelled`` within :data:`CANCEL_TIMEOUT_S`.
* ``burst``: ``CLIENTS`` clients released together (after go) each connect and send one request. Per client:
  ``open_ms`` (NNRP: connect + open session; HTTP: TCP connect; TLS included; ``None`` when it never got
  that far), ``served_ms`` (release -> the request's end) and ``error``; a client not served within
  :data:`BURST_TIMEOUT_S` is a failure.
* ``idle``: ``SESSIONS`` NNRP sessions (one connection each) opened, then left idle until go; results are
  empty.

TLS (``TARGET`` ``https://…`` or ``nnrps://…``): ``--ca-file`` names the PEM certificate the client trusts (the
server's self-signed one, :mod:`bench.load` ``tls``). aiohttp gets one ``ssl.SSLContext`` made from it for
all its connections; the NNRP client gets its DER bytes (``connect(trusted_cert_der=…)``), from which it makes
the context of each connection itself, as any user of :func:`vllm_nnrp_plugin.client.connect` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import sys
import time
from typing import Any

import attrs
import orjson

from bench.e2e import Clock
from vllm_nnrp_plugin.client import Session, connect
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, RESPONSES_CREATE, SCHEMA_VERSION

STREAM_TIMEOUT_S = 600
BURST_TIMEOUT_S = 10.0
CANCEL_TIMEOUT_S = 10.0
CANCEL_AFTER_S = 0.005
CANCEL_SPACING_S = 0.02
#: connections opened at once while setting up (not timed): keeps the server's accept backlog from overflowing
SETUP_CONCURRENCY = 64


def _handshake(lines: Any) -> None:
    """Print ``lines`` (``ready`` or the results) and wait for the parent's next line."""
    sys.stdout.buffer.write(lines if isinstance(lines, bytes) else orjson.dumps(lines))
    sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()
    sys.stdin.readline()


async def _handshake_async(lines: Any) -> None:
    await asyncio.get_running_loop().run_in_executor(None, _handshake, lines)


def _record(clock: Clock, tokens: int, error: str | None) -> dict[str, Any]:
    return {**attrs.asdict(clock.done(tokens)), "error": error}


# -- HTTP/SSE: aiohttp, one task per stream --------------------------------------------------------------


#: where the HTTP requests go by default (``--path``; :data:`bench.drain.PATH` for the floor)
CHAT_PATH = "/v1/chat/completions"


#: the Responses API's path (``--api responses``)
RESPONSES_PATH = "/v1/responses"


async def _http_request(http: Any, path: str, body: bytes, clock: Clock, trace: dict | None = None) -> dict[str, Any]:
    """One streamed request to ``path`` on ``http``; vLLM's SSE ``data:`` lines parsed as they come (chat chunks,
    or Responses events when ``path`` is :data:`RESPONSES_PATH`)."""
    tokens, error = 0, None
    responses = path == RESPONSES_PATH
    async with http.post(
        path, data=body, headers={"Content-Type": "application/json"}, trace_request_ctx=trace
    ) as response:
        if response.status != 200:
            return _record(clock, 0, f"HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if responses:
                kind = chunk.get("type")
                if kind == "response.output_text.delta" and chunk.get("delta"):
                    clock.text()
                elif kind == "response.completed":
                    tokens = chunk["response"]["usage"]["output_tokens"]
                elif kind == "error" or "error" in chunk:
                    error = error or str(chunk)[:300]
                continue
            choices = chunk.get("choices")
            if choices and (choices[0].get("delta") or {}).get("content"):
                clock.text()
            elif chunk.get("usage") and not choices:
                tokens = chunk["usage"]["completion_tokens"]
            elif "error" in chunk:
                error = error or str(chunk["error"])[:300]
    return _record(clock, tokens, error)


async def _http_main(
    mode: str, base: str, count: int, body: bytes, ca_file: str | None = None, path: str = CHAT_PATH
) -> None:
    import aiohttp

    tls = ssl.create_default_context(cafile=ca_file) if ca_file else True  # True: aiohttp's default checks

    async def connected(session: Any, trace_ctx: Any, params: Any) -> None:
        if trace_ctx.trace_request_ctx is not None:
            trace_ctx.trace_request_ctx["connected"] = time.perf_counter()

    trace = aiohttp.TraceConfig()  # the burst's open_ms: when aiohttp has the TCP (and TLS) connection
    trace.on_connection_create_end.append(connected)
    sessions = [
        aiohttp.ClientSession(
            base,
            connector=aiohttp.TCPConnector(limit=1, ssl=tls),
            trace_configs=[trace],
            timeout=aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S),
        )
        for _ in range(count)
    ]
    if mode == "stream":  # every stream's connection open before go
        gate = asyncio.Semaphore(SETUP_CONCURRENCY)

        async def health(http: Any) -> None:
            async with gate, http.get("/health") as response:
                response.raise_for_status()
                await response.read()

        await asyncio.gather(*(health(s) for s in sessions))

    async def one(http: Any) -> dict[str, Any]:
        clock, ctx = Clock(), {}
        try:
            if mode == "stream":  # new_connection: the kept-alive one was gone (the server's idle timeout)
                out = await _http_request(http, path, body, clock, ctx)
                return {**out, "new_connection": "connected" in ctx}
            async with asyncio.timeout(BURST_TIMEOUT_S):  # not wait_for: before 3.12 it can swallow a cancel
                out = await _http_request(http, path, body, clock, ctx)
            opened = ctx.get("connected")
            return {**out, "open_ms": (opened - clock.start) * 1000 if opened else None, "served_ms": out["total_ms"]}
        except Exception as exc:  # reported as the request's failure (its connection's time if it got one)
            opened = ctx.get("connected")
            return {
                **_record(clock, 0, f"{type(exc).__name__}: {exc}"[:300]),
                "open_ms": (opened - clock.start) * 1000 if opened else None,
            }

    await _handshake_async(b"ready")
    results = await asyncio.gather(*(one(s) for s in sessions))
    await _handshake_async({"requests": results})
    await asyncio.gather(*(s.close() for s in sessions))


# -- NNRP: vllm_nnrp_plugin.client.aio.connection, one task per stream -------------------------------------------------


#: the operation of the NNRP requests, per ``--api``
OPERATIONS = {"chat": CHAT_COMPLETIONS_CREATE, "responses": RESPONSES_CREATE}


def _envelope(body: dict[str, Any], operation: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "operation": operation, "body": body}


async def _nnrp_request(
    session: Session, envelope: dict[str, Any], clock: Clock, cancel_after_s: float | None = None
) -> dict[str, Any]:
    """One operation on ``session``, read until its terminal; with ``cancel_after_s``, FRAME_CANCEL that long
    after its first text delta, then wait (at most :data:`CANCEL_TIMEOUT_S`) for the terminal."""
    tokens, terminal = 0, None
    op = session.submit(envelope)
    async for event in op:
        kind = event.get("type")
        if kind == "response.output_text.delta" and event["delta"]:
            clock.text()
            if cancel_after_s is not None:
                await asyncio.sleep(cancel_after_s)
                return await _cancel(op, clock)
        elif kind == "response.usage":
            tokens = event["usage"]["output_tokens"]
        terminal = event
    error = None if terminal and terminal.get("type") == "response.completed" else f"terminal: {terminal}"[:300]
    return {**_record(clock, tokens, error), "cancel_ms": None}


async def _cancel(op: Any, clock: Clock) -> dict[str, Any]:
    if op.done:  # the stream ended before the cancel: nothing to measure
        terminal = await op.result()
        error = None if terminal.get("type") == "response.completed" else f"terminal: {terminal}"[:300]
        return {**_record(clock, 0, error), "cancel_ms": None}
    sent = time.perf_counter()
    op.cancel()
    try:
        async with asyncio.timeout(CANCEL_TIMEOUT_S):
            terminal = await op.result()
    except TimeoutError:
        return {**_record(clock, 0, f"no terminal within {CANCEL_TIMEOUT_S} s of the cancel"), "cancel_ms": None}
    cancel_ms = (time.perf_counter() - sent) * 1000
    error = None if terminal.get("type") == "response.cancelled" else f"cancel answered by {terminal}"[:300]
    return {**_record(clock, 0, error), "cancel_ms": cancel_ms}


#: the certificate (DER) the NNRP client trusts for ``nnrps://`` (``--ca-file``), else the system's trust store
TRUSTED_CERT_DER: bytes | None = None


def _trust(ca_file: str | None) -> None:
    global TRUSTED_CERT_DER
    if ca_file:
        with open(ca_file) as f:
            TRUSTED_CERT_DER = ssl.PEM_cert_to_DER_cert(f.read())


async def _connect(uri: str) -> Any:
    return await connect(uri, trusted_cert_der=TRUSTED_CERT_DER)


async def _open(uri: str, count: int, per_session: int) -> list[Session]:
    """``count`` sessions, each on its own connection, at most :data:`SETUP_CONCURRENCY` opening at once."""
    gate = asyncio.Semaphore(SETUP_CONCURRENCY)

    async def one() -> Session:
        async with gate:
            conn = await _connect(uri)
            # ask what nnrp-py asks (4): both server runtimes grant the plugin's own per-session limit, and
            # nnrp-py's native server refuses an ask above its 4
            return await conn.open_session(max_in_flight_operations=min(per_session, 4))

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def _close(sessions: list[Session]) -> None:
    await asyncio.gather(*(s.conn.close() for s in sessions), return_exceptions=True)


async def _nnrp_stream(
    uri: str, count: int, body: dict[str, Any], per_session: int, cancel: int, operation: str = CHAT_COMPLETIONS_CREATE
) -> None:
    sessions = await _open(uri, -(-count // per_session), per_session)
    spaced = {round(k * count / cancel): k for k in range(cancel)} if cancel else {}
    envelope = _envelope(body, operation)

    async def one(i: int) -> dict[str, Any]:
        clock = Clock()
        k = spaced.get(i)
        try:
            async with asyncio.timeout(STREAM_TIMEOUT_S):
                return await _nnrp_request(
                    sessions[i // per_session],
                    envelope,
                    clock,
                    None if k is None else CANCEL_AFTER_S + k * CANCEL_SPACING_S,
                )
        except Exception as exc:  # reported as the request's failure
            return {**_record(clock, 0, f"{type(exc).__name__}: {exc}"[:300]), "cancel_ms": None}

    await _handshake_async(b"ready")
    results = await asyncio.gather(*(one(i) for i in range(count)))
    await _handshake_async({"requests": results})
    await _close(sessions)


async def _nnrp_burst(uri: str, count: int, body: dict[str, Any], operation: str = CHAT_COMPLETIONS_CREATE) -> None:
    release = asyncio.Event()
    envelope = _envelope(body, operation)

    async def one() -> dict[str, Any]:
        await release.wait()
        clock, conn, open_ms = Clock(), None, None
        try:
            async with asyncio.timeout(BURST_TIMEOUT_S):
                conn = await _connect(uri)
                session = await conn.open_session(max_in_flight_operations=1)
                open_ms = (time.perf_counter() - clock.start) * 1000
                out = await _nnrp_request(session, envelope, clock)
            return {**out, "open_ms": open_ms, "served_ms": out["total_ms"]}
        except Exception as exc:  # reported as the client's failure (TimeoutError: not served in time), with
            # its open time if its session had opened
            return {**_record(clock, 0, f"{type(exc).__name__}: {exc}"[:300]), "open_ms": open_ms}
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(BURST_TIMEOUT_S):
                        await conn.close()

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await _handshake_async(b"ready")
    release.set()
    results = await asyncio.gather(*tasks)
    await _handshake_async({"requests": results})


async def _nnrp_idle(uri: str, count: int) -> None:
    sessions = await _open(uri, count, 1)
    await _handshake_async(b"ready")
    await _handshake_async({"requests": []})
    await _close(sessions)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.load_client", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["stream", "burst", "idle"])
    p.add_argument("protocol", choices=["http", "nnrp"])
    p.add_argument("target", help="HTTP base URL or NNRP URI")
    p.add_argument("count", type=int, help="streams, clients or sessions")
    p.add_argument("body", nargs="?", default="{}", help="the chat request body (JSON)")
    p.add_argument("--per-session", type=int, default=1, help="NNRP streams per session (stream mode)")
    p.add_argument("--cancel", type=int, default=0, help="NNRP streams to cancel after their first token")
    p.add_argument("--ca-file", help="PEM certificate to trust for https:// and nnrps:// (a self-signed server's)")
    p.add_argument("--path", help="HTTP path of the requests (default: the --api's route)")
    p.add_argument(
        "--api",
        choices=sorted(OPERATIONS),
        default="chat",
        help="chat.completions (default) or responses: the HTTP route and the NNRP operation",
    )
    a = p.parse_args(argv)
    path = a.path or (RESPONSES_PATH if a.api == "responses" else CHAT_PATH)
    body = orjson.loads(a.body)
    if a.protocol == "http" and (a.mode == "idle" or a.per_session != 1 or a.cancel):
        p.error("idle, --per-session and --cancel are NNRP's")
    _trust(a.ca_file)
    if a.protocol == "http":
        asyncio.run(_http_main(a.mode, a.target, a.count, orjson.dumps(body), a.ca_file, path))
    elif a.mode == "stream":
        asyncio.run(_nnrp_stream(a.target, a.count, body, a.per_session, min(a.cancel, a.count), OPERATIONS[a.api]))
    elif a.mode == "burst":
        asyncio.run(_nnrp_burst(a.target, a.count, body, OPERATIONS[a.api]))
    else:
        asyncio.run(_nnrp_idle(a.target, a.count))


if __name__ == "__main__":
    main()

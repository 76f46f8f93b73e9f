"""``python -m bench carriers``: what each NNRP carrier costs the API server, on one real ``vllm serve``.

The server is :mod:`bench.load`'s (the tiny model with ``--load-format dummy``, :data:`bench.load.NNRP_CONFIG`)
listening on every carrier at once: ``tcp://``, ``nnrps://``, ``ws://``, ``wss://`` and ``quic://`` (one
self-signed certificate for the TLS ones). Every carrier is served by the same wire core on vLLM's event loop;
what differs is the framing around it (TLS records, WebSocket frames, QUIC packets and their encryption). The
load generator is the same for all: :mod:`bench.load_client` on :mod:`vllm_nnrp_plugin.client.aio.connection`, one
session per stream, :data:`bench.load.CLIENT_PROCESSES` processes.

Per level (default 32, 128, 256) the same streamed chat request as :mod:`bench.load`'s levels runs over each
carrier in ``rounds`` windows, the carriers' order reversed every other round. Rows, id
``carriers.c<N>.<metric>.<carrier>``: ``api_server_cpu_us_per_token`` (µs, one sample per window),
``tokens_per_s``, ``failed``; and ``carriers.c<N>.api_server_cpu_us_per_token_ratio.<carrier>_over_<base>``: a
plain carrier over ``tcp``, a TLS one over ``nnrps`` (target: p50 ≤ 1.10). Then per carrier: cancels under 256
streams (:func:`bench.load.cancel_rows`, ids ``carriers.<carrier>.cancel.c256.…``; the API server's cancel →
vLLM abort p99 must be ≤ 5 ms: ``…server_cancel_to_abort_p99_ms.nnrp``) and the API server's threads with 256
idle sessions open (:func:`bench.load.thread_rows`, ids ``carriers.<carrier>.threads.…``; must add none).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import orjson

from bench import load, tiny_model
from bench.e2e import START_TIMEOUT_S
from bench.results import Result, Target
from compat.launcher import free_port, serve_with_nnrp

CARRIERS = ("tcp", "nnrps", "ws", "wss", "quic")
#: what each carrier is compared with: the plain ones with TCP, the TLS ones with TLS over TCP
BASE = {"ws": "tcp", "quic": "tcp", "wss": "nnrps"}
WITHIN_10_PERCENT = Target("p50", "<=", 1.10)
CANCEL_P99 = Target("max", "<=", 5.0)


def level_rows(
    server: Any,
    engine: Sequence[int],
    *,
    levels: Sequence[int],
    rounds: int,
    max_tokens: int,
    carriers: Sequence[str],
    workdir: str,
) -> list[Result]:
    body = load.request_body("chat", max_tokens)
    rows: list[Result] = []
    for c in levels:
        got: dict[str, list[load.Window]] = {carrier: [] for carrier in carriers}
        started = time.perf_counter()
        for r in range(rounds):
            for carrier in carriers if r % 2 == 0 else carriers[::-1]:
                got[carrier].append(
                    load.window(server, engine, "stream", "nnrp", c, body, transport=carrier, workdir=workdir)
                )
        print(f"bench carriers: c{c} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        cpu: dict[str, Result] = {}
        for carrier, windows in got.items():
            params = {
                "concurrency": c,
                "rounds": rounds,
                "max_tokens": max_tokens,
                "nnrp_transport": carrier,
                "client_processes": len(load.shares(c)),
            }
            cpu[carrier] = Result.of(
                f"carriers.c{c}.api_server_cpu_us_per_token.{carrier}",
                "us",
                [w.api_cpu_s * 1e6 / max(1, w.tokens) for w in windows],
                parameters=params,
            )
            rows += [
                cpu[carrier],
                Result.of(
                    f"carriers.c{c}.tokens_per_s.{carrier}",
                    "tokens/s",
                    [w.tokens / w.wall_s for w in windows],
                    parameters=params,
                ),
                load._failed(f"carriers.c{c}.failed.{carrier}", windows, params),
            ]
        for carrier, base in BASE.items():
            if carrier in cpu and base in cpu:
                rows.append(
                    load._ratio(
                        f"carriers.c{c}.api_server_cpu_us_per_token_ratio.{carrier}_over_{base}",
                        cpu[carrier],
                        cpu[base],
                        WITHIN_10_PERCENT,
                        cpu[carrier].parameters,
                    )
                )
    return rows


def cancel_and_thread_rows(
    server: Any,
    engine: Sequence[int],
    *,
    carriers: Sequence[str],
    cancel_streams: int,
    cancel_per_session: int,
    cancel_sample: int,
    thread_sessions: int,
    workdir: str,
) -> list[Result]:
    """Per carrier, the cancels under load (none when ``cancel_streams`` is 0), then the threads with idle
    sessions (none when ``thread_sessions`` is 0)."""
    rows: list[Result] = []
    for carrier in carriers if cancel_streams else ():
        rows += load.cancel_rows(
            server,
            engine,
            streams=cancel_streams,
            per_session=cancel_per_session,
            cancel=cancel_sample,
            max_tokens=load.RUNNING_TOKENS,
            transport=carrier,
            workdir=workdir,
            prefix=f"carriers.{carrier}",
            p99_target=CANCEL_P99,
        )
    for carrier in carriers if thread_sessions else ():
        rows += load.thread_rows(
            server, sessions=thread_sessions, transport=carrier, workdir=workdir, prefix=f"carriers.{carrier}"
        )
    return rows


def run(
    *,
    model: str | None = None,
    levels: Sequence[int] = load.LEVELS,
    rounds: int = 2,
    max_tokens: int = 256,
    carriers: Sequence[str] = CARRIERS,
    cancel_streams: int = 256,
    cancel_per_session: int = 32,
    cancel_sample: int = 32,
    thread_sessions: int = 256,
) -> list[Result]:
    """Serve the tiny model made from ``model`` (default ``$VLLM_NNRP_TEST_MODEL``) on every carrier and measure
    (module docstring). Raises ``SystemExit`` without a model, ``compat.launcher.ServeError`` when ``vllm serve``
    does not start, ``RuntimeError`` when a client process fails."""
    model = model or os.environ.get("VLLM_NNRP_TEST_MODEL")
    if not model:
        raise SystemExit("carriers benchmark: give --model or set VLLM_NNRP_TEST_MODEL")
    with tempfile.TemporaryDirectory() as workdir:
        tiny = str(tiny_model.build(model))
        cert, key = load.self_signed(workdir)
        nnrp = {
            "tcp": f"tcp://127.0.0.1:{free_port()}",
            "nnrps": f"nnrps://127.0.0.1:{free_port()}",
            "ws": f"ws://127.0.0.1:{free_port()}/nnrp",
            "wss": f"wss://127.0.0.1:{free_port()}/nnrp",
            "quic": f"quic://127.0.0.1:{free_port()}",
        }
        nnrp = {carrier: nnrp[carrier] for carrier in carriers}
        config = {"nnrp": {**load.NNRP_CONFIG["nnrp"], "tls_cert_file": cert, "tls_key_file": key}}
        seqs = max(256, *levels, cancel_streams)
        server = serve_with_nnrp(
            tiny,
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
            ),
        )
        server.nnrp, server.ca_file = nnrp, cert
        try:
            server.wait_ready(START_TIMEOUT_S)
            engine = load.engine_pids(server.pid)
            for carrier in carriers:  # warm-up: every carrier's first connections and vLLM's first requests
                load.window(
                    server,
                    engine,
                    "stream",
                    "nnrp",
                    4,
                    load.request_body("chat", 16),
                    transport=carrier,
                    workdir=workdir,
                )
            rows = level_rows(
                server, engine, levels=levels, rounds=rounds, max_tokens=max_tokens, carriers=carriers, workdir=workdir
            )
            rows += cancel_and_thread_rows(
                server,
                engine,
                carriers=carriers,
                cancel_streams=cancel_streams,
                cancel_per_session=cancel_per_session,
                cancel_sample=cancel_sample,
                thread_sessions=thread_sessions,
                workdir=workdir,
            )
            return rows
        finally:
            served = server.log.stat().st_size
            server.stop()
            load._report_log(server, served)

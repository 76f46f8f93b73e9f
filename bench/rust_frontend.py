"""``python -m bench rust --rust-frontend PATH``: vLLM's Rust frontend as the reference beside :mod:`bench.load`.

vLLM 0.32 can serve its OpenAI API from a Rust process instead of the Python API server: ``VLLM_USE_RUST_FRONTEND=1
vllm serve …`` with ``VLLM_RUST_FRONTEND_PATH`` naming the ``vllm-rs`` binary (``vllm/envs.py``,
``vllm/entrypoints/cli/serve.py``; the Python process then only supervises the engine core and the ``vllm-rs
frontend`` child). The binary ships in PyPI's CUDA wheel of vLLM, not in a CPU build; on a CPU machine take it from
that wheel (``pip download vllm==0.32.0 --no-deps``, then ``unzip -j vllm-0.32.0-*.whl vllm/vllm-rs``) and give its
path. The plugin cannot attach to it (there is no Python API server to attach to): this run measures what a user
who picks the Rust frontend instead of NNRP gets, as the reference the load benchmark's figures are read against.

The server is :mod:`bench.load`'s model and shape (the tiny model with ``--load-format dummy``; ``tools``: the
agent server, hermes tool-call parser, one tool in every request), started by the installed vLLM with the Rust
frontend. Per level (default 32, 128, 256), ``rounds`` windows of HTTP/SSE streams from :mod:`bench.load_client`
(the same clients, requests and counting as :mod:`bench.load`'s HTTP rows). Rows, id
``rust[.tools].c<N>.<metric>.http``: ``api_server_cpu_us_per_token`` (µs: the ``vllm-rs`` process, every thread),
``engine_cpu_us_per_token``, ``tokens_per_s``, ``ttft`` (ms), ``gap`` (ms), ``failed``.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import attrs

from bench import load, tiny_model
from bench.e2e import START_TIMEOUT_S
from bench.results import Result
from compat.launcher import VLLMServer


@attrs.define
class RustServer:
    """What :func:`bench.load.window` reads of a server: ``pid`` (the API server: the ``vllm-rs`` process) and
    ``http`` (its base URL)."""

    pid: int
    http: str


def frontend_pid(supervisor: int, binary: str) -> int:
    """The ``vllm-rs`` process among ``supervisor``'s descendants (the process whose executable is ``binary``).
    Raises ``RuntimeError`` when there is none."""
    target = os.path.realpath(binary)
    seen, queue = set(), [supervisor]
    while queue:
        pid = queue.pop()
        seen.add(pid)
        try:
            if os.path.realpath(f"/proc/{pid}/exe") == target:
                return pid
            queue += [c for c in load._children(pid) if c not in seen]
        except OSError:  # ended meanwhile
            continue
    raise RuntimeError(f"no {binary} process under the vllm serve process {supervisor}")


def level_rows(
    server: RustServer,
    engine: Sequence[int],
    prefix: str,
    *,
    levels: Sequence[int],
    rounds: int,
    max_tokens: int,
    workdir: str,
    parameters: dict[str, Any],
    body_extra: dict[str, Any] | None = None,
) -> list[Result]:
    body = {**load.request_body("chat", max_tokens), **(body_extra or {})}
    rows: list[Result] = []
    for c in levels:
        started = time.perf_counter()
        windows = [
            load.window(server, engine, "stream", "http", c, body, transport="tcp", workdir=workdir)
            for _ in range(rounds)
        ]
        print(f"bench rust: {prefix}.c{c} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        params = {
            **parameters,
            "concurrency": c,
            "client_processes": len(load.shares(c)),
            "rounds": rounds,
            "max_tokens": max_tokens,
        }
        ok = [r for w in windows for r in w.requests if r["error"] is None and r["ttft_ms"] > 0]
        name = f"{prefix}.c{c}.{{}}.http"
        rows += [
            Result.of(
                name.format("api_server_cpu_us_per_token"),
                "us",
                [w.api_cpu_s * 1e6 / max(1, w.tokens) for w in windows],
                parameters=params,
            ),
            Result.of(
                name.format("engine_cpu_us_per_token"),
                "us",
                [w.engine_cpu_s * 1e6 / max(1, w.tokens) for w in windows],
                parameters=params,
            ),
            Result.of(
                name.format("tokens_per_s"), "tokens/s", [w.tokens / w.wall_s for w in windows], parameters=params
            ),
            Result.of(name.format("ttft"), "ms", [r["ttft_ms"] for r in ok] or [0.0], parameters=params),
            Result.of(name.format("gap"), "ms", [g for r in ok for g in r["gaps_ms"]] or [0.0], parameters=params),
            load._failed(name.format("failed"), windows, params),
        ]
    return rows


def run(
    *,
    frontend: str,
    model: str | None = None,
    levels: Sequence[int] = load.LEVELS,
    rounds: int = 2,
    max_tokens: int = 256,
    tools: bool = False,
) -> list[Result]:
    """Serve the tiny model made from ``model`` (default ``$VLLM_NNRP_TEST_MODEL``) behind the Rust frontend
    ``frontend`` (the ``vllm-rs`` binary) and measure (module docstring). Raises ``SystemExit`` without a model or
    binary, ``compat.launcher.ServeError`` when ``vllm serve`` does not start."""
    model = model or os.environ.get("VLLM_NNRP_TEST_MODEL")
    if not model:
        raise SystemExit("rust frontend benchmark: give --model or set VLLM_NNRP_TEST_MODEL")
    if not frontend or not os.access(frontend, os.X_OK):
        raise SystemExit(
            f"rust frontend benchmark: --rust-frontend {frontend!r} is not an executable vllm-rs binary "
            "(module docstring of bench/rust_frontend.py: where to get it)"
        )
    prefix = "rust.tools" if tools else "rust"
    parameters = {
        "frontend": "vllm-rs",
        "api": "chat",
        **({"server": "hermes tool parser", "tool_choice": "auto"} if tools else {}),
    }
    with tempfile.TemporaryDirectory() as workdir:
        tiny = str(tiny_model.build(model))
        env = {"VLLM_USE_RUST_FRONTEND": "1", "VLLM_RUST_FRONTEND_PATH": str(pathlib.Path(frontend).resolve())}
        args = (
            "--load-format",
            "dummy",
            "--max-num-seqs",
            str(max(256, *levels)),
            *(load.AGENT_SERVER_ARGS if tools else ()),
        )
        with VLLMServer(tiny, workdir, env=env, extra_args=args) as served:
            served.wait_ready(START_TIMEOUT_S)
            server = RustServer(frontend_pid(served.pid, frontend), served.http)
            engine = load.engine_pids(served.pid)
            return level_rows(
                server,
                engine,
                prefix,
                levels=levels,
                rounds=rounds,
                max_tokens=max_tokens,
                workdir=workdir,
                parameters=parameters,
                body_extra=load.agent_fields("chat") if tools else None,
            )

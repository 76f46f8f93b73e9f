"""6. Framework cost per streamed chunk: what the serving around vLLM costs, without vLLM's model or its stream
generator — vLLM's HTTP/SSE stack against the plugin's NNRP path, in one server process.

The server (``python -m bench.framework --serve``: prints ``ready``, serves until its stdin closes) runs on
uvloop, as ``vllm serve`` does, and serves the same synthetic streams both ways: HTTP/SSE through the ASGI
stack vLLM builds (FastAPI, ``CORSMiddleware``, vLLM's ``ScalingMiddleware``, the Prometheus instrumentator;
a ``StreamingResponse`` under uvicorn's httptools protocol: ``vllm/entrypoints/openai/api_server.py``
``build_app``) and NNRP through the plugin's service over TCP (:class:`vllm_nnrp_plugin.service.NNRPService`,
its listener, the adapter, :func:`~vllm_nnrp_plugin.vllm_binding.chunk_shapes.vllm_chunks`). One engine tick
(every :data:`TICK_S`) gives every stream its next chunk, the ``data: <chat.completion.chunk>`` string vLLM's
generator would yield for a one-token text delta, so both sides wake and write once per stream and tick.

Per concurrency level, windows alternate HTTP / NNRP / NNRP / HTTP (:func:`bench.load.window`, the load
benchmark's client processes: aiohttp, and the plugin's asyncio client, one stream per connection). Rows
``framework.c<N>.server_{user,sys}_us_per_chunk.<http|nnrp>`` (the server process's utime / stime over the
window per chunk streamed, µs) and ``framework.c<N>.server_cpu_us_per_chunk_ratio.nnrp_over_http``. The
chunk strings are built by the same code on both sides, so the difference is the framework's. Needs vLLM's
environment (FastAPI, uvicorn, uvloop, vLLM's middleware).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import types
from typing import Any

import orjson
from starlette.requests import Request  # module level: FastAPI resolves the endpoints' annotations here

from bench.procs import ROOT, env
from bench.results import Result
from compat.launcher import free_port

TICK_S = 0.004
LEVELS = (32, 128)
WORDS = ("Hello", "!", " I", "'s", "ure", " the", " model", " says", ",", " and")


class Engine:
    """One tick for all streams: :meth:`stream` yields a stream's chunk strings, one per tick."""

    def __init__(self) -> None:
        self._step: asyncio.Future | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step, self._step = self._step, loop.create_future()
            if step is not None:
                step.set_result(None)
            await asyncio.sleep(TICK_S)

    async def stream(self, request_id: str, tokens: int):
        head = (
            f'{{"id":"chatcmpl-{request_id}","object":"chat.completion.chunk","created":1796000968,"model":"m",'
            '"choices":[{"index":0,"delta":{'
        )
        await self._step
        yield (
            "data: "
            + head
            + '"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null}\n\n'
        )
        for i in range(tokens):
            await self._step
            finish = "null" if i < tokens - 1 else '"length","stop_reason":null'
            text = orjson.dumps(WORDS[i % len(WORDS)]).decode()
            yield f'data: {head}"content":{text}}},"logprobs":null,"finish_reason":{finish},"token_ids":null}}]}}\n\n'
        usage = f'{{"prompt_tokens":9,"total_tokens":{9 + tokens},"completion_tokens":{tokens}}}'
        yield (
            f'data: {{"id":"chatcmpl-{request_id}","object":"chat.completion.chunk","created":1796000968,'
            f'"model":"m","choices":[],"usage":{usage}}}\n\n'
        )
        yield "data: [DONE]\n\n"


class _Backend:
    """The plugin's backend surface over :class:`Engine` (a chat stream of ``max_tokens`` chunks)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def capabilities(self) -> dict[str, Any]:
        from vllm_nnrp_plugin.profile.capabilities import chat_operation, runtime_document

        return runtime_document(models=["m"], owned_by="bench", operations=[chat_operation(tool_calls=False)])

    async def create(
        self,
        operation: str,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None = None,
        controls: Any = None,
    ):
        from vllm_nnrp_plugin.core.adapter import Call
        from vllm_nnrp_plugin.vllm_binding.chunk_shapes import TokenBudget, vllm_chunks

        tokens = int(body["max_tokens"])
        return Call(stream=vllm_chunks(self._engine.stream(request_id, tokens), TokenBudget(tokens, 1 << 20)))

    def engine_request_id(self, operation: str, request_id: str) -> str:
        return request_id

    async def abort(self, operation: str, request_id: str) -> None:
        """Nothing to stop: closing the stream ends it."""


def _app(engine: Engine) -> Any:
    from fastapi import FastAPI
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, StreamingResponse
    from prometheus_client import CollectorRegistry
    from prometheus_fastapi_instrumentator import Instrumentator
    from vllm.entrypoints.serve.elastic_ep.middleware import ScalingMiddleware

    app = FastAPI()
    ids = iter(range(1 << 62))

    async def chat(request: Request) -> StreamingResponse:
        body = orjson.loads(await request.body())
        return StreamingResponse(engine.stream(str(next(ids)), int(body["max_tokens"])), media_type="text/event-stream")

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({})

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/health", health)
    Instrumentator(excluded_handlers=["/metrics", "/health"], registry=CollectorRegistry()).add().instrument(app)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(ScalingMiddleware)
    return app


async def _serve(http_port: int, nnrp_uri: str) -> None:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from vllm_nnrp_plugin.config import NNRPConfig
    from vllm_nnrp_plugin.service import NNRPService

    loop = asyncio.get_running_loop()
    engine = Engine()
    ticking = loop.create_task(engine.run())
    config = uvicorn.Config(
        _app(engine),
        host="127.0.0.1",
        port=http_port,
        loop="none",
        http="httptools",
        lifespan="off",
        log_level="warning",
        backlog=2048,
    )
    http = uvicorn.Server(config)
    serving = loop.create_task(http.serve())
    service = NNRPService(
        NNRPConfig(enabled=True, listen=(nnrp_uri,)), _Backend(engine), loop, registry=CollectorRegistry()
    )
    await service.start()
    while not http.started:
        await asyncio.sleep(0.05)
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    await service.stop()
    http.should_exit = True
    await serving
    ticking.cancel()


def run(*, levels: tuple[int, ...] = LEVELS, rounds: int = 2, tokens: int = 1024) -> list[Result]:
    from bench import load

    http_port, nnrp_uri = free_port(), f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.framework", "--serve", str(http_port), nnrp_uri],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env(),
        cwd=ROOT,
    )
    rows: list[Result] = []
    try:
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError("the framework benchmark's server did not start")
        target = types.SimpleNamespace(pid=server.pid, http=f"http://127.0.0.1:{http_port}", nnrp={"tcp": nnrp_uri})
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with tempfile.TemporaryDirectory() as workdir:
            for c in levels:
                got: dict[str, dict[str, list[float]]] = {p: {"user": [], "sys": []} for p in ("http", "nnrp")}
                for r in range(rounds):
                    for protocol in ("http", "nnrp") if r % 2 == 0 else ("nnrp", "http"):
                        before = load.cpu_times(server.pid)
                        w = load.window(target, [], "stream", protocol, c, body, transport="tcp", workdir=workdir)
                        after = load.cpu_times(server.pid)
                        if w.failed:
                            raise RuntimeError(f"framework benchmark: {w.failed[0]['error']}")
                        for i, part in enumerate(("user", "sys")):
                            got[protocol][part].append((after[i] - before[i]) * 1e6 / w.tokens)
                params = {"concurrency": c, "rounds": rounds, "tokens_per_stream": tokens, "tick_ms": TICK_S * 1000}
                made = {}
                for protocol, parts in got.items():
                    for part, values in parts.items():
                        made[protocol, part] = Result.of(
                            f"framework.c{c}.server_{part}_us_per_chunk.{protocol}", "us", values, parameters=params
                        )
                        rows.append(made[protocol, part])
                total = {p: [u + s for u, s in zip(got[p]["user"], got[p]["sys"], strict=True)] for p in got}
                nnrp = Result.of(f"framework.c{c}.server_cpu_us_per_chunk.nnrp", "us", total["nnrp"], parameters=params)
                http = Result.of(f"framework.c{c}.server_cpu_us_per_chunk.http", "us", total["http"], parameters=params)
                nnrp.versus(http)
                rows += [http, nnrp]
    finally:
        server.stdin.close()
        server.wait(60)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        import uvloop

        uvloop.run(_serve(int(sys.argv[2]), sys.argv[3]))
    else:
        for row in run():
            ratio = f"  ratio {row.compare['p50_ratio']}" if row.compare else ""
            print(f"{row.id}: p50 {row.p50:.2f} p95 {row.p95:.2f} us{ratio}")

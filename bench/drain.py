"""The floor of :mod:`bench.load`: vLLM's own Python output path with nothing consuming the stream.

Loaded into the API server as an ASGI middleware (``vllm serve --middleware bench.drain.DrainMiddleware``, vLLM's
documented flag; the checkout must be on the server's ``PYTHONPATH``), it answers ``POST /bench/drain``
(:data:`PATH`) itself: it starts one request in vLLM's engine client (``app.state.engine_client.generate``,
``vllm/v1/engine/async_llm.py``) with a fixed 16-token prompt and the body's ``max_tokens`` (a Responses body's
``max_output_tokens``; ``ignore_eos``, ``temperature`` 0, DELTA outputs, detokenised as a chat stream's are), reads
every ``RequestOutput`` and drops it, then answers one SSE-shaped body whose only chunk is the usage
(``completion_tokens``: the output tokens read), so the load client counts its tokens as for a chat stream. What the
API server spends per token on such a request is what vLLM's output path costs before any chat formatting — the
floor under both vLLM's HTTP/SSE and NNRP.

It is a plain ASGI class, not ``@app.middleware("http")`` (Starlette's ``BaseHTTPMiddleware``, which would carry
every other response's body through a stream of its own and make vLLM's own HTTP/SSE streams dearer): every other
request goes to vLLM unchanged.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

PATH = "/bench/drain"
#: the prompt of every drained request (its content does not matter to the random-weight model of the load bench)
PROMPT_TOKEN_IDS = list(range(100, 116))


class DrainMiddleware:
    """The middleware: ``POST`` :data:`PATH` is answered here, everything else passes on to ``app``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        body = orjson.loads(raw)
        budget = body.get("max_tokens") or body.get("max_output_tokens") or 16  # a chat or a Responses body's
        params = SamplingParams(
            max_tokens=int(budget), ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
        )
        tokens = 0
        async for output in scope["app"].state.engine_client.generate(
            {"prompt_token_ids": PROMPT_TOKEN_IDS}, params, f"drain-{uuid.uuid4().hex}"
        ):
            tokens += len(output.outputs[0].token_ids)
        usage = {
            "prompt_tokens": len(PROMPT_TOKEN_IDS),
            "completion_tokens": tokens,
            "total_tokens": len(PROMPT_TOKEN_IDS) + tokens,
        }
        chunk = orjson.dumps({"object": "chat.completion.chunk", "choices": [], "usage": usage})
        payload = b"data: " + chunk + b"\n\ndata: [DONE]\n\n"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

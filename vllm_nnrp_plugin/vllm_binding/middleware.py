"""The explicit-configuration attach path:
``vllm serve --middleware vllm_nnrp_plugin.vllm_binding.middleware.NNRPMiddleware``.

vLLM 0.18 and 0.22 have no API-server plugin hook; their documented ``--middleware`` flag (also on 0.26 to 0.32,
also ``middleware: <path>`` in a ``--config`` YAML file) makes vLLM call ``app.add_middleware(NNRPMiddleware)``.
(vLLM's ``build_app`` in ``vllm/entrypoints/openai/api_server.py``, on 0.32 ``init_entrypoints_middleware`` in
``vllm/entrypoints/serve/middleware/register.py``, adds a class with ``app.add_middleware``, so it is constructed
with the ASGI app only.) As a pure ASGI middleware it sees the ``lifespan`` scope: it starts the service
when the inner app reports ``lifespan.startup.complete`` (``app.state`` is complete then) and stops it when
``lifespan.shutdown`` arrives, before passing it inward (before vLLM's lifespan deletes ``app.state``). HTTP and
websocket traffic passes through untouched. If the endpoint plugin already attached the service, this does nothing
(:func:`.lifecycle.claim`).
"""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.vllm_binding.families import MIDDLEWARE
from vllm_nnrp_plugin.vllm_binding.lifecycle import claim, log_like_vllm, start_service, stop_service

Scope = dict[str, Any]


class NNRPMiddleware:
    """ASGI middleware constructed by vLLM with the inner app only (``app.add_middleware(cls)``: no options;
    settings come from ``--additional-config``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        attached = False

        async def send_startup(message: Scope) -> None:
            # An exception here is raised inside the inner lifespan, which reports lifespan.startup.failed:
            # uvicorn then logs "Application startup failed" with the message and vllm serve exits.
            nonlocal attached
            if message["type"] == "lifespan.startup.complete" and claim(state, MIDDLEWARE):
                attached = True
                log_like_vllm()
                await start_service(state, MIDDLEWARE)
            await send(message)

        async def receive_shutdown() -> Scope:
            message = await receive()
            if message["type"] == "lifespan.shutdown" and attached:
                await stop_service(state)
            return message

        await self.app(scope, receive_shutdown, send_startup)

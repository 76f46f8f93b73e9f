"""The ``vllm.endpoint_plugins`` entry point ``nnrp`` and the router lifespan that runs the NNRP service.

:class:`NNRPEndpointPlugin` (vLLM 0.26 to 0.32, loaded in the API-server process when ``VLLM_PLUGINS`` names
``nnrp``; ``vllm/plugins/__init__.py``): ``build_app`` (``vllm/entrypoints/openai/api_server.py`` up to 0.28,
``vllm/entrypoints/launchers/app.py`` through ``vllm/plugins/endpoint_plugins/interface.py`` from 0.29) calls
``attach_router``, which adds an ``APIRouter`` whose lifespan FastAPI runs nested inside vLLM's own: it starts
the service after ``app.state`` is complete and stops it before vLLM's lifespan deletes the state.

vLLM loads an endpoint plugin only when its ``required_tasks`` is ``None`` or meets the server's supported tasks
(``load_endpoint_plugins``), logging a skip at INFO otherwise. NNRP serves generate servers (chat, models) and
pooling servers (models, embeddings) alike, so it requires no task: it attaches to every server and the backend
decides what it serves — a server whose operations make up no whole profile level stops ``vllm serve`` at
start-up with ``NNRPStartupError`` (:class:`~vllm_nnrp_plugin.vllm_binding.backend.VLLMBackend`), never a silent
server without a listener.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from vllm_nnrp_plugin.vllm_binding.families import ENDPOINT_PLUGIN
from vllm_nnrp_plugin.vllm_binding.lifecycle import claim, log_like_vllm, start_service, stop_service


class NNRPEndpointPlugin:
    """vLLM's ``EndpointPlugin`` (the same protocol on 0.26 to 0.32): no HTTP routes, only a lifespan that runs
    the NNRP service."""

    name = "nnrp"
    required_tasks = None  # every server: the backend decides what it serves (or refuses it at start-up)

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter

        if claim(app.state, ENDPOINT_PLUGIN):  # never attach the service twice
            app.include_router(APIRouter(lifespan=nnrp_lifespan))

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing to prepare: settings were checked at start-up (:mod:`.general`); the lifespan reads
        ``app.state``."""


@contextlib.asynccontextmanager
async def nnrp_lifespan(app: Any) -> AsyncIterator[None]:
    """Start the NNRP service on this app's state; stop it on the way out. Start-up errors propagate, so
    uvicorn reports "Application startup failed" and ``vllm serve`` exits."""
    log_like_vllm()
    await start_service(app.state, ENDPOINT_PLUGIN)
    try:
        yield
    finally:
        await stop_service(app.state)

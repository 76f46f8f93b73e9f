"""The ``vllm.endpoint_plugins`` entry point ``nnrp`` and the router lifespan that runs the listener.

:class:`NNRPEndpointPlugin` (vLLM 0.26+, loaded in the API-server process when ``VLLM_PLUGINS`` names
``nnrp``): ``attach_router`` adds an ``APIRouter`` whose lifespan starts the listener after ``app.state`` is
complete and stops it before vLLM deletes the state (vllm-integration.md §3.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from vllm_nnrp_plugin.config import load_config
from vllm_nnrp_plugin.service import NNRPService
from vllm_nnrp_plugin.vllm_binding.chat import VLLMChatBackend
from vllm_nnrp_plugin.vllm_binding.gate import NNRPStartupError, binding_name

logger = logging.getLogger("vllm_nnrp_plugin")

_ATTACHED = "nnrp_listener_attached"
_SERVICE = "nnrp_service"


class NNRPEndpointPlugin:
    """vLLM 0.26 ``EndpointPlugin``: no HTTP routes, only a lifespan that runs the NNRP listener."""

    name = "nnrp"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter

        if getattr(app.state, _ATTACHED, False):
            return  # never attach the listener twice
        setattr(app.state, _ATTACHED, True)
        app.include_router(APIRouter(lifespan=nnrp_lifespan))

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing to prepare: settings were checked at start-up (:mod:`.general`); the lifespan reads
        ``app.state``."""


@contextlib.asynccontextmanager
async def nnrp_lifespan(app: Any) -> AsyncIterator[None]:
    """Start the NNRP service on this app's state; stop it on the way out. Start-up errors propagate, so
    uvicorn reports "Application startup failed" and ``vllm serve`` exits."""
    _log_like_vllm()
    state = app.state
    config = load_config(state.vllm_config.additional_config)
    if not config.enabled:
        logger.info("NNRP listener disabled (nnrp.enabled is false)")
        yield
        return

    import vllm

    api_servers = getattr(state.vllm_config.parallel_config, "_api_process_count", 1)
    if api_servers > 1:
        raise NNRPStartupError(
            f"vllm-nnrp-plugin: this release serves NNRP from one API-server process, but vLLM runs {api_servers} "
            "(--api-server-count, or data parallelism). Fix: --api-server-count 1, or disable NNRP."
        )
    backend = VLLMChatBackend(state)
    service = NNRPService(config, backend, asyncio.get_running_loop())
    bound = await asyncio.to_thread(service.start)  # binding is a native call: keep it off vLLM's loop
    setattr(state, _SERVICE, service)
    logger.info(
        "NNRP listening on %s (vLLM %s, binding %s, models: %s)",
        ", ".join(bound),
        vllm.__version__,
        binding_name(vllm.__version_tuple__),
        ", ".join(backend.model_ids()),
    )
    if service.metrics_address is not None:
        logger.info("NNRP metrics also served on http://%s/metrics (nnrp.metrics_listen)", service.metrics_address)
    try:
        yield
    finally:
        await service.stop()
        logger.info("NNRP listener stopped")


def _log_like_vllm() -> None:
    """Send this package's log records to vLLM's own handlers and level (vLLM does not propagate to root)."""
    ours, theirs = logging.getLogger("vllm_nnrp_plugin"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False

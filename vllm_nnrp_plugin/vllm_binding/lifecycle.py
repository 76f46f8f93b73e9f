"""Start and stop the NNRP service on a vLLM app's state; shared by both attach paths.

Both the endpoint plugin's router lifespan (:mod:`.endpoint`) and the ASGI middleware (:mod:`.middleware`) call
:func:`claim` when they attach and :func:`start_service` / :func:`stop_service` around serving. vLLM would run
both when both are configured (it includes every endpoint plugin's router and adds every ``--middleware``), so
the first to claim the app (a flag on ``app.state``, the object vLLM's ``build_app`` fills) runs the one service.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import attrs

from vllm_nnrp_plugin.config import NNRPConfig, load_config
from vllm_nnrp_plugin.nnrp_binding.authentication import APIKeys
from vllm_nnrp_plugin.service import NNRPService
from vllm_nnrp_plugin.vllm_binding.backend import VLLMBackend
from vllm_nnrp_plugin.vllm_binding.families import MIDDLEWARE, api_keys
from vllm_nnrp_plugin.vllm_binding.fault_injection import with_fault_injection
from vllm_nnrp_plugin.vllm_binding.gate import decision_for, middleware_enables
from vllm_nnrp_plugin.vllm_binding.ranks import rank_listen
from vllm_nnrp_plugin.vllm_binding.shutdown import stop_before_engine_shutdown

logger = logging.getLogger("vllm_nnrp_plugin")

_ATTACHED = "nnrp_service_attached"
_SERVICE = "nnrp_service"
_UNDO_SHUTDOWN_HOOK = "nnrp_undo_shutdown_hook"


def claim(state: Any, attach_path: str) -> bool:
    """True for the first attach path to claim this app's NNRP service, False for any later one."""
    if getattr(state, _ATTACHED, None):
        return False
    setattr(state, _ATTACHED, attach_path)
    return True


async def start_service(state: Any, attach_path: str) -> None:
    """Start the NNRP service (listeners, sessions, the backend of every operation the server serves) on ``state``
    (vLLM's complete ``app.state``) and keep it there.

    Settings: ``state.vllm_config.additional_config["nnrp"]`` plus the environment (:func:`load_config`); the
    middleware path counts as enabling unless ``nnrp.enabled`` is explicitly false. The vLLM version and family
    binding are the start-up gate's decision (:func:`.gate.decision_for`: made at CLI-parse time in this process,
    or here where the gate did not run). With ``nnrp.fault_injection_backend_error_model`` (test only) the backend
    is wrapped here (:mod:`.fault_injection`), the one place in the package that installs it.
    API-server rank ``r`` of ``N`` listens on the addresses of :func:`rank_listen`; only rank 0 serves the
    standalone ``/metrics`` of ``nnrp.metrics_listen``. vLLM's engine shutdown (SIGTERM/SIGINT) first stops
    this service gracefully (:mod:`.shutdown`).

    Raises ``NNRPStartupError`` (no binding), ``ConfigError`` (settings), ``RankAddressError``,
    ``ListenError`` (bind); raised inside the lifespan they make vLLM's start-up fail with the message.
    """
    additional = state.vllm_config.additional_config
    config = load_config(middleware_enables(additional) if attach_path == MIDDLEWARE else additional, os.environ)
    if not config.enabled:
        logger.info("NNRP listener disabled (nnrp.enabled is false)")
        return
    decision = decision_for(attach_path, config.allow_untested_vllm)
    parallel = state.vllm_config.parallel_config
    rank, count = getattr(parallel, "_api_process_rank", 0), getattr(parallel, "_api_process_count", 1)
    # the standalone /metrics (nnrp.metrics_listen) is served once, by rank 0, from the registry that
    # aggregates every rank (vLLM sets PROMETHEUS_MULTIPROC_DIR when it runs several API servers)
    config = attrs.evolve(
        config,
        listen=rank_listen(config.listen, rank, count),
        metrics_listen=config.metrics_listen if rank == 0 else None,
    )
    if config.max_in_flight_per_session is None:  # a session's credit: what vLLM's scheduler runs at once
        config = attrs.evolve(config, max_in_flight_per_session=state.vllm_config.scheduler_config.max_num_seqs)
    keys = _keys(state, config)
    backend = VLLMBackend(
        state,
        config.operations,
        vllm_version=decision.vllm_version,
        binding=decision.binding,
        priorities=config.vllm_priorities(),
    )
    await backend.prove_lanes()
    served = with_fault_injection(backend, config.fault_injection_backend_error_model)  # test only, off by default
    service = NNRPService(config, served, asyncio.get_running_loop(), keys=keys)
    bound = await service.start()
    setattr(state, _SERVICE, service)
    undo = stop_before_engine_shutdown(
        state.engine_client,
        asyncio.get_running_loop(),
        service.drain,
        grace_s=config.drain_timeout_ms / 1000,  # running operations finish first (nnrp.drain_timeout_ms)
        killed_at_timeout=count > 1,
    )
    setattr(state, _UNDO_SHUTDOWN_HOOK, undo)
    logger.info(
        "NNRP listening on %s (vLLM %s, binding %s, attach path %s, API server %d of %d, models: %s)",
        ", ".join(bound),
        decision.vllm_version,
        decision.binding.name,
        attach_path,
        rank,
        count,
        ", ".join(backend.model_ids()),
    )
    for label, path in backend.stream_paths():
        logger.info("NNRP %s streams: %s", label, path)
    if decision.untested:
        logger.warning(
            "NNRP runs on vLLM %s, a line newer than every one this release was tested on (nnrp.allow_untested_vllm "
            "is true): the %s binding's start-up probes passed and the engine lanes kept above passed their "
            "self-checks on this vLLM, but nothing else of this line was tested",
            decision.vllm_version,
            decision.binding.name,
        )
    logger.info("NNRP priority classes: %s", backend.priority_note())
    if service.metrics_address is not None:
        logger.info("NNRP metrics also served on http://%s/metrics (nnrp.metrics_listen)", service.metrics_address)


def _keys(state: Any, config: NNRPConfig) -> APIKeys | None:
    """vLLM's API keys as NNRP requires them (:mod:`vllm_nnrp_plugin.nnrp_binding.authentication`), with the
    start-up line that says so; ``None`` when HTTP requires no key or the operator opted out."""
    keys = api_keys(state, os.environ)
    if not keys:
        return None
    if config.allow_unauthenticated:
        logger.warning(
            "NNRP serves WITHOUT an API key although vLLM's HTTP API requires one (nnrp.allow_unauthenticated is "
            "true): anyone who reaches the NNRP addresses can use the model"
        )
        return None
    logger.info(
        "NNRP requires vLLM's API key (%d configured; --api-key / VLLM_API_KEY) on tcp://, nnrps://, ws://, "
        "wss:// and quic://; unix:// sockets are authenticated by their file permissions; "
        "nnrp-py's native client cannot send a "
        "key and is refused",
        len(keys),
    )
    return APIKeys(keys)


async def stop_service(state: Any) -> None:
    """Stop the service :func:`start_service` started, if any (idempotent)."""
    service = getattr(state, _SERVICE, None)
    if service is None:
        return
    setattr(state, _SERVICE, None)
    await service.stop()
    getattr(state, _UNDO_SHUTDOWN_HOOK)()
    logger.info("NNRP listener stopped")


def log_like_vllm() -> None:
    """Send this package's log records to vLLM's own handlers and level (vLLM does not propagate to root)."""
    ours, theirs = logging.getLogger("vllm_nnrp_plugin"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False

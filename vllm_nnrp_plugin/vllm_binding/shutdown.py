"""Stop NNRP before vLLM stops its engine (SIGTERM/SIGINT, or any other shutdown of the engine client).

vLLM's API server reacts to SIGTERM/SIGINT by calling ``engine_client.shutdown(timeout=...)`` in an executor thread
(``serve_http`` in ``vllm/entrypoints/launcher.py``; ``vllm/entrypoints/launchers/launcher.py`` on 0.32) and only
afterwards lets uvicorn, and so our router lifespan, exit (with several API-server processes, vLLM's process manager
kills them ``--shutdown-timeout`` s after the
signal, default 0, possibly before their lifespan exit runs at all). Left alone, every in-flight NNRP stream would
end against a dead engine. Hooking the signal itself does not work: vLLM runs on uvloop, whose signal handlers
cannot be read and chained. So :func:`stop_before_engine_shutdown` wraps the engine client's ``shutdown`` on this
instance: the wrapper runs the service's drain and graceful stop on the loop (no new connection, session or
operation, said on the wire (:mod:`vllm_nnrp_plugin.contract.draining`); running operations finish within
``nnrp.drain_timeout_ms``; then one ``server_shutdown`` terminal per operation left, vLLM requests aborted), waits
at most the grace plus :data:`STOP_BUDGET_S`, then calls vLLM's ``shutdown`` unchanged (its own ``--shutdown-timeout``
drain included). Per process: each API-server process has its own engine client, loop, lifespan and service.

With several API-server processes, vLLM's process manager kills them ``--shutdown-timeout`` s after the signal
(``vllm/entrypoints/cli/serve.py``: ``api_server_manager.shutdown(timeout=vllm_config.shutdown_timeout)``), so a
drain longer than that would be cut by the kill: the operations would lose their connection instead of getting
their ``server_shutdown`` terminal. :func:`drain_grace` then ends the drain :data:`KILL_MARGIN_S` before the kill.
vLLM passes that timeout to the call it makes (``engine_client.shutdown(timeout=vllm_config.shutdown_timeout)``
in ``serve_http``), so the grace is decided when the call comes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


#: longest NNRP graceful stop (s), after the drain, before vLLM's engine shutdown proceeds
STOP_BUDGET_S = 10.0
#: how long before vLLM's process manager kills an API-server process its drain ends (s): time for the stop to
#: send every ``server_shutdown`` terminal and abort the vLLM requests
KILL_MARGIN_S = 2.0


def drain_grace(grace_s: float, vllm_timeout_s: float | None, *, killed_at_timeout: bool) -> float:
    """How long (s) the running operations may finish: ``grace_s`` (``nnrp.drain_timeout_ms``), ended
    :data:`KILL_MARGIN_S` before vLLM's kill when ``killed_at_timeout`` (several API servers) and vLLM gave its
    ``--shutdown-timeout`` (``vllm_timeout_s``); never negative."""
    if killed_at_timeout and vllm_timeout_s is not None:
        return max(0.0, min(grace_s, vllm_timeout_s - KILL_MARGIN_S))
    return grace_s


def stop_before_engine_shutdown(
    engine_client: Any,
    loop: asyncio.AbstractEventLoop,
    drain: Callable[[float], Coroutine[Any, Any, None]],
    *,
    grace_s: float,
    killed_at_timeout: bool,
) -> Callable[[], None]:
    """Make ``engine_client.shutdown`` run ``drain(grace)`` on ``loop`` first (the grace from
    :func:`drain_grace`; waiting at most the grace plus :data:`STOP_BUDGET_S`). Returns the undo, to call once
    the service is stopped (then vLLM's method is used directly again)."""
    original = engine_client.shutdown

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if not on_loop and loop.is_running():  # vLLM calls it from an executor thread
            vllm_timeout = kwargs.get("timeout", args[0] if args else None)
            grace = drain_grace(grace_s, vllm_timeout, killed_at_timeout=killed_at_timeout)
            if grace < grace_s:
                logger.info(
                    "NNRP drain shortened to %.0f s: vLLM stops this API-server process %s s after the signal "
                    "(--shutdown-timeout)",
                    grace,
                    vllm_timeout,
                )
            future = asyncio.run_coroutine_threadsafe(drain(grace), loop)
            budget = grace + STOP_BUDGET_S
            try:
                future.result(budget)
            except concurrent.futures.TimeoutError:
                logger.warning("NNRP graceful stop did not finish in %.0f s; vLLM's shutdown goes on", budget)
            except Exception:
                logger.warning("NNRP graceful stop failed; vLLM's shutdown goes on", exc_info=True)
        return original(*args, **kwargs)

    engine_client.shutdown = shutdown

    def undo() -> None:
        if engine_client.__dict__.get("shutdown") is shutdown:
            del engine_client.shutdown

    return undo

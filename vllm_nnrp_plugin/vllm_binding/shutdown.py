"""Stop NNRP before vLLM stops its engine (SIGTERM/SIGINT, or any other shutdown of the engine client).

vLLM's API server reacts to SIGTERM/SIGINT by calling ``engine_client.shutdown(timeout=...)`` in an executor thread
(``serve_http`` in ``vllm/entrypoints/launcher.py``; ``vllm/entrypoints/launchers/launcher.py`` on 0.32) and only
afterwards lets uvicorn, and so our router lifespan, exit (with several API-server processes, vLLM's process manager kills them ``--shutdown-timeout`` s after the
signal, default 0, possibly before their lifespan exit runs at all). Left alone, every in-flight NNRP stream would
end against a dead engine. Hooking the signal itself does not work: vLLM runs on uvloop, whose signal handlers
cannot be read and chained. So :func:`stop_before_engine_shutdown` wraps the engine client's ``shutdown`` on this
instance: the wrapper runs the service's drain and graceful stop on the loop (no new connection, session or
operation, said on the wire (:mod:`vllm_nnrp_plugin.draining`); running operations finish within
``nnrp.drain_timeout_ms``; then one ``server_shutdown`` terminal per operation left, vLLM requests aborted), waits
at most ``budget_s``, then calls vLLM's ``shutdown`` unchanged (its own ``--shutdown-timeout`` drain included). Per
process: each API-server process has its own engine client, loop, lifespan and service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)


def stop_before_engine_shutdown(
    engine_client: Any, loop: asyncio.AbstractEventLoop, stop: Callable[[], Awaitable[None]], *, budget_s: float
) -> Callable[[], None]:
    """Make ``engine_client.shutdown`` run ``stop()`` on ``loop`` first (waiting at most ``budget_s`` s).
    Returns the undo, to call once the service is stopped (then vLLM's method is used directly again)."""
    original = engine_client.shutdown

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if not on_loop and loop.is_running():  # vLLM calls it from an executor thread
            future = asyncio.run_coroutine_threadsafe(stop(), loop)
            try:
                future.result(budget_s)
            except concurrent.futures.TimeoutError:
                logger.warning("NNRP graceful stop did not finish in %.0f s; vLLM's shutdown goes on", budget_s)
            except Exception:
                logger.warning("NNRP graceful stop failed; vLLM's shutdown goes on", exc_info=True)
        return original(*args, **kwargs)

    engine_client.shutdown = shutdown

    def undo() -> None:
        if engine_client.__dict__.get("shutdown") is shutdown:
            del engine_client.shutdown

    return undo

"""Stop NNRP before vLLM stops its engine on SIGTERM/SIGINT.

vLLM's API server handles both signals on its event loop (``loop.add_signal_handler`` in
``vllm.entrypoints.launcher.serve_http``): it shuts the engine client down first and only then lets uvicorn
(and so our router lifespan) exit (vllm-integration.md §3.4). Left alone, every in-flight NNRP stream would
end with an engine error. So the lifespan puts a handler in front of vLLM's: it runs the service's graceful
stop (stop accepting, one ``server_shutdown`` terminal per operation, vLLM requests aborted), bounded by
``budget_s``, then calls vLLM's handler unchanged. Per process: each API-server process has its own loop,
lifespan and service.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_first_on_signals(
    loop: asyncio.AbstractEventLoop, stop: Callable[[], Awaitable[None]], *, budget_s: float
) -> bool:
    """Chain ``stop`` in front of the loop's SIGINT/SIGTERM handlers; returns False when the loop has none
    (then the lifespan exit is the only stop). ``budget_s``: longest wait (s) before vLLM's handler runs."""
    handlers = getattr(loop, "_signal_handlers", None)  # asyncio's Unix loop keeps its handlers here
    chained = False
    for sig in SIGNALS:
        previous = handlers.get(sig) if handlers else None
        if previous is None:
            continue

        async def stop_then_continue(previous: asyncio.Handle = previous) -> None:
            try:
                await asyncio.wait_for(stop(), budget_s)
            except Exception:
                logger.warning("NNRP graceful stop did not finish in %.0f s", budget_s, exc_info=True)
            finally:
                previous._callback(*previous._args)

        loop.add_signal_handler(sig, lambda run=stop_then_continue: loop.create_task(run()))
        chained = True
    return chained

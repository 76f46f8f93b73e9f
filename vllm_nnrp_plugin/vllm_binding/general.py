"""The ``vllm.general_plugins`` entry point ``nnrp``: runs in every vLLM process at start-up.

In the process that parses ``vllm serve``'s arguments (:func:`is_serve_process`) it probes the installed vLLM,
makes the start-up decision of :mod:`.gate` and records it for the service's start (:func:`.gate.record`); the
gate's refusals are not caught by vLLM, so they stop ``vllm serve`` at argument-parsing time with the message,
before any engine, model or API-server child exists. In every other process (EngineCore, workers, model
inspection, ``vllm bench`` …) it returns at once and imports nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence

from vllm_nnrp_plugin.vllm_binding.families import API_SERVER_MAIN_MODULES, API_SERVER_MODULE


def is_serve_process(argv: Sequence[str], main_module: str | None, spawned: bool, api_server_loaded: bool) -> bool:
    """True in the process that parses ``vllm serve``'s arguments: the API server itself, or the parent of
    ``--api-server-count N`` API servers and of ``--headless`` engines. Plain data, so it holds on lines this
    release does not know (which the gate must refuse there).

    ``argv``: ``sys.argv``; ``main_module``: the ``__main__`` module's spec name (``python -m X``), else
    ``None``; ``spawned``: a multiprocessing child (``multiprocessing.parent_process()`` is not ``None``);
    ``api_server_loaded``: ``vllm.entrypoints.openai.api_server`` is imported.

    vLLM loads general plugins while it builds the ``serve`` parser (``AsyncEngineArgs.add_cli_args`` in
    ``vllm/engine/arg_utils.py``), in the ``vllm serve`` main process. Its spawned children (EngineCore, workers,
    ``ApiServer_i``; ``vllm/v1/utils.py``) carry the same argv, so being spawned excludes them; the
    model-inspection subprocess (``python -m vllm.model_executor.models.registry``), ``vllm bench``,
    ``vllm run-batch`` … have another argv. Up to 0.26 vLLM imports the API-server module wherever it serves the
    API, which is how this was recognised there (kept, so those lines decide exactly as before); 0.29 and later
    never import it.
    """
    if api_server_loaded:
        return True
    if spawned:
        return False
    return main_module in API_SERVER_MAIN_MODULES or (len(argv) > 1 and argv[1] == "serve")


def register() -> None:
    """Raises ``NNRPStartupError`` when NNRP is enabled but cannot work in this ``vllm serve``."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if not is_serve_process(
        sys.argv,
        getattr(main_spec, "name", None),
        multiprocessing.parent_process() is not None,
        API_SERVER_MODULE in sys.modules,
    ):
        return
    from vllm_nnrp_plugin.vllm_binding import gate
    from vllm_nnrp_plugin.vllm_binding.families import read_surface

    gate.record(gate.startup_check(os.environ, sys.argv, read_surface()))

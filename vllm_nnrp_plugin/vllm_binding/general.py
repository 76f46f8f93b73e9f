"""The ``vllm.general_plugins`` entry point ``nnrp``: runs in every vLLM process at start-up.

In the API-server process it runs the start-up checks of :mod:`.gate` (their exceptions stop ``vllm serve``
at argument-parsing time, with the message); in every other process (EngineCore, workers, model inspection,
``vllm bench`` …) it returns at once and imports nothing.
"""

from __future__ import annotations

import os
import sys

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def register() -> None:
    """Raises ``NNRPStartupError`` when NNRP is enabled but cannot work in this ``vllm serve``."""
    if API_SERVER_MODULE not in sys.modules:
        return
    import vllm
    import vllm.plugins

    from vllm_nnrp_plugin.vllm_binding.gate import startup_check

    startup_check(
        os.environ,
        sys.argv,
        vllm.__version__,
        vllm.__version_tuple__,
        hasattr(vllm.plugins, "load_endpoint_plugins"),
    )

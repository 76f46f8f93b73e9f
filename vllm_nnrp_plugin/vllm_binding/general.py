"""The ``vllm.general_plugins`` entry point ``nnrp``: runs in every vLLM process at start-up.

In the API-server process it probes the installed vLLM and runs the start-up checks of :mod:`.gate` (their
exceptions are not caught by vLLM, so they stop ``vllm serve`` at argument-parsing time with the message); in
every other process (EngineCore, workers, model inspection, ``vllm bench`` …) it returns at once and imports
nothing.
"""

from __future__ import annotations

import os
import sys

from vllm_nnrp_plugin.vllm_binding.families import API_SERVER_MODULE


def register() -> None:
    """Raises ``NNRPStartupError`` when NNRP is enabled but cannot work in this ``vllm serve``."""
    if API_SERVER_MODULE not in sys.modules:
        return
    from vllm_nnrp_plugin.vllm_binding.families import read_surface
    from vllm_nnrp_plugin.vllm_binding.gate import startup_check

    startup_check(os.environ, sys.argv, read_surface())

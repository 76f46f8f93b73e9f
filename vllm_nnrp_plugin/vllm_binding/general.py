"""The ``vllm.general_plugins`` entry point ``nnrp``: runs in every vLLM process at start-up.

In the API-server process it probes the installed vLLM, makes the start-up decision of :mod:`.gate` and
records it for the service's start (:func:`.gate.record`); the gate's refusals are not caught by vLLM, so they
stop ``vllm serve`` at argument-parsing time with the message. In every other process (EngineCore, workers,
model inspection, ``vllm bench`` …) it returns at once and imports nothing.
"""

from __future__ import annotations

import os
import sys

from vllm_nnrp_plugin.vllm_binding.families import API_SERVER_MODULE


def register() -> None:
    """Raises ``NNRPStartupError`` when NNRP is enabled but cannot work in this ``vllm serve``."""
    if API_SERVER_MODULE not in sys.modules:
        return
    from vllm_nnrp_plugin.vllm_binding import gate
    from vllm_nnrp_plugin.vllm_binding.families import read_surface

    gate.record(gate.startup_check(os.environ, sys.argv, read_surface()))

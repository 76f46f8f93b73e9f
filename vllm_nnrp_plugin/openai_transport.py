"""Deprecated import path of the ``openai`` SDK transports; use :mod:`vllm_nnrp_plugin.client`.

The transports moved to ``vllm_nnrp_plugin.client`` (defined in :mod:`vllm_nnrp_plugin.client.openai.transport`).
This module re-exports the names the old module exported, :class:`NNRPTransport` and
:class:`AsyncNNRPTransport`, and warns (``DeprecationWarning``) when it is imported. It will be removed in a
later release (CHANGELOG.md)::

    from vllm_nnrp_plugin.client import AsyncNNRPTransport, NNRPTransport  # instead of
    from vllm_nnrp_plugin.openai_transport import AsyncNNRPTransport, NNRPTransport

The server side never imports this module.
"""

from __future__ import annotations

import warnings

from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport

__all__ = ["AsyncNNRPTransport", "NNRPTransport"]

MESSAGE = (
    "vllm_nnrp_plugin.openai_transport is deprecated and will be removed in a later release: import "
    "NNRPTransport and AsyncNNRPTransport from vllm_nnrp_plugin.client"
)


# stacklevel 2: the importing code (warnings skips the import machinery's frames), so that Python's default
# filters show it where they show any deprecation
warnings.warn(MESSAGE, DeprecationWarning, stacklevel=2)

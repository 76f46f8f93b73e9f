"""Test-only fault injection: a backend wrapper that fails requests for one model id with ``backend_error``.

The conformance suite's only fault channel is ``model == "backend-error"`` (its recipe
``profiles/openai-compatible/1/recipes/chat-backend-error.json``); a real vLLM answers such a request with
404 ``model_not_found``. Setting ``nnrp.fault_injection_backend_error_model``
(off by default, never for production) makes this wrapper answer requests for that model with
``response.error`` ``backend_error`` (status 500) before they reach vLLM. Everything else passes through.

Installed where the backend is built from the configuration, outside the service: the vLLM binding's start-up
(:func:`vllm_nnrp_plugin.vllm_binding.lifecycle.start_service`) wraps the backend it hands to
:class:`vllm_nnrp_plugin.service.NNRPService`, which never sees the setting.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_nnrp_plugin.core.adapter import Backend, Call
from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.profile import errors as E

logger = logging.getLogger(__name__)


class BackendErrorInjector:
    """A :class:`Backend` around ``backend``; ``model`` is the model id that fails (for every operation)."""

    def __init__(self, backend: Backend, model: str) -> None:
        self._backend = backend
        self.model = model

    def capabilities(self) -> dict[str, Any]:
        return self._backend.capabilities()

    async def create(
        self,
        operation: str,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None = None,
        controls: RuntimeControls | None = None,
    ) -> Call:
        """Raises :class:`ProfileError` ``backend_error`` for :attr:`model`, else delegates."""
        if body.get("model") == self.model:
            raise E.backend_error(
                f"injected backend failure for model {self.model!r} "
                "(nnrp.fault_injection_backend_error_model, test only)"
            )
        return await self._backend.create(operation, body, request_id, traceparent, controls)

    def engine_request_id(self, operation: str, request_id: str) -> str:
        return self._backend.engine_request_id(operation, request_id)

    async def abort(self, operation: str, request_id: str) -> None:
        await self._backend.abort(operation, request_id)


def with_fault_injection(backend: Backend, model: str | None) -> Backend:
    """``backend`` itself when ``model`` is None (the default), else wrapped (with a warning in the log)."""
    if model is None:
        return backend
    logger.warning("NNRP test-only fault injection is ON: requests for model %r fail with backend_error", model)
    return BackendErrorInjector(backend, model)

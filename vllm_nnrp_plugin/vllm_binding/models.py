"""``models.list`` on vLLM's own model registry (``vllm/entrypoints/openai/models/serving.py``,
``OpenAIServingModels``; the same call on 0.22 -> 0.32).

``app.state.openai_serving_models.show_available_models()`` — what ``GET /v1/models``
(``vllm/entrypoints/openai/models/api_router.py``) returns — gives vLLM's ``ModelList``: ``{object: "list",
data: [{id, object: "model", created, owned_by, root, parent, max_model_len, permission: […]}]}`` (served model
names, then loaded LoRA adapters). The operation answers with that object as ``response.completed {body}``.
Every vLLM API server has the registry, whatever its task (``generate``, ``embed``, ``classify``, …).

The body: ``GET /v1/models`` takes no parameters, so ``models.list`` takes the empty object ``{}``; any key in it
is refused with ``invalid_request`` naming the keys (a client sending parameters expects them to mean something).
No engine request is made, so there is nothing to abort.
"""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.profile import MODELS_LIST
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import operation


class ModelsBinding:
    """``models.list`` over ``app.state.openai_serving_models`` (present on every vLLM API server)."""

    name = MODELS_LIST

    def __init__(self, serving_models: Any) -> None:
        self._models = serving_models

    def operation(self) -> dict[str, Any]:
        """The capability entry: non-streaming only; nothing to cancel (the answer is immediate)."""
        return operation(MODELS_LIST, streaming=False, non_streaming=True, cancellation=False)

    async def create(
        self, body: dict[str, Any], request_id: str, traceparent: str | None = None, controls: Any = None
    ) -> Call:
        """vLLM's ``ModelList`` as a dict (JSON types, as ``GET /v1/models`` sends it; no engine request, so
        ``controls`` steer nothing).

        Raises :class:`ProfileError` ``invalid_request`` when ``body`` is not empty.
        """
        if body:
            keys = ", ".join(sorted(body))
            raise E.ProfileError(E.INVALID_REQUEST, f"invalid {MODELS_LIST} body: it takes no parameters (got {keys})")
        model_list = await self._models.show_available_models()
        return Call(body=model_list.model_dump(mode="json"))

    def engine_request_id(self, request_id: str) -> str:
        """``request_id`` itself: ``models.list`` starts no engine request."""
        return request_id

    def engine_request_ids(self, request_id: str) -> list[str]:
        """Nothing to abort (no engine request)."""
        return []

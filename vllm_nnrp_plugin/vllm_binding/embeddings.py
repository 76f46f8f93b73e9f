"""``embeddings.create`` on vLLM's own embedding serving object (``vllm/entrypoints/pooling/embed/serving.py``,
``ServingEmbedding``; the same call on 0.22 -> 0.32).

``app.state.serving_embedding`` exists when the server runs a pooling model with the ``embed`` task
(``--runner pooling`` / ``--convert embed``; ``vllm/entrypoints/pooling/factories.py``). Awaiting it with vLLM's
``EmbeddingRequest`` (a union of the completion-style ``input`` and chat-style ``messages`` requests,
``vllm/entrypoints/pooling/embed/protocol.py``) — what ``POST /v1/embeddings`` does — returns a JSON ``Response``
whose body is vLLM's embedding ``list`` object ``{id, object: "list", created, model, data: [{index, object:
"embedding", embedding}], usage: {prompt_tokens, total_tokens, …}}``, or raises (bad input, engine failure). The
operation answers with that object as ``response.completed {body}``; errors are mapped by vLLM's own
``create_error_response`` (as its HTTP exception handler does) and then like chat's: ``invalid_request``,
``model_not_found``, ``backend_error``.

Encodings: ``float`` (a list of floats) and ``base64`` (little-endian float32 by default, vLLM's
``embed_dtype``/``endianness`` options) travel in the JSON body; ``bytes`` and ``bytes_only`` are vLLM's binary
responses and are refused with ``invalid_request``. ``dimensions`` works only on Matryoshka models
(``model_config.is_matryoshka``; vLLM refuses it otherwise with 400 -> ``invalid_request``).

Engine request ids: vLLM names the request ``embd-<X-Request-Id header>`` (``_base_request_id``) and each input
``embd-<id>-<i>`` (``_prepare_generators``); the operation runs with a synthetic request whose ``X-Request-Id`` is
the operation's request id, so every input's engine id is known and an unfinished operation aborts all of them.
"""

from __future__ import annotations

from typing import Any

import orjson

from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.profile import EMBEDDINGS_CREATE
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import operation
from vllm_nnrp_plugin.vllm_binding.serving import (
    error_from_body,
    error_from_response,
    trace_request,
    validate,
    with_controls,
)

#: the encodings vLLM answers with a JSON body (``JsonEncodingFormat``, ``vllm/entrypoints/pooling/utils.py``)
ENCODING_FORMATS = ("float", "base64")
_BINARY_FORMATS = ("bytes", "bytes_only")


class EmbeddingsBinding:
    """``embeddings.create`` over ``app.state.serving_embedding`` (present when the server runs the ``embed``
    pooling task)."""

    name = EMBEDDINGS_CREATE

    def __init__(self, serving: Any, priorities: tuple[int, ...] | None = None) -> None:
        from pydantic import TypeAdapter
        from vllm.entrypoints.openai.models.serving import create_error_response  # this line's, on 0.22 -> 0.32
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

        self._parse = TypeAdapter(EmbeddingRequest).validate_python
        self._error_response = create_error_response
        self._serving = serving
        self._priorities = priorities
        self._inputs: dict[str, int] = {}  # request id -> inputs, while its engine requests may run

    def operation(self) -> dict[str, Any]:
        """The capability entry: non-streaming, cancellable, ``encoding_formats`` (:data:`ENCODING_FORMATS`) and
        ``dimensions``: ``false`` (the model is not Matryoshka: vLLM refuses the option), ``true`` (any size up
        to the model's) or the list of sizes the model allows (``matryoshka_dimensions``)."""
        model_config = self._serving.model_config
        dimensions: bool | list[int] = bool(model_config.is_matryoshka)
        if dimensions and model_config.matryoshka_dimensions:
            dimensions = list(model_config.matryoshka_dimensions)
        return operation(
            EMBEDDINGS_CREATE,
            streaming=False,
            non_streaming=True,
            encoding_formats=list(ENCODING_FORMATS),
            dimensions=dimensions,
        )

    async def create(
        self,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None = None,
        controls: RuntimeControls | None = None,
    ) -> Call:
        """Validate ``body`` as vLLM's ``EmbeddingRequest`` and run it under ``request_id`` (engine ids
        ``embd-<request_id>-<i>``), with ``traceparent`` (W3C header value) as the parent of vLLM's span, at the
        ``priority`` of the operation's class (:func:`~.serving.with_controls`; no token budget applies).

        Raises :class:`ProfileError`: ``invalid_request`` (validation, a binary ``encoding_format``, vLLM 4xx),
        ``model_not_found`` (404), ``backend_error`` (5xx, engine errors).
        """
        if body.get("encoding_format") in _BINARY_FORMATS:
            raise E.ProfileError(
                E.INVALID_REQUEST,
                f"invalid {self.name} body: encoding_format {body['encoding_format']!r} is a binary response; "
                f"over NNRP use one of {', '.join(ENCODING_FORMATS)}",
            )
        request = validate(self._parse, with_controls(body, controls, self._priorities), self.name)
        self._inputs[request_id] = _input_count(request)
        try:
            response = await self._serving(request, trace_request(traceparent, "/v1/embeddings", request_id))
            answer = orjson.loads(response.body)
        except Exception as exc:  # vLLM raises for invalid requests and engine failures (its HTTP handler maps them)
            raise error_from_response(self._error_response(exc)) from None
        if "error" in answer:
            raise error_from_body(answer["error"])
        del self._inputs[request_id]  # finished: nothing left to abort
        return Call(body=answer)

    def engine_request_id(self, request_id: str) -> str:
        """``embd-`` + ``request_id``: the prefix of every input's engine id and vLLM's response ``id``
        (``ServingEmbedding.request_id_prefix``)."""
        return f"embd-{request_id}"

    def engine_request_ids(self, request_id: str) -> list[str]:
        """The engine ids of an unfinished operation's inputs, ``embd-<request_id>-<i>`` (forgotten afterwards)."""
        count = self._inputs.pop(request_id, 0)
        return [f"{self.engine_request_id(request_id)}-{i}" for i in range(count)]


def _input_count(request: Any) -> int:
    """How many engine requests vLLM starts for ``request``: one per string or token list of ``input``, one per
    conversation of a batched ``messages``, else one."""
    items = getattr(request, "input", None)
    if items is None:
        messages = getattr(request, "messages", None) or []
        return len(messages) if messages and isinstance(messages[0], list) else 1
    if isinstance(items, list) and (not items or isinstance(items[0], (str, list))):
        return len(items)
    return 1

"""The chat backend on vLLM's own serving objects (``vllm/entrypoints/openai/chat_completion/serving.py``,
``OpenAIServingChat``; the same call on 0.18 -> 0.26).

``app.state.openai_serving_chat.create_chat_completion(request, raw_request=None)`` — the object behind
``/v1/chat/completions`` — returns an ``ErrorResponse``, a ``ChatCompletionResponse``, or an async generator
of ``"data: <json>\\n\\n"`` strings ending with ``data: [DONE]``; it may also raise. All four outcomes map to
:class:`ChatCall` or :class:`ProfileError`. Engine requests are aborted with
``engine_client.abort("chatcmpl-" + request_id)``.

Trace context: vLLM reads a W3C ``traceparent`` only from ``raw_request.headers`` (and on 0.18–0.26 only
when tracing is on, ``--otlp-traces-endpoint``), so an operation with a trace context is run with a
synthetic ``starlette.requests.Request`` whose only header is that ``traceparent`` (vLLM's serving object reads
it with ``extract_trace_headers``, ``vllm/tracing/utils.py``); vLLM's ``llm_request`` span then has its trace
id and parent span id.
"""

from __future__ import annotations

import asyncio
import inspect
import typing
from typing import Any

from vllm_nnrp_plugin.adapter import ChatCall
from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import runtime_document
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import TokenBudget, normalise_body, vllm_chunks
from vllm_nnrp_plugin.vllm_binding.families import has_tool_parser


class VLLMChatBackend:
    """:class:`vllm_nnrp_plugin.adapter.ChatBackend` over ``app.state`` (``openai_serving_chat``,
    ``engine_client``, ``openai_serving_models``)."""

    def __init__(self, state: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        if state.openai_serving_chat is None:
            raise NNRPStartupError("this vLLM server does not serve chat completions (no 'generate' task)")
        self._request_cls = ChatCompletionRequest
        annotation = ChatCompletionRequest.model_fields["stream_options"].annotation
        self._stream_options_cls = next(a for a in typing.get_args(annotation) if a is not type(None))
        self._serving = state.openai_serving_chat
        self._engine = state.engine_client
        self._models = state.openai_serving_models

    def model_ids(self) -> list[str]:
        """Served model names (``--served-model-name``, else ``--model``)."""
        return [path.name for path in self._models.base_model_paths]

    def tool_calls(self) -> bool:
        """True when vLLM has a tool-call parser (``--tool-call-parser``; vLLM refuses
        ``--enable-auto-tool-choice`` without one): only then does it answer requests with ``tool_choice``."""
        return has_tool_parser(self._serving)

    def capabilities(self) -> dict[str, Any]:
        """The runtime capability document of this vLLM server."""
        return runtime_document(models=self.model_ids(), owned_by="vllm", tool_calls=self.tool_calls())

    async def create_chat_completion(
        self, body: dict[str, Any], request_id: str, traceparent: str | None = None
    ) -> ChatCall:
        """Validate ``body`` as vLLM's ``ChatCompletionRequest`` and run it under ``request_id``, with
        ``traceparent`` (W3C header value) as the parent of vLLM's span when given.

        A stream is always run with ``stream_options.include_usage`` (``continuous_usage_stats`` too when
        ``n`` > 1), whatever ``body`` asked: vLLM's usage is how the stream learns that the token budget ended a
        tool call (vLLM streams ``finish_reason: "tool_calls"`` there; :class:`~.chunk_shapes.TokenBudget`), and
        it lets the completed body carry ``usage`` as vLLM's non-streaming body does. Only the validated request
        is changed (``body`` is not); the profile mapper emits ``response.usage`` only when ``body`` asked for it.

        Raises :class:`ProfileError`: ``invalid_request`` (validation, vLLM 4xx), ``model_not_found`` (404 on
        ``model``), ``backend_error`` (5xx, engine errors).
        """
        try:
            request = self._request_cls.model_validate({**body, "request_id": request_id})
        except ValueError as exc:  # pydantic.ValidationError
            raise E.ProfileError(E.INVALID_REQUEST, _validation_message(exc)) from None
        if request.stream:
            asked = request.stream_options
            request.stream_options = self._stream_options_cls(
                include_usage=True,
                continuous_usage_stats=bool(asked and asked.continuous_usage_stats) or (request.n or 1) > 1,
            )
        try:
            raw_request = None if traceparent is None else _trace_request(traceparent)
            result = await self._serving.create_chat_completion(request, raw_request=raw_request)
        except Exception as exc:  # vLLM raises for some invalid requests and for engine death
            result = self._serving.create_error_response(exc)
        if inspect.isasyncgen(result):
            return ChatCall(stream=vllm_chunks(result, self._token_budget(request)))
        if hasattr(result, "choices"):
            return ChatCall(body=normalise_body(result.model_dump(mode="json")))
        raise error_from_response(result)

    def _token_budget(self, request: Any) -> TokenBudget:
        """The budget ``get_max_tokens`` gives ``request`` (vllm/entrypoints/serve/utils/api_utils.py; the
        serving object's ``default_sampling_params`` and ``override_max_tokens`` are its inputs on 0.18–0.26)."""
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if requested is None:
            requested = (getattr(self._serving, "default_sampling_params", None) or {}).get("max_tokens")
        caps = [v for v in (requested, getattr(self._serving, "override_max_tokens", None)) if v is not None]
        model_config = getattr(self._serving, "model_config", None)
        return TokenBudget(min(caps) if caps else None, getattr(model_config, "max_model_len", None))

    def engine_request_id(self, request_id: str) -> str:
        """vLLM's engine request id: ``chatcmpl-`` + ``request_id`` (``OpenAIServingChat.create_chat_completion`` prefixes ``request.request_id``)."""
        return f"chatcmpl-{request_id}"

    async def abort(self, request_id: str) -> None:
        """Abort the engine request (no-op if it already finished)."""
        await self._engine.abort(self.engine_request_id(request_id))


def error_from_response(response: Any) -> E.ProfileError:
    """Map vLLM's ``ErrorResponse`` (``.error.message/.type/.param/.code``, code = HTTP status)."""
    error = response.error
    status = int(error.code) if isinstance(error.code, int) else 500
    message = str(error.message) or error.type
    if status == 404 and (error.param == "model" or error.type == "NotFoundError"):
        return E.ProfileError(E.MODEL_NOT_FOUND, message, E.INVALID_REQUEST_ERROR, 404)
    if 400 <= status < 500:
        return E.ProfileError(E.INVALID_REQUEST, message, E.INVALID_REQUEST_ERROR, status)
    return E.backend_error(message, status)


def _trace_request(traceparent: str) -> Any:
    """A synthetic HTTP request carrying only ``traceparent``; its ``receive`` never reports a disconnect
    (the NNRP side handles cancellation)."""
    from starlette.requests import Request

    async def _never() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
        "headers": [(b"traceparent", traceparent.encode("latin-1"))], "state": {},
    }  # fmt: skip
    return Request(scope, receive=_never)


def _validation_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors():
        location = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{location}: {err.get('msg')}")
    return "invalid chat.completions.create body: " + "; ".join(parts)

"""``chat.completions.create`` on vLLM's own serving object (``vllm/entrypoints/openai/chat_completion/serving.py``,
``OpenAIServingChat``; the same call on 0.18 -> 0.32).

``app.state.openai_serving_chat.create_chat_completion(request, raw_request)`` — the object behind
``/v1/chat/completions`` — returns an ``ErrorResponse``, a ``ChatCompletionResponse``, or an async generator
of ``"data: <json>\\n\\n"`` strings ending with ``data: [DONE]``; it may also raise. All four outcomes map to
:class:`~vllm_nnrp_plugin.core.adapter.Call` or :class:`ProfileError`. The engine knows the request as
``"chatcmpl-" + request_id``.

A stream takes the engine lane (:mod:`.engine_lane`) where it can: vLLM formats its first, finish and usage
chunks; the outputs in between come from the engine without vLLM's chunk strings — text as it is on a server
without a parser, and through the request's own vLLM parser object on a server with a tool-call or reasoning
parser.

Trace context: vLLM reads a W3C ``traceparent`` only from ``raw_request.headers`` (and on 0.18–0.26 only
when tracing is on, ``--otlp-traces-endpoint``), so an operation with a trace context is run with a
synthetic request carrying it (:func:`.serving.trace_request`); vLLM's ``llm_request`` span then has its
trace id and parent span id.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE
from vllm_nnrp_plugin.profile.capabilities import chat_operation
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import TokenBudget, normalise_body, vllm_chunks
from vllm_nnrp_plugin.vllm_binding.engine_lane import EngineStream, has_parser, lane_serving, serving_fits
from vllm_nnrp_plugin.vllm_binding.engine_tap import view_maker
from vllm_nnrp_plugin.vllm_binding.families import Binding, has_tool_parser
from vllm_nnrp_plugin.vllm_binding.self_check import Case, ProvenLane, chat_cases
from vllm_nnrp_plugin.vllm_binding.serving import call_serving, error_from_response, validate, with_controls

#: the body fields a token budget caps (``get_max_tokens`` reads ``max_completion_tokens`` first)
_MAX_TOKENS = ("max_completion_tokens", "max_tokens")


class ChatBinding(ProvenLane):
    """``chat.completions.create`` over ``app.state.openai_serving_chat`` (present when the server runs the
    ``generate`` task). ``lane_off``: why streams cannot take the engine lane on this server (``None``: they can,
    :func:`~.engine_lane.serving_fits`); ``lane_parser``: the lane drives the server's tool-call or reasoning
    parser (:func:`~.engine_lane.has_parser`)."""

    name = CHAT_COMPLETIONS_CREATE

    def __init__(self, serving: Any, binding: Binding, priorities: tuple[int, ...] | None = None) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self._request_cls = ChatCompletionRequest
        annotation = ChatCompletionRequest.model_fields["stream_options"].annotation
        self._stream_options_cls = next(a for a in typing.get_args(annotation) if a is not type(None))
        self._serving = serving
        self.lane_off = serving_fits(serving, binding)
        self.lane_parser = self.lane_off is None and has_parser(serving)
        self._priorities = priorities
        # what each request is run on: a view of ``serving`` whose engine client is tapped for the request
        # (:mod:`.engine_tap`); the lane's view differs also in its stream generator (and, with a parser, in the
        # ``parser_cls`` the stream generator sees)
        self._vllm_views = view_maker(serving)
        self._lane_views = None if self.lane_off is not None else lane_serving(serving)
        self._views = self._lane_views or self._vllm_views

    def _cases(self, model: str) -> list[Case]:
        """The requests of the lane's start-up self-check (:meth:`~.self_check.ProvenLane.prove_lane`)."""
        return chat_cases(model, has_tool_parser(self._serving))

    def operation(self) -> dict[str, Any]:
        """The capability entry: tool calls only when vLLM has a tool-call parser (``--tool-call-parser``;
        vLLM refuses ``--enable-auto-tool-choice`` without one): only then does it answer ``tool_choice``."""
        return chat_operation(tool_calls=has_tool_parser(self._serving))

    async def create(
        self,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None = None,
        controls: RuntimeControls | None = None,
    ) -> Call:
        """Validate ``body`` as vLLM's ``ChatCompletionRequest`` and run it under ``request_id``, with
        ``traceparent`` (W3C header value) as the parent of vLLM's span when given, steered by the operation's
        runtime ``controls`` (priority, token budget: :func:`~.serving.with_controls`, :mod:`.engine_tap`).

        A stream is always run with ``stream_options.include_usage`` (``continuous_usage_stats`` too when
        ``n`` > 1), whatever ``body`` asked: vLLM's usage is how the stream learns that the token budget ended a
        tool call (vLLM streams ``finish_reason: "tool_calls"`` there; :class:`~.chunk_shapes.TokenBudget`), and
        it lets the completed body carry ``usage`` as vLLM's non-streaming body does. Only the validated request
        is changed (``body`` is not); the profile mapper emits ``response.usage`` only when ``body`` asked for it.

        Raises :class:`ProfileError`: ``invalid_request`` (validation, vLLM 4xx), ``model_not_found`` (404 on
        ``model``), ``backend_error`` (5xx, engine errors).
        """
        return await self._create(self._views, body, request_id, traceparent, controls)

    async def _create(
        self,
        views: Any,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None,
        controls: RuntimeControls | None,
        engine: Any = None,
    ) -> Call:
        """:meth:`create` on the views ``views`` (``engine``: the engine client to run on, vLLM's when ``None``)."""
        body = with_controls(body, controls, self._priorities, _MAX_TOKENS)
        request = validate(self._request_cls.model_validate, {**body, "request_id": request_id}, self.name)
        if request.stream:
            asked = request.stream_options
            request.stream_options = self._stream_options_cls(
                include_usage=True,
                continuous_usage_stats=bool(asked and asked.continuous_usage_stats) or (request.n or 1) > 1,
            )
        result = await call_serving(
            views(controls, engine), "create_chat_completion", request, traceparent, "/v1/chat/completions"
        )
        if result.__class__ is EngineStream:
            return Call(stream=result.items(self._token_budget(request)))
        if inspect.isasyncgen(result):
            return Call(stream=vllm_chunks(result, self._token_budget(request)))  # type: ignore[arg-type]  # of SSE str
        if hasattr(result, "choices"):
            return Call(body=normalise_body(result.model_dump(mode="json")))
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
        """``chatcmpl-`` + ``request_id`` (``OpenAIServingChat.create_chat_completion`` prefixes
        ``request.request_id``)."""
        return f"chatcmpl-{request_id}"

    def engine_request_ids(self, request_id: str) -> list[str]:
        """What an unfinished operation aborts: its one engine request."""
        return [self.engine_request_id(request_id)]

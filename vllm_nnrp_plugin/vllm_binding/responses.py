"""``responses.create`` on vLLM's own Responses serving object (``vllm/entrypoints/openai/responses/serving.py``,
``OpenAIServingResponses``; the same call on 0.18 -> 0.32).

``app.state.openai_serving_responses.create_responses(request, raw_request)`` — the object behind
``/v1/responses`` — returns an ``ErrorResponse``, a ``ResponsesResponse``, or an async generator of Responses
streaming event objects (``response.created`` … ``response.completed``), which ``/v1/responses`` writes as
``event: <type>\\ndata: <json>`` (``vllm/entrypoints/openai/responses/api_router.py``); it may also raise. The
stream items handed to the adapter are those events as dicts (``model_dump(mode="json", by_alias=True)``, the
``data:`` of vLLM's SSE; a text delta reduced to the fields the mapper reads), mapped by
:class:`~vllm_nnrp_plugin.profile.responses_stream.ResponsesStreamMapper`;
a non-streaming call returns the Response object as ``/v1/responses`` does. A stream takes the Responses lane
(:mod:`.responses_lane`) where it can: its text and reasoning deltas come straight from the engine's outputs
through vLLM's own parser and processor state, as the dicts vLLM's event objects would have given.

Request ids: the request is run with ``request_id = "resp_" + <the adapter's id>`` (the ``resp_`` prefix of
vLLM's own default, ``ResponsesRequest.request_id``), which is also the Response's ``id``; the engine knows it
as ``<request_id>_0`` (``OpenAIServingResponses._generate_with_builtin_tools`` numbers its sub-requests
``f"{request_id}_{n}"``; without a ``--tool-server`` there is only sub-request 0; the same on 0.22.1, 0.26.0 and
0.32.0, and on 0.18.1 where that method lives in ``vllm/entrypoints/openai/engine/serving.py``).

Refused with ``invalid_request``: ``background: true`` (vLLM would run the request as a background task that
outlives the NNRP operation, beyond its cancellation and timeout); a streamed request the line's Responses stream
breaks off before its first event (:func:`~vllm_nnrp_plugin.vllm_binding.families.responses_stream_fails`: on
0.18.x a JSON-schema ``text.format``, also the one a forced tool choice gets), where vLLM's ``/v1/responses``
answers 200 with an empty body: the refusal says to send it with ``stream: false``, which vLLM answers.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.profile import RESPONSES_CREATE
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import operation
from vllm_nnrp_plugin.vllm_binding.engine_tap import view_maker
from vllm_nnrp_plugin.vllm_binding.families import Binding, responses_lane_off, responses_stream_fails
from vllm_nnrp_plugin.vllm_binding.responses_lane import TEXT_DELTA, responses_lane_serving
from vllm_nnrp_plugin.vllm_binding.self_check import Case, ProvenLane, responses_cases
from vllm_nnrp_plugin.vllm_binding.serving import call_serving, error_from_response, validate, with_controls

#: vLLM's sub-request number of the first (and, without a tool server, only) engine request of a Responses request
_FIRST_SUB_REQUEST = 0


class ResponsesBinding(ProvenLane):
    """``responses.create`` over ``app.state.openai_serving_responses`` (present when the server runs the
    ``generate`` task) of the vLLM line ``family`` ((major, minor)). ``priorities``: vLLM ``priority`` by NNRP
    priority class (:func:`~.serving.with_controls`; ``None``: the server does not schedule by priority).
    ``lane_off``: why streams cannot take the Responses lane on this server (``None``: they can,
    :func:`~.families.responses_lane_off`); ``lane_parser``: the lane drives the server's parser."""

    name = RESPONSES_CREATE

    def __init__(
        self, serving: Any, family: tuple[int, int], binding: Binding, priorities: tuple[int, ...] | None = None
    ) -> None:
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        self._request_cls = ResponsesRequest
        self._serving = serving
        self._family = family
        self._priorities = priorities
        self.lane_off = responses_lane_off(serving, binding)
        # one view per request, its engine client tapped (:mod:`.engine_tap`)
        self._vllm_views = view_maker(serving)
        self._lane_views = None if self.lane_off is not None else responses_lane_serving(serving)
        self._views = self._lane_views or self._vllm_views
        parser = getattr(serving, "parser", None)
        self.lane_parser = parser is not None
        self._tool_parser = parser is not None and getattr(parser, "tool_parser_cls", None) is not None

    def operation(self) -> dict[str, Any]:
        """The capability entry: tool calls only when vLLM's Responses serving object has a tool-call parser
        (``serving.parser.tool_parser_cls``, from ``--enable-auto-tool-choice --tool-call-parser``): only then
        does it parse function calls out of the model's output."""
        return operation(RESPONSES_CREATE, streaming=True, non_streaming=True, tool_calls=self._tool_parser)

    def _cases(self, model: str) -> list[Case]:
        """The requests of the lane's start-up self-check (:meth:`~.self_check.ProvenLane.prove_lane`)."""
        return responses_cases(model, self._tool_parser)

    async def create(
        self,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None = None,
        controls: RuntimeControls | None = None,
    ) -> Call:
        """Validate ``body`` as vLLM's ``ResponsesRequest`` and run it under ``resp_<request_id>``, with
        ``traceparent`` (W3C header value) as the parent of vLLM's span when given, steered by the operation's
        runtime ``controls`` (priority, token budget as ``max_output_tokens``: :func:`~.serving.with_controls`,
        :mod:`.engine_tap`).

        Raises :class:`ProfileError`: ``invalid_request`` (validation, ``background: true``, a stream this line
        cannot produce, vLLM 4xx),
        ``model_not_found`` (404 on ``model``), ``backend_error`` (5xx, engine errors).
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
        body = with_controls(body, controls, self._priorities, ("max_output_tokens",))
        request = validate(self._request_cls.model_validate, {**body, "request_id": f"resp_{request_id}"}, self.name)
        if request.background:
            raise E.ProfileError(
                E.INVALID_REQUEST,
                "background responses are not served over NNRP: the operation "
                "is the request (cancel it, or set nnrp.timeout_ms)",
            )
        if responses_stream_fails(self._family, body, self._tool_parser):
            raise E.ProfileError(
                E.INVALID_REQUEST,
                f"vLLM {self._family[0]}.{self._family[1]}.x cannot stream a "
                "response whose text format is a JSON schema (text.format json_schema, or the "
                'schema of the calls a tool_choice of "required" or a named function forces): '
                "its stream fails before its first event. Send it with stream: false, or serve "
                "it with vLLM 0.22 or later",
            )
        result = await call_serving(views(controls, engine), "create_responses", request, traceparent, "/v1/responses")
        if inspect.isasyncgen(result):
            return Call(stream=_event_dicts(result))
        if hasattr(result, "output"):
            return Call(body=result.model_dump(mode="json", by_alias=True))
        raise error_from_response(result)

    def engine_request_id(self, request_id: str) -> str:
        """``resp_<request_id>_0``: the engine request of the Responses request ``resp_<request_id>``."""
        return f"resp_{request_id}_{_FIRST_SUB_REQUEST}"

    def engine_request_ids(self, request_id: str) -> list[str]:
        """What an unfinished operation aborts: its one engine request."""
        return [self.engine_request_id(request_id)]


async def _event_dicts(events: Any) -> Any:
    """vLLM's streamed event objects as the dicts ``/v1/responses`` writes after ``data:``; a text delta (most of a
    stream's events) as only the fields :class:`~vllm_nnrp_plugin.profile.responses_stream.ResponsesStreamMapper`
    reads of it (``type``, ``output_index``, ``delta``), without dumping the whole event; the Responses lane's
    events are such dicts already."""
    try:
        async for event in events:
            if event.__class__ is dict:
                yield event
            elif event.type == TEXT_DELTA:
                yield {"type": TEXT_DELTA, "output_index": event.output_index, "delta": event.delta}
            else:
                yield event.model_dump(mode="json", by_alias=True)
    finally:
        await events.aclose()

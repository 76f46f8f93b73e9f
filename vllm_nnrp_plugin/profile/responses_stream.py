"""Map a stream of OpenAI Responses streaming events to profile events (the profile's "Events" section).

Input: the event objects vLLM's ``OpenAIServingResponses.responses_stream_generator``
(``vllm/entrypoints/openai/responses/serving.py``) yields, as dicts (``model_dump(mode="json", by_alias=True)``,
exactly the ``data:`` of vLLM's ``/v1/responses`` SSE). Every event's ``output_index`` is the position of its
item in the Response's ``output``; it is the profile event's ``index``.

* ``response.output_text.delta {output_index, delta}`` -> ``response.output_text.delta {index, delta}``;
* ``response.output_item.added`` of a ``function_call`` item -> ``response.tool_call.started {index, item_id,
  call_id, name}`` (vLLM's item ``id`` and ``call_id``); ``response.function_call_arguments.delta`` of that
  ``item_id`` -> ``response.tool_call.delta {arguments_delta}``; ``response.output_item.done`` of it ->
  ``response.tool_call.completed {arguments}`` when the item's ``arguments`` are one JSON value (Python's
  ``json.loads``, as vLLM's tool parsers read them), else ``response.tool_call.error``: ``tool_call_incomplete``
  when the Response ends ``incomplete`` (the token budget ended generation), else ``tool_call_invalid`` — so
  such an error waits for ``response.completed``; a call vLLM never ended (on 0.18.x its stream sends no
  ``output_item.done`` for a call without argument text) ends the same way at ``response.completed``, judged
  on its streamed fragments. As for chat, a call of a tool whose declaration accepts ``{}``
  (``no_argument_tools``) with no argument text completes with ``"{}"`` (a ``delta`` of ``"{}"``, then
  ``completed``) when the Response is not ``incomplete``
  (:func:`~vllm_nnrp_plugin.profile.tool_calls.ending_arguments`): the function call vLLM's completed
  Response lists for it;
* ``response.completed {response}`` (or ``response.incomplete {response}``, vLLM 0.33+'s end of a Response cut
  short) -> ``response.usage {usage: {input_tokens, output_tokens, total_tokens}}``
  from the Response's ``usage`` (the Responses API always reports usage at its end; it has no
  ``stream_options``), and the Response object becomes :meth:`ResponsesStreamMapper.completed_body`: the body
  of the terminal ``response.completed``, the same object the non-streaming call returns;
* vLLM's mid-stream error (``{"type": "error", …}`` or ``{"error": {…}}``) -> :class:`ProfileError`
  ``backend_error``;
* every event of a reasoning item (vLLM runs a ``--reasoning-parser``: ``response.output_item.added`` / ``.done``
  of a ``reasoning`` item, ``response.reasoning_part.*``, ``response.reasoning_text.*``) ->
  ``response.output_text.delta {index: output_index, delta: "", openai_chunk: <vLLM's event>}`` (the
  ``vllm.openai_chunk`` extension of :mod:`vllm_nnrp_plugin.profile.events`; the text is empty: reasoning is
  not output text);
* every other event (``response.created``, ``response.in_progress``, ``content_part``, ``*.done``, …)
  gives nothing: its content reaches the client through the events above or the completed body.

Per ``call_id``: started first, once; deltas; one completed/error last (the profile's tool-call ordering rule).
The ids are vLLM's, passed through as its HTTP stream has them. On 0.32.x the streamed function call carries
its tool parser's ids, the same as the completed Response's item; on 0.22.x and 0.26.x vLLM's streaming
processor makes new ones (``call_<hex>``, ``streaming_events.emit_simple_tool_call_open``), so there the ids in
the completed body differ from the events'.
"""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events
from vllm_nnrp_plugin.profile.tool_calls import ending_arguments, is_one_json_value

#: the events that end a Response stream with the Response object: ``response.completed``, and
#: ``response.incomplete`` (openai's ``ResponseIncompleteEvent``), which vLLM 0.33+ sends instead when the Response's
#: status is ``incomplete`` (``max_output_tokens`` cut it; ``responses_stream_generator`` in
#: ``vllm/entrypoints/openai/responses/serving.py``); earlier lines send ``response.completed`` for both
_ENDS = frozenset({"response.completed", "response.incomplete"})


class ResponsesStreamMapper:
    """Feed vLLM's Responses events in arrival order with :meth:`feed`, then :meth:`finish`; read the final
    Response with :meth:`completed_body`. ``no_argument_tools``: the names of the request's tools whose
    declaration accepts ``{}`` (:func:`~vllm_nnrp_plugin.profile.tool_calls.tools_without_required_arguments`
    of its ``tools``)."""

    __slots__ = ("_calls", "_pending", "_response", "_no_argument_tools")

    def __init__(self, no_argument_tools: frozenset[str] = frozenset()) -> None:
        self._calls: dict[str, _Call] = {}  # vLLM item id -> call, in the order vLLM began them
        self._pending: list[_Call] = []  # ended with invalid arguments: how they end waits for the Response
        self._response: dict[str, Any] | None = None
        self._no_argument_tools = no_argument_tools

    def feed(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one vLLM Responses event, in order (often one, often none).

        Raises :class:`ProfileError` ``backend_error`` for vLLM's mid-stream error event.
        """
        kind = item.get("type")
        call: _Call | None  # the function call the event names, None when none is known
        if _is_reasoning(item):
            return [events.output_text_delta(item["output_index"], "", item)]
        if kind == "response.output_text.delta":
            return [events.output_text_delta(item["output_index"], item["delta"])] if item["delta"] else []
        if kind == "response.output_item.added" and item["item"]["type"] == "function_call":
            call = self._calls[item["item"]["id"]] = _Call(item["output_index"], item["item"])
            return [events.tool_call_started(call.index, call.item_id, call.call_id, call.name)]
        if kind == "response.function_call_arguments.delta":
            call = self._calls.get(item["item_id"])
            if call is None or call.done or not item["delta"]:
                return []
            call.arguments += item["delta"]
            return [events.tool_call_delta(call.index, call.item_id, call.call_id, item["delta"])]
        if kind == "response.output_item.done" and item["item"]["type"] == "function_call":
            call = self._calls.get(item["item"]["id"])
            if call is None or call.done:
                return []
            call.done = True
            call.arguments = item["item"]["arguments"]
            if is_one_json_value(call.arguments):
                return [events.tool_call_completed(call.index, call.item_id, call.call_id, call.name, call.arguments)]
            self._pending.append(call)
            return []
        if kind in _ENDS:
            return self._complete(item["response"])
        if kind == "error" or "error" in item:
            raise _stream_error(item)
        return []

    def _complete(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        self._response = response
        cut = response.get("status") == "incomplete"
        no_argument_tools = frozenset() if cut else self._no_argument_tools
        out = [e for call in (*self._pending, *self._open()) for e in call.end(cut, no_argument_tools)]
        self._pending.clear()
        usage = response.get("usage")
        if usage:
            out.append(
                events.usage(
                    {
                        "prompt_tokens": usage.get("input_tokens"),
                        "completion_tokens": usage.get("output_tokens"),
                        "total_tokens": usage.get("total_tokens"),
                    }
                )
            )
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Check the end of the stream; returns no events. Raises :class:`ProfileError` ``backend_error`` when
        vLLM ended the stream without ``response.completed`` (the caller then ends open calls with
        :meth:`fail_open_calls`)."""
        if self._response is None:
            raise E.backend_error("vLLM's Responses stream ended without response.completed")
        return []

    def fail_open_calls(self, err: E.ProfileError) -> list[dict[str, Any]]:
        """``response.tool_call.error`` (``err``) for every call not yet ended (mid-stream error)."""
        out = [e for call in (*self._pending, *self._open()) for e in call.fail(err)]
        self._pending.clear()
        return out

    def completed_body(self) -> dict[str, Any]:
        """The Response object of vLLM's ``response.completed`` event (``{}`` if none arrived: :meth:`finish`
        refuses that stream first)."""
        return self._response or {}

    def _open(self) -> list[_Call]:
        return [call for call in self._calls.values() if not call.done]


class _Call:
    __slots__ = ("index", "item_id", "call_id", "name", "arguments", "done")

    def __init__(self, index: int, item: dict[str, Any]) -> None:
        self.index = index
        self.item_id = item["id"]
        self.call_id = item.get("call_id") or item["id"]
        self.name = item.get("name") or ""
        self.arguments = item.get("arguments") or ""
        self.done = False

    def end(self, cut: bool, no_argument_tools: frozenset[str]) -> list[dict[str, Any]]:
        """The end of a call whose arguments were not one JSON value when vLLM ended it, or that vLLM never
        ended (judged on its streamed fragments): ``completed`` with what
        :func:`~vllm_nnrp_plugin.profile.tool_calls.ending_arguments` gives, else the error."""
        ending = ending_arguments(self.name, self.arguments, no_argument_tools) if self.name else None
        if ending is None:
            return self.fail(_invalid_arguments(self, cut))
        self.done = True
        completed = events.tool_call_completed(self.index, self.item_id, self.call_id, self.name, ending)
        if ending == self.arguments:
            return [completed]
        return [events.tool_call_delta(self.index, self.item_id, self.call_id, ending), completed]

    def fail(self, err: E.ProfileError) -> list[dict[str, Any]]:
        self.done = True
        return [events.tool_call_error(self.index, self.item_id, self.call_id, err)]


def _invalid_arguments(call: _Call, cut: bool) -> E.ProfileError:
    if cut:
        return E.ProfileError(
            E.TOOL_CALL_INCOMPLETE,
            f"generation stopped (token budget) before tool call "
            f"{call.call_id} was complete: its arguments are not one complete JSON value",
            E.SERVER_ERROR,
        )
    return E.ProfileError(
        E.TOOL_CALL_INVALID,
        f"tool call {call.call_id} has arguments that are not one complete JSON value",
        E.SERVER_ERROR,
    )


def _is_reasoning(item: dict[str, Any]) -> bool:
    """True for vLLM's events of a reasoning item: ``response.reasoning_*`` (part added/done, text delta/done) and
    ``response.output_item.added`` / ``.done`` of an item of type ``reasoning``
    (``vllm/entrypoints/openai/responses/streaming_events.py``)."""
    kind = item.get("type") or ""
    if kind.startswith("response.reasoning_"):
        return True
    return kind.startswith("response.output_item.") and (item.get("item") or {}).get("type") == "reasoning"


def _stream_error(item: dict[str, Any]) -> E.ProfileError:
    """vLLM's streamed error: ``{"type": "error", "code", "message"}`` (the Responses error event) or
    ``{"error": {"message", "code"}}`` (its generic streaming error body); always ``backend_error``."""
    nested = item.get("error")
    error = nested if isinstance(nested, dict) else item
    status = error.get("code")
    return E.backend_error(
        str(error.get("message") or "backend error in Responses stream"), status if isinstance(status, int) else 500
    )

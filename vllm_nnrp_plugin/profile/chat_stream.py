"""Map a stream of OpenAI ``chat.completion.chunk`` objects to profile events (the profile's "Events" section).

Input is the chunk *normal form* of :mod:`vllm_nnrp_plugin.vllm_binding.chunk_shapes` (what vLLM streams, with
its finish reasons made truthful). ``choices[i].delta.content`` -> ``response.output_text.delta {index: i,
delta}``; a choice whose chunk carries token logprobs (``choices[i].logprobs`` not null: vLLM sends them only
when the request asked with ``logprobs``) or reasoning (``delta.reasoning``: vLLM runs a ``--reasoning-parser``)
-> ``response.output_text.delta {index: i, delta: <its content or "">, openai_chunk: <the chunk, reduced to that
choice>}`` (the ``vllm.openai_chunk`` extension of :mod:`vllm_nnrp_plugin.profile.events`), before the choice's
tool-call events; a chunk with ``choices: []`` and ``usage`` (vLLM's final usage chunk) -> ``response.usage``
when the request asked for it (``stream_options.include_usage``, :func:`usage_asked`); ``usage`` anywhere else only
reaches the completed body; an ``{"error": {...}}`` chunk -> :class:`ProfileError` ``backend_error``; a stream
that ends while a choice has no ``finish_reason`` (vLLM ended it without saying why) -> ``backend_error`` from
:meth:`ChatStreamMapper.finish`. :meth:`ChatStreamMapper.completed_body` assembles the ``chat.completion``
object the terminal ``response.completed`` carries, in the shape of vLLM's non-streaming body: ``content``
(a string once any delta carried the key, as vLLM's role delta ``content: ""`` does), ``reasoning`` (when
streamed), ``tool_calls`` (completed calls only), ``logprobs`` (``{"content": [...]}``, every streamed token
entry in order, when streamed), ``finish_reason``, ``stop_reason``, ``usage``.

Tool calls (``choices[i].delta.tool_calls[]``; the profile's tool-call ordering rule: per ``call_id``, started once
first, deltas, exactly one completed or error last):

* Identity: a call is vLLM's tool call ``id`` (its ``call_id``) on a tool-call ``index``; an entry without an
  ``id`` continues the latest call on its index; a *new* ``id`` on a used index is a new call (vLLM's parsers
  reuse indexes) and ends the earlier one there.
* ``response.tool_call.started`` once the call has a name (``function.name``); argument fragments that arrive
  before it wait and follow the ``started``; then every ``function.arguments`` fragment ->
  ``response.tool_call.delta``, in exactly the order vLLM sent them (a name and a fragment in one entry, several
  entries in one chunk).
* When the call ends (its choice's ``finish_reason``, or a new call on its index) -> exactly one
  ``response.tool_call.completed`` with the concatenated arguments if it has a name and the arguments are one
  complete JSON value (Python's ``json.loads``, as vLLM's tool parsers read arguments); otherwise
  ``response.tool_call.error`` ``tool_call_incomplete`` when the token budget (``finish_reason: "length"``) or a
  stop string or token (``stop_reason`` not null) ended generation, else ``tool_call_invalid``. A call that never
  got a name is announced (``started`` with ``name: ""``) only to end it with that error. One exception, when
  generation was not cut: a call of a tool whose declaration accepts ``{}`` (``no_argument_tools``) that got no
  argument text completes with ``"{}"`` (a ``delta`` of ``"{}"``, then ``completed``), as vLLM's non-streaming
  answer gives it (:func:`~vllm_nnrp_plugin.profile.tool_calls.ending_arguments`).
* A mid-stream error ends every open call with ``response.tool_call.error`` ``backend_error``
  (:meth:`ChatStreamMapper.fail_open_calls`). The completed body lists only completed calls, and its
  ``finish_reason`` is never ``"tool_calls"`` for a choice that lists none: vLLM streams ``"tool_calls"`` for
  every choice that streamed a call (``chat_completion_stream_generator`` in
  ``vllm/entrypoints/openai/chat_completion/serving.py``); the budget case already arrives as ``"length"``
  (:class:`~vllm_nnrp_plugin.vllm_binding.chunk_shapes.VLLMStream`), every other choice without a completed
  call gets ``"stop"`` — a stop string or token, or a call that ended with ``tool_call_invalid``: the engine's
  own finish reason there, which vLLM's non-streaming answer reports when its parser finds no call.

Per ``call_id``: started first, once; deltas; one completed/error last. Calls may interleave. ``item_id`` is
``tool_call_<choice>_<index>`` (``_<n>`` appended for the n-th later call on the same index): unique within
the operation.
"""

from __future__ import annotations

from typing import Any, final

import attrs

from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events
from vllm_nnrp_plugin.profile.tool_calls import ending_arguments

#: the values pydantic's lax ``bool`` reads as true (vLLM validates ``stream_options`` with pydantic)
_TRUE_STRINGS = frozenset({"1", "true", "t", "yes", "y", "on"})


def usage_asked(body: dict[str, Any]) -> bool:
    """True when the chat request asks vLLM to stream usage (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    flag = options.get("include_usage") if isinstance(options, dict) else None
    if isinstance(flag, str):
        return flag.strip().lower() in _TRUE_STRINGS
    return flag is True or (type(flag) is int and flag == 1)


@final  # no subclasses: feed tells it from a dict by its exact class
@attrs.define(slots=True)
class TextDelta:
    """A normal-form chunk whose only news is text: :meth:`chunk` — ``template`` (an earlier chunk of the same
    stream with exactly one choice, whose delta is ``{"content": <text>}`` and whose ``logprobs``,
    ``finish_reason`` and ``usage`` are null or absent) with that choice's ``delta.content`` = ``content``
    (non-empty). A binding hands this over instead of the dict when it can tell without building the dict
    (:class:`~vllm_nnrp_plugin.vllm_binding.chunk_shapes.VLLMStream`); :meth:`ChatStreamMapper.feed` gives the
    same events and state for both."""

    index: int
    content: str
    template: dict[str, Any]

    def chunk(self) -> dict[str, Any]:
        """The chunk dict this stands for."""
        (choice,) = self.template["choices"]
        return {**self.template, "choices": [{**choice, "delta": {"content": self.content}}]}


class ChatStreamMapper:
    """Feed chunks in arrival order with :meth:`feed`, then :meth:`finish`; read the final body with
    :meth:`completed_body`. ``usage_events``: emit ``response.usage`` for the final usage chunk (the request's
    :func:`usage_asked`). ``no_argument_tools``: the names of the request's tools whose declaration accepts
    ``{}`` (:func:`~vllm_nnrp_plugin.profile.tool_calls.tools_without_required_arguments` of its ``tools``)."""

    __slots__ = ("_head", "_choices", "_usage", "_usage_events", "_no_argument_tools")

    def __init__(self, usage_events: bool = True, no_argument_tools: frozenset[str] = frozenset()) -> None:
        self._head: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._usage_events = usage_events
        self._no_argument_tools = no_argument_tools

    def feed(self, chunk: dict[str, Any] | TextDelta) -> list[dict[str, Any]]:
        """Events for one chunk (a dict, or a :class:`TextDelta`), in order (often one, sometimes none).

        Raises :class:`ProfileError` ``backend_error`` for an error chunk (vLLM's mid-stream
        ``data: {"error": {...}}``).
        """
        if type(chunk) is TextDelta:
            state = self._choices.get(chunk.index)
            if state is None or self._head is None:  # not after its template: the general path
                return self.feed(chunk.chunk())
            content = chunk.content
            state.content_seen = True
            state.text.append(content)
            return [events.output_text_delta(state.index, content)]
        if "error" in chunk:
            raise _stream_error(chunk["error"])
        if self._head is None:
            self._head = {k: chunk.get(k) for k in ("id", "created", "model")}
        out: list[dict[str, Any]] = []
        choices = chunk.get("choices") or ()
        for choice in choices:
            index = choice.get("index", 0)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice(index, self._no_argument_tools)
            delta = choice.get("delta") or {}
            content = delta.get("content") or ""
            state.content_seen = state.content_seen or "content" in delta
            if content:
                state.text.append(content)
            if delta.get("reasoning"):
                state.reasoning.append(delta["reasoning"])
            logprobs = choice.get("logprobs")
            if logprobs is not None:
                state.logprobs.extend(logprobs.get("content") or ())
            if logprobs is not None or delta.get("reasoning"):
                replay = chunk if len(choices) == 1 else {**chunk, "choices": [choice]}
                out.append(events.output_text_delta(index, content, replay))
            elif content:
                out.append(events.output_text_delta(index, content))
            for call in delta.get("tool_calls") or ():
                out.extend(state.add_tool_call_delta(call))
            if choice.get("finish_reason") is not None:
                state.finish_reason = choice["finish_reason"]
                state.stop_reason = choice.get("stop_reason")
                out.extend(state.close_tool_calls())
        usage = chunk.get("usage")
        if usage:
            self._usage = usage
            if not choices and self._usage_events:
                out.append(events.usage(usage))
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Check the end of a stream; returns no events (every call already ended with its choice's finish).

        Raises :class:`ProfileError` ``backend_error`` when a choice never got a ``finish_reason`` or no choice
        arrived at all: vLLM ended the stream without its answer (e.g. the engine failed before the first
        token), which is a failure, not an empty success. The caller ends open calls with
        :meth:`fail_open_calls`.
        """
        unfinished = [i for i in sorted(self._choices) if self._choices[i].finish_reason is None]
        if not self._choices or unfinished:
            which = f"choice {unfinished[0]}" if unfinished else "any choice"
            raise E.backend_error(f"vLLM's stream ended without a finish_reason for {which}")
        return []

    def fail_open_calls(self, err: E.ProfileError) -> list[dict[str, Any]]:
        """``response.tool_call.error`` (``err``) for every call not yet ended (mid-stream error)."""
        return [e for i in sorted(self._choices) for c in self._choices[i].open_calls() for e in c.end_with(err)]

    def completed_body(self) -> dict[str, Any]:
        """The ``chat.completion`` object assembled from the stream (OpenAI usage names kept)."""
        head = self._head or {}
        body: dict[str, Any] = {
            "id": head.get("id"),
            "object": "chat.completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [self._choices[i].as_choice() for i in sorted(self._choices)],
        }
        if self._usage is not None:
            body["usage"] = self._usage
        return body


class _ToolCall:
    __slots__ = ("index", "item_id", "call_id", "vllm_id", "name", "arguments", "started", "done", "completed")

    def __init__(self, item_id: str, index: int, vllm_id: str | None) -> None:
        self.index = index
        self.item_id = item_id
        self.vllm_id = vllm_id
        self.call_id = vllm_id or item_id
        self.name = ""
        self.arguments: list[str] = []
        self.started = False
        self.done = False
        self.completed = False

    def add(self, name: str, fragment: str) -> list[dict[str, Any]]:
        """Events for one entry of this call: ``started`` once the name is known, then its fragment."""
        if self.done:
            return []
        out = []
        if name and not self.name:
            self.name = name
        if fragment:
            self.arguments.append(fragment)
        if not self.started and self.name:
            self.started = True
            out.append(events.tool_call_started(self.index, self.item_id, self.call_id, self.name))
            out.extend(events.tool_call_delta(self.index, self.item_id, self.call_id, f) for f in self.arguments)
        elif self.started and fragment:
            out.append(events.tool_call_delta(self.index, self.item_id, self.call_id, fragment))
        return out

    def close(self, cut: bool, no_argument_tools: frozenset[str]) -> list[dict[str, Any]]:
        """``completed`` if named and the arguments are one JSON value (or, not ``cut``, the ``"{}"`` of
        :func:`~vllm_nnrp_plugin.profile.tool_calls.ending_arguments`), else ``error`` (``cut``: the budget or a
        stop condition ended generation)."""
        arguments = "".join(self.arguments)
        ending = ending_arguments(self.name, arguments, frozenset() if cut else no_argument_tools)
        if self.name and ending is not None:
            out = self.add("", ending) if ending != arguments else []  # the "{}" vLLM's stream left out
            self.done = self.completed = True
            out.append(events.tool_call_completed(self.index, self.item_id, self.call_id, self.name, ending))
            return out
        problem = "has no function name" if not self.name else "has arguments that are not one complete JSON value"
        if cut:
            err = E.ProfileError(
                E.TOOL_CALL_INCOMPLETE,
                f"generation stopped (token budget or stop condition) "
                f"before tool call {self.call_id} was complete: it {problem}",
                E.SERVER_ERROR,
            )
        else:
            err = E.ProfileError(E.TOOL_CALL_INVALID, f"tool call {self.call_id} {problem}", E.SERVER_ERROR)
        return self.end_with(err)

    def end_with(self, err: E.ProfileError) -> list[dict[str, Any]]:
        """``started`` (if never announced) then ``response.tool_call.error``."""
        self.done = True
        out = [] if self.started else [events.tool_call_started(self.index, self.item_id, self.call_id, self.name)]
        self.started = True
        out.append(events.tool_call_error(self.index, self.item_id, self.call_id, err))
        return out


class _Choice:
    __slots__ = (
        "index",
        "text",
        "content_seen",
        "reasoning",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "calls",
        "latest",
        "no_argument_tools",
    )

    def __init__(self, index: int, no_argument_tools: frozenset[str]) -> None:
        self.index = index
        self.no_argument_tools = no_argument_tools
        self.text: list[str] = []
        self.content_seen = False
        self.reasoning: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # vLLM's per-token entries, in order
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.calls: list[_ToolCall] = []  # in the order vLLM began them
        self.latest: dict[int, _ToolCall] = {}  # tool-call index -> the latest call on it

    def add_tool_call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        index = delta.get("index", 0)
        vllm_id = delta.get("id") or None
        function = delta.get("function") or {}
        out: list[dict[str, Any]] = []
        call = self.latest.get(index)
        if call is None or (vllm_id and vllm_id != call.vllm_id and (call.vllm_id or call.started or call.done)):
            if call is not None and not call.done:
                out.extend(call.close(False, self.no_argument_tools))  # a new call on its index ended the earlier
            reuse = sum(c.index == index for c in self.calls)
            item_id = f"tool_call_{self.index}_{index}" + (f"_{reuse}" if reuse else "")
            call = self.latest[index] = _ToolCall(item_id, index, vllm_id)
            self.calls.append(call)
        elif vllm_id and call.vllm_id is None:  # the id of a call whose first entry had none
            call.vllm_id = call.call_id = vllm_id
        out.extend(call.add(function.get("name") or "", function.get("arguments") or ""))
        return out

    def open_calls(self) -> list[_ToolCall]:
        return [c for c in self.calls if not c.done]

    def close_tool_calls(self) -> list[dict[str, Any]]:
        cut = self.finish_reason == "length" or self.stop_reason is not None
        return [e for call in self.open_calls() for e in call.close(cut, self.no_argument_tools)]

    def as_choice(self) -> dict[str, Any]:
        content = "".join(self.text) if self.content_seen else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning"] = "".join(self.reasoning)
        completed = [c for c in self.calls if c.completed]
        if completed:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                for c in completed
            ]
        finish_reason = "stop" if self.finish_reason == "tool_calls" and not completed else self.finish_reason
        logprobs = {"content": self.logprobs} if self.logprobs else None
        return {
            "index": self.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": self.stop_reason,
        }


def _stream_error(error: object) -> E.ProfileError:
    """A mid-stream error object is always ``backend_error``: generation had already started."""
    if not isinstance(error, dict):
        return E.backend_error(str(error))
    status = error.get("code")
    return E.backend_error(
        str(error.get("message") or "backend error in stream"), status if isinstance(status, int) else 500
    )

"""Map a stream of OpenAI ``chat.completion.chunk`` objects to profile events (profile-contract.md §3).

``choices[i].delta.content`` -> ``response.output_text.delta {index: i, delta}``; a chunk with
``choices: []`` and ``usage`` (sent when ``stream_options.include_usage``) -> ``response.usage``; an
``{"error": {...}}`` chunk -> :class:`ProfileError` ``backend_error``. :meth:`ChatStreamMapper.completed_body`
assembles the ``chat.completion`` object the terminal ``response.completed`` carries (tool calls folded into
``message.tool_calls`` as vLLM's non-streaming body has them).

Tool calls (``choices[i].delta.tool_calls[]``, vllm-integration.md §8; profile-contract.md §3 "Deriving tool
events"): the first delta of a call (keyed by choice and vLLM's tool-call ``index``) -> ``response.tool_call.started``
with ``call_id`` = vLLM's tool call ``id`` and ``name``; every ``function.arguments`` fragment (also one riding in
the name chunk, as on 0.18/0.22 with a named ``tool_choice``) -> ``response.tool_call.delta``; when the choice
finishes (its ``finish_reason``, or the end of the stream) -> exactly one ``response.tool_call.completed`` with the
concatenated arguments, or ``response.tool_call.error`` ``tool_call_incomplete`` when generation stopped at the
token limit (``finish_reason: "length"``) with arguments that are not complete JSON. A mid-stream error ends
every open call with ``response.tool_call.error`` ``backend_error`` (:meth:`ChatStreamMapper.fail_open_calls`).
Per ``call_id``: started first, once; deltas; one completed/error last. Calls may interleave.
``item_id`` is ``tool_call_<choice>_<index>`` (adapter-chosen, unique within the operation).
"""

from __future__ import annotations

from typing import Any

import orjson

from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events


class ChatStreamMapper:
    """Feed chunks in arrival order with :meth:`feed`; read the final body with :meth:`completed_body`."""

    __slots__ = ("_head", "_choices", "_usage", "_fingerprint")

    def __init__(self) -> None:
        self._head: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._fingerprint: str | None = None

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chunk, in order (often one, sometimes none).

        Raises :class:`ProfileError` ``backend_error`` for an error chunk (vLLM's mid-stream
        ``data: {"error": {...}}``).
        """
        if "error" in chunk:
            raise _stream_error(chunk["error"])
        if self._head is None:
            self._head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("system_fingerprint"):
            self._fingerprint = chunk["system_fingerprint"]
        out: list[dict[str, Any]] = []
        choices = chunk.get("choices") or ()
        for choice in choices:
            index = choice.get("index", 0)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice()
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                state.text.append(content)
                out.append(events.output_text_delta(index, content))
            for call in delta.get("tool_calls") or ():
                out.extend(state.add_tool_call_delta(index, call))
            if choice.get("finish_reason") is not None:
                state.finish_reason = choice["finish_reason"]
                out.extend(state.close_tool_calls())
        usage = chunk.get("usage")
        if usage and not choices:
            self._usage = usage
            out.append(events.usage(usage))
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Events owed at the end of a stream: completes tool calls of choices that never sent a
        ``finish_reason``."""
        return [e for i in sorted(self._choices) for e in self._choices[i].close_tool_calls()]

    def fail_open_calls(self, err: E.ProfileError) -> list[dict[str, Any]]:
        """``response.tool_call.error`` (``err``) for every started call not yet completed (mid-stream error)."""
        out = []
        for choice_index in sorted(self._choices):
            for call in self._choices[choice_index].open_calls():
                call.done = True
                out.append(events.tool_call_error(call.index, call.item_id, call.call_id, err))
        return out

    def completed_body(self) -> dict[str, Any]:
        """The ``chat.completion`` object assembled from the stream (OpenAI usage names kept)."""
        head = self._head or {}
        body: dict[str, Any] = {
            "id": head.get("id"),
            "object": "chat.completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [self._choices[i].as_choice(i) for i in sorted(self._choices)],
        }
        if self._usage is not None:
            body["usage"] = self._usage
        if self._fingerprint is not None:
            body["system_fingerprint"] = self._fingerprint
        return body


class _ToolCall:
    __slots__ = ("index", "item_id", "call_id", "name", "arguments", "done")

    def __init__(self, choice_index: int, index: int) -> None:
        self.index = index
        self.item_id = f"tool_call_{choice_index}_{index}"
        self.call_id = ""
        self.name = ""
        self.arguments: list[str] = []
        self.done = False


class _Choice:
    __slots__ = ("text", "finish_reason", "tool_calls")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.tool_calls: dict[int, _ToolCall] = {}

    def add_tool_call_delta(self, choice_index: int, delta: dict[str, Any]) -> list[dict[str, Any]]:
        index = delta.get("index", len(self.tool_calls))
        function = delta.get("function") or {}
        out: list[dict[str, Any]] = []
        call = self.tool_calls.get(index)
        if call is None:
            call = self.tool_calls[index] = _ToolCall(choice_index, index)
            call.call_id = delta.get("id") or call.item_id
            call.name = function.get("name") or ""
            out.append(events.tool_call_started(index, call.item_id, call.call_id, call.name))
        elif function.get("name") and not call.name:
            call.name = function["name"]
        fragment = function.get("arguments")
        if fragment and not call.done:
            call.arguments.append(fragment)
            out.append(events.tool_call_delta(index, call.item_id, call.call_id, fragment))
        return out

    def open_calls(self) -> list[_ToolCall]:
        return [c for _, c in sorted(self.tool_calls.items()) if not c.done]

    def close_tool_calls(self) -> list[dict[str, Any]]:
        out = []
        for call in self.open_calls():
            call.done = True
            arguments = "".join(call.arguments)
            if self.finish_reason == "length" and not _is_json(arguments):
                err = E.ProfileError(
                    E.TOOL_CALL_INCOMPLETE,
                    f"generation stopped at the token limit (finish_reason length) inside the arguments of "
                    f"tool call {call.call_id}",
                    E.SERVER_ERROR,
                )
                out.append(events.tool_call_error(call.index, call.item_id, call.call_id, err))
            else:
                out.append(events.tool_call_completed(call.index, call.item_id, call.call_id, call.name, arguments))
        return out

    def as_choice(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) if self.text else None}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                for _, c in sorted(self.tool_calls.items())
            ]
        return {"index": index, "message": message, "logprobs": None, "finish_reason": self.finish_reason}


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def _stream_error(error: object) -> E.ProfileError:
    """A mid-stream error object is always ``backend_error``: generation had already started."""
    if not isinstance(error, dict):
        return E.backend_error(str(error))
    status = error.get("code")
    return E.backend_error(str(error.get("message") or "backend error in stream"),
                           status if isinstance(status, int) else 500)

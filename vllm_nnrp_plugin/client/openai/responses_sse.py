"""vLLM's ``/v1/responses`` server-sent events built from the profile events of one streamed ``responses.create``:
no I/O, plain data in, bytes out (used by :mod:`vllm_nnrp_plugin.client.openai.transport`).

The profile carries only what a client needs (``response.output_text.delta {index, delta}``,
``response.tool_call.started`` / ``.delta`` / ``.completed`` / ``.error``, ``response.usage`` and the terminal
``response.completed {body: <vLLM's Response>}``); :class:`ResponsesEventStream` rebuilds around them the event
sequence vLLM's ``responses_stream_generator`` writes (``vllm/entrypoints/openai/responses/serving.py`` and
``streaming_events.py``), each as ``event: <type>`` and ``data: <json>`` with ``sequence_number`` counting
from 0, so that the ``openai`` SDK's ``responses.create(stream=True)`` and ``responses.stream()`` (whose
accumulator, ``openai/lib/streaming/responses/_responses.py``, checks every item's identity) accept it:

* first ``response.created`` and ``response.in_progress`` with an in-progress Response made from the request
  (``id``, ``created_at``, ``model``, the request's sampling and tool fields, ``status: "in_progress"``,
  ``output: []``);
* text of output ``index``: ``response.output_item.added`` (a ``message`` item), ``response.content_part.added``
  (an empty ``output_text``), one ``response.output_text.delta`` per profile delta; when a later item begins or
  the stream ends, ``response.output_text.done``, ``response.content_part.done`` and
  ``response.output_item.done`` with the whole text;
* a tool call: ``response.output_item.added`` (a ``function_call`` item with the event's ``item_id``,
  ``call_id`` and ``name``), ``response.function_call_arguments.delta`` per delta, then on
  ``response.tool_call.completed`` ``response.function_call_arguments.done`` and ``response.output_item.done``
  (``status: "completed"``); on ``response.tool_call.error`` the same with the arguments streamed so far and
  ``status: "incomplete"``;
* a delta carrying vLLM's own event (``openai_chunk``, the ``vllm.openai_chunk`` extension of
  :mod:`vllm_nnrp_plugin.profile.events`: the events of a reasoning item when vLLM runs a reasoning parser):
  that event as vLLM streamed it, in this stream's ``sequence_number`` order (an ``output_item.added`` first ends
  the open text items, as a tool call's does);
* ``response.completed {response}``: the terminal body, whose ``id`` is replaced by the stream's own (the
  events carry no Response id before the end, and the SDK's accumulator refuses a Response whose id changed);
* a ``response.error`` after the stream began: ``event: error`` with vLLM's error body
  (``{"error": {"message", "type", "param", "code"}}``, :func:`vllm_nnrp_plugin.client.openai.sse.error_reply`),
  on which the SDK raises ``APIError``.

Not invented: message item ids are made locally (``msg_<stream id>_<index>``; vLLM's own streamed message ids
differ from its completed Response's too), deltas carry ``logprobs: []``.
"""

from __future__ import annotations

from typing import Any

import orjson

from vllm_nnrp_plugin.client.openai import sse
from vllm_nnrp_plugin.profile import events

#: the keys of a replayed vLLM event (``openai_chunk``) that :meth:`ResponsesEventStream._event` writes itself
_RENUMBERED = frozenset({"type", "sequence_number"})
#: request fields the in-progress Response repeats, with vLLM's default when the request has none
_REQUEST_FIELDS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "temperature": None,
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
}


class ResponsesEventStream:
    """The SSE bytes of one streamed Responses call: :meth:`feed` per non-terminal profile event, then
    :meth:`finish` (the ``response.completed`` body) or :meth:`fail` (a ``response.error``).

    ``response_id``: the stream's Response id (``resp_…``); ``created_at``: Unix seconds; ``request``: the
    request body (its ``model`` and :data:`_REQUEST_FIELDS` go into the in-progress Response).
    """

    def __init__(self, *, response_id: str, created_at: int, request: dict[str, Any]) -> None:
        self._id = response_id
        self._initial: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
            "model": request.get("model"),
            "status": "in_progress",
            "output": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **{key: request.get(key, default) for key, default in _REQUEST_FIELDS.items()},
        }
        self._sequence = 0
        self._texts: dict[int, str] = {}  # output index -> text of an open message item
        self._calls: dict[str, dict[str, Any]] = {}  # item id -> its function_call item (open ones)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _start(self) -> bytes:
        if self._sequence:
            return b""
        return self._event("response.created", response=self._initial) + self._event(
            "response.in_progress", response=self._initial
        )

    def _message_id(self, index: int) -> str:
        return f"msg_{self._id}_{index}"

    def _close_texts(self) -> bytes:
        out = b""
        for index, text in sorted(self._texts.items()):
            item_id = self._message_id(index)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            out += self._event("response.output_text.done", **where, text=text, logprobs=[])
            out += self._event("response.content_part.done", **where, part=part)
            item = {"type": "message", "id": item_id, "role": "assistant", "status": "completed", "content": [part]}
            out += self._event("response.output_item.done", output_index=index, item=item)
        self._texts.clear()
        return out

    def _open_text(self, index: int) -> bytes:
        if index in self._texts:
            return b""
        out = self._close_texts()
        self._texts[index] = ""
        item_id = self._message_id(index)
        item = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out += self._event("response.output_item.added", output_index=index, item=item)
        return out + self._event(
            "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part
        )

    def _end_call(self, event: dict[str, Any], status: str) -> bytes:
        item = self._calls.pop(event["item_id"], None)
        if item is None:
            return b""
        if status == "completed":
            item["arguments"] = event["arguments"]
        item["status"] = status
        done = self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=event["index"],
            name=item["name"],
            arguments=item["arguments"],
        )
        return done + self._event("response.output_item.done", output_index=event["index"], item=item)

    def feed(self, event: dict[str, Any]) -> bytes:
        """The SSE events of one non-terminal profile event (the opening events before the first;
        ``response.usage`` gives none: the completed Response carries the usage)."""
        out = self._start()
        kind = event.get("type")
        if kind == events.OUTPUT_TEXT_DELTA and "openai_chunk" in event:
            replay = event["openai_chunk"]
            if replay["type"] == "response.output_item.added":
                out += self._close_texts()
            out += self._event(replay["type"], **{k: v for k, v in replay.items() if k not in _RENUMBERED})
        elif kind == events.OUTPUT_TEXT_DELTA:
            index = event["index"]
            out += self._open_text(index)
            self._texts[index] += event["delta"]
            out += self._event(
                "response.output_text.delta",
                item_id=self._message_id(index),
                output_index=index,
                content_index=0,
                delta=event["delta"],
                logprobs=[],
            )
        elif kind == events.TOOL_CALL_STARTED:
            out += self._close_texts()
            item = self._calls[event["item_id"]] = {
                "type": "function_call",
                "id": event["item_id"],
                "call_id": event["call_id"],
                "name": event["name"],
                "arguments": "",
                "status": "in_progress",
            }
            out += self._event("response.output_item.added", output_index=event["index"], item=dict(item))
        elif kind == events.TOOL_CALL_DELTA and event["item_id"] in self._calls:
            self._calls[event["item_id"]]["arguments"] += event["arguments_delta"]
            out += self._event(
                "response.function_call_arguments.delta",
                item_id=event["item_id"],
                output_index=event["index"],
                delta=event["arguments_delta"],
            )
        elif kind == events.TOOL_CALL_COMPLETED:
            out += self._end_call(event, "completed")
        elif kind == events.TOOL_CALL_ERROR:
            out += self._end_call(event, "incomplete")
        return out

    def finish(self, body: dict[str, Any]) -> bytes:
        """The end of the stream: open text items done, then ``response.completed`` with ``body`` (vLLM's
        Response) under the stream's id."""
        out = self._start() + self._close_texts()
        return out + self._event("response.completed", response={**body, "id": self._id})

    def fail(self, error_event: dict[str, Any], status: int | None) -> bytes:
        """A ``response.error`` after the stream began: ``event: error`` with vLLM's error body."""
        body = sse.error_reply(error_event, status)[1]
        return self._start() + b"event: error\n" + sse.sse(body)

"""The OpenAI HTTP answers vLLM's server gives, built from profile events: no I/O, plain data in, bytes out.

Used by :mod:`vllm_nnrp_plugin.client.openai.transport`, which feeds it the events of one operation:

* :class:`ChatChunkStream` turns the non-terminal events of a streamed ``chat.completions.create``
  (``response.output_text.delta``, ``response.tool_call.started`` / ``.delta``) into the server-sent events of
  vLLM's ``/v1/chat/completions`` stream (``vllm/entrypoints/openai/chat_completion/serving.py``): one
  ``chat.completion.chunk`` per event (the first of each choice carries ``delta.role``), then, from the
  ``response.completed`` body, one chunk per choice with its ``finish_reason``, the usage chunk (``choices: []``)
  when the request asked with ``stream_options.include_usage``, and ``data: [DONE]``. A ``response.error`` after
  the stream began becomes vLLM's in-stream error item (``data: {"error": {...}}``) and ``data: [DONE]``.
* :func:`error_reply` turns a terminal ``response.error`` into (HTTP status, body) in the shape of vLLM's
  ``ErrorResponse`` (``{"error": {"message", "type", "param", "code"}}``, ``vllm/entrypoints/openai/engine/
  protocol.py``), keeping the profile's ``code`` (``model_not_found``, ``invalid_request``, …) as ``code``;
  ``unsupported_operation`` (an operation the server does not serve, e.g. ``embeddings.create`` on a
  ``generate`` server) is 404, as vLLM's HTTP server answers a route it does not have.
* :func:`model_list` answers ``GET /v1/models`` from the capability document of a server without
  ``models.list``; :func:`route_reply` is FastAPI's answer to a path or method vLLM does not serve
  (``{"detail": "Not Found"}``, 404; ``Method Not Allowed``, 405).

A delta carrying vLLM's chunk (``openai_chunk``, the ``vllm.openai_chunk`` extension of
:mod:`vllm_nnrp_plugin.profile.events`: the request asked for ``logprobs``, or vLLM runs a reasoning parser)
becomes a chunk with that chunk's ``delta.content`` / ``delta.reasoning`` and ``choices[].logprobs``, exactly as
vLLM streamed them over HTTP. What the profile does not carry is not invented: streamed chunks get one locally
made ``id`` and the request's ``model`` (the events have neither), chunks of deltas without ``openai_chunk``
have ``logprobs: null`` and no ``delta.reasoning``, and error bodies carry ``param: null``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson

from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events

DONE = b"data: [DONE]\n\n"
CHAT_PATH = "/chat/completions"
MODELS_PATH = "/models"
RESPONSES_PATH = "/responses"
EMBEDDINGS_PATH = "/embeddings"
#: the paths of vLLM's that the transport maps to profile operations
SERVED_PATHS = (CHAT_PATH, RESPONSES_PATH, EMBEDDINGS_PATH, MODELS_PATH)
#: the status of a terminal ``response.error`` whose RESULT_PUSH status is not an HTTP error status
_STATUS_BY_CODE: dict[str | None, int] = {
    E.MODEL_NOT_FOUND: 404,
    E.ENVELOPE_TOO_LARGE: 413,
    E.TOO_MANY_REQUESTS: 429,
    E.CLIENT_TOO_SLOW: 429,
    E.BACKEND_ERROR: 500,
    E.SERVER_SHUTDOWN: 503,
    E.REQUEST_TIMEOUT: 504,
}


def sse(item: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + orjson.dumps(item) + b"\n\n"


def error_status(error_event: dict[str, Any], status: int | None) -> int:
    """The HTTP status of a ``response.error``: 404 for ``unsupported_operation`` (the server does not serve the
    operation: vLLM's HTTP server has no such route then), else its RESULT_PUSH status when that is 400–599, else
    by ``code`` (the table of :mod:`vllm_nnrp_plugin.profile.errors`), else 400."""
    if (error_event.get("error") or {}).get("code") == E.UNSUPPORTED_OPERATION:
        return 404
    if status is not None and 400 <= status <= 599:
        return status
    return _STATUS_BY_CODE.get((error_event.get("error") or {}).get("code"), 400)


def error_type(status: int) -> str:
    """vLLM's ``error.type`` for a status: the reason phrase without spaces plus ``Error`` (``NotFoundError``,
    ``BadRequestError``, ``InternalServerError``), as ``vllm/entrypoints/serve/utils/error_response.py`` names them."""
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "Error"
    return phrase if phrase.endswith("Error") else phrase + "Error"


def error_reply(error_event: dict[str, Any], status: int | None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, ``{"error": {"message", "type", "param": null, "code": <profile code>}}``) for a terminal
    ``response.error`` (``status``: its RESULT_PUSH status code, or None)."""
    http_status = error_status(error_event, status)
    error = error_event.get("error") or {}
    return http_status, {
        "error": {
            "message": error.get("message") or "error",
            "type": error_type(http_status),
            "param": None,
            "code": error.get("code"),
        }
    }


def route_reply(path: str, method: str) -> tuple[int, dict[str, Any]]:
    """FastAPI's answer to a request vLLM has no route for: 405 for a served path with another method, else 404."""
    if path.endswith(SERVED_PATHS):
        return 405, {"detail": "Method Not Allowed"}
    return 404, {"detail": "Not Found"}


def model_list(document: dict[str, Any], created: int) -> dict[str, Any]:
    """``GET /v1/models`` from the capability document's ``models`` (``{"id", "owned_by"}`` each): an OpenAI
    ``list`` of ``model`` objects (``created``: Unix seconds)."""
    return {
        "object": "list",
        "data": [
            {"id": m["id"], "object": "model", "created": created, "owned_by": m.get("owned_by", "vllm")}
            for m in document.get("models") or ()
        ],
    }


def _choice_of(item_id: str) -> int:
    """The choice index inside a tool call's ``item_id`` (``tool_call_<choice>_<index>[_<n>]``)."""
    return int(item_id.split("_")[2])


class ChatChunkStream:
    """The SSE bytes of one streamed chat completion, one :meth:`feed` per non-terminal event.

    ``completion_id``, ``created`` (Unix seconds), ``model``: the chunk head; ``include_usage``: the request's
    ``stream_options.include_usage``.
    """

    def __init__(self, *, completion_id: str, created: int, model: str | None, include_usage: bool) -> None:
        self._head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._include_usage = include_usage
        self._roles_sent: set[int] = set()

    def _chunk(
        self,
        choice: int,
        delta: dict[str, Any],
        finish: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        out = b""
        if choice not in self._roles_sent:
            self._roles_sent.add(choice)
            out = self._chunk(choice, {"role": "assistant", "content": ""})
        entry = {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": None, **(finish or {})}
        return out + sse({**self._head, "choices": [entry]})

    def _replay(self, index: int, openai_chunk: dict[str, Any]) -> bytes:
        """The chunk of a delta carrying vLLM's own (``openai_chunk``): its choice's ``delta`` (``content``,
        ``reasoning``) and ``logprobs`` as vLLM sent them; ``role`` and ``tool_calls`` have chunks of their own,
        the finish reason comes with :meth:`finish`."""
        choice = next(c for c in openai_chunk["choices"] if c.get("index", 0) == index)
        delta = {k: v for k, v in (choice.get("delta") or {}).items() if k not in ("role", "tool_calls")}
        return self._chunk(index, delta, logprobs=choice.get("logprobs"))

    def feed(self, event: dict[str, Any]) -> bytes:
        """The chunk(s) of one non-terminal profile event (``b""`` for events with no chunk of their own:
        ``response.tool_call.completed`` / ``.error``, whose text already streamed, and ``response.usage``,
        which :meth:`finish` sends from the final body)."""
        kind = event.get("type")
        if kind == events.OUTPUT_TEXT_DELTA:
            if "openai_chunk" in event:
                return self._replay(event["index"], event["openai_chunk"])
            return self._chunk(event["index"], {"content": event["delta"]})
        if kind == events.TOOL_CALL_STARTED:
            call = {
                "id": event["call_id"],
                "type": "function",
                "index": event["index"],
                "function": {"name": event["name"]},
            }
            return self._chunk(_choice_of(event["item_id"]), {"tool_calls": [call]})
        if kind == events.TOOL_CALL_DELTA:
            call = {"index": event["index"], "function": {"arguments": event["arguments_delta"]}}
            return self._chunk(_choice_of(event["item_id"]), {"tool_calls": [call]})
        return b""

    def finish(self, body: dict[str, Any]) -> bytes:
        """The end of the stream from the ``response.completed`` body: one chunk per choice with its
        ``finish_reason`` (and ``stop_reason``), the usage chunk when asked, ``data: [DONE]``."""
        out = b""
        for choice in body.get("choices") or ():
            finish = {"finish_reason": choice.get("finish_reason"), "stop_reason": choice.get("stop_reason")}
            out += self._chunk(choice.get("index", 0), {}, finish)
        if self._include_usage and body.get("usage") is not None:
            out += sse({**self._head, "choices": [], "usage": body["usage"]})
        return out + DONE

    def fail(self, error_event: dict[str, Any], status: int | None) -> bytes:
        """A ``response.error`` after the stream began: vLLM's in-stream error item, then ``data: [DONE]``."""
        return sse(error_reply(error_event, status)[1]) + DONE

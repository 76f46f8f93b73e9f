"""Profile events (the profile's "Events" section of ``openai-compatible-1.json``): builders returning plain dicts, and
their JSON encoding.

Non-terminal events (``response.output_text.delta``, ``response.tool_call.*``, ``response.usage``) travel one
per PARTIAL_RESULT; terminals (``response.completed``, ``response.error``, ``response.cancelled``) end the operation.
A delta is a fragment of its output (the profile's "Events" section: ``delta`` is text, ``arguments_delta`` a piece
of the call's JSON arguments, both concatenated in order by the client), so two consecutive deltas of the same
output may travel as one event carrying both fragments (:func:`merge`).

**The ``vllm.openai_chunk`` extension** (:data:`~vllm_nnrp_plugin.profile.capabilities.OPENAI_CHUNK_EXTENSION`):
the profile's "Events" section gives ``response.output_text.delta`` an optional ``openai_chunk``, "replay data,
never required". This server puts there the provider object a delta came from when that object carries what the
profile's events do not — token logprobs (``choices[].logprobs``, sent by vLLM only when the request asked with
``logprobs``) or reasoning (``delta.reasoning`` of a chat chunk, Responses reasoning-item events, sent by vLLM only
when it runs a ``--reasoning-parser``): the ``chat.completion.chunk`` (reduced to that delta's choice) or the
Responses event, as vLLM streams it over HTTP. Such an object with no text of its own (a reasoning-only chunk,
a chunk whose token decodes to no text) rides on a delta whose ``delta`` is ``""``, so a client that ignores
``openai_chunk`` reads the same text and every other event unchanged. Every other stream carries none.
"""

from __future__ import annotations

from typing import Any

import orjson

from vllm_nnrp_plugin.profile.errors import ProfileError

OUTPUT_TEXT_DELTA = "response.output_text.delta"
TOOL_CALL_STARTED = "response.tool_call.started"
TOOL_CALL_DELTA = "response.tool_call.delta"
TOOL_CALL_COMPLETED = "response.tool_call.completed"
TOOL_CALL_ERROR = "response.tool_call.error"
USAGE = "response.usage"
COMPLETED = "response.completed"
ERROR = "response.error"
CANCELLED = "response.cancelled"


def output_text_delta(index: int, delta: str, openai_chunk: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"type": "response.output_text.delta", "index": <choice index>, "delta": <text>}``, plus
    ``"openai_chunk": <provider object>`` when given (the ``vllm.openai_chunk`` extension above)."""
    if openai_chunk is None:
        return {"type": OUTPUT_TEXT_DELTA, "index": index, "delta": delta}
    return {"type": OUTPUT_TEXT_DELTA, "index": index, "delta": delta, "openai_chunk": openai_chunk}


def tool_call_started(index: int, item_id: str, call_id: str, name: str) -> dict[str, Any]:
    """``response.tool_call.started``: the first event of one call (``call_id`` is vLLM's tool call id)."""
    return {"type": TOOL_CALL_STARTED, "index": index, "item_id": item_id, "call_id": call_id, "name": name}


def tool_call_delta(index: int, item_id: str, call_id: str, arguments_delta: str) -> dict[str, Any]:
    """``response.tool_call.delta``: one fragment of the call's JSON arguments, in arrival order."""
    return {
        "type": TOOL_CALL_DELTA,
        "index": index,
        "item_id": item_id,
        "call_id": call_id,
        "arguments_delta": arguments_delta,
    }


def tool_call_completed(index: int, item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """``response.tool_call.completed``: the last event of a call; ``arguments`` is the concatenated JSON text."""
    return {
        "type": TOOL_CALL_COMPLETED,
        "index": index,
        "item_id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def tool_call_error(index: int, item_id: str, call_id: str, err: ProfileError) -> dict[str, Any]:
    """``response.tool_call.error``: the last event of a call that did not complete (same error shape)."""
    return {
        "type": TOOL_CALL_ERROR,
        "index": index,
        "item_id": item_id,
        "call_id": call_id,
        "error": {"type": err.type, "code": err.code, "message": err.message},
    }


def usage(openai_usage: dict[str, Any]) -> dict[str, Any]:
    """``response.usage`` from OpenAI usage (``prompt_tokens``/``completion_tokens``/``total_tokens``, tokens)
    renamed to the profile's ``input_tokens``/``output_tokens``/``total_tokens``."""
    prompt = openai_usage.get("prompt_tokens") or 0
    completion = openai_usage.get("completion_tokens") or 0
    total = openai_usage.get("total_tokens")
    return {
        "type": USAGE,
        "usage": {
            "input_tokens": prompt,
            "output_tokens": completion,
            "total_tokens": prompt + completion if total is None else total,
        },
    }


def with_cached_tokens(event: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    """``response.usage`` with the profile extension ``usage.input_tokens_details.cached_tokens``: the prompt tokens
    served from the server's prefix cache (tokens; the name and shape of OpenAI's Responses usage)."""
    return {**event, "usage": {**event["usage"], "input_tokens_details": {"cached_tokens": cached_tokens}}}


def completed(body: dict[str, Any]) -> dict[str, Any]:
    """``{"type": "response.completed", "body": <chat.completion object>}``."""
    return {"type": COMPLETED, "body": body}


def error(err: ProfileError) -> dict[str, Any]:
    """``{"type": "response.error", "error": {"type", "code", "message"}}``."""
    return {"type": ERROR, "error": {"type": err.type, "code": err.code, "message": err.message}}


def cancelled(reason: str) -> dict[str, Any]:
    """``{"type": "response.cancelled", "reason": <reason>}``."""
    return {"type": CANCELLED, "reason": reason}


def merge(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any] | None:
    """One event equal to ``first`` immediately followed by ``then``, or ``None`` when they do not merge.

    Only deltas of the same output merge: two ``response.output_text.delta`` of the same choice ``index``
    (texts concatenated), or two ``response.tool_call.delta`` of the same call (``index``, ``item_id``,
    ``call_id``; ``arguments_delta`` concatenated). Events with any other key never merge — a delta carrying
    ``openai_chunk`` is one provider object and stays its own event. Neither input is changed.
    """
    kind = first["type"]
    if kind != then["type"] or len(first) != len(then):
        return None
    if kind == OUTPUT_TEXT_DELTA and len(first) == 3 and first["index"] == then["index"]:
        return {"type": kind, "index": first["index"], "delta": first["delta"] + then["delta"]}
    if (
        kind == TOOL_CALL_DELTA
        and len(first) == 5
        and first["index"] == then["index"]
        and first["item_id"] == then["item_id"]
        and first["call_id"] == then["call_id"]
    ):
        return {**first, "arguments_delta": first["arguments_delta"] + then["arguments_delta"]}
    return None


def encode(event: dict[str, Any]) -> bytes:
    """UTF-8 JSON bytes of one event (no SSE framing)."""
    return orjson.dumps(event)

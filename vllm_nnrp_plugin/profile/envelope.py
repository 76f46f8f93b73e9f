"""Decode one request envelope (the profile's "Request envelope" section).

Shape: ``{"schema_version": "openai-compatible/1", "operation": str, "body": {...},
"request_id"?: str, "nnrp"?: {...}}``. Unknown top-level keys are ignored (forward compatible). The ``nnrp``
object carries NNRP-side hints and is never forwarded into ``body``. Read here: ``nnrp.timeout_ms``
(positive integer, ms from the submit) bounds the operation; the adapter reads ``nnrp.diagnostics`` (``true``:
the terminal event carries the operation's diagnostics); others (the conformance harness's
``cancel_after_events`` …) are ignored.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson

from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION
from vllm_nnrp_plugin.profile import errors as E


@attrs.frozen
class Envelope:
    """A validated envelope: ``operation`` is one the caller supports, ``body`` a JSON object."""

    operation: str
    body: dict[str, Any]
    request_id: str | None = None
    nnrp: dict[str, Any] = attrs.field(factory=dict)
    #: ``nnrp.timeout_ms``: the operation's time budget in ms from its submit, or None
    timeout_ms: int | None = None


def decode_envelope(payload: bytes, *, operations: frozenset[str], max_bytes: int) -> Envelope:
    """Parse and validate ``payload`` (UTF-8 JSON, at most ``max_bytes`` bytes).

    ``operations`` is the set the capability document advertises; any other operation is refused.
    Raises :class:`ProfileError` with code ``envelope_too_large`` (413), ``invalid_json``,
    ``invalid_envelope``, ``unsupported_schema_version``, ``unsupported_operation`` or
    ``missing_messages`` (all 400); ``invalid_envelope`` also for an ``nnrp.timeout_ms`` that is not a
    positive integer.
    """
    if len(payload) > max_bytes:
        raise E.ProfileError(
            E.ENVELOPE_TOO_LARGE,
            f"envelope is {len(payload)} bytes; the limit is {max_bytes} bytes (nnrp.max_envelope_bytes)",
            status=413,
        )
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise E.ProfileError(E.INVALID_JSON, f"envelope is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise E.ProfileError(E.INVALID_ENVELOPE, f"envelope must be a JSON object, got {_kind(doc)}")

    version = doc.get("schema_version")
    if version is None:
        raise E.ProfileError(E.INVALID_ENVELOPE, "envelope has no schema_version")
    if version != SCHEMA_VERSION:
        raise E.ProfileError(
            E.UNSUPPORTED_SCHEMA_VERSION, f"schema_version {version!r} is not supported; use {SCHEMA_VERSION!r}"
        )
    operation = doc.get("operation")
    if not isinstance(operation, str) or not operation:
        raise E.ProfileError(E.INVALID_ENVELOPE, "envelope operation must be a non-empty string")
    if operation not in operations:
        raise E.ProfileError(
            E.UNSUPPORTED_OPERATION,
            f"operation {operation!r} is not supported; supported: {', '.join(sorted(operations))}",
        )
    body = doc.get("body")
    if not isinstance(body, dict):
        raise E.ProfileError(E.INVALID_ENVELOPE, f"envelope body must be a JSON object, got {_kind(body)}")
    request_id = doc.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise E.ProfileError(E.INVALID_ENVELOPE, "envelope request_id must be a string")
    hints = doc.get("nnrp", {})
    if not isinstance(hints, dict):
        raise E.ProfileError(E.INVALID_ENVELOPE, f"envelope nnrp must be a JSON object, got {_kind(hints)}")
    timeout_ms = hints.get("timeout_ms")
    if timeout_ms is not None and (isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0):
        raise E.ProfileError(E.INVALID_ENVELOPE, f"envelope nnrp.timeout_ms must be a positive integer (ms), got {timeout_ms!r}")
    if operation == CHAT_COMPLETIONS_CREATE and "messages" not in body:
        raise E.ProfileError(E.MISSING_MESSAGES, "chat.completions.create body has no messages")
    return Envelope(operation=operation, body=body, request_id=request_id, nnrp=hints, timeout_ms=timeout_ms)


def _kind(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )

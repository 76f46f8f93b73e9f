"""Decode one request envelope (the profile's "Request envelope" section).

Shape: ``{"schema_version": "openai-compatible/1", "operation": str, "body": {...},
"request_id"?: str, "nnrp"?: {...}}``. Unknown top-level keys are ignored (forward compatible). The ``nnrp``
object carries NNRP-side hints and is never forwarded into ``body``. Read here: ``nnrp.timeout_ms``
(positive integer, ms from the submit) bounds the operation; ``nnrp.priority_class`` (``interactive``,
``balanced`` or ``background``: NNRP/1's priority classes) is the operation's own priority class, over its
session's (an extension of this adapter, :mod:`vllm_nnrp_plugin.core.controls`); the adapter reads
``nnrp.diagnostics`` (``true``: the terminal event carries the operation's diagnostics); others (the conformance
harness's ``cancel_after_events`` …) are ignored.

Codes (the profile freezes only ``missing_messages`` and ``unsupported_operation`` here; the others are this
adapter's, docs/wire-mapping.md "Error codes"): bytes that are not UTF-8 JSON → ``invalid_json``; JSON that breaks
a rule of the envelope → ``invalid_envelope``. One of those rules is this adapter's: arrays and objects nest at
most :data:`MAX_NESTING` deep, counting the envelope object itself as 1 (``body`` is at depth 2, a message at 4),
so that nothing downstream that walks a request recursively (vLLM's request validation, chat templates, guided
decoding, error formatting, orjson writing it back) meets an input deep enough to exhaust its stack. Error messages
never quote a client value as it came: they name its JSON type and show a short escaped preview (:func:`_preview`).
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson

from vllm_nnrp_plugin.core.controls import PRIORITY_CLASSES
from vllm_nnrp_plugin.observability.log_safety import loggable
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION
from vllm_nnrp_plugin.profile import errors as E

#: the deepest nesting of arrays and objects an envelope may have (the envelope object is depth 1): the most
#: orjson writes back (its ``dumps`` refuses deeper), which is how it is checked, at C speed
MAX_NESTING = 254
#: the most characters of a client value quoted in an error message
PREVIEW_CHARS = 48


@attrs.frozen
class Envelope:
    """A validated envelope: ``operation`` is one the caller supports, ``body`` a JSON object."""

    operation: str
    body: dict[str, Any]
    request_id: str | None = None
    nnrp: dict[str, Any] = attrs.field(factory=dict)
    #: ``nnrp.timeout_ms``: the operation's time budget in ms from its submit, or None
    timeout_ms: int | None = None
    #: ``nnrp.priority_class``: the operation's own NNRP priority class name, or None
    priority_class: str | None = None


def decode_envelope(payload: bytes, *, operations: frozenset[str], max_bytes: int) -> Envelope:
    """Parse and validate ``payload`` (UTF-8 JSON, at most ``max_bytes`` bytes).

    ``operations`` is the set the capability document advertises; any other operation is refused.
    Raises :class:`ProfileError` with code ``envelope_too_large`` (413), ``invalid_json``,
    ``invalid_envelope``, ``unsupported_schema_version``, ``unsupported_operation`` or
    ``missing_messages`` (all 400); ``invalid_envelope`` also for an ``nnrp.timeout_ms`` that is not a
    positive integer, an ``nnrp.priority_class`` that is not a class name, and for nesting deeper than
    :data:`MAX_NESTING` (also past orjson's own limit of 1024,
    which it reports as a parse error). Raises nothing else for any ``payload``.
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
        if "depth limit" in str(exc):  # orjson refuses nesting past 1024 before it checks anything else
            raise _too_deep() from None
        raise E.ProfileError(E.INVALID_JSON, f"envelope is not valid UTF-8 JSON: {exc}") from None
    if _nests_deeper(payload, doc):
        raise _too_deep()
    if not isinstance(doc, dict):
        raise E.ProfileError(E.INVALID_ENVELOPE, f"envelope must be a JSON object, got {_kind(doc)}")

    version = doc.get("schema_version")
    if version is None:
        raise E.ProfileError(E.INVALID_ENVELOPE, "envelope has no schema_version")
    if version != SCHEMA_VERSION:
        raise E.ProfileError(
            E.UNSUPPORTED_SCHEMA_VERSION, f"schema_version {_preview(version)} is not supported; use '{SCHEMA_VERSION}'"
        )
    operation = doc.get("operation")
    if not isinstance(operation, str) or not operation:
        raise E.ProfileError(E.INVALID_ENVELOPE, "envelope operation must be a non-empty string")
    if operation not in operations:
        raise E.ProfileError(
            E.UNSUPPORTED_OPERATION,
            f"operation {_preview(operation)} is not supported; supported: {', '.join(sorted(operations))}",
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
        raise E.ProfileError(
            E.INVALID_ENVELOPE, f"envelope nnrp.timeout_ms must be a positive integer (ms), got {_preview(timeout_ms)}"
        )
    if operation == CHAT_COMPLETIONS_CREATE and "messages" not in body:
        raise E.ProfileError(E.MISSING_MESSAGES, "chat.completions.create body has no messages")
    priority_class = hints.get("priority_class")
    if priority_class is not None and priority_class not in PRIORITY_CLASSES:
        raise E.ProfileError(
            E.INVALID_ENVELOPE,
            f"envelope nnrp.priority_class must be one of {', '.join(PRIORITY_CLASSES)}, got "
            f"{_preview(priority_class)}",
        )
    return Envelope(
        operation=operation,
        body=body,
        request_id=request_id,
        nnrp=hints,
        timeout_ms=timeout_ms,
        priority_class=priority_class,
    )


def _too_deep() -> E.ProfileError:
    return E.ProfileError(
        E.INVALID_ENVELOPE, f"envelope nests arrays/objects deeper than {MAX_NESTING} levels (the adapter's limit)"
    )


def _nests_deeper(payload: bytes, doc: Any) -> bool:
    """Whether ``doc`` (``payload`` as orjson parsed it: dicts, lists, strings, numbers, booleans, None) nests
    arrays/objects more than :data:`MAX_NESTING` deep. A payload of fewer than ``2 × (MAX_NESTING + 1)`` bytes
    cannot (each level takes an opening and a closing byte): what a usual short envelope costs is one length
    check. Else orjson encodes it again (at C speed, about a sixth of parsing it), which it refuses past exactly
    that depth (orjson's recursion limit, 255 levels) and cannot refuse for anything else it parsed."""
    if len(payload) < 2 * (MAX_NESTING + 1):
        return False
    try:
        orjson.dumps(doc)
    except orjson.JSONEncodeError:
        return True
    return False


def _preview(value: object) -> str:
    """A client value in an error message: its JSON type and, for a scalar, a short escaped preview
    (``string 'openai-compatible/2'``, ``number 5.5``, ``array of 3 items``); never the value itself."""
    kind = _kind(value)
    if isinstance(value, str):
        return f"string '{loggable(value, PREVIEW_CHARS)}'"
    if isinstance(value, (list, dict)):
        return f"{kind} of {len(value)} {'items' if isinstance(value, list) else 'keys'}"
    if value is None:
        return "null"
    return f"{kind} {loggable(value, PREVIEW_CHARS)}"


def _kind(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )

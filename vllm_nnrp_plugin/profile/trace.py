"""NNRP TRACE_CONTEXT -> one W3C ``traceparent`` for vLLM (the profile's frozen
"TRACE_CONTEXT → traceparent" rules).

NNRP trace metadata is ``TraceContextMetadata(trace_id u64, span_id u64, parent_span_id u64, stage_code u16,
flags u16, body_bytes u32)``; its opaque attribute body is never read, copied or logged here.

* ``traceparent = "00-" + trace-id + "-" + parent-id + "-" + trace-flags``;
* trace-id: the 64-bit ``trace_id`` zero-extended into the low 64 bits (32 hex digits, the high 16 are ``0``);
* parent-id: the NNRP ``span_id`` (the sender's span is the parent of vLLM's span); ``parent_span_id`` unused;
* trace-flags: ``01`` when ``flags & 1`` (sampled), else ``00``;
* a context with a zero ``trace_id`` or ``span_id`` is ignored (W3C forbids all-zero ids);
* scope: ``frame_id == 0`` is the session default; a context naming an operation's frame overrides it for that
  operation, but only until the operation is dispatched to vLLM (in-flight work is never changed).

Example: ``TraceContext(91, 92, 90, 5, 3, 0)`` -> ``00-0000000000000000000000000000005b-000000000000005c-01``.
"""

from __future__ import annotations

from typing import Any

import attrs

SESSION = "session"
OPERATION = "operation"


@attrs.frozen
class TraceContext:
    """The fixed TRACE_CONTEXT metadata (integers as on the wire; ``body_bytes`` in bytes) and its scope
    (``session`` or ``operation``)."""

    trace_id: int
    span_id: int
    parent_span_id: int
    stage_code: int
    flags: int
    body_bytes: int
    scope: str = SESSION

    @property
    def eligible(self) -> bool:
        """Both ids non-zero (otherwise the frame is ignored)."""
        return self.trace_id != 0 and self.span_id != 0

    def traceparent(self) -> str:
        """The W3C ``traceparent`` header value (version 00)."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.flags & 1 else '00'}"

    def observation(self) -> dict[str, Any]:
        """What an operation records: the full fixed metadata, the attribute body's size only, the scope and
        the header sent to vLLM. Never the attribute bytes."""
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "stage_code": self.stage_code,
            "flags": self.flags,
            "attribute_bytes": self.body_bytes,
            "scope": self.scope,
            "traceparent": self.traceparent(),
        }


def received(frame_id: int, metadata: Any) -> TraceContext | None:
    """The context one TRACE_CONTEXT frame carries (``metadata``: its fixed fields under nnrp-py's
    ``TraceContextMetadata`` names): session scope for frame 0, operation scope for any other frame; ``None``
    when it is not eligible (a zero id: the frame is ignored)."""
    context = TraceContext(
        metadata.trace_id,
        metadata.span_id,
        metadata.parent_span_id,
        metadata.stage_code,
        metadata.flags,
        metadata.body_bytes,
        SESSION if frame_id == 0 else OPERATION,
    )
    return context if context.eligible else None


def for_dispatch(session_default: TraceContext | None, override: TraceContext | None) -> TraceContext | None:
    """The context an operation is dispatched with: its own override, else the session default."""
    return override if override is not None else session_default

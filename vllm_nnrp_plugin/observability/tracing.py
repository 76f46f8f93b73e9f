"""One OpenTelemetry span per operation, built from its observation record (``opentelemetry-api`` only).

The span ``nnrp chat.completions.create`` (kind SERVER) starts when the submit was received and ends when the
terminal was sent (wall clock: ``submitted_unix_ns`` plus the record's monotonic durations). Its parent is the NNRP
trace context the operation was dispatched with (TRACE_CONTEXT, by the profile's "TRACE_CONTEXT → traceparent" rules
of :mod:`vllm_nnrp_plugin.profile.trace`: the 64-bit NNRP ``trace_id`` zero-extended to 128 bits, the sender's
``span_id`` as parent, ``flags`` bit 0 = sampled); otherwise it is a root span. Without an SDK configured by the
host (vLLM configures one only with ``--otlp-traces-endpoint``), the API's no-op tracer makes this free.

Attributes: ``nnrp.operation_id``, ``nnrp.frame_id``, ``nnrp.session_id``, ``nnrp.transport``,
``nnrp.outcome``, ``nnrp.events``, ``nnrp.error.code``, ``nnrp.cancel.source``, ``nnrp.cancel.reason``,
``nnrp.trace.attribute_bytes``, ``gen_ai.request.model``, ``gen_ai.request.id`` (vLLM's request id, as on
vLLM's own ``llm_request`` span), ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from vllm_nnrp_plugin import __version__
from vllm_nnrp_plugin.observability.observation import ERROR, Observation


def tracer() -> trace.Tracer:
    """The package's tracer from the globally configured provider (no-op unless the host set one)."""
    return trace.get_tracer("vllm_nnrp_plugin", __version__)


def emit_span(tracer_: trace.Tracer, record: Observation) -> None:
    """Record one finished operation as a span (see the module docstring for timing, parent, attributes)."""
    parent = None
    meta = record.trace
    if meta is not None and meta.eligible:
        remote = SpanContext(
            trace_id=meta.trace_id,
            span_id=meta.span_id,
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED if meta.flags & 1 else TraceFlags.DEFAULT),
        )
        parent = trace.set_span_in_context(NonRecordingSpan(remote))
    start = record.submitted_unix_ns
    end_ns = record.terminal_ns if record.terminal_ns is not None else record.submitted_ns
    span = tracer_.start_span(
        f"nnrp {record.operation or 'submit'}", context=parent, kind=SpanKind.SERVER, start_time=start
    )
    if span.is_recording():
        attributes: dict[str, Any] = {
            "nnrp.operation_id": record.operation_id,
            "nnrp.frame_id": record.frame_id,
            "nnrp.session_id": record.session_id,
            "nnrp.transport": record.transport,
            "nnrp.outcome": record.outcome,
            "nnrp.events": record.events,
            "nnrp.error.code": record.error_code,
            "nnrp.cancel.source": record.cancel_source,
            "nnrp.cancel.reason": record.cancel_reason,
            "nnrp.trace.attribute_bytes": meta.body_bytes if meta is not None else None,
            "gen_ai.request.model": record.model,
            "gen_ai.request.id": record.request_id,
            "gen_ai.usage.input_tokens": record.input_tokens,
            "gen_ai.usage.output_tokens": record.output_tokens,
        }
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if record.outcome == ERROR:
            span.set_status(Status(StatusCode.ERROR, record.error_code))
    span.end(end_time=start + (end_ns - record.submitted_ns))

"""One observation record per operation: the single source of the operation's log line, diagnostics,
metrics and span (plain data, no I/O, no clock: every time is passed in by the caller).

The operation's rules (:class:`vllm_nnrp_plugin.core.operation.Operation`), the NNRP binding and the adapter fill
one :class:`Observation` as the operation lives:

| step | who calls | fields |
|---|---|---|
| submit received | connection | ids, ``transport``, ``submitted_ns``, ``submitted_unix_ns`` |
| envelope decoded | adapter | ``operation``, ``model``, ``request_id``, ``diagnostics_requested``, ``started_ns`` |
| dispatched to vLLM | operation rules | ``trace``: the TRACE_CONTEXT it runs in (fixed fields + attribute byte count, never the body) |
| first backend chunk, backend done | adapter | ``backend_first_chunk_ns``, ``backend_done_ns`` |
| usage seen | adapter | ``input_tokens``, ``output_tokens`` |
| partial result sent | operation rules, told by the connection | ``events``, ``first_event_ns``, ``last_event_ns`` |
| terminal decided | operation rules | ``outcome``, ``error_*``; ``cancel_*`` when told to stop |
| terminal sealed for sending | operation rules, asked by the connection | ``terminal_ns`` |
| backend abort | adapter | ``abort_ns``, ``abort_accepted`` |
| backend call ended | adapter, from the runtime controls | ``priority_class``, ``vllm_priority``, ``late_priority_updates``, ``token_budget``, ``budget_ended``, ``cached_tokens`` |

Times ending in ``_ns`` are ``time.monotonic_ns()`` (a clock shared by every process of the host, so
benchmarks compare them across processes) except ``submitted_unix_ns`` (``time.time_ns()``, for spans).
Durations are derived in ms (``*_ms``). No prompt or output text is ever stored.

:func:`diagnostics` derives the opt-in ``diagnostics`` object (``nnrp.diagnostics: true``) and
:func:`log_fields` the log line from the same record.
"""

from __future__ import annotations

from typing import Any

import attrs

from vllm_nnrp_plugin.core.controls import PRIORITY_CLASSES, RuntimeControls
from vllm_nnrp_plugin.observability.log_safety import loggable, quote_field
from vllm_nnrp_plugin.profile.trace import TraceContext

COMPLETED = "completed"
ERROR = "error"
CANCELLED = "cancelled"

#: cancellation sources: the client cancelled or aborted; its session or connection ended; the server stopped;
#: the operation's deadline (``nnrp.timeout_ms`` or NNRP DEADLINE) passed
CLIENT = "client"
TRANSPORT = "transport"
SERVER = "server"
DEADLINE = "deadline"

DIAGNOSTICS_SCHEMA = "vllm.diagnostics/1"


def _ms(start: int | None, end: int | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) / 1e6, 3)


@attrs.define(slots=True)
class Observation:
    """What one operation did (see the module table for who fills which field)."""

    # identity: the listener's accept counter (nnrp-py's server exposes no NNRP connection id), the header's
    # session id, the client's operation id and frame id, ``tcp`` / ``ipc``
    connection_id: int
    session_id: int
    operation_id: int
    frame_id: int
    transport: str
    submitted_ns: int
    submitted_unix_ns: int
    trace: TraceContext | None = None
    # the request
    operation: str | None = None
    model: str | None = None
    request_id: str | None = None  # vLLM's engine request id, ``chatcmpl-nnrp-…``
    diagnostics_requested: bool = False
    # timing (monotonic ns)
    started_ns: int | None = None
    backend_first_chunk_ns: int | None = None
    backend_done_ns: int | None = None
    first_event_ns: int | None = None
    last_event_ns: int | None = None
    terminal_ns: int | None = None
    # output
    events: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    # the end
    outcome: str | None = None
    error_code: str | None = None
    error_family: str | None = None  # the OpenAI error type: invalid_request_error / server_error
    error_status: int | None = None
    cancel_source: str | None = None
    cancel_reason: str | None = None
    cancel_ns: int | None = None
    abort_ns: int | None = None
    abort_accepted: bool | None = None  # None: no abort was needed (the backend request finished)
    # runtime controls (vllm_nnrp_plugin.core.controls)
    priority_class: str | None = None  # the NNRP priority class it ran in
    vllm_priority: int | None = None  # the priority vLLM scheduled it with (None: no priority scheduling)
    late_priority_updates: int = 0  # PRIORITY_UPDATEs after dispatch, which vLLM cannot apply
    token_budget: int | None = None  # tokens, from BUDGET_UPDATE
    budget_ended: bool = False  # the stream was ended at the token budget
    cached_tokens: int | None = None  # prompt tokens served from vLLM's prefix cache

    # -- recording (each method is one step of the module table) -----------------------------------------

    def started(
        self, now_ns: int, *, operation: str, model: str | None, request_id: str | None, diagnostics: bool
    ) -> None:
        self.started_ns = now_ns
        self.operation = operation
        self.model = model
        self.request_id = request_id
        self.diagnostics_requested = diagnostics

    def backend_chunk(self, now_ns: int) -> None:
        if self.backend_first_chunk_ns is None:
            self.backend_first_chunk_ns = now_ns

    def backend_done(self, now_ns: int) -> None:
        self.backend_done_ns = now_ns

    def usage(self, input_tokens: int | None, output_tokens: int | None) -> None:
        self.input_tokens, self.output_tokens = input_tokens, output_tokens

    def event_sent(self, now_ns: int) -> None:
        self.events += 1
        if self.first_event_ns is None:
            self.first_event_ns = now_ns
        self.last_event_ns = now_ns

    def completed(self) -> None:
        """A ``response.completed`` was decided."""
        self.outcome = COMPLETED

    def failed(self, *, code: str, family: str, status: int) -> None:
        """A ``response.error`` was decided (``family``: the OpenAI error type; ``status``: HTTP-like)."""
        self.outcome = ERROR
        self.error_code, self.error_family, self.error_status = code, family, status

    def cancelled(self, now_ns: int, *, source: str, reason: str) -> None:
        """The operation was told to stop (``source`` :data:`CLIENT`, :data:`TRANSPORT`, :data:`SERVER` or
        :data:`DEADLINE`); the first call wins."""
        if self.cancel_source is None:
            self.cancel_source, self.cancel_reason, self.cancel_ns = source, reason, now_ns

    def terminal_sent(self, now_ns: int, *, dropped: bool) -> None:
        """The terminal went out (or, for a lost transport, could not): a drop makes the outcome
        ``cancelled`` whatever had been decided before."""
        self.terminal_ns = now_ns
        if dropped:
            self.outcome = CANCELLED
            self.error_code = self.error_family = self.error_status = None

    def aborted(self, now_ns: int, *, accepted: bool) -> None:
        self.abort_ns, self.abort_accepted = now_ns, accepted

    def steered(self, controls: RuntimeControls) -> None:
        """What the operation's runtime controls were when its backend call ended."""
        self.priority_class = PRIORITY_CLASSES[controls.priority_class]
        self.vllm_priority, self.late_priority_updates = controls.vllm_priority, controls.late_priority_updates
        self.token_budget, self.budget_ended = controls.token_budget, controls.budget_ended
        self.cached_tokens = controls.cached_tokens

    # -- derived ------------------------------------------------------------------------------------------

    @property
    def queue_delay_ms(self) -> float | None:
        """Submit received -> backend called (ms): time spent between the wire core and the adapter on the event
        loop."""
        return _ms(self.submitted_ns, self.started_ns)

    @property
    def first_event_ms(self) -> float | None:
        """Submit received -> first partial result sent (ms)."""
        return _ms(self.submitted_ns, self.first_event_ns)

    @property
    def backend_first_chunk_ms(self) -> float | None:
        """Backend called -> first chunk from vLLM (ms): vLLM's queueing + prefill."""
        return _ms(self.started_ns, self.backend_first_chunk_ns)

    @property
    def backend_ms(self) -> float | None:
        """Backend called -> its answer or stream ended (ms)."""
        return _ms(self.started_ns, self.backend_done_ns)

    @property
    def total_ms(self) -> float | None:
        """Submit received -> terminal sent (ms)."""
        return _ms(self.submitted_ns, self.terminal_ns)

    @property
    def cancel_to_abort_ms(self) -> float | None:
        """Told to stop (:meth:`cancelled`) -> backend abort issued (:meth:`aborted`), ms."""
        return _ms(self.cancel_ns, self.abort_ns)


def diagnostics(obs: Observation) -> dict[str, Any]:
    """The ``diagnostics`` object a terminal event carries when the envelope asked for it
    (``nnrp: {"diagnostics": true}``). Shape (absent values are ``null``; durations in ms)::

        {"schema": "vllm.diagnostics/1", "session_id", "operation_id", "frame_id", "transport",
         "request_id", "model", "queue_delay_ms", "backend_first_chunk_ms", "first_event_ms", "total_ms",
         "events", "usage": {"input_tokens", "output_tokens"} | null,
         "cancel": {"source", "reason"} | null,
         "priority": {"class", "vllm_priority", "late_updates"} | null, "token_budget", "cached_tokens",
         "trace": {"trace_id", "span_id", "parent_span_id", "stage_code", "flags", "attribute_bytes", "scope",
                   "traceparent"} | null}

    ``events`` counts partial results sent before the terminal. Clients ignore fields they do not know.
    """
    return {
        "schema": DIAGNOSTICS_SCHEMA,
        "session_id": obs.session_id,
        "operation_id": obs.operation_id,
        "frame_id": obs.frame_id,
        "transport": obs.transport,
        "request_id": obs.request_id,
        "model": obs.model,
        "queue_delay_ms": obs.queue_delay_ms,
        "backend_first_chunk_ms": obs.backend_first_chunk_ms,
        "first_event_ms": obs.first_event_ms,
        "total_ms": obs.total_ms,
        "events": obs.events,
        "usage": None
        if obs.input_tokens is None
        else {"input_tokens": obs.input_tokens, "output_tokens": obs.output_tokens},
        "cancel": None if obs.cancel_source is None else {"source": obs.cancel_source, "reason": obs.cancel_reason},
        "priority": None
        if obs.priority_class is None
        else {
            "class": obs.priority_class,
            "vllm_priority": obs.vllm_priority,
            "late_updates": obs.late_priority_updates,
        },
        "token_budget": obs.token_budget,
        "cached_tokens": obs.cached_tokens,
        "trace": None if obs.trace is None else obs.trace.observation(),
    }


_LOG_FIELDS = (
    "operation",
    "model",
    "transport",
    "connection_id",
    "session_id",
    "operation_id",
    "frame_id",
    "request_id",
    "outcome",
    "error_code",
    "error_family",
    "cancel_source",
    "cancel_reason",
    "abort_accepted",
    "events",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "priority_class",
    "vllm_priority",
    "token_budget",
)
_LOG_DURATIONS = (
    "queue_delay_ms",
    "backend_first_chunk_ms",
    "first_event_ms",
    "backend_ms",
    "total_ms",
    "cancel_to_abort_ms",
)


def log_fields(obs: Observation) -> dict[str, Any]:
    """The fields of the operation's log line (no prompt or output text), in a fixed order; ``None``
    values are left out. Every string (``model`` and ``request_id`` come from the client) is made safe for a
    log line by :func:`vllm_nnrp_plugin.observability.log_safety.loggable` (escaped, at most ``MAX_LOG_CHARS``
    characters and a length marker); numbers and booleans stay as they are."""
    fields = {name: getattr(obs, name) for name in _LOG_FIELDS + _LOG_DURATIONS}
    if obs.trace is not None:
        fields["traceparent"] = obs.trace.traceparent()
        fields["trace_attribute_bytes"] = obs.trace.body_bytes
    return {k: loggable(v) if type(v) is str else v for k, v in fields.items() if v is not None}


def log_line(obs: Observation) -> str:
    """``nnrp operation key=value …`` from :func:`log_fields`: one line whatever the client sent (a string value
    with a space, ``=`` or ``"`` is double-quoted: :func:`vllm_nnrp_plugin.observability.log_safety.quote_field`)."""
    return "nnrp operation " + " ".join(
        f"{k}={quote_field(v) if type(v) is str else v}" for k, v in log_fields(obs).items()
    )

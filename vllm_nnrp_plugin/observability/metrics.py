"""Prometheus metrics derived from observation records, registered into an existing registry.

By default that is ``prometheus_client.REGISTRY``, the registry vLLM 0.26's own ``/metrics`` serves
(``vllm.v1.metrics.prometheus.get_prometheus_registry``): operators see the NNRP series where they already
scrape, with no new port. When ``PROMETHEUS_MULTIPROC_DIR`` is set (vLLM with several API-server processes),
prometheus-client writes every process's values to that directory and vLLM's ``/metrics`` aggregates them
through its ``MultiProcessCollector``; the gauge below sums live processes there. A separate ``/metrics``
HTTP server is started only when ``nnrp.metrics_listen`` is configured (:func:`serve_metrics`).

| series | type | labels | unit |
|---|---|---|---|
| ``nnrp_operations_total`` | counter | ``operation``, ``outcome``, ``transport`` | operations |
| ``nnrp_errors_total`` | counter | ``code``, ``family`` | operations ending with ``response.error`` |
| ``nnrp_cancellations_total`` | counter | ``source``, ``reason`` | operations told to stop |
| ``nnrp_backend_aborts_total`` | counter | ``accepted`` (``true``/``false``) | vLLM aborts issued |
| ``nnrp_output_events_total`` | counter | ``transport`` | partial results sent |
| ``nnrp_tokens_total`` | counter | ``kind`` (``input``/``output``; ``cached``: input tokens from vLLM's prefix cache) | tokens (from usage, when streamed) |
| ``nnrp_queue_delay_seconds`` | histogram | | submit received -> backend called |
| ``nnrp_first_event_latency_seconds`` | histogram | ``transport`` | submit received -> first partial sent |
| ``nnrp_operation_duration_seconds`` | histogram | ``operation``, ``outcome`` | submit received -> terminal sent |
| ``nnrp_sessions_active`` | gauge | ``transport`` | open NNRP sessions |
| ``nnrp_sessions_total`` | counter | ``transport`` | sessions accepted |
| ``nnrp_auth_refusals_total`` | counter | ``transport``, ``reason`` (``missing_key``/``wrong_key``) | session opens refused ``auth_failed`` |
| ``nnrp_handshake_timeouts_total`` | counter | ``transport`` | connections closed with no session opened in time |
| ``nnrp_connections_refused_total`` | counter | ``transport``, ``reason`` (``max_connections``/``no_descriptor``) | connections refused at accept (``no_descriptor``: accept pauses) |
"""

from __future__ import annotations

import os
import threading
from wsgiref.simple_server import WSGIServer

import attrs
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.observability.observation import Observation

# seconds; from sub-millisecond adapter work up to long generations
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class NNRPMetrics:
    """The collectors of one registry; get them with :func:`metrics_for` (registering twice would fail)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.operations = Counter(
            "nnrp_operations",
            "NNRP operations by terminal outcome (completed, error, cancelled).",
            ("operation", "outcome", "transport"),
            registry=registry,
        )
        self.errors = Counter(
            "nnrp_errors",
            "NNRP operations that ended with response.error, by error code and family.",
            ("code", "family"),
            registry=registry,
        )
        self.cancellations = Counter(
            "nnrp_cancellations",
            "NNRP operations told to stop, by source (client, transport, server) and reason.",
            ("source", "reason"),
            registry=registry,
        )
        self.aborts = Counter(
            "nnrp_backend_aborts",
            "vLLM request aborts issued for unfinished NNRP operations, by whether vLLM accepted them.",
            ("accepted",),
            registry=registry,
        )
        self.events = Counter(
            "nnrp_output_events",
            "Partial results (profile events) sent to NNRP clients.",
            ("transport",),
            registry=registry,
        )
        self.tokens = Counter(
            "nnrp_tokens", "Tokens of NNRP operations, from the usage vLLM reported.", ("kind",), registry=registry
        )
        self.queue_delay = Histogram(
            "nnrp_queue_delay_seconds",
            "NNRP submit received -> vLLM called.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.first_event = Histogram(
            "nnrp_first_event_latency_seconds",
            "NNRP submit received -> first partial result sent.",
            ("transport",),
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.duration = Histogram(
            "nnrp_operation_duration_seconds",
            "NNRP submit received -> terminal sent.",
            ("operation", "outcome"),
            registry=registry,
            buckets=_DURATION_BUCKETS,
        )
        self.sessions_active = Gauge(
            "nnrp_sessions_active",
            "Open NNRP sessions.",
            ("transport",),
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.sessions = Counter("nnrp_sessions", "NNRP sessions accepted.", ("transport",), registry=registry)
        self.auth_refusals = Counter(
            "nnrp_auth_refusals",
            "NNRP session opens refused with auth_failed (no key, or a key vLLM does not hold).",
            ("transport", "reason"),
            registry=registry,
        )
        self.connections_refused = Counter(
            "nnrp_connections_refused",
            "NNRP connections refused at accept (over nnrp.max_connections, or the process out of file descriptors).",
            ("transport", "reason"),
            registry=registry,
        )
        self.handshake_timeouts = Counter(
            "nnrp_handshake_timeouts",
            "NNRP connections closed because no session opened within nnrp.handshake_timeout_ms.",
            ("transport",),
            registry=registry,
        )
        self.connections_ended = Counter(
            "nnrp_connections_ended",
            "NNRP connections the server ended for breaking a bound (credit_violations: "
            "kept submitting beyond the granted credit).",
            ("transport", "reason"),
            registry=registry,
        )

    def observe(self, record: Observation) -> None:
        """Count one finished operation."""
        operation = record.operation or "none"  # the envelope was refused before naming a known operation
        outcome = record.outcome or "none"
        self.operations.labels(operation, outcome, record.transport).inc()
        if record.error_code is not None:
            self.errors.labels(record.error_code, record.error_family).inc()
        if record.cancel_source is not None:
            self.cancellations.labels(record.cancel_source, record.cancel_reason).inc()
        if record.abort_accepted is not None:
            self.aborts.labels("true" if record.abort_accepted else "false").inc()
        if record.events:
            self.events.labels(record.transport).inc(record.events)
        if record.input_tokens is not None:
            self.tokens.labels("input").inc(record.input_tokens)
        if record.output_tokens is not None:
            self.tokens.labels("output").inc(record.output_tokens)
        if record.cached_tokens:
            self.tokens.labels("cached").inc(record.cached_tokens)
        if record.queue_delay_ms is not None:
            self.queue_delay.observe(record.queue_delay_ms / 1000)
        if record.first_event_ms is not None:
            self.first_event.labels(record.transport).observe(record.first_event_ms / 1000)
        if record.total_ms is not None:
            self.duration.labels(operation, outcome).observe(record.total_ms / 1000)

    def session(self, transport: str, opened: bool) -> None:
        """A session started (``opened``) or ended."""
        if opened:
            self.sessions.labels(transport).inc()
            self.sessions_active.labels(transport).inc()
        else:
            self.sessions_active.labels(transport).dec()


_by_registry: dict[int, tuple[CollectorRegistry, NNRPMetrics]] = {}
_lock = threading.Lock()


def metrics_for(registry: CollectorRegistry | None = None) -> NNRPMetrics:
    """The NNRP collectors registered in ``registry`` (default ``prometheus_client.REGISTRY``), created on
    first use; every later call (another service in the same process) shares them."""
    registry = prometheus_client.REGISTRY if registry is None else registry
    with _lock:
        entry = _by_registry.get(id(registry))
        if entry is None or entry[0] is not registry:
            entry = _by_registry[id(registry)] = (registry, NNRPMetrics(registry))
        return entry[1]


@attrs.frozen
class MetricsServer:
    """A standalone ``/metrics`` HTTP server (prometheus-client's); :meth:`close` stops it."""

    server: WSGIServer
    thread: threading.Thread
    address: str  # ``HOST:PORT`` actually bound

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class MetricsListenError(NNRPStartupError):
    """``nnrp.metrics_listen`` cannot be bound; the message names the address and the fix."""


def serve_metrics(listen: str, registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve ``registry`` over HTTP on ``listen`` (``HOST:PORT``; port 0 picks a free one). Without one: what
    vLLM's ``/metrics`` serves — every process's values aggregated when ``PROMETHEUS_MULTIPROC_DIR`` is set,
    else ``prometheus_client.REGISTRY``. Raises :class:`MetricsListenError` when the address cannot be bound."""
    if registry is None:
        registry = prometheus_client.REGISTRY
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
    host, _, port = listen.rpartition(":")
    try:
        server, thread = prometheus_client.start_http_server(
            int(port), addr=host.strip("[]") or "127.0.0.1", registry=registry
        )
    except OSError as exc:
        raise MetricsListenError(
            f"vllm-nnrp-plugin: cannot serve NNRP metrics on {listen} (nnrp.metrics_listen): {exc}. Fix: choose a "
            "free HOST:PORT, or drop nnrp.metrics_listen (the series are in vLLM's own /metrics too)."
        ) from exc
    bound_host, bound_port = server.server_address[:2]
    return MetricsServer(server, thread, f"{bound_host}:{bound_port}")  # type: ignore[str-bytes-safe]  # TCP: a str

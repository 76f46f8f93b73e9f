"""Observation records, diagnostics, metrics and spans over the real NNRP path (nnrp-py native server and
client on loopback TCP and IPC), with the backend replaying streams recorded from vLLM 0.26.0."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from nnrp.runtime import TraceContextMetadata
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT, envelope
from tests.test_loopback import Served, wait_until
from vllm_nnrp_plugin.client import ProfileClient

STREAM = {
    "model": "b-stream-text-usage",
    "messages": [{"role": "user", "content": "SECRET PROMPT"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}  # as the recorded request
SLOW = {"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.05}


class Observed(Served):
    """A served NNRPService with its own registry, a standalone /metrics server and a record list."""

    def __init__(self, tmp_path, tracer=None) -> None:
        self.records = []
        self.registry = CollectorRegistry()
        super().__init__(
            tmp_path,
            metrics_listen="127.0.0.1:0",
            registry=self.registry,
            tracer=tracer,
            observers=(self.records.append,),
        )

    def record_of(self, op, transport, mark):
        """The record of ``op``, among those finished after ``mark`` (``len(records)`` before the submit):
        operation ids restart in every client."""
        assert wait_until(lambda: self.find(op, transport, mark) is not None), self.records
        return self.find(op, transport, mark)

    def find(self, op, transport, mark):
        return next(
            (r for r in self.records[mark:] if r.operation_id == op.operation_id and r.transport == transport), None
        )

    def scrape(self) -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(f"http://{self.service.metrics_address}/metrics", timeout=5) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    server = Observed(tmp_path_factory.mktemp("obs"))
    yield server
    server.stop()


@pytest.fixture(params=["tcp", "ipc"])
def transport(request):
    return request.param


@pytest.fixture
def client(observed, transport):
    client = asyncio.run(ProfileClient.connect(getattr(observed, transport)))
    yield client
    client.close()


def run(server, client, transport, env):
    """Submit ``env``, read every event; returns the operation, its events and its observation record."""
    mark = len(server.records)
    op = client.submit(env)
    events = list(client.events(op, timeout_s=10))
    return op, events, server.record_of(op, transport, mark)


def test_a_streamed_operation_is_one_complete_record(observed, client, transport):
    op, events, record = run(observed, client, transport, envelope(STREAM, request_id="obs-1"))
    assert record.operation == "chat.completions.create" and record.model == "b-stream-text-usage"
    assert record.frame_id == op.frame_id and record.transport == transport and record.session_id
    assert record.request_id.startswith("chatcmpl-nnrp-obs-1-")
    assert record.outcome == "completed" and record.events == len(events) - 1 >= 2
    assert (record.input_tokens, record.output_tokens) == (33, 16)
    assert record.abort_accepted is None and record.cancel_source is None and record.error_code is None
    assert 0 <= record.queue_delay_ms <= record.first_event_ms <= record.total_ms
    assert record.started_ns <= record.backend_first_chunk_ns <= record.backend_done_ns <= record.terminal_ns


def test_diagnostics_come_only_when_asked_and_come_from_the_record(observed, client, transport):
    _, plain, _ = run(observed, client, transport, envelope(STREAM))
    assert "diagnostics" not in plain[-1].event
    op, events, record = run(observed, client, transport, envelope(STREAM, nnrp={"diagnostics": True}))
    diagnostics = events[-1].event["diagnostics"]
    assert events[-1].event["type"] == "response.completed"
    assert diagnostics["schema"] == "vllm.diagnostics/1"
    assert diagnostics["events"] == len(events) - 1 == record.events
    assert diagnostics["operation_id"] == op.operation_id and diagnostics["transport"] == transport
    assert diagnostics["request_id"] == record.request_id
    assert diagnostics["usage"] == {"input_tokens": 33, "output_tokens": 16}
    assert diagnostics["first_event_ms"] == record.first_event_ms and diagnostics["cancel"] is None


def test_a_cancelled_operation_records_source_reason_and_the_accepted_abort(observed, client, transport):
    mark = len(observed.records)
    op = client.submit(envelope(SLOW, nnrp={"diagnostics": True}))
    stream = client.events(op, timeout_s=10)
    assert next(stream).frame == "partial_result"
    client.cancel(op)
    terminal = list(stream)[-1]
    assert terminal.frame == "result_drop"
    assert terminal.event["type"] == "response.cancelled"
    assert terminal.event["diagnostics"]["cancel"] == {"source": "client", "reason": "client_cancelled"}
    record = observed.record_of(op, transport, mark)
    assert record.outcome == "cancelled" and record.cancel_source == "client"
    assert record.cancel_reason == "client_cancelled" and record.abort_accepted is True
    assert record.cancel_ns <= record.terminal_ns and record.cancel_ns <= record.abort_ns
    assert record.last_event_ns is None or record.last_event_ns <= record.terminal_ns


def test_errors_record_code_and_family(observed, client, transport):
    _, _, record = run(observed, client, transport, envelope({"model": "raise", "messages": []}))
    assert (record.outcome, record.error_code, record.error_family, record.error_status) == (
        "error",
        "backend_error",
        "server_error",
        500,
    )
    assert record.abort_accepted is True  # the backend request never finished
    _, _, record = run(observed, client, transport, b"{not json")
    assert record.operation is None and record.error_code == "invalid_json"


def test_metrics_count_operations_sessions_and_latencies(observed, transport):
    def value(name, **labels):
        return observed.scrape().get((name, tuple(sorted(labels.items()))), 0.0)

    before = value(
        "nnrp_operations_total", operation="chat.completions.create", outcome="completed", transport=transport
    )
    events_before = value("nnrp_output_events_total", transport=transport)
    client = asyncio.run(ProfileClient.connect(getattr(observed, transport)))
    try:
        assert wait_until(lambda: value("nnrp_sessions_active", transport=transport) >= 1)
        _, events, _ = run(observed, client, transport, envelope(STREAM))
        assert (
            value(
                "nnrp_operations_total", operation="chat.completions.create", outcome="completed", transport=transport
            )
            == before + 1
        )
        assert value("nnrp_output_events_total", transport=transport) == events_before + len(events) - 1
        assert value("nnrp_first_event_latency_seconds_count", transport=transport) >= 1
        assert value("nnrp_tokens_total", kind="output") >= 16
    finally:
        client.close()
    samples = observed.scrape()
    assert (
        "nnrp_operation_duration_seconds_bucket",
        (("le", "+Inf"), ("operation", "chat.completions.create"), ("outcome", "completed")),
    ) in samples


def test_the_log_line_has_ids_and_outcome_but_no_text(observed, client, transport, caplog):
    with caplog.at_level(logging.DEBUG, logger="vllm_nnrp_plugin.service"):
        op, events, _ = run(observed, client, transport, envelope(STREAM))
        assert wait_until(lambda: any("nnrp operation" in r.getMessage() for r in caplog.records))
    (line,) = [
        r
        for r in caplog.records
        if f"operation_id={op.operation_id} " in r.getMessage() and r.nnrp["transport"] == transport
    ]
    message = line.getMessage()
    assert (
        "outcome=completed" in message
        and f"transport={transport}" in message
        and f"events={len(events) - 1}" in message
    )
    assert "SECRET" not in message and "Hello" not in message
    assert line.levelno == logging.DEBUG and line.nnrp["output_tokens"] == 16


@pytest.fixture(scope="module")
def spans():
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed (pip install .[test])")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_one_span_per_operation_linked_to_the_nnrp_trace_context(tmp_path, spans):
    tracer, exporter = spans
    server = Observed(tmp_path, tracer=tracer)
    client = asyncio.run(ProfileClient.connect(server.ipc))
    try:
        op, _, _ = run(server, client, "ipc", envelope(STREAM))  # no trace context: a root span
        client.session.send_trace_context(TraceContextMetadata(91, 92, 90, 5, 3, 4), b"abcd")  # session scope
        _, _, record = run(server, client, "ipc", envelope(STREAM))
        assert wait_until(lambda: len(exporter.get_finished_spans()) >= 2)
    finally:
        client.close()
        server.stop()
    root, child = exporter.get_finished_spans()[-2:]
    assert root.parent is None and root.attributes["nnrp.operation_id"] == op.operation_id
    assert child.name == "nnrp chat.completions.create"
    assert child.parent.trace_id == 91 and child.parent.span_id == 92 and child.parent.is_remote
    assert child.context.trace_id == 91 and child.context.trace_flags.sampled
    assert child.attributes["nnrp.trace.attribute_bytes"] == 4 and record.trace.body_bytes == 4
    assert child.attributes["gen_ai.usage.output_tokens"] == 16 and child.attributes["nnrp.outcome"] == "completed"
    assert child.end_time - child.start_time == record.terminal_ns - record.submitted_ns


MULTIPROCESS = textwrap.dedent(
    """
    import os, sys
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from vllm_nnrp_plugin.observability.metrics import NNRPMetrics
    from vllm_nnrp_plugin.observability.observation import Observation
    metrics = NNRPMetrics(CollectorRegistry())   # what each API-server process does
    record = Observation(connection_id=1, session_id=1, operation_id=1, frame_id=1, transport="tcp",
                         submitted_ns=0, submitted_unix_ns=0, operation="chat.completions.create")
    record.completed(); record.terminal_sent(2_000_000, dropped=False)
    metrics.observe(record)
    metrics.session("tcp", True)
    served = CollectorRegistry()                  # what vLLM's /metrics serves with PROMETHEUS_MULTIPROC_DIR
    multiprocess.MultiProcessCollector(served)
    sys.stdout.write(generate_latest(served).decode())
    import urllib.request
    from vllm_nnrp_plugin.observability.metrics import serve_metrics
    standalone = serve_metrics("127.0.0.1:0")     # nnrp.metrics_listen serves the same aggregated view
    with urllib.request.urlopen(f"http://{standalone.address}/metrics", timeout=5) as response:
        sys.stdout.write("STANDALONE\\n" + response.read().decode())
    standalone.close()
    """
)


def test_metrics_reach_a_multiprocess_registry(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", MULTIPROCESS], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (
        'nnrp_operations_total{operation="chat.completions.create",outcome="completed",transport="tcp"} 1.0'
        in done.stdout
    )
    assert 'nnrp_sessions_active{transport="tcp"} 1.0' in done.stdout
    assert "nnrp_operation_duration_seconds_count" in done.stdout
    standalone = done.stdout.split("STANDALONE\n", 1)[1]
    assert (
        'nnrp_operations_total{operation="chat.completions.create",outcome="completed",transport="tcp"} 1.0'
        in standalone
    )

"""Observability inside a real ``vllm serve`` 0.26 (CPU): the NNRP series in vLLM's own ``/metrics`` and
diagnostics built from real vLLM timing and usage."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.conftest import SERVED_NAME
from tests.support import envelope
from vllm_nnrp_plugin.client import ProfileClient

pytestmark = pytest.mark.vllm

HELLO = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def eventually(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_nnrp_metrics_are_served_by_vllms_own_metrics_endpoint(vllm_server, transport):
    operations = vllm_server.metric("nnrp_operations_total")
    events = vllm_server.metric("nnrp_output_events_total")
    latencies = vllm_server.metric("nnrp_first_event_latency_seconds_count")
    client = asyncio.run(ProfileClient.connect(vllm_server.nnrp[transport]))
    try:
        assert eventually(lambda: vllm_server.metric("nnrp_sessions_active") >= 1)
        sent = list(client.events(client.submit(envelope(HELLO)), timeout_s=120))
        assert sent[-1].event["type"] == "response.completed"
        assert eventually(lambda: vllm_server.metric("nnrp_operations_total") == operations + 1)
        assert vllm_server.metric("nnrp_output_events_total") == events + len(sent) - 1
        assert vllm_server.metric("nnrp_first_event_latency_seconds_count") == latencies + 1
    finally:
        client.close()


def test_diagnostics_carry_vllms_timing_and_usage(vllm_server):
    client = asyncio.run(ProfileClient.connect(vllm_server.nnrp["ipc"]))
    try:
        events = list(client.events(client.submit(envelope(HELLO, nnrp={"diagnostics": True})), timeout_s=120))
    finally:
        client.close()
    terminal = events[-1].event
    diagnostics = terminal["diagnostics"]
    usage = terminal["body"]["usage"]
    assert diagnostics["usage"] == {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
    assert diagnostics["request_id"] == terminal["body"]["id"]  # vLLM's own request id
    assert diagnostics["events"] == len(events) - 1 and diagnostics["model"] == SERVED_NAME
    assert 0 < diagnostics["backend_first_chunk_ms"] <= diagnostics["first_event_ms"] <= diagnostics["total_ms"]

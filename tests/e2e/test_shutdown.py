"""Graceful shutdown of a real ``vllm serve`` (CPU) with NNRP streams in flight: SIGTERM → the listener stops
accepting first, every in-flight operation gets exactly one terminal, its vLLM request is aborted before vLLM
stops its engine, and the server exits in time without traceback noise.

One API-server process here; with ``--api-server-count`` > 1 every process runs the same per-process stop
(vllm_binding/shutdown.py), to be tested once several API-server processes serve NNRP.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest

from tests.e2e.conftest import SERVED_NAME, VLLMServer
from tests.support import envelope, free_port
from vllm_nnrp_plugin.client import ProfileClient

pytestmark = pytest.mark.vllm

LONG = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Write a long story about the sea."}],
    "max_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
}
EXIT_WITHIN_S = 60
TRANSPORT_CLOSED = 8


def test_sigterm_ends_every_in_flight_operation_once_and_aborts_its_vllm_request(tmp_path):
    listen = {"tcp": f"tcp://127.0.0.1:{free_port()}", "ipc": f"unix://{tmp_path}/nnrp.sock"}
    server = VLLMServer(
        tmp_path,
        env={"VLLM_PLUGINS": "nnrp", "VLLM_NNRP_LISTEN": ",".join(listen.values())},
        extra_args=("--enable-log-requests",),  # vLLM then logs "Aborted request(s) <id>"
    )
    clients = []
    try:
        server.wait_ready()
        clients = [asyncio.run(ProfileClient.connect(uri)) for uri in listen.values()]
        ops = [
            (client, client.submit(envelope(LONG, request_id=f"shutdown-{c}-{n}")), f"shutdown-{c}-{n}")
            for c, client in enumerate(clients)
            for n in range(2)
        ]
        streams = [client.events(op, timeout_s=120) for client, op, _rid in ops]
        for stream in streams:
            assert next(stream).event["type"] == "response.output_text.delta"
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for stream in streams:
            rest = list(stream)  # raises ClientTimeout if no terminal arrives
            terminals = [e for e in rest if e.terminal]
            assert len(terminals) == 1 and rest[-1] is terminals[0]
            terminal = terminals[0]
            assert (terminal.frame == "result_push" and terminal.event["error"]["code"] == "server_shutdown") or (
                terminal.frame == "result_drop" and terminal.drop_reason == TRANSPORT_CLOSED
            ), terminal
        server.wait_exit(EXIT_WITHIN_S)
        assert time.monotonic() - signalled < EXIT_WITHIN_S
    finally:
        for client in clients:
            client.close()
        server.stop()
    log = server.output()
    stopping = log.index("NNRP stopping: no new sessions; ending 4 in-flight operations")
    engine_stop = log.index("[shutdown] MPClient: start")  # logged inside engine_client.shutdown
    assert stopping < engine_stop
    for _client, _op, request_id in ops:
        aborted = re.search(rf"Aborted request\(s\) chatcmpl-nnrp-{request_id}-", log)
        assert aborted and aborted.start() < engine_stop, f"{request_id} not aborted before the engine stopped"
    assert "NNRP listener stopped" in log
    assert "Traceback" not in log, log[-4000:]

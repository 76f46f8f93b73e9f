"""Graceful shutdown of a real ``vllm serve`` (CPU) with NNRP streams in flight: SIGTERM → the listener stops
accepting first, every in-flight operation gets exactly one terminal, its vLLM request is aborted before vLLM
stops its engine, and the server exits in time without traceback noise. With one API-server process (streams on
every carrier: TCP, unix socket, WebSocket plain and TLS, QUIC) and with two (``--api-server-count 2``: each
process runs its own stop, vllm_binding/shutdown.py), through the anchor's attach path.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import orjson
import pytest

from tests.e2e.conftest import HAS_QUIC, LONG, VLLMServer, attach_options, model_dir
from tests.support import envelope, free_port, self_signed, two_free_ports
from vllm_nnrp_plugin.client import ProfileClient

pytestmark = pytest.mark.vllm

EXIT_WITHIN_S = 60
TRANSPORT_CLOSED = 8


@pytest.mark.parametrize("api_servers", [pytest.param(1, marks=pytest.mark.binding_core), 2])
def test_sigterm_ends_every_in_flight_operation_once_and_aborts_its_vllm_request(tmp_path, vllm_version, api_servers):
    port = two_free_ports()
    env, args = attach_options(vllm_version[1])
    # rank r serves on PORT + r and nnrp-r.sock (rank 0: nnrp.sock)
    addresses = [f"tcp://127.0.0.1:{port}", f"unix://{tmp_path}/nnrp.sock"]
    if api_servers == 2:
        addresses += [f"tcp://127.0.0.1:{port + 1}", f"unix://{tmp_path}/nnrp-1.sock"]
    else:  # every carrier stops the same way
        addresses += [f"ws://127.0.0.1:{free_port()}/nnrp", f"wss://127.0.0.1:{free_port()}/nnrp"]
        addresses += [f"quic://127.0.0.1:{free_port()}"] if HAS_QUIC else []
    cert, key, der = self_signed(tmp_path)
    config = orjson.dumps({"nnrp": {"tls_cert_file": cert, "tls_key_file": key}}).decode()
    server = VLLMServer(
        model_dir(),
        tmp_path,
        env={**env, "VLLM_NNRP_LISTEN": ",".join(addresses[:2] if api_servers == 2 else addresses)},
        # --enable-log-requests: vLLM then logs "Aborted request(s) <id>"
        # with several API servers vLLM's process manager kills them after --shutdown-timeout (default 0 s)
        extra_args=(
            *args,
            "--enable-log-requests",
            "--api-server-count",
            str(api_servers),
            "--shutdown-timeout",
            "10",
            "--additional-config",
            config,
        ),
    )
    clients = []
    try:
        server.wait_ready()
        deadline = time.monotonic() + 120  # HTTP answers as soon as one rank is up
        while server.output().count("NNRP listening on") < api_servers:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.tail()
            time.sleep(0.5)
        clients = [asyncio.run(ProfileClient.connect(uri, trusted_cert_der=der)) for uri in addresses]
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
    per_process = len(ops) // api_servers
    stopping = [m.start() for m in re.finditer(f"NNRP stopping: no new sessions; ending {per_process} in-flight", log)]
    assert len(stopping) == api_servers, log[-4000:]

    # 0.26 logs inside engine_client.shutdown; older lines log nothing there, and their abort lines can only
    # come from a live engine client. Each API-server process stops its own engine client: compare each abort
    # with the engine stop of the process that logged it (its "(ApiServer_N pid=P)" line prefix)
    def engine_stop(at: int) -> int:
        """Where the engine stop of the process that logged the line at ``at`` begins (the end of the log when it
        logs none)."""
        prefix = re.escape(_prefix(log, at))
        marker = re.search(prefix + r"[^\n]*\[shutdown\] MPClient: start", log)
        return marker.start() if marker else len(log)

    assert all(at < engine_stop(at) for at in stopping)
    for _client, _op, request_id in ops:
        aborted = re.search(rf"Aborted request\(s\) chatcmpl-nnrp-{request_id}-", log)
        assert aborted, f"{request_id} never aborted"
        assert aborted.start() < engine_stop(aborted.start()), f"{request_id} not aborted before its engine stopped"
    assert log.count("NNRP listener stopped") == api_servers
    # vLLM 0.32's own output handler may log EngineDeadError with a traceback once its engine manager stopped
    # (a race inside vLLM's shutdown, vllm/v1/engine/async_llm.py): after the engine stop began, nothing of ours
    vllm_own = [line for line in log.splitlines() if "ERROR" in line and "[async_llm.py:" in line]
    first_own = log.find(vllm_own[0]) if vllm_own else -1
    assert not vllm_own or ("EngineDeadError" in "".join(vllm_own) and first_own > engine_stop(first_own)), log[-4000:]
    assert "Traceback" not in "\n".join(line for line in log.splitlines() if line not in vllm_own), log[-4000:]


def _prefix(log: str, at: int) -> str:
    """The process prefix of the log line at offset ``at`` (``(APIServer pid=P)``, ``(ApiServer_1 pid=P)``)."""
    line = log[log.rfind("\n", 0, at) + 1 : at + 200]
    match = re.match(r"\([^)]*pid=\d+\)", line)
    return match.group(0) if match else ""

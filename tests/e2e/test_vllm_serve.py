"""End to end inside a real ``vllm serve`` on CPU (each anchor of families.py, through its own
attach path): the real NNRP client over TCP and IPC against the plugin, with vLLM's own HTTP API on the same
server as the reference."""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from tests.e2e.conftest import LONG, QUIC, SERVED_NAME, VLLMServer, attach_options, model_dir, wait_idle
from tests.support import envelope, free_port, two_free_ports
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import normalise_body
from vllm_nnrp_plugin.vllm_binding.families import MIDDLEWARE_FLAG, MIDDLEWARE_PATH, binding_for

pytestmark = pytest.mark.vllm

HELLO = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 16,
    "temperature": 0,
}


@pytest.fixture(params=["tcp", "ipc", "nnrps", "ws", "wss", QUIC])
def client(request, vllm_server):
    """nnrp-py's native client (the interop oracle) on each carrier: TCP, a unix socket, TLS over TCP, WebSocket
    plain and over TLS, QUIC."""
    client = asyncio.run(ProfileClient.connect(vllm_server.nnrp[request.param], trusted_cert_der=vllm_server.der))
    yield client
    client.close()


def run(client, env, timeout_s=120):
    return list(client.events(client.submit(env), timeout_s=timeout_s))


def http_chat(server, body):
    response = httpx.post(f"{server.http}/v1/chat/completions", json=body, timeout=120)
    return response.status_code, response.json()


@pytest.mark.binding_core
def test_start_up_log_names_addresses_version_binding_and_models(vllm_server):
    (line,) = [x for x in vllm_server.output().splitlines() if "NNRP listening on" in x]
    assert vllm_server.nnrp["tcp"] in line and vllm_server.nnrp["ipc"] in line
    binding = binding_for(vllm_server.family)  # vllm-0.26 serves 0.26-0.28, vllm-0.32 0.29-0.32
    attach_path = "endpoint-plugin" if vllm_server.family >= (0, 26) else "middleware"
    assert f"vLLM {vllm_server.version}, binding {binding.name}, attach path {attach_path}" in line
    assert SERVED_NAME in line


@pytest.mark.binding_core
def test_streamed_text_equals_the_http_answer(vllm_server, client):
    status, reference = http_chat(vllm_server, HELLO)
    assert status == 200
    expected = reference["choices"][0]["message"]["content"]
    events = run(client, envelope({**HELLO, "stream": True}, request_id="e2e-stream"))
    *partials, terminal = events
    assert partials and all(e.event["type"] == "response.output_text.delta" for e in partials)
    assert "".join(e.event["delta"] for e in partials) == expected
    assert terminal.frame == "result_push" and terminal.event["type"] == "response.completed"
    body = terminal.event["body"]
    assert body["choices"][0]["message"]["content"] == expected
    assert body["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"]
    assert body["id"].startswith("chatcmpl-nnrp-e2e-stream-")  # envelope request_id is in vLLM's request id


@pytest.mark.binding_core
def test_usage_is_streamed_when_asked(vllm_server, client):
    _, reference = http_chat(vllm_server, HELLO)
    events = run(client, envelope({**HELLO, "stream": True, "stream_options": {"include_usage": True}}))
    usage = [e.event for e in events if e.event["type"] == "response.usage"]
    assert type(usage[0]["usage"].pop("input_tokens_details")["cached_tokens"]) is int  # the prefix-cache extension
    assert usage == [
        {
            "type": "response.usage",
            "usage": {
                "input_tokens": reference["usage"]["prompt_tokens"],
                "output_tokens": reference["usage"]["completion_tokens"],
                "total_tokens": reference["usage"]["total_tokens"],
            },
        }
    ]
    assert events[-1].event["body"]["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]


@pytest.mark.binding_core
def test_non_streaming_body_is_vllms_chat_completion(vllm_server, client):
    _, reference = http_chat(vllm_server, HELLO)
    (terminal,) = run(client, envelope(HELLO))
    body = terminal.event["body"]
    assert terminal.event["type"] == "response.completed" and body["object"] == "chat.completion"
    reference = normalise_body(reference)  # the same on every anchor (vllm_binding/chunk_shapes.py)
    for volatile in ("id", "created"):
        body.pop(volatile), reference.pop(volatile)
    assert body == reference


@pytest.mark.binding_core
@pytest.mark.parametrize(
    "submit, code",
    [
        (envelope({**HELLO, "model": "nope"}), "model_not_found"),
        (envelope({**HELLO, "model": "nope", "stream": True}), "model_not_found"),
        (envelope({**HELLO, "max_tokens": 100000}), "invalid_request"),
        (envelope({**HELLO, "max_tokens": 100000, "stream": True}), "invalid_request"),
        (envelope({**HELLO, "n": 2, "stream": True}), "invalid_request"),
        (envelope({**HELLO, "messages": "not a list"}), "invalid_request"),
        (envelope({"model": SERVED_NAME}), "missing_messages"),
        ({**envelope(HELLO), "operation": "embeddings.create"}, "unsupported_operation"),
        ({**envelope(HELLO), "schema_version": "openai-compatible/0"}, "unsupported_schema_version"),
        ({**envelope(HELLO), "body": "text"}, "invalid_envelope"),
        (b"\x00not json", "invalid_json"),
    ],
)
def test_errors_are_typed_and_the_session_keeps_serving(client, submit, code):
    (terminal,) = run(client, submit)
    assert terminal.event["type"] == "response.error"
    assert terminal.event["error"]["code"] == code and terminal.event["error"]["message"]
    (again,) = run(client, envelope({**HELLO, "max_tokens": 2}))
    assert again.event["type"] == "response.completed"


@pytest.mark.binding_core
def test_cancel_aborts_the_vllm_request(vllm_server, client):
    assert wait_idle(vllm_server)
    tokens_before = vllm_server.metric("vllm:generation_tokens_total")
    op = client.submit(envelope(LONG))
    stream = client.events(op, timeout_s=120)
    for _ in range(3):
        assert next(stream).event["type"] == "response.output_text.delta"
    client.cancel(op)
    terminal = list(stream)[-1]
    assert terminal.frame == "result_drop" and terminal.event == {
        "type": "response.cancelled",
        "reason": "client_cancelled",
    }
    assert wait_idle(vllm_server), "vLLM still runs the cancelled request"
    time.sleep(1)  # a second more in which tokens of a request vLLM failed to abort would be counted
    assert vllm_server.metric("vllm:generation_tokens_total") - tokens_before < 200  # far from max_tokens=1000


KILLED_CLIENT = textwrap.dedent(
    """
    import asyncio, os, sys, orjson
    from vllm_nnrp_plugin.client import ProfileClient
    der = bytes.fromhex(sys.argv[3]) if len(sys.argv) > 3 else None
    client = asyncio.run(ProfileClient.connect(sys.argv[1], trusted_cert_der=der))
    op = client.submit(orjson.loads(sys.argv[2]))
    events = client.events(op, timeout_s=120)
    next(events); next(events)
    print("streaming", flush=True)
    os._exit(9)
    """
)


@pytest.mark.parametrize("transport", ["tcp", "ipc", "ws", QUIC])
def test_a_killed_client_leaves_no_request_running(vllm_server, transport):
    import orjson

    assert wait_idle(vllm_server)
    tokens_before = vllm_server.metric("vllm:generation_tokens_total")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            KILLED_CLIENT,
            vllm_server.nnrp[transport],
            orjson.dumps(envelope(LONG)).decode(),
            vllm_server.der.hex(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "streaming" in proc.stdout, proc.stderr
    if transport == "quic":  # UDP has no reset: the server gives a silent client PEER_SILENT_S, then aborts
        from vllm_nnrp_plugin.nnrp_binding.quic import PEER_SILENT_S

        assert wait_idle(vllm_server, PEER_SILENT_S + 15), "vLLM still runs the dead client's request"
        time.sleep(1)  # a second more in which tokens of a request vLLM failed to abort would be counted
        assert vllm_server.metric("vllm:generation_tokens_total") - tokens_before < LONG["max_tokens"]  # cut short
        return
    assert wait_idle(vllm_server), "vLLM still runs the dead client's request"
    time.sleep(1)  # a second more in which tokens of a request vLLM failed to abort would be counted
    assert vllm_server.metric("vllm:generation_tokens_total") - tokens_before < 200


def test_the_http_api_keeps_working_beside_nnrp(vllm_server):
    status, body = http_chat(vllm_server, HELLO)
    assert status == 200 and body["choices"][0]["message"]["content"]


def test_cli_streams_the_answer(vllm_server):
    _, reference = http_chat(vllm_server, HELLO)
    cli = pathlib.Path(sys.executable).with_name("vllm-nnrp")
    args = [str(cli), "chat", "--endpoint", vllm_server.nnrp["tcp"], "--max-tokens", "16", "--temperature", "0"]
    done = subprocess.run([*args, "Say hello."], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(reference["choices"][0]["message"]["content"])
    assert "[usage] input" in done.stdout
    failed = subprocess.run([*args, "--model", "nope", "x"], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "model_not_found" in failed.stderr


def test_enabled_but_unable_to_bind_stops_vllm_serve(tmp_path, vllm_version):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    env, args = attach_options(vllm_version[1])
    server = VLLMServer(
        model_dir(), tmp_path, env={**env, "VLLM_NNRP_LISTEN": f"tcp://127.0.0.1:{taken}"}, extra_args=args
    )
    try:
        assert server.wait_exit() != 0
        output = server.output()
        assert f"cannot listen for NNRP on tcp://127.0.0.1:{taken}" in output and "Fix:" in output
    finally:
        server.stop()
        holder.close()


def test_installed_but_not_enabled_claims_no_port(tmp_path):
    port = free_port()
    env = {"VLLM_NNRP_LISTEN": f"tcp://127.0.0.1:{port}"}  # VLLM_PLUGINS unset: plugin installed, not asked for
    server = VLLMServer(model_dir(), tmp_path, env=env)
    try:
        server.wait_ready()
        assert "NNRP listening" not in server.output()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        server.stop()


@pytest.mark.binding_core
def test_enabled_without_an_attach_path_fails_fast_with_the_fix(tmp_path, vllm_version):
    """0.26/0.32: ``--additional-config`` enables NNRP but ``VLLM_PLUGINS`` does not load the endpoint plugin;
    0.18/0.22: NNRP enabled without the ``--middleware`` flag. Both stop before the model loads."""
    vllm = pathlib.Path(sys.executable).with_name("vllm")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    done = subprocess.run(
        [str(vllm), "serve", "unused-model", "--additional-config", '{"nnrp": {"enabled": true}}'],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    if vllm_version[1] >= (0, 26):
        assert "export VLLM_PLUGINS=nnrp" in done.stderr
    else:
        assert f"add {MIDDLEWARE_FLAG} to vllm serve" in done.stderr


#: a version string of another binding whose probes the installed line fails, per installed line
PROBE_FAILING_VERSION = {(0, 18): "0.22.1", (0, 22): "0.18.1", (0, 26): "0.32.0", (0, 29): "0.26.0"}


@pytest.mark.binding_core
def test_a_line_failing_its_probes_on_purpose_is_refused_before_the_model_loads(tmp_path, vllm_version):
    """The installed vLLM with its version string patched to another binding's line (a ``sitecustomize`` on
    ``PYTHONPATH`` sets ``vllm.__version__``): the gate selects that binding, its probes fail on this line's real
    surfaces, and ``vllm serve`` of the real model stops with the diagnostic before any engine starts."""
    family = vllm_version[1]
    patched = PROBE_FAILING_VERSION[max(f for f in PROBE_FAILING_VERSION if f <= family)]
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import vllm
        vllm.__version__ = {patched!r}
        vllm.__version_tuple__ = {tuple(int(p) for p in patched.split("."))!r}
    """)
    )
    env, args = attach_options(vllm_version[1])
    server = VLLMServer(
        model_dir(),
        tmp_path,
        env={
            **env,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        },
        extra_args=args,
    )
    try:
        assert server.wait_exit() != 0
        output = server.output()
        assert f"vllm-nnrp-plugin: vLLM {patched} lacks " in output and "Fix:" in output
        assert "EngineCore" not in output and "Loading weights" not in output
    finally:
        server.stop()


def test_every_api_server_process_serves_nnrp_on_its_rank_address(tmp_path, vllm_version):
    """``--api-server-count 2``: rank r listens on PORT + r and NAME-r.sock, each serves, and a cancel on rank 1
    aborts the request in rank 1's engine client. Both attach paths are configured (on 0.26 the endpoint plugin
    and the middleware; older lines only have the middleware), and each rank still runs one listener."""
    port = two_free_ports()
    env, args = attach_options(vllm_version[1])
    if "--middleware" not in args:
        args = (*args, "--middleware", MIDDLEWARE_PATH)
    listen = f"tcp://127.0.0.1:{port},unix://{tmp_path}/nnrp.sock"
    server = VLLMServer(
        model_dir(), tmp_path, env={**env, "VLLM_NNRP_LISTEN": listen}, extra_args=(*args, "--api-server-count", "2")
    )
    try:
        server.wait_ready()  # HTTP answers once any rank is up
        deadline = time.monotonic() + 120
        while len(lines := [x for x in server.output().splitlines() if "NNRP listening on" in x]) < 2:
            assert time.monotonic() < deadline and server.proc.poll() is None, server.tail()
            time.sleep(0.5)
        time.sleep(2)  # a negative check: no third listener attaches late
        lines = [x for x in server.output().splitlines() if "NNRP listening on" in x]
        assert len(lines) == 2, lines  # one listener per API-server process, none attached twice
        by_rank = {r: next(x for x in lines if f"API server {r} of 2" in x) for r in (0, 1)}
        assert f"tcp://127.0.0.1:{port}," in by_rank[0] and f"{tmp_path}/nnrp.sock" in by_rank[0]
        assert f"tcp://127.0.0.1:{port + 1}," in by_rank[1] and f"{tmp_path}/nnrp-1.sock" in by_rank[1]
        addresses = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", f"unix://{tmp_path}/nnrp-1.sock"]
        for address in addresses:
            client = asyncio.run(ProfileClient.connect(address))
            try:
                (terminal,) = run(client, envelope({**HELLO, "max_tokens": 4}))
                assert terminal.event["type"] == "response.completed", address
            finally:
                client.close()
        assert wait_idle(server)
        tokens_before = server.metric("vllm:generation_tokens_total")
        client = asyncio.run(ProfileClient.connect(f"tcp://127.0.0.1:{port + 1}"))
        try:
            op = client.submit(envelope(LONG))
            stream = client.events(op, timeout_s=120)
            for _ in range(3):
                assert next(stream).event["type"] == "response.output_text.delta"
            client.cancel(op)
            assert list(stream)[-1].frame == "result_drop"
        finally:
            client.close()
        assert wait_idle(server), "vLLM still runs the request cancelled on rank 1"
        time.sleep(1)  # a second more in which tokens of a request vLLM failed to abort would be counted
        assert server.metric("vllm:generation_tokens_total") - tokens_before < 200
    finally:
        server.stop()

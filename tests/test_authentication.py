"""vLLM's API key over real NNRP carriers on loopback (the service with a recorded backend): the asyncio client,
the ``openai`` SDK over the transports and nnrp-py's native client, on ``tcp://``, ``nnrps://`` (the project's
own TLS carrier) and ``unix://``; refusals counted, never logged with the key; the handshake timeout."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import openai
import pytest

from tests.support import ServedNNRP, envelope, free_port, metric, self_signed, wait_until
from vllm_nnrp_plugin.client import AsyncNNRPTransport, AuthenticationFailed, NNRPTransport, ProfileClient, connect
from vllm_nnrp_plugin.client.errors import ClientTransportError
from vllm_nnrp_plugin.nnrp_wire.codecs import SESSION_ERROR_AUTH_FAILED

KEY = "sk-the-right-key-0123"
STREAM = envelope({"model": "a-stream-text", "messages": [], "stream": True})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    cert, key, der = self_signed(tmp)
    listen = (f"tcp://127.0.0.1:{free_port()}", f"nnrps://127.0.0.1:{free_port()}", f"unix://{tmp}/nnrp.sock")
    served = ServedNNRP(listen, api_keys=("sk-other", KEY), tls_cert_file=cert, tls_key_file=key)
    served.der = der
    yield served
    served.stop()


def uri_of(served: ServedNNRP, scheme: str) -> str:
    (uri,) = [u for u in served.bound if u.startswith(f"{scheme}://")]
    return uri


async def stream_text(uri: str, der: bytes, api_key: str | None) -> str:
    conn = await connect(uri, api_key=api_key, trusted_cert_der=der)
    try:
        session = await conn.open_session()
        events = [event async for event in session.submit(STREAM)]
        assert events[-1]["type"] == "response.completed"
        return "".join(e.get("delta", "") for e in events)
    finally:
        await conn.close()


def refusals(served: ServedNNRP, transport: str, reason: str) -> float:
    return metric("nnrp_auth_refusals_total", transport=transport, reason=reason)


@pytest.mark.parametrize("scheme", ["tcp", "nnrps"])
def test_a_network_carrier_serves_only_with_one_of_vllms_keys(served, scheme, caplog):
    uri = uri_of(served, scheme)
    transport = "tls" if scheme == "nnrps" else "tcp"
    missing, wrong = refusals(served, transport, "missing_key"), refusals(served, transport, "wrong_key")
    started = len(served.backend.started)
    with caplog.at_level(logging.INFO, logger="vllm_nnrp_plugin"):
        for api_key in (None, "sk-wrong"):
            with pytest.raises(AuthenticationFailed) as refused:
                asyncio.run(stream_text(uri, served.der, api_key))
            assert refused.value.session_error_code == SESSION_ERROR_AUTH_FAILED
        assert len(served.backend.started) == started  # refused before any model work
        assert asyncio.run(stream_text(uri, served.der, KEY))  # the right key: served
    assert refusals(served, transport, "missing_key") == missing + 1
    assert wait_until(lambda: refusals(served, transport, "wrong_key") == wrong + 1)
    assert "auth_failed" in caplog.text and "sk-wrong" not in caplog.text and KEY not in caplog.text


def test_a_unix_socket_needs_no_key(served):
    """The socket file is owner-only: the operating system already decided who connects."""
    assert asyncio.run(stream_text(uri_of(served, "unix"), served.der, None))


@pytest.mark.parametrize("scheme", ["tcp", "nnrps"])
def test_the_openai_sdk_sends_its_api_key_as_over_https(served, scheme):
    uri = uri_of(served, scheme)

    async def ask(api_key: str) -> str:
        transport = AsyncNNRPTransport(uri, trusted_cert_der=served.der)
        async with openai.AsyncOpenAI(
            base_url="http://nnrp.invalid/v1",
            api_key=api_key,
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        ) as sdk:
            stream = await sdk.chat.completions.create(model="a-stream-text", messages=[], stream=True)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

    assert asyncio.run(ask(KEY))
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(ask("sk-wrong"))
    with httpx.Client(transport=NNRPTransport(uri, trusted_cert_der=served.der)) as http:
        sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="sk-wrong", max_retries=0, http_client=http)
        with pytest.raises(openai.AuthenticationError):
            sdk.chat.completions.create(model="a-stream-text", messages=[])
        sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key=KEY, max_retries=0, http_client=http)
        assert sdk.chat.completions.create(model="a-stream-text", messages=[]).choices


def test_nnrp_pys_native_client_cannot_send_a_key_and_is_refused(served):
    with pytest.raises(ClientTransportError) as refused:
        asyncio.run(ProfileClient.connect(uri_of(served, "tcp")))
    assert refused.value.status.protocol_error_code == SESSION_ERROR_AUTH_FAILED
    client = asyncio.run(ProfileClient.connect(uri_of(served, "unix")))  # key-free carrier: served
    try:
        assert list(client.events(client.submit(STREAM), timeout_s=10))[-1].event["type"] == "response.completed"
    finally:
        client.close()


def test_without_keys_every_client_is_served_and_a_sent_key_is_ignored(tmp_path):
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    try:
        for api_key in (None, "sk-anything"):
            assert asyncio.run(stream_text(served.bound[0], b"", api_key))
    finally:
        served.stop()


def test_a_connection_that_opens_no_session_in_time_is_closed(tmp_path):
    """A silent client, and one that sent half a hello, lose their connection after ``handshake_timeout_ms``
    and are counted; a client that opened a session keeps its connection."""
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), handshake_timeout_ms=300)
    try:
        host, port = served.bound[0].removeprefix("tcp://").rsplit(":", 1)
        silent = socket.create_connection((host, int(port)))
        half = socket.create_connection((host, int(port)))
        half.sendall(b"NNRP\x01\x00\x01")  # the first bytes of a header
        started = time.monotonic()
        for sock in (silent, half):
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by the server
            sock.close()
        assert 0.25 < time.monotonic() - started < 3
        assert wait_until(lambda: metric("nnrp_handshake_timeouts_total", transport="tcp") >= 2)

        async def open_and_wait() -> None:
            conn = await connect(served.bound[0])
            session = await conn.open_session()
            await asyncio.sleep(0.6)  # twice the timeout
            events = [event async for event in session.submit(STREAM)]
            assert events[-1]["type"] == "response.completed"
            await conn.close()

        asyncio.run(open_and_wait())
    finally:
        served.stop()


def test_quic_requires_the_key_too(tmp_path):
    """QUIC runs on the project's wire core like every other network carrier: with keys, nnrp-py's native QUIC
    client (which cannot send one) is refused ``auth_failed`` and counted; the server starts (ws and wss take
    keys like tcp: tests/test_websocket.py)."""
    cert, key, der = self_signed(tmp_path)
    served = ServedNNRP((f"quic://127.0.0.1:{free_port()}",), api_keys=(KEY,), tls_cert_file=cert, tls_key_file=key)
    before = refusals(served, "quic", "missing_key")  # the counter is the process's: other tests count too
    try:
        with pytest.raises(ClientTransportError) as refused:
            asyncio.run(ProfileClient.connect(served.bound[0], trusted_cert_der=der))
        assert refused.value.status.protocol_error_code == SESSION_ERROR_AUTH_FAILED
        assert refusals(served, "quic", "missing_key") == before + 1
    finally:
        served.stop()


def test_no_metric_carries_a_key(served):
    """No metric label or value carries a key."""
    from prometheus_client import generate_latest

    text = generate_latest()  # the default registry, where the service registered its collectors
    assert b"nnrp_auth_refusals_total" in text
    assert KEY.encode() not in text and b"sk-wrong" not in text


def test_the_cli_takes_the_key_from_its_flag_or_the_environment(served, tmp_path):
    """``vllm-nnrp chat``: refused without a key (exit 2, saying how to give one), served with ``--api-key``,
    with ``$VLLM_API_KEY`` and with ``$OPENAI_API_KEY``; over ``nnrps://`` with ``--tls-ca``."""
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    cert = tmp_path / "server.pem"
    cert.write_text(__import__("ssl").DER_cert_to_PEM_cert(served.der))

    def chat(uri: str, *extra: str, **env: str) -> subprocess.CompletedProcess:
        environ = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "OPENAI_API_KEY")} | env
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "vllm_nnrp_plugin.client.cli",
                "chat",
                "--endpoint",
                uri,
                "--model",
                "a-stream-text",
                *extra,
                "Say hello.",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=environ,
        )

    tcp = uri_of(served, "tcp")
    refused = chat(tcp)
    assert refused.returncode == 2 and "--api-key" in refused.stderr
    assert chat(tcp, "--api-key", "sk-wrong").returncode == 2
    for done in (
        chat(tcp, "--api-key", KEY),
        chat(tcp, VLLM_API_KEY=KEY),
        chat(tcp, OPENAI_API_KEY=KEY),
        chat(uri_of(served, "nnrps"), "--tls-ca", str(cert), "--api-key", KEY),
    ):
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip()

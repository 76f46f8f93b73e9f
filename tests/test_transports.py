"""Every carrier end to end through the real listener path: TCP, IPC, WebSocket (ws, wss), QUIC and TLS over
TCP (``nnrps``), with a self-signed certificate made here (URI forms: vllm_nnrp_plugin/contract/endpoints.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support import ServedNNRP, envelope, free_port, recorded_chunks, self_signed
from vllm_nnrp_plugin.client import ProfileClient

STREAM = envelope({"model": "a-stream-text", "messages": [], "stream": True})


SCHEMES = ["tcp", "unix", "ws", "wss", "quic", "nnrps"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key, der = self_signed(tmp)
    listen = tuple(
        f"unix://{tmp}/nnrp.sock" if scheme == "unix" else f"{scheme}://127.0.0.1:{free_port()}" for scheme in SCHEMES
    )
    served = ServedNNRP(listen, tls_cert_file=cert, tls_key_file=key)
    served.der = der
    served.other_der = self_signed(tmp, "other")[2]
    yield served
    served.stop()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_carrier_streams_an_operation_end_to_end(served, scheme):
    (uri,) = [u for u in served.bound if u.startswith(f"{scheme}://")]
    client = asyncio.run(ProfileClient.connect(uri, trusted_cert_der=served.der))
    try:
        events = list(client.events(client.submit(STREAM), timeout_s=10))
        expected = "".join(c["choices"][0]["delta"]["content"] for c in recorded_chunks("a-stream-text"))
        assert "".join(e.event.get("delta", "") for e in events[:-1]) == expected
        assert events[-1].event["type"] == "response.completed"
        assert client.session is not None
    finally:
        client.close()


@pytest.mark.parametrize("scheme", ["wss", "quic", "nnrps"])
def test_tls_carriers_refuse_a_client_that_does_not_trust_the_certificate(served, scheme):
    (uri,) = [u for u in served.bound if u.startswith(f"{scheme}://")]
    with pytest.raises(Exception):  # noqa: B017 - nnrp-py's native TLS failure differs per carrier
        client = asyncio.run(asyncio.wait_for(ProfileClient.connect(uri, trusted_cert_der=served.other_der), 20))
        try:
            list(client.events(client.submit(STREAM), timeout_s=5))
        finally:
            client.close()


@pytest.mark.parametrize("trusted", ["server", "other"])
def test_the_openai_transports_speak_tls_over_tcp(served, trusted):
    """``nnrps://`` through the SDK (the project's asyncio client over TLS to nnrp-py's native ``nnrps``
    carrier): a trusted certificate streams, an untrusted one is the SDK's ``APIConnectionError``."""
    import httpx
    import openai

    from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport

    (uri,) = [u for u in served.bound if u.startswith("nnrps://")]
    der = served.der if trusted == "server" else served.other_der
    body = {"model": "a-stream-text", "messages": [{"role": "user", "content": "hi"}]}
    expected = "".join(c["choices"][0]["delta"]["content"] for c in recorded_chunks("a-stream-text"))
    with httpx.Client(transport=NNRPTransport(uri, trusted_cert_der=der)) as http:
        client = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)
        if trusted == "other":
            with pytest.raises(openai.APIConnectionError):
                client.chat.completions.create(**body, stream=True)
            return
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True)
        )
        assert streamed == expected

    async def async_call() -> str:
        async with httpx.AsyncClient(transport=AsyncNNRPTransport(uri, trusted_cert_der=der)) as http:
            client = openai.AsyncOpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http)
            return "".join(
                [
                    c.choices[0].delta.content or ""
                    async for c in await client.chat.completions.create(**body, stream=True)
                ]
            )

    assert asyncio.run(async_call()) == expected

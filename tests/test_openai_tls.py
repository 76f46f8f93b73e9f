"""``tls_ca_file`` on the openai transports: the PEM file of CA or server certificates that
:func:`vllm_nnrp_plugin.client.connect` takes (and ``vllm-nnrp --tls-ca``), so the certificate made by
docs/operating.md's TLS walk-through works with the SDK over ``nnrps://``, ``wss://`` and ``quic://`` as it is.
A certificate not trusted is ``APIConnectionError``; an unreadable file a ``ValueError`` at once."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.support import ServedNNRP, free_port, self_signed
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key, _ = self_signed(tmp)
    other, _, _ = self_signed(tmp_path_factory.mktemp("other"), "localhost")  # another self-signed certificate
    server = ServedNNRP(
        (f"nnrps://127.0.0.1:{free_port()}", f"wss://127.0.0.1:{free_port()}/nnrp", f"quic://127.0.0.1:{free_port()}"),
        tls_cert_file=cert,
        tls_key_file=key,
    )
    server.cert, server.other = cert, other
    yield server
    server.stop()


def _sdk(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["nnrps", "wss", "quic"])
def test_the_pem_file_of_the_walk_through_is_trusted(served, index):
    uri = served.bound[index]
    with httpx.Client(transport=NNRPTransport(uri, tls_ca_file=served.cert)) as http:
        assert _sdk(http).chat.completions.create(model="c-nonstream-text", messages=MESSAGES).choices
    with httpx.Client(transport=NNRPTransport(uri, tls_ca_file=served.other)) as http:
        with pytest.raises(openai.APIConnectionError):  # a certificate the server's is not signed by
            _sdk(http).chat.completions.create(model="c-nonstream-text", messages=MESSAGES)


def test_the_async_transport_takes_it_too(served):
    async def main() -> None:
        async with httpx.AsyncClient(transport=AsyncNNRPTransport(served.bound[0], tls_ca_file=served.cert)) as http:
            sdk = openai.AsyncOpenAI(
                base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0
            )
            assert (await sdk.chat.completions.create(model="c-nonstream-text", messages=MESSAGES)).choices

    asyncio.run(main())


def test_an_unreadable_file_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="tls_ca_file"):
        NNRPTransport("nnrps://127.0.0.1:9443", tls_ca_file=tmp_path / "missing.crt")
    with pytest.raises(ValueError, match="tls_ca_file"):
        AsyncNNRPTransport("nnrps://127.0.0.1:9443", tls_ca_file=str(tmp_path / "missing.crt"))

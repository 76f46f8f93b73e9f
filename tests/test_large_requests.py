"""Requests as large as vLLM's HTTP server takes reach vLLM over NNRP too (loopback, a backend that answers as
vLLM does for a prompt longer than the model's context): the default ``max_envelope_bytes`` (32 MiB) and the
advertised packet limit (64 MiB, the native peers' own) take 8 MiB and 20 MiB chat requests through the openai
SDK and through nnrp-py's native client, and each gets vLLM's own answer (its context-length 400 →
``response.error`` → ``BadRequestError``); only an envelope over the limit gets ``envelope_too_large``."""

from __future__ import annotations

import contextlib
import socket
import types

import httpx
import openai
import pytest
from nnrp.core.enums import MessageType as T
from nnrp.core.messages.control import ServerHelloAckMetadata

from tests.support import RecordedBackend, ServedNNRP, envelope, free_port
from tests.test_native_interop import native_connection, profile_client
from tests.wire import wirekit as w
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport, NNRPTransport
from vllm_nnrp_plugin.config import NNRPConfig
from vllm_nnrp_plugin.nnrp_binding.bounds import CarrierBounds, packet_limit
from vllm_nnrp_plugin.nnrp_wire import framing
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader
from vllm_nnrp_plugin.vllm_binding.serving import error_from_response

MiB = 1 << 20
MAX_MODEL_LEN = 2048


def context_length_error(prompt_chars: int):
    """vLLM's 400 for a prompt longer than the model's context (``vllm/entrypoints/openai/serving_engine.py``
    ``_validate_input``: "This model's maximum context length is … tokens"), roughly 4 characters a token."""
    message = (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has "
        f"{prompt_chars // 4} input tokens. Please reduce the length of the input messages."
    )
    return types.SimpleNamespace(
        error=types.SimpleNamespace(message=message, type="BadRequestError", param=None, code=400)
    )


class ContextBackend(RecordedBackend):
    """:class:`RecordedBackend`; a chat request whose messages hold more than the model's context gets vLLM's
    context-length 400 (``prompt_chars`` records each request's size)."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_chars: list[int] = []

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        chars = sum(len(str(m.get("content", ""))) for m in body.get("messages") or ())
        self.prompt_chars.append(chars)
        if chars > 4 * MAX_MODEL_LEN:
            self.started.append(request_id)
            raise error_from_response(context_length_error(chars))
        return await super().create(operation, body, request_id, traceparent, controls)


@pytest.fixture(scope="module")
def served():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), ContextBackend())  # default limits
    yield server
    server.stop()


def test_the_defaults_take_tens_of_mib_and_advertise_the_native_packet_limit(served):
    config = NNRPConfig()
    assert config.max_envelope_bytes == 32 * MiB
    assert (
        packet_limit(config.max_envelope_bytes)
        == framing.MAX_PACKET_BYTES
        == 64 * MiB
        == CarrierBounds().max_packet_bytes
    )
    host, port = served.bound[0].removeprefix("tcp://").rsplit(":", 1)
    with contextlib.closing(socket.create_connection((host, int(port)))) as sock:
        sock.sendall(w.hello())
        sock.settimeout(5)
        (ack,) = PacketReader().feed(sock.recv(4096))
    assert ack.msg_type == T.SERVER_HELLO_ACK
    assert ServerHelloAckMetadata.unpack(ack.meta).max_body_bytes == 64 * MiB


@pytest.mark.parametrize("size_mib", [8, 20])
def test_large_chat_requests_through_the_sdk_get_vllms_own_answer(served, size_mib):
    content = "x" * (size_mib * MiB)
    with httpx.Client(transport=NNRPTransport(served.bound[0])) as http:
        sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model="a-stream-text", messages=[{"role": "user", "content": content}])
    assert refused.value.status_code == 400
    assert refused.value.body["message"] == context_length_error(len(content)).error.message
    assert served.backend.prompt_chars[-1] == len(content)  # the whole request reached vLLM


def test_a_large_request_streams_through_the_async_sdk_too(served):
    content = "x" * (8 * MiB)

    async def main() -> None:
        async with httpx.AsyncClient(transport=AsyncNNRPTransport(served.bound[0])) as http:
            sdk = openai.AsyncOpenAI(
                base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0
            )
            with pytest.raises(openai.BadRequestError):
                await sdk.chat.completions.create(
                    model="a-stream-text", stream=True, messages=[{"role": "user", "content": content}]
                )

    import asyncio

    asyncio.run(main())
    assert served.backend.prompt_chars[-1] == len(content)


def test_an_envelope_over_the_limit_is_envelope_too_large_and_the_connection_lives(served):
    content = "x" * (33 * MiB)  # over max_envelope_bytes, under the packet limit
    with httpx.Client(transport=NNRPTransport(served.bound[0])) as http:
        sdk = openai.OpenAI(base_url="http://nnrp.invalid/v1", api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            sdk.chat.completions.create(model="a-stream-text", messages=[{"role": "user", "content": content}])
        assert refused.value.status_code == 413 and refused.value.code == "envelope_too_large"
        assert sdk.chat.completions.create(model="c-nonstream-text", messages=[]).choices  # same connection


def test_nnrp_pys_native_client_submits_a_20_mib_envelope_within_the_advertised_limit(served):
    payload = envelope({"model": "a-stream-text", "messages": [{"role": "user", "content": "x" * (20 * MiB)}]})
    with native_connection(served.bound[0]) as connection:
        client = profile_client(connection)
        (terminal,) = list(client.events(client.submit(payload), timeout_s=60))
        assert terminal.event["type"] == "response.error" and terminal.event["error"]["code"] == "invalid_request"
        assert "maximum context length" in terminal.event["error"]["message"]
        client.session.close()

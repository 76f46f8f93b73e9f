"""The ``openai`` transports' priority classes: the pool's sessions open with the transport's ``priority_class``,
a call's ``X-NNRP-Priority-Class`` header becomes its envelope's ``nnrp.priority_class``, bad values are refused
(:mod:`vllm_nnrp_plugin.client.openai.calls`, ``.pool``, ``.transport``)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest

from vllm_nnrp_plugin.client import AsyncNNRPTransport, NNRPTransport
from vllm_nnrp_plugin.client.openai.calls import Call
from vllm_nnrp_plugin.nnrp_wire import events as ev

from .test_client_controls import Server

URL = "http://nnrp.invalid/v1"
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}


def planned(method: str, path: str, body: dict | None = None, headers: dict | None = None, **extensions) -> Call:
    request = httpx.Request(
        method,
        URL + path,
        content=orjson.dumps(body) if body is not None else b"",
        headers=headers,
        extensions=extensions,
    )
    call = Call(request)
    call.answer_now = call.plan()
    return call


def test_the_header_becomes_the_envelopes_priority_class():
    call = planned(
        "POST", "/chat/completions", {"messages": []}, {"X-NNRP-Priority-Class": "background"}, timeout={"read": 2.0}
    )
    assert call.answer_now is None
    assert call.envelope["nnrp"] == {"priority_class": "background"}  # the read timeout stays the client's
    call = planned("GET", "/models", headers={"x-nnrp-priority-class": "interactive"})
    assert call.answer_now is None and call.envelope["nnrp"] == {"priority_class": "interactive"}
    assert "nnrp" not in planned("POST", "/embeddings", {"input": "x"}).envelope


def test_an_unknown_priority_class_is_a_400_without_a_submit():
    call = planned("POST", "/chat/completions", {"messages": []}, {"X-NNRP-Priority-Class": "urgent"})
    assert call.envelope is None and call.answer_now.status_code == 400
    error = orjson.loads(call.answer_now.content)["error"]
    assert error["code"] == "invalid_request" and error["type"] == "BadRequestError" and "urgent" in error["message"]


@pytest.mark.parametrize("transport", [NNRPTransport, AsyncNNRPTransport])
def test_an_unknown_transport_priority_class_is_a_value_error(transport):
    with pytest.raises(ValueError, match="priority class"):
        transport("tcp://127.0.0.1:9", priority_class="urgent")


def answer(envelope: dict) -> dict:
    body = COMPLETION if envelope["operation"] == "chat.completions.create" else {}
    return {"type": "response.completed", "body": body}


def test_async_transport_sessions_and_calls_carry_their_classes():
    async def main() -> None:
        server = Server(answer)
        async with server as uri:
            transport = AsyncNNRPTransport(uri, priority_class="interactive")
            client = openai.AsyncOpenAI(base_url=URL, api_key="k", http_client=httpx.AsyncClient(transport=transport))
            await client.chat.completions.create(model="m", messages=[])
            reply = await client.chat.completions.create(
                model="m", messages=[], extra_headers={"X-NNRP-Priority-Class": "background"}
            )
            assert reply.choices[0].message.content == "hi"
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(
                    model="m", messages=[], extra_headers={"X-NNRP-Priority-Class": "x"}
                )
            await client.close()
            await transport.aclose()
        assert {e.priority_class for e in server.of(ev.SessionOpenRequested)} == {0}
        chats = [e for e in server.envelopes if e["operation"] == "chat.completions.create"]
        assert [e.get("nnrp", {}).get("priority_class") for e in chats] == [None, "background"]

    asyncio.run(asyncio.wait_for(main(), 30))


def test_sync_transport_sessions_open_with_its_class():
    async def main() -> None:
        server = Server(answer)
        async with server as uri:

            def call() -> None:
                with NNRPTransport(uri, priority_class="background") as transport:
                    client = openai.OpenAI(
                        base_url=URL, api_key="k", http_client=httpx.Client(transport=transport), max_retries=0
                    )
                    client.chat.completions.create(model="m", messages=[])

            await asyncio.to_thread(call)
        assert {e.priority_class for e in server.of(ev.SessionOpenRequested)} == {2}

    asyncio.run(asyncio.wait_for(main(), 30))

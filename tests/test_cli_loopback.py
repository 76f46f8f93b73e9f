"""The ``vllm-nnrp`` command against a real NNRP listener (the service's own wire core, TCP on loopback).

Chat is answered by :class:`tests.support.RecordedBackend` (recorded vLLM 0.26.0 streams); ``responses.create``,
``models.list`` and ``embeddings.create`` by :class:`ScriptedBackend` with small bodies of OpenAI's documented
shapes as vLLM returns them (a ``response`` object and its streaming events, a ``list`` of ``model`` objects
with vLLM's ``max_model_len``, a ``list`` of ``embedding`` objects). A Level-1-only server (chat alone) answers
the other commands with ``unsupported_operation``.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import struct
import subprocess
import sys

import pytest

from tests.support import ROOT, RecordedBackend, ServedNNRP, free_port
from vllm_nnrp_plugin.core.adapter import STREAM_MAPPERS, Call
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, EMBEDDINGS_CREATE, MODELS_LIST, RESPONSES_CREATE
from vllm_nnrp_plugin.profile.capabilities import chat_operation, operation, runtime_document

MODELS = {
    "object": "list",
    "data": [
        {
            "id": "example-model",
            "object": "model",
            "created": 1796123190,
            "owned_by": "vllm",
            "root": "/models/smollm2-135m-instruct",
            "parent": None,
            "max_model_len": 2048,
            "permission": [],
        },
    ],
}
FUNCTION_CALL = {
    "type": "function_call",
    "id": "fc_1",
    "call_id": "call_1",
    "name": "lookup",
    "arguments": '{"city": "Paris"}',
    "status": "completed",
}
RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1796123190,
    "model": "example-model",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello there.", "annotations": []}],
        },
        FUNCTION_CALL,
    ],
    "usage": {"input_tokens": 12, "output_tokens": 7, "total_tokens": 19},
}
#: vLLM's Responses streaming events for RESPONSE (``responses_stream_generator``'s objects as dicts)
RESPONSE_EVENTS = [
    {
        "type": "response.created",
        "sequence_number": 0,
        "response": {**RESPONSE, "status": "in_progress", "output": [], "usage": None},
    },
    {
        "type": "response.output_item.added",
        "sequence_number": 1,
        "output_index": 0,
        "item": {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []},
    },
    {
        "type": "response.output_text.delta",
        "sequence_number": 2,
        "output_index": 0,
        "content_index": 0,
        "item_id": "msg_1",
        "delta": "Hello",
    },
    {
        "type": "response.output_text.delta",
        "sequence_number": 3,
        "output_index": 0,
        "content_index": 0,
        "item_id": "msg_1",
        "delta": " there.",
    },
    {"type": "response.output_item.done", "sequence_number": 4, "output_index": 0, "item": RESPONSE["output"][0]},
    {
        "type": "response.output_item.added",
        "sequence_number": 5,
        "output_index": 1,
        "item": {**FUNCTION_CALL, "arguments": "", "status": "in_progress"},
    },
    {
        "type": "response.function_call_arguments.delta",
        "sequence_number": 6,
        "output_index": 1,
        "item_id": "fc_1",
        "delta": '{"city": ',
    },
    {
        "type": "response.function_call_arguments.delta",
        "sequence_number": 7,
        "output_index": 1,
        "item_id": "fc_1",
        "delta": '"Paris"}',
    },
    {"type": "response.output_item.done", "sequence_number": 8, "output_index": 1, "item": FUNCTION_CALL},
    {"type": "response.completed", "sequence_number": 9, "response": RESPONSE},
]
STREAMED_RESPONSES = RESPONSES_CREATE in STREAM_MAPPERS  # the Responses stream mapper is registered


def vector(index: int) -> list[float]:
    return [0.5 * (index + 1), -0.25, 0.125, 1.0, -2.0, 0.0]


class ScriptedBackend(RecordedBackend):
    """Every profile operation: chat replayed from recordings (:class:`RecordedBackend`), the others from the
    bodies above; ``embeddings.create`` answers each input with :func:`vector` in the asked
    ``encoding_format``."""

    def capabilities(self):
        return runtime_document(
            models=["example-model"],
            owned_by="recorded",
            operations=[
                chat_operation(tool_calls=True),
                operation(RESPONSES_CREATE, streaming=STREAMED_RESPONSES, non_streaming=True, tool_calls=True),
                operation(MODELS_LIST, streaming=False, non_streaming=True, cancellation=False),
                operation(EMBEDDINGS_CREATE, streaming=False, non_streaming=True, encoding_formats=["float", "base64"]),
            ],
        )

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        if operation == CHAT_COMPLETIONS_CREATE:
            return await super().create(operation, body, request_id, traceparent)
        self.started.append(request_id)
        if operation == MODELS_LIST:
            return Call(body=MODELS)
        if operation == EMBEDDINGS_CREATE:
            return Call(body=self._embeddings(body))
        if body.get("stream"):
            return Call(stream=self._events())
        return Call(body=RESPONSE)

    @staticmethod
    def _embeddings(body):
        def encode(values):
            if body.get("encoding_format") == "base64":
                return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
            return values

        data = [{"object": "embedding", "index": i, "embedding": encode(vector(i))} for i in range(len(body["input"]))]
        tokens = sum(len(text.split()) for text in body["input"])
        return {
            "id": "embd-1",
            "object": "list",
            "created": 1796123190,
            "model": "example-model",
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    @staticmethod
    async def _events():
        for event in RESPONSE_EVENTS:
            yield event


@pytest.fixture(scope="module")
def every_operation():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), backend=ScriptedBackend())
    yield server.bound[0]
    server.stop()


@pytest.fixture(scope="module")
def level1_only():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",))
    yield server.bound[0]
    server.stop()


def vllm_nnrp(endpoint, *args):
    done = subprocess.run(
        [sys.executable, "-m", "vllm_nnrp_plugin.client.cli", args[0], "--endpoint", endpoint, *args[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_models_prints_the_served_models(every_operation):
    done = vllm_nnrp(every_operation, "models")
    assert (done.returncode, done.stdout) == (0, "example-model  max_model_len 2048\n"), done.stderr
    raw = vllm_nnrp(every_operation, "models", "--json")
    assert raw.returncode == 0 and json.loads(raw.stdout) == MODELS


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embed_prints_each_inputs_dimensions_and_first_values(every_operation, encoding):
    done = vllm_nnrp(every_operation, "embed", "--encoding-format", encoding, "first text", "second")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "[0] 6 dimensions: 0.5000, -0.2500, 0.1250, 1.0000, …\n"
        "[1] 6 dimensions: 1.0000, -0.2500, 0.1250, 1.0000, …\n"
        "[usage] input 3 · total 3 tokens\n"
    )


def test_respond_without_streaming_prints_the_output_text_calls_and_usage(every_operation):
    done = vllm_nnrp(every_operation, "respond", "--no-stream", "--max-output-tokens", "16", "Say hello.")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        'Hello there.\n[tool call call_1] lookup({"city": "Paris"})\n[usage] input 12 · output 7 · total 19 tokens\n'
    )


@pytest.mark.skipif(not STREAMED_RESPONSES, reason="no Responses stream mapper registered in the adapter")
def test_respond_streams_the_text_then_calls_and_usage(every_operation):
    done = vllm_nnrp(every_operation, "respond", "Say hello.")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        'Hello there.\n[tool call call_1] lookup({"city": "Paris"})\n[usage] input 12 · output 7 · total 19 tokens\n'
    )
    events = [
        json.loads(line) for line in vllm_nnrp(every_operation, "respond", "--json", "Say hello.").stdout.splitlines()
    ]
    # the sender may merge a delta still waiting into the next one: compare runs of one type
    assert [kind for kind, _ in itertools.groupby(event["type"] for event in events)] == [
        "response.output_text.delta",
        "response.tool_call.started",
        "response.tool_call.delta",
        "response.tool_call.completed",
        "response.usage",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello there."


def test_chat_still_streams_from_the_same_server(every_operation):
    done = vllm_nnrp(every_operation, "chat", "--model", "b-stream-text-usage", "hi")
    assert done.returncode == 0 and "[usage] input" in done.stdout, done.stderr


@pytest.mark.parametrize("command", [["models"], ["embed", "x"], ["respond", "x"], ["respond", "--no-stream", "x"]])
def test_a_level1_only_server_answers_unsupported_operation(level1_only, command):
    done = vllm_nnrp(level1_only, *command)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("vllm-nnrp: error unsupported_operation: ")


def test_no_server_is_exit_2_with_a_message():
    done = vllm_nnrp(f"tcp://127.0.0.1:{free_port()}", "models")
    assert done.returncode == 2 and done.stderr.startswith("vllm-nnrp: cannot connect to ")


@pytest.mark.parametrize("fleet", [False, True], ids=["one address", "fleet"])
def test_a_peer_that_never_answers_the_hello_is_exit_2_within_the_timeout(fleet):
    """A TCP peer that accepts and then says nothing: the CLI gives up after ``--timeout`` and says so."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as listening:
        address = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        started = time.monotonic()
        done = vllm_nnrp(f"{address},{address}" if fleet else address, "chat", "--timeout", "1", "hi")
    assert done.returncode == 2 and done.stderr.rstrip().endswith(": timed out"), done.stderr
    assert time.monotonic() - started < 30


#: what a hostile peer puts in the text the CLI quotes: an OSC retitle, a screen clear, a forged line, NUL, a line
#: separator and a backslash escape already written out
EVIL = "\x1b]0;pwned\x07\x1b[2J\r\nvllm-nnrp: forged line\u2028\x00end\\x41"


@contextlib.contextmanager
def hostile_peer(answer: str):
    """An NNRP server on loopback (the project's sans-IO server core in a thread's loop) whose every word the CLI
    quotes is :data:`EVIL`: ``refuse`` rejects each session with it as the diagnostic; ``error`` accepts, then
    answers each submit with a ``response.error`` whose code and message hold it. Yields the address."""
    import asyncio
    import threading

    import orjson

    from vllm_nnrp_plugin.contract import wire_mapping
    from vllm_nnrp_plugin.core.operation import ResultPush
    from vllm_nnrp_plugin.nnrp_wire import events as wire_events
    from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

    async def serve(reader, writer) -> None:
        core = ServerConnection(max_in_flight_per_session=4)
        while data := await reader.read(65536):
            for event in core.receive_data(data):
                if isinstance(event, wire_events.SessionOpenRequested):
                    if answer == "refuse":
                        core.reject_session(event.request, 5, EVIL)
                    else:
                        core.accept_session(event.request)
                elif isinstance(event, wire_events.OperationSubmitted):
                    error = {"type": "response.error", "error": {"code": EVIL, "message": EVIL, "type": EVIL}}
                    metadata, body = wire_mapping.result_push(ResultPush(500, orjson.dumps(error)))
                    core.send_result_push(event.session_id, event.frame_id, metadata.pack(), body)
            writer.write(core.data_to_send())
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(serve, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.parametrize("fleet", [False, True], ids=["one address", "fleet"])
@pytest.mark.parametrize("answer", ["refuse", "error"])
def test_what_a_hostile_peer_says_reaches_stderr_escaped_on_one_line(answer, fleet):
    """A refusal's diagnostic and a ``response.error``'s code and message are the peer's words: the CLI quotes
    them with every control character escaped, so they cannot drive the terminal or forge a line."""
    with hostile_peer(answer) as address:
        done = vllm_nnrp(f"{address},{address}" if fleet else address, "chat", "--timeout", "5", "hi")
    assert done.returncode == (2 if answer == "refuse" else 1), done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), repr(done.stderr)
    line = done.stderr[:-1]
    assert line.isprintable(), repr(line)
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x0d\\x0avllm-nnrp: forged line\\u2028\\x00end\\\\x41" in line, line

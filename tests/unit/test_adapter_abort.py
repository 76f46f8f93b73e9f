"""An unfinished backend request is always aborted, even when the operation's task is cancelled while the
adapter winds it down (:func:`vllm_nnrp_plugin.adapter.run_operation`): a client cancel or a deadline that lands
while the backend stream is being closed must not skip the abort."""

from __future__ import annotations

import asyncio

import orjson

from tests.unit.test_properties import CAPABILITIES, MAX_BYTES, RecordingSink, envelope
from vllm_nnrp_plugin.adapter import AdapterLimits, Call, run_operation

CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}  # fmt: skip


class FailingSlowToCloseBackend:
    """Streams a few chunks, then an error item (vLLM's mid-stream error, so the adapter stops reading with the
    request unfinished); closing the stream takes ``close_s`` (vLLM's generator cleans up when closed)."""

    def __init__(self, close_s: float) -> None:
        self.close_s = close_s
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.closing = asyncio.Event()

    async def create(self, operation, body, request_id, traceparent=None):
        self.started.append(request_id)
        return Call(stream=self._stream())

    async def _stream(self):
        try:
            for _ in range(3):
                yield CHUNK
            yield {"error": {"message": "engine hiccup", "type": "InternalServerError", "code": 500}}
            await asyncio.sleep(3600)
        finally:
            self.closing.set()
            await asyncio.sleep(self.close_s)

    def engine_request_id(self, operation: str, request_id: str) -> str:
        return request_id

    async def abort(self, operation: str, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_cancel_while_the_backend_stream_closes_still_aborts_the_backend_request():
    async def scenario():
        backend = FailingSlowToCloseBackend(close_s=0.05)
        sink = RecordingSink()
        payload = orjson.dumps(envelope({"messages": [], "stream": True}))
        task = asyncio.ensure_future(run_operation(sink, payload, backend, AdapterLimits(MAX_BYTES), CAPABILITIES))
        await backend.closing.wait()  # the adapter is closing the stream after the error
        task.cancel()  # and the client cancels (or the deadline fires) right then
        await asyncio.wait([task])
        assert task.cancelled()
        return backend

    backend = asyncio.run(scenario())
    assert backend.aborted == backend.started, "the cancel skipped the abort: vLLM would go on generating"

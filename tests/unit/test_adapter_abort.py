"""An unfinished backend request is always aborted, even when the operation's task is cancelled while the
adapter winds it down (:func:`vllm_nnrp_plugin.core.adapter.run_operation`): a client cancel or a deadline that lands
while the backend stream is being closed must not skip the abort."""

from __future__ import annotations

import asyncio

import orjson

from tests.unit.test_properties import CAPABILITIES, MAX_BYTES, RecordingSink, envelope
from vllm_nnrp_plugin.core.adapter import AdapterLimits, Call, run_operation

CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
}


class FailingSlowToCloseBackend:
    """Streams a few chunks, then an error item (vLLM's mid-stream error, so the adapter stops reading with the
    request unfinished); closing the stream takes ``close_s`` (vLLM's generator cleans up when closed)."""

    def __init__(self, close_s: float) -> None:
        self.close_s = close_s
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.closing = asyncio.Event()

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        self.started.append(request_id)
        return Call(stream=self._stream())

    async def _stream(self):
        try:
            for _ in range(3):
                yield CHUNK
            yield {"error": {"message": "engine hiccup", "type": "InternalServerError", "code": 500}}
            await asyncio.sleep(3600)  # nothing more comes: the adapter closes the stream after the error
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


class StreamingBackend:
    """Streams ``CHUNK`` forever, one per loop iteration; ``create`` waits for ``created`` to be set (vLLM
    preparing the request); records aborts."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.created = asyncio.Event()
        self.streaming = asyncio.Event()

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        self.started.append(request_id)
        await self.created.wait()
        return Call(stream=self._stream())

    async def _stream(self):
        while True:
            yield CHUNK
            self.streaming.set()
            await asyncio.sleep(0)

    def engine_request_id(self, operation: str, request_id: str) -> str:
        return request_id

    async def abort(self, operation: str, request_id: str) -> None:
        self.aborted.append(request_id)  # what vLLM's AsyncLLM.abort does without waiting, then its ZMQ send


class AbortCapturingSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__()
        self.abort = None

    def abort_with(self, abort):
        self.abort = abort


def _start(backend):
    sink = AbortCapturingSink()
    payload = orjson.dumps(envelope({"messages": [], "stream": True}))
    task = asyncio.ensure_future(run_operation(sink, payload, backend, AdapterLimits(MAX_BYTES), CAPABILITIES))
    return sink, task


def test_the_owners_stop_aborts_the_streaming_request_in_the_same_callback_and_only_once():
    async def scenario():
        backend = StreamingBackend()
        backend.created.set()
        sink, task = _start(backend)
        await backend.streaming.wait()
        sink.abort()  # the service's stop_operation, in the callback that read the cancel
        assert backend.aborted == backend.started  # issued before any other task ran
        task.cancel()
        await asyncio.wait([task])
        return backend, sink

    backend, sink = asyncio.run(scenario())
    assert backend.aborted == backend.started  # not again: the engine surely knew the streaming request
    assert sink.observation.abort_accepted is True and sink.abort is None  # disarmed once the task ended


def test_a_stop_while_vllm_prepares_the_request_aborts_again_on_the_way_out():
    async def scenario():
        backend = StreamingBackend()
        sink, task = _start(backend)
        await asyncio.sleep(0)  # in create, before the engine knows the request
        sink.abort()
        first = list(backend.aborted)
        record_ns = sink.observation.abort_ns
        task.cancel()
        await asyncio.wait([task])
        return backend, sink, first, record_ns

    backend, sink, first, record_ns = asyncio.run(scenario())
    assert first == backend.started and backend.aborted == backend.started * 2
    assert sink.observation.abort_ns == record_ns  # the record keeps the first abort


def test_a_finished_request_is_never_aborted_by_a_late_stop():
    async def scenario():
        backend = FailingSlowToCloseBackend(close_s=0)
        sink = AbortCapturingSink()
        payload = orjson.dumps(envelope({"messages": [], "stream": False}))

        async def create(operation, body, request_id, traceparent=None, controls=None):
            return Call(body={"id": "x", "object": "chat.completion", "choices": []})

        backend.create = create
        await run_operation(sink, payload, backend, AdapterLimits(MAX_BYTES), CAPABILITIES)
        return backend, sink

    backend, sink = asyncio.run(scenario())
    assert sink.abort is None and backend.aborted == [] and sink.observation.abort_accepted is None

"""The benchmark server process: the plugin's real server path (listener, session pumps, adapter, vLLM's SSE
parsing) in front of a paced synthetic backend instead of a model.

    python -m bench.server [--no-nodelay] URI [URI …]

prints ``ready``, serves until its stdin closes, then prints every observation record as one JSON line,
then one line ``{"pump_wait_ns": […], "send_ns": […], "cpu_s": …}`` and exits: per partial result, the time
it waited in the session pump's outbox (queued -> send started) and the time spent inside nnrp-py's send
call; and the CPU time (s, all threads) the process used while serving. Requests choose the stream in their body: ``n``
chunks, one every ``interval_us`` µs. Each chunk is the
SSE string vLLM would yield, ``data: {chat.completion.chunk}``, whose delta text is the
``time.monotonic_ns()`` at which the backend produced it followed by a space (deltas the server merged carry
several); the clock is shared by every process of the host,
so a client in another process measures backend chunk produced -> event received. ``--no-nodelay`` skips the
listener's TCP_NODELAY step (what nnrp-py does alone: Nagle on). Both the send timings and ``--no-nodelay`` go
through the listener's explicit hooks (:class:`~vllm_nnrp_plugin.nnrp_binding.listener.ListenerHooks`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import attrs
import orjson
from prometheus_client import CollectorRegistry

from vllm_nnrp_plugin.config import NNRPConfig
from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.core.operation import PartialResult
from vllm_nnrp_plugin.nnrp_binding.listener import ListenerHooks
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile.capabilities import chat_operation, runtime_document
from vllm_nnrp_plugin.service import NNRPService
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import vllm_chunks


class PacedBackend:
    """A :class:`~vllm_nnrp_plugin.core.adapter.Backend` producing ``n`` timestamped chunks at a fixed pace."""

    def capabilities(self) -> dict[str, Any]:
        return runtime_document(models=["paced"], owned_by="bench", operations=[chat_operation(tool_calls=False)])

    async def create(
        self, operation, body: dict[str, Any], request_id: str, traceparent: str | None = None, controls: Any = None
    ) -> Call:
        return Call(stream=vllm_chunks(self._sse(request_id, int(body["n"]), int(body["interval_us"]) * 1000)))

    def engine_request_id(self, operation, request_id: str) -> str:
        return request_id

    async def abort(self, operation, request_id: str) -> None:
        """Nothing to stop: the stream generator is closed by the adapter (the record has the abort time)."""

    @staticmethod
    async def _sse(request_id: str, n: int, interval_ns: int):
        head = b'data: {"id":"chatcmpl-' + request_id.encode() + b'","object":"chat.completion.chunk","created":0,'
        head += b'"model":"paced","choices":[{"index":0,"delta":{"content":"'
        tail = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        start = time.monotonic_ns()
        for i in range(n):
            delay = start + i * interval_ns - time.monotonic_ns()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            yield (head + str(time.monotonic_ns()).encode() + b" " + tail).decode()
        yield (head + b'"},"logprobs":null,"finish_reason":"length"}]}\n\n').decode()  # vLLM ends every choice
        yield "data: [DONE]\n\n"


class SendTimes:
    """A :class:`~vllm_nnrp_plugin.nnrp_binding.server_operation.SendProbe`: per partial result, the time it
    waited in the session pump's outbox (queued -> send started) and the time inside nnrp-py's send call."""

    def __init__(self) -> None:
        self.pump_wait_ns: list[int] = []
        self.send_ns: list[int] = []
        self._queued: dict[int, int] = {}

    def queued(self, action: PartialResult) -> None:
        self._queued[id(action)] = time.monotonic_ns()

    def sent(self, action: PartialResult, started_ns: int, ended_ns: int) -> None:
        queued = self._queued.pop(id(action), None)
        if queued is not None:
            self.pump_wait_ns.append(started_ns - queued)
        self.send_ns.append(ended_ns - started_ns)


async def serve(listen: tuple[str, ...], *, tcp_nodelay: bool = True) -> None:
    loop = asyncio.get_running_loop()
    times = SendTimes()
    records: list[Observation] = []
    config = NNRPConfig(enabled=True, listen=listen)
    service = NNRPService(
        config,
        PacedBackend(),
        loop,
        registry=CollectorRegistry(),
        observers=(records.append,),
        hooks=ListenerHooks(send_probe=times, tcp_nodelay=tcp_nodelay),
    )
    await service.start()
    print("ready", flush=True)
    cpu_start = time.process_time()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await service.stop()
    for record in records:
        sys.stdout.write(orjson.dumps(attrs.asdict(record)).decode() + "\n")
    done = {"pump_wait_ns": times.pump_wait_ns, "send_ns": times.send_ns, "cpu_s": time.process_time() - cpu_start}
    sys.stdout.write(orjson.dumps(done).decode() + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    args = sys.argv[1:]
    nodelay = not (args and args[0] == "--no-nodelay")
    asyncio.run(serve(tuple(args if nodelay else args[1:]), tcp_nodelay=nodelay))

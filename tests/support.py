"""Test helpers: recorded vLLM outputs (compat/fixtures) and a backend that replays them.

The replaying backend feeds the adapter exactly what vLLM 0.26.0 produced through the path production uses:
SSE strings through :func:`vllm_nnrp_plugin.vllm_binding.chunk_shapes.vllm_chunks` (parser, normaliser and the
recorded request's token budget), error bodies through the error mapping of
:mod:`vllm_nnrp_plugin.vllm_binding.chat`.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import pathlib
import types
from typing import Any

import orjson

from compat.launcher import free_port
from vllm_nnrp_plugin.core.adapter import Call
from vllm_nnrp_plugin.profile.capabilities import chat_operation, runtime_document
from vllm_nnrp_plugin.profile.chat_stream import TextDelta
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import TokenBudget, VLLMStream, vllm_chunks
from vllm_nnrp_plugin.vllm_binding.serving import error_from_response

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "compat" / "fixtures" / "vllm" / "0.26.0"
#: ``--max-model-len`` of the servers the fixtures were recorded from (compat/fixtures/vllm/README.md)
RECORDED_MAX_MODEL_LEN = 2048


def sse_items(case: str, version: str = "0.26.0") -> list[str]:
    """The ``data: …`` items of a recorded stream, each as vLLM's generator yields it."""
    text = (FIXTURES.parent / version / f"{case}.sse").read_text()
    return [block + "\n\n" for block in text.split("\n\n") if block.strip()]


def recorded_budget(case: str, version: str = "0.26.0") -> TokenBudget:
    """The token budget vLLM gave the recorded request (its ``max_tokens``; the recording server's context)."""
    request = orjson.loads((FIXTURES.parent / version / f"{case}.request.json").read_bytes())
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    return TokenBudget(limit, RECORDED_MAX_MODEL_LEN)


def recorded_chunks(case: str, version: str = "0.26.0") -> list[dict[str, Any]]:
    """The chunks of a recorded stream as production hands them to the mapper (:class:`VLLMStream`, the core
    of :func:`vllm_chunks`, with the recorded request's budget), each as a dict (a text-only chunk handed over as a
    :class:`TextDelta` is given as the chunk it stands for)."""
    stream = VLLMStream(recorded_budget(case, version))
    return [as_dict(chunk) for item in sse_items(case, version) for chunk in stream.feed(item)] + stream.end()


def as_dict(chunk: dict[str, Any] | TextDelta) -> dict[str, Any]:
    """The chunk dict a :class:`TextDelta` stands for (a dict as it is)."""
    return chunk.chunk() if isinstance(chunk, TextDelta) else chunk


def recorded_json(case: str) -> dict[str, Any]:
    return orjson.loads((FIXTURES / f"{case}.json").read_bytes())


def error_response(case: str) -> Any:
    """A recorded ``{"error": {...}}`` body as an object shaped like vLLM's ErrorResponse."""
    return types.SimpleNamespace(error=types.SimpleNamespace(**recorded_json(case)["error"]))


class RecordedBackend:
    """A :class:`Backend` whose answers are recorded vLLM outputs, chosen by ``body["model"]``:

    * ``<case>`` with a ``.sse`` recording: replay the stream (``body["pace_s"]`` seconds before each item, or
      before each ``body["burst"]`` items; ``body["repeat"]`` times over);
    * ``<case>`` with a ``.json`` recording: the non-streaming body, or the error it holds;
    * ``raise``: raise RuntimeError (an engine failure vLLM did not wrap);
    * ``midstream-error``: two recorded chunks, then vLLM's mid-stream error object.

    ``started`` / ``aborted`` list request ids; ``traceparents`` maps request ids to the traceparent they
    were dispatched with; ``open_streams`` counts streams not yet closed.
    """

    def __init__(self, *, tool_calls: bool = True) -> None:
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.traceparents: dict[str, str | None] = {}
        self.open_streams = 0
        self._tool_calls = tool_calls

    def capabilities(self) -> dict[str, Any]:
        return runtime_document(
            models=["example-model"], owned_by="recorded", operations=[chat_operation(tool_calls=self._tool_calls)]
        )

    async def create(
        self, operation, body: dict[str, Any], request_id: str, traceparent: str | None = None, controls: Any = None
    ) -> Call:
        self.started.append(request_id)
        self.traceparents[request_id] = traceparent
        case = body.get("model", "a-stream-text")
        if case == "raise":
            raise RuntimeError("engine exploded")
        if case == "midstream-error":
            items = sse_items("a-stream-text")[:2] + [
                'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
            ]
            return Call(stream=self._replay(items, 0.0))
        if (FIXTURES / f"{case}.sse").exists():
            items = sse_items(case)
            items = items[:-1] * int(body.get("repeat", 1)) + items[-1:]
            pace_s, burst = float(body.get("pace_s", 0.0)), int(body.get("burst", 1))
            return Call(stream=self._replay(items, pace_s, recorded_budget(case), burst))
        recorded = recorded_json(case)
        if "error" in recorded:
            raise error_from_response(error_response(case))
        return Call(body=recorded)

    def engine_request_id(self, operation, request_id: str) -> str:
        return f"chatcmpl-{request_id}"  # as vLLM, whose outputs this replays

    async def abort(self, operation, request_id: str) -> None:
        self.aborted.append(request_id)

    def _replay(self, items: list[str], pace_s: float, budget: TokenBudget | None = None, burst: int = 1):
        async def generator():
            self.open_streams += 1
            try:
                for i, item in enumerate(items):
                    if pace_s and i % burst == 0:
                        await asyncio.sleep(pace_s)
                    yield item
            finally:
                self.open_streams -= 1

        return vllm_chunks(generator(), budget)


def envelope(body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"schema_version": "openai-compatible/1", "operation": "chat.completions.create", "body": body, **extra}


def two_free_ports() -> int:
    """A port P with P and P + 1 both free (rank 1 of 2 listens on P + 1)."""
    return free_port(span=2)


class ServedNNRP:
    """An NNRPService with ``backend`` (default a :class:`RecordedBackend`) on its own event-loop thread
    (standing in for vLLM's loop); ``config`` keys are :class:`NNRPConfig` fields; ``api_keys``: vLLM's API keys
    the service requires on network carriers (none: no key). As the vLLM binding's start-up does
    (:func:`vllm_nnrp_plugin.vllm_binding.lifecycle.start_service`), ``fault_injection_backend_error_model``
    wraps the backend the service is given; :attr:`backend` stays the one passed in."""

    def __init__(
        self, listen: tuple[str, ...], backend: Any = None, *, api_keys: tuple[str, ...] = (), **config: Any
    ) -> None:
        import threading

        from vllm_nnrp_plugin.config import NNRPConfig
        from vllm_nnrp_plugin.nnrp_binding.authentication import APIKeys
        from vllm_nnrp_plugin.service import NNRPService
        from vllm_nnrp_plugin.vllm_binding.fault_injection import with_fault_injection

        self.backend = backend if backend is not None else RecordedBackend()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        keys = APIKeys(api_keys) if api_keys else None
        settings = NNRPConfig(enabled=True, listen=listen, **config)
        served = with_fault_injection(self.backend, settings.fault_injection_backend_error_model)
        self.service = NNRPService(settings, served, self.loop, keys=keys)
        self.bound = asyncio.run_coroutine_threadsafe(self.service.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` every 10 ms until it is true or ``timeout_s`` passed; returns its last value."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


async def until(predicate, timeout_s: float = 5.0) -> bool:
    """On an event loop: :func:`wait_until` for what another thread or task does (a server's own loop, a
    background task), where nothing signals it; polls every 10 ms, returns ``predicate``'s last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return bool(predicate())


def metric(name: str, **labels: str) -> float:
    """A sample of the NNRP metrics as a scrape of vLLM's ``/metrics`` reads it: ``name`` (with its ``_total``
    suffix for a counter) for ``labels`` in ``prometheus_client.REGISTRY``, where a :class:`ServedNNRP`
    registers them (the process's: every service in it counts there); 0 before the first count."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def self_signed(tmp_path, name="localhost"):
    """A PEM certificate + key for ``name`` and 127.0.0.1; returns (cert path, key path, cert DER)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path), cert.public_bytes(serialization.Encoding.DER)

"""The adapter: one submitted operation -> one backend call -> ordered profile events -> one terminal.

It joins the profile (envelope, stream mapping) to a :class:`ChatBackend` (vLLM's serving object in
production, a scripted backend fed with recorded vLLM chunks in unit tests) and to an
:class:`OperationSink` (the NNRP operation in production, a list in unit tests). It owns the rule that a
backend request is always aborted unless it finished: on cancel, client loss, error, or shutdown. It records
the request, backend timing, token usage and the abort into the sink's
:class:`~vllm_nnrp_plugin.observation.Observation`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import attrs

from vllm_nnrp_plugin.observation import Observation
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper
from vllm_nnrp_plugin.profile.envelope import decode_envelope

logger = logging.getLogger(__name__)

OPERATIONS = frozenset({CHAT_COMPLETIONS_CREATE})


@attrs.frozen
class ChatCall:
    """What the backend returned: ``body`` (a ``chat.completion`` dict) when not streaming, else ``stream``
    (an async iterator of ``chat.completion.chunk`` dicts; an ``{"error": …}`` dict reports a mid-stream
    error)."""

    body: dict[str, Any] | None = None
    stream: AsyncIterator[dict[str, Any]] | None = None


class ChatBackend(Protocol):
    """The backend surface the adapter needs (implemented by :mod:`vllm_nnrp_plugin.vllm_binding.chat`)."""

    async def create_chat_completion(self, body: dict[str, Any], request_id: str) -> ChatCall:
        """Start one chat completion under ``request_id``; raises :class:`ProfileError` when refused."""

    async def abort(self, request_id: str) -> None:
        """Abort the engine request started under ``request_id`` (unknown ids are a no-op)."""


class OperationSink(Protocol):
    """Where events go (implemented by :class:`vllm_nnrp_plugin.nnrp_binding.session.ServerOperation`)."""

    observation: Observation

    def envelope_bytes(self) -> bytes: ...

    def partial(self, event: dict[str, Any]) -> None: ...

    def complete(self, body: dict[str, Any]) -> None: ...

    def fail(self, err: E.ProfileError) -> None: ...


@attrs.frozen
class AdapterLimits:
    """``max_envelope_bytes``: the largest envelope accepted (bytes)."""

    max_envelope_bytes: int


_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")


def engine_request_id(envelope_request_id: str | None) -> str:
    """A unique vLLM request id, ``nnrp-[<envelope request_id>-]<12 hex>``; vLLM's engine id is
    ``chatcmpl-`` + this (vllm-integration.md §4, request ids)."""
    suffix = uuid.uuid4().hex[:12]
    if envelope_request_id:
        return f"nnrp-{_UNSAFE.sub('_', envelope_request_id)[:64]}-{suffix}"
    return f"nnrp-{suffix}"


async def run_operation(sink: OperationSink, backend: ChatBackend, limits: AdapterLimits) -> None:
    """Serve one operation to its terminal.

    Never raises for bad input or backend failures: they become ``response.error``. Task cancellation
    (client cancel, client gone, shutdown) propagates after the backend request was aborted.
    """
    try:
        envelope = decode_envelope(sink.envelope_bytes(), operations=OPERATIONS, max_bytes=limits.max_envelope_bytes)
    except E.ProfileError as err:
        sink.fail(err)
        return
    request_id = engine_request_id(envelope.request_id)
    record = sink.observation
    record.started(
        time.monotonic_ns(),
        operation=envelope.operation,
        model=envelope.body.get("model"),
        request_id=f"chatcmpl-{request_id}",
        diagnostics=envelope.nnrp.get("diagnostics") is True,
    )
    finished = False
    stream: AsyncIterator[dict[str, Any]] | None = None
    try:
        call = await backend.create_chat_completion(envelope.body, request_id)
        if call.stream is None:
            finished = True
            record.backend_done(time.monotonic_ns())
            _record_usage(record, call.body)
            sink.complete(call.body)
            return
        stream = call.stream
        mapper = ChatStreamMapper()
        async for chunk in stream:
            if record.backend_first_chunk_ns is None:
                record.backend_chunk(time.monotonic_ns())
            for event in mapper.feed(chunk):
                sink.partial(event)
        finished = True
        record.backend_done(time.monotonic_ns())
        body = mapper.completed_body()
        _record_usage(record, body)
        sink.complete(body)
    except E.ProfileError as err:
        sink.fail(err)
    except Exception as exc:  # the engine failed in a way vLLM did not wrap
        logger.exception("NNRP operation %s failed in the backend", request_id)
        sink.fail(E.backend_error(f"{type(exc).__name__}: {exc}"))
    finally:
        if stream is not None:
            await _close(stream)
        if not finished:
            await asyncio.shield(_abort(backend, request_id, record))


def _record_usage(record: Observation, body: dict[str, Any]) -> None:
    usage = body.get("usage")
    if usage:
        record.usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))


async def _abort(backend: ChatBackend, request_id: str, record: Observation) -> None:
    issued = time.monotonic_ns()
    try:
        await backend.abort(request_id)
    except Exception:  # the engine may already be gone (shutdown); nothing is left to stop then
        logger.warning("aborting backend request %s failed", request_id, exc_info=True)
        record.aborted(issued, accepted=False)
    else:
        record.aborted(issued, accepted=True)


async def _close(stream: AsyncIterator[dict[str, Any]]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # closing a generator that already failed
            logger.debug("closing the backend stream failed", exc_info=True)

"""The adapter: one submitted operation -> one backend call -> ordered profile events -> one terminal.

It joins the profile (envelope, stream mapping) to a :class:`Backend` (vLLM's serving objects in
production, a scripted backend fed with recorded vLLM outputs in unit tests) and to an
:class:`OperationSink` (the NNRP operation in production, a list in unit tests). It owns the rule that a
backend request is always aborted unless it finished: on cancel, client loss, error, timeout or shutdown — on
a stop by the operation's owner at once, in the callback that decided the stop (:meth:`OperationSink.abort_with`),
before the operation's task even sees its cancel. When it aborts is the backend request's lifecycle table's
decision (:mod:`vllm_nnrp_plugin.core.backend_request`).

Before dispatch it decodes the envelope (already unwrapped from the submit frame by the NNRP binding) against
the capability document (only advertised operations, plus the capability fetch ``nnrp.capabilities``),
reports ``nnrp.timeout_ms`` to the sink (the service turns it into a timer), and takes the operation's trace
context at the moment of dispatch (the ``openai-compatible/1`` profile's TRACE_CONTEXT mapping: the context
an operation runs in is fixed when it is dispatched). It applies the envelope's ``nnrp.priority_class`` to the
operation's runtime controls (:mod:`vllm_nnrp_plugin.core.controls`), never dispatches an operation whose bound already
passed, and hands the controls to the backend, which reports the engine's prefix-cache hits back (they go into
``response.usage``: :func:`~vllm_nnrp_plugin.profile.events.with_cached_tokens`; bodies stay vLLM's).
It records the request, backend timing, token usage, the controls and the abort into the sink's
:class:`~vllm_nnrp_plugin.observability.observation.Observation`.

Every operation runs the same way; what differs per operation is only the stream mapper that turns the
backend's stream items into profile events (:data:`STREAM_MAPPERS`). An operation the backend answers with a
body (non-streaming, ``models.list``, ``embeddings.create``) ends with ``response.completed {body}``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

import attrs

from vllm_nnrp_plugin.core.backend_request import BackendRequest
from vllm_nnrp_plugin.core.backend_request import Input as BackendInput
from vllm_nnrp_plugin.core.backend_request import State as BackendState
from vllm_nnrp_plugin.core.controls import RuntimeControls, priority_class_of
from vllm_nnrp_plugin.core.eager import start_now
from vllm_nnrp_plugin.observability.log_safety import traceback_text
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, RESPONSES_CREATE
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import CAPABILITIES_OPERATION, operation_names
from vllm_nnrp_plugin.profile.chat_stream import ChatStreamMapper, usage_asked
from vllm_nnrp_plugin.profile.envelope import Envelope, decode_envelope
from vllm_nnrp_plugin.profile.events import USAGE, with_cached_tokens
from vllm_nnrp_plugin.profile.responses_stream import ResponsesStreamMapper
from vllm_nnrp_plugin.profile.tool_calls import tools_without_required_arguments
from vllm_nnrp_plugin.profile.trace import TraceContext

logger = logging.getLogger(__name__)


@attrs.frozen
class Call:
    """What the backend returned: ``body`` (the operation's OpenAI object, e.g. a ``chat.completion``) when not
    streaming, else ``stream`` (an async iterator of the operation's stream items: ``chat.completion.chunk`` dicts
    for chat, a text-only one possibly as a :class:`~vllm_nnrp_plugin.profile.chat_stream.TextDelta`; vLLM's
    Responses streaming events as dicts for ``responses.create``; an error item reports a mid-stream error)."""

    body: dict[str, Any] | None = None
    stream: AsyncIterator[Any] | None = None


class Backend(Protocol):
    """The backend surface the adapter needs (implemented by :mod:`vllm_nnrp_plugin.vllm_binding.backend`)."""

    def capabilities(self) -> dict[str, Any]:
        """The runtime capability document of what this backend serves
        (:func:`vllm_nnrp_plugin.profile.capabilities.runtime_document`)."""

    async def create(
        self,
        operation: str,
        body: dict[str, Any],
        request_id: str,
        traceparent: str | None = None,
        controls: RuntimeControls | None = None,
    ) -> Call:
        """Start ``operation`` (one the capability document lists) with ``body`` under ``request_id``, in the W3C
        trace ``traceparent`` when given, steered by the operation's runtime ``controls`` (the backend applies
        its priority and token budget and reports what the engine did: :mod:`vllm_nnrp_plugin.core.controls`);
        raises :class:`ProfileError` when refused."""

    def engine_request_id(self, operation: str, request_id: str) -> str:
        """The id the engine knows the request started under ``request_id`` by (recorded in the observation)."""

    async def abort(self, operation: str, request_id: str) -> None:
        """Abort the engine request started under ``request_id`` (unknown ids are a no-op)."""


class StreamMapper(Protocol):
    """Turns one operation's backend stream items into profile events (:mod:`vllm_nnrp_plugin.profile`)."""

    def feed(self, item: Any) -> Iterable[dict[str, Any]]:
        """The events one stream item gives; raises :class:`ProfileError` for an error item."""

    def finish(self) -> Iterable[dict[str, Any]]:
        """The events due when the stream ended normally (e.g. ``response.tool_call.completed``)."""

    def completed_body(self) -> dict[str, Any]:
        """The ``body`` of the terminal ``response.completed`` of a streamed operation."""

    def fail_open_calls(self, err: E.ProfileError) -> Iterable[dict[str, Any]]:
        """``response.tool_call.error`` for every call still open when the operation fails with ``err``."""


#: operation -> the stream mapper of one streamed request of it, made from the request's ``body``
STREAM_MAPPERS: dict[str, Callable[[dict[str, Any]], StreamMapper]] = {
    CHAT_COMPLETIONS_CREATE: lambda body: ChatStreamMapper(
        usage_events=usage_asked(body), no_argument_tools=tools_without_required_arguments(body.get("tools"))
    ),
    RESPONSES_CREATE: lambda body: ResponsesStreamMapper(tools_without_required_arguments(body.get("tools"))),
}


class OperationSink(Protocol):
    """Where events go (implemented by :class:`vllm_nnrp_plugin.nnrp_binding.server_operation.ServerOperation`)."""

    @property
    def observation(self) -> Observation: ...

    controls: RuntimeControls

    def partial(self, event: dict[str, Any]) -> None: ...

    def complete(self, body: dict[str, Any]) -> None: ...

    def fail(self, err: E.ProfileError) -> None: ...

    def limit_time(self, timeout_ms: int) -> None:
        """Bound the operation to ``timeout_ms`` (ms) from its submit (envelope ``nnrp.timeout_ms``)."""

    def expired(self) -> bool:
        """True when the operation's bound passed before dispatch: it ended (an NNRP deadline's
        ``deadline_expired`` drop) and must not reach the backend."""

    def dispatch(self) -> TraceContext | None:
        """The operation is handed to the backend now: its priority class is fixed; freeze and return its trace
        context."""

    def abort_with(self, abort: Callable[[], None] | None) -> None:
        """``abort()`` stops the backend request at once (``None``: nothing to stop any more); the operation's
        owner calls it the moment the operation is told to stop, before its task sees the cancel."""


@attrs.frozen
class AdapterLimits:
    """``max_envelope_bytes``: the largest envelope accepted (bytes)."""

    max_envelope_bytes: int


_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")


def new_request_id(envelope_request_id: str | None) -> str:
    """A new, unique request id for the backend, ``nnrp-[<envelope request_id>-]<12 hex>`` (the envelope's
    id made safe and cut to 64 characters); the engine's own id is :meth:`Backend.engine_request_id` of
    it."""
    suffix = uuid.uuid4().hex[:12]
    if envelope_request_id:
        return f"nnrp-{_UNSAFE.sub('_', envelope_request_id)[:64]}-{suffix}"
    return f"nnrp-{suffix}"


async def run_operation(
    sink: OperationSink,
    envelope_payload: bytes | E.ProfileError,
    backend: Backend,
    limits: AdapterLimits,
    capabilities: dict[str, Any],
) -> None:
    """Serve one operation to its terminal.

    ``envelope_payload`` is the JSON envelope of the submit, or the ``invalid_frame`` error its frame raised
    (it becomes the terminal ``response.error``).

    ``capabilities`` is the runtime capability document: its operations are the only ones accepted
    (others: ``unsupported_operation``); the operation ``nnrp.capabilities`` answers with the document itself
    as ``response.completed {body: <document>}``. Never raises for bad input, backend failures or a failure of
    its own: they become ``response.error`` (an exception no layer turned into a profile error is logged once
    with its traceback, and the client learns only its type: :func:`~vllm_nnrp_plugin.profile.errors.failure`;
    one raised while the envelope is decoded is that envelope's ``invalid_envelope``), so the task always ends
    normally and the operation's slots are given back. Only task cancellation (client cancel, client gone,
    timeout, shutdown) propagates, after the backend request was aborted.
    """
    operations = operation_names(capabilities) | {CAPABILITIES_OPERATION}
    if isinstance(envelope_payload, E.ProfileError):
        _fail_safely(sink, envelope_payload)
        return
    try:
        envelope = decode_envelope(envelope_payload, operations=operations, max_bytes=limits.max_envelope_bytes)
    except E.ProfileError as err:
        _fail_safely(sink, err)
        return
    except Exception as exc:  # noqa: BLE001 - a bug decoding this client's input ends this operation only
        _log_unexpected(sink, "decoding its envelope", exc)
        _fail_safely(
            sink, E.ProfileError(E.INVALID_ENVELOPE, f"the envelope could not be decoded ({type(exc).__name__})")
        )
        return
    try:
        await _serve(sink, envelope, backend, capabilities)
    except Exception as exc:  # noqa: BLE001 - a bug on this operation's path ends this operation only
        _log_unexpected(sink, "serving it", exc)
        _fail_safely(sink, E.failure(exc))


def _log_unexpected(sink: OperationSink, stage: str, exc: BaseException) -> None:
    """Log ``exc``, once, with its traceback: the server's record of what failed (never sent to the client), its
    messages escaped and bounded (they may quote the request:
    :func:`~vllm_nnrp_plugin.observability.log_safety.traceback_text`)."""
    record = sink.observation
    logger.error(
        "NNRP operation %d of session %d failed while %s\n%s",
        record.operation_id,
        record.session_id,
        stage,
        traceback_text(exc),
    )


def _fail_safely(sink: OperationSink, err: E.ProfileError) -> None:
    """``sink.fail(err)`` (a no-op once a terminal was decided); a sink that raises is logged, not raised."""
    try:
        sink.fail(err)
    except Exception as exc:  # noqa: BLE001 - the sink itself is broken: nothing more can be told to the client
        logger.error(
            "NNRP operation %d: its error terminal cannot be queued\n%s",
            sink.observation.operation_id,
            traceback_text(exc),
        )


async def _serve(sink: OperationSink, envelope: Envelope, backend: Backend, capabilities: dict[str, Any]) -> None:
    """:func:`run_operation` once the envelope decoded: record it, then the capability fetch or the backend
    call to its terminal. Raises only for a bug (and task cancellation)."""
    record = sink.observation
    capabilities_fetch = envelope.operation == CAPABILITIES_OPERATION
    request_id = new_request_id(envelope.request_id)
    model = None if capabilities_fetch else envelope.body.get("model")
    record.started(
        time.monotonic_ns(),
        operation=envelope.operation,
        model=model if type(model) is str else None,  # anything else is the backend's to refuse, never recorded
        request_id=None if capabilities_fetch else backend.engine_request_id(envelope.operation, request_id),
        diagnostics=envelope.nnrp.get("diagnostics") is True,
    )
    if envelope.timeout_ms is not None:
        sink.limit_time(envelope.timeout_ms)
    if capabilities_fetch:
        sink.complete(capabilities)
        return
    controls = sink.controls
    if envelope.priority_class is not None and controls.own_class is None:  # a PRIORITY_UPDATE came after it
        controls.update_priority(priority_class_of(envelope.priority_class))
    if sink.expired():  # its NNRP deadline passed before dispatch: it never reaches the backend
        record.steered(controls)
        return
    stream: AsyncIterator[Any] | None = None
    mapper: StreamMapper | None = None
    abort = _BackendAbort(backend, envelope.operation, request_id, record)
    sink.abort_with(abort.now)
    try:
        trace = sink.dispatch()
        call = await backend.create(
            envelope.operation,
            envelope.body,
            request_id,
            trace.traceparent() if trace is not None else None,
            controls,
        )
        if call.stream is None:
            abort.finished()
            sink.abort_with(None)
            record.backend_done(time.monotonic_ns())
            assert call.body is not None  # a Call has a body or a stream
            _record_usage(record, call.body)
            sink.complete(call.body)
            return
        stream = call.stream
        mapper = STREAM_MAPPERS[envelope.operation](envelope.body)
        async for chunk in stream:
            if record.backend_first_chunk_ns is None:
                record.backend_chunk(time.monotonic_ns())
                abort.streamed()
            for event in mapper.feed(chunk):
                if event["type"] == USAGE and controls.cached_tokens is not None:
                    event = with_cached_tokens(event, controls.cached_tokens)
                sink.partial(event)
        abort.finished()
        sink.abort_with(None)
        for event in mapper.finish():
            sink.partial(event)
        record.backend_done(time.monotonic_ns())
        body = mapper.completed_body()
        _record_usage(record, body)
        sink.complete(body)
    except E.ProfileError as err:
        _fail(sink, mapper, err)
    except Exception as exc:  # the engine failed in a way vLLM did not wrap (or the stream mapping did)
        logger.error("NNRP operation %s failed in the backend\n%s", request_id, traceback_text(exc))
        _fail(sink, mapper, E.failure(exc))
    finally:
        record.steered(controls)
        sink.abort_with(None)
        if stream is not None or not abort.is_finished:
            await _through_cancels(asyncio.ensure_future(_release(stream, None if abort.is_finished else abort)))


def _record_usage(record: Observation, body: dict[str, Any]) -> None:
    """Tokens of OpenAI's ``usage``: ``prompt_tokens``/``completion_tokens`` (chat, embeddings) or
    ``input_tokens``/``output_tokens`` (a Responses ``response`` object)."""
    usage = body.get("usage")
    if isinstance(usage, dict) and usage:  # a malformed stream may carry anything there: record only counts
        record.usage(
            _count(usage.get("prompt_tokens", usage.get("input_tokens"))),
            _count(usage.get("completion_tokens", usage.get("output_tokens"))),
        )


def _count(value: Any) -> int | None:
    return value if type(value) is int else None


def _fail(sink: OperationSink, mapper: StreamMapper | None, err: E.ProfileError) -> None:
    """End open tool calls with ``response.tool_call.error``, then the operation with ``response.error``."""
    if mapper is not None:
        for event in mapper.fail_open_calls(err):
            sink.partial(event)
    sink.fail(err)


async def _release(stream: AsyncIterator[dict[str, Any]] | None, abort: _BackendAbort | None) -> None:
    """Close the backend stream, then abort the backend request (unless it finished: ``abort`` is ``None``)."""
    if stream is not None:
        await _close(stream)
    if abort is not None:
        await abort.last()


async def _through_cancels(release: asyncio.Future) -> None:
    """Wait for ``release`` to finish even when this task is cancelled again meanwhile (a deadline firing
    after a client cancel, the server stopping), then re-raise that cancel: an unfinished vLLM request is
    always aborted, and the task ends only once it was."""
    cancelled = False
    while not release.done():
        try:
            await asyncio.shield(release)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


class _BackendAbort:
    """The abort of one operation's backend request, as its lifecycle table decides
    (:mod:`vllm_nnrp_plugin.core.backend_request`): :meth:`now` when its owner stops it (started at once, in that very
    callback, :func:`~vllm_nnrp_plugin.core.eager.start_now`), and :meth:`last` on the adapter's way out, which aborts
    again after an abort that came before the backend streamed (and was accepted), and aborts a request not
    aborted yet. The record keeps the first abort."""

    __slots__ = ("_backend", "_operation", "_request_id", "_record", "_request", "_early")

    def __init__(self, backend: Backend, operation: str, request_id: str, record: Observation) -> None:
        self._backend, self._operation, self._request_id, self._record = backend, operation, request_id, record
        self._request = BackendRequest()
        self._early: asyncio.Future[None] | None = None  # the abort :meth:`now` started

    @property
    def is_finished(self) -> bool:
        """The backend's stream ended: nothing is left to abort."""
        return self._request.state is BackendState.FINISHED

    def streamed(self) -> None:
        """The backend's first output came: the engine knows the request."""
        self._request.step(BackendInput.STREAM)

    def finished(self) -> None:
        """The backend's stream ended (or its whole result came)."""
        self._request.step(BackendInput.FINISH)

    def now(self) -> None:
        if self._request.step(BackendInput.STOP):
            self._early = start_now(self._issue())

    async def last(self) -> None:
        if self._early is not None:
            await self._early  # a refusal moved the request to GONE
        if self._request.step(BackendInput.RELEASE):
            await self._issue()

    async def _issue(self) -> None:
        issued = time.monotonic_ns()
        try:
            await self._backend.abort(self._operation, self._request_id)
        except Exception:  # the engine may already be gone (shutdown); nothing is left to stop then
            logger.warning("aborting backend request %s failed", self._request_id, exc_info=True)
            accepted = False
            self._request.step(BackendInput.REFUSED)
        else:
            accepted = True
        if self._record.abort_ns is None:
            self._record.aborted(issued, accepted=accepted)


async def _close(stream: AsyncIterator[dict[str, Any]]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # closing a generator that already failed
            logger.debug("closing the backend stream failed", exc_info=True)

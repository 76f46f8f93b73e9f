"""One pump thread per NNRP server session: polls incoming frames, flushes outgoing ones.

Why a thread per session (nnrp-sdk.md §11–12): every native call blocks; while a poll waits inside its
timeout, every other native call on the same session (our sends) waits for it too (trap 1); and a poll with
``max_events > 1`` lingers ~2.3 ms (trap 2). So the pump is the only thread that touches its session: it
alternates a ``max_events=1`` poll with flushing the outbox. An empty poll with nnrp-py's shortest timeout
(1 ms) lasts ~2.2 ms, and events queued meanwhile wait for it; so while operations are active the pump
polls on a cadence instead of after every send: after an empty poll it only sends, waking on the outbox so
a queued event goes out within microseconds, for ``ACTIVE_POLL_GAP_S``, then polls again (cancels are seen
within ~2–4 ms while events flow). While no event goes out the gap doubles up to ``MAX_POLL_GAP_S``, so slow
streams wake the pump (and take vLLM's GIL) less often. When idle it polls with ``idle_poll_ms`` (a submit
wakes that poll at once).

Cross-thread contract: :class:`ServerOperation` methods ``partial`` / ``complete`` / ``fail`` may be called
from any thread (vLLM's event loop, in practice); they never block on I/O. The pump reports submits, peer
cancellations, deadlines and finished operations to a :class:`SessionHandler` through
``loop.call_soon_threadsafe``.

Each operation's :class:`~vllm_nnrp_plugin.observation.Observation` is filled here with what only the pump
knows (ids, when each partial result and the terminal went out, cancellations, the trace context it was
dispatched with) and handed to ``on_finished`` once both the terminal was sent and the operation's task
ended (:meth:`ServerOperation.settle`).

Runtime metadata the pump reads besides cancels (nnrp-sdk.md §4, §8):

* ``DEADLINE`` (``SchedulingMetadata.deadline_unix_ms``, wall-clock ms) bounds the named operation; one that
  arrives before its submit (``submit_and_poll_result(timeout_ms=…)`` sends it first) is kept until the
  submit (the newest ``MAX_EARLY_DEADLINES`` of them). The earliest bound wins.
* ``TRACE_CONTEXT``: frame 0 sets the session's default trace context; an operation's frame overrides it for
  that operation until it is dispatched to vLLM (profile-contract.md §6). Ineligible contexts (zero ids) and
  late ones are ignored; the attribute body is never read.

Limits (the SDK's credit is advisory, nnrp-sdk.md §9, so the pump enforces them): a submit over
``SessionLimits.max_in_flight`` for this session, or over the process-wide :class:`Slots`, is answered at once
with ``response.error`` ``too_many_requests`` and never reaches the handler (so never vLLM); the session then
gets a BACKPRESSURE frame (credit window 0) and, once an operation finished, a CREDIT_UPDATE with the free
window. The outbox holds at most ``SessionLimits.max_queued_events`` partial results: the operation whose
event would overflow it ends with ``response.error`` ``client_too_slow`` and is stopped (its vLLM request
aborted). Terminals are always queued, so the outbox never exceeds that bound plus one per operation.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import threading
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from nnrp.core import MessageType
from nnrp.native import NativeInvalidStateError, NativeRuntimeError, NativeRuntimeServerSession
from nnrp.runtime import PressureMetadata

from vllm_nnrp_plugin import observation as obs
from vllm_nnrp_plugin.nnrp_binding import sdk_sync, wire
from vllm_nnrp_plugin.operation import (
    Action,
    DropReason,
    OperationMachine,
    PartialResult,
    ResultDrop,
    ResultPush,
)
from vllm_nnrp_plugin.limits import SessionLimits, Slots
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import trace
from vllm_nnrp_plugin.profile.errors import REQUEST_TIMEOUT, SERVER_ERROR, SERVER_SHUTDOWN, ProfileError

logger = logging.getLogger(__name__)

ACTIVE_POLL_MS = 1  # the shortest poll nnrp-py offers; an empty one lasts ~2.2 ms and blocks our sends
ACTIVE_POLL_GAP_S = 0.002  # while operations are active: sends only, for this long after an empty poll…
MAX_POLL_GAP_S = 0.016  # …doubling up to this while no event went out (fewer wake-ups competing for the GIL)
PEER_GONE_AFTER = 3  # consecutive failing polls that mean the client is gone (one can be a stale cancel)
MAX_EARLY_DEADLINES = 256  # DEADLINE controls kept for operations not submitted yet
# BACKPRESSURE frame after a refused submit: this plugin's values (NNRP leaves level/reason to the server)
PRESSURE_LEVEL_FULL = 1
PRESSURE_REASON_IN_FLIGHT = 1
RETRY_AFTER_MS = 100

_SESSION_IDS = itertools.count(1)  # the accept counter standing in for a connection id (see Observation)

CANCEL_SOURCE = {DropReason.PEER_CANCELLED: obs.CLIENT, DropReason.TRANSPORT_CLOSED: obs.TRANSPORT}

CANCEL_DETAIL = {
    MessageType.FRAME_CANCEL: "client_cancelled",
    MessageType.CANCEL: "client_cancelled",
    MessageType.ABORT: "client_aborted",
}


class SessionHandler(Protocol):
    """Receives operation starts and stops; called on ``loop`` (never on the pump thread)."""

    def on_submit(self, op: ServerOperation) -> None: ...

    def on_stop(self, op: ServerOperation) -> None:
        """The operation must stop: peer cancel, client gone, or server stopping. Abort its backend work."""

    def on_finished(self, op: ServerOperation) -> None:
        """``op.observation`` is complete: the terminal was sent and the operation's task has ended."""

    def on_session(self, transport: str, opened: bool) -> None:
        """A session started or ended. Called on the pump thread: must not block."""

    def on_deadline(self, op: ServerOperation) -> None:
        """``op.expires_unix_ms`` was set or moved earlier: (re)arm its timer."""


class ServerOperation:
    """One submitted operation, as the adapter sees it: the submit payload in, profile events out.

    ``operation_id`` (u64) and ``frame_id`` (u32) are the client's; ``transport`` is ``tcp`` or ``ipc``;
    ``observation`` is the operation's record, filled by the pump, the adapter and this object.
    """

    __slots__ = (
        "operation_id", "frame_id", "transport", "submitted_unix_ms", "expires_unix_ms", "observation",
        "_op", "_pump", "_machine", "_lock", "_cancel_detail", "_terminal_sent", "_unsettled", "_trace", "_dispatched",
    )

    def __init__(self, op: Any, pump: SessionPump) -> None:
        self.operation_id: int = op.operation_id
        self.frame_id: int = op.frame_id
        self.transport: str = pump.transport
        self.observation = obs.Observation(
            connection_id=pump.connection_id,
            session_id=op.submit.header.session_id,
            operation_id=self.operation_id,
            frame_id=self.frame_id,
            transport=self.transport,
            submitted_ns=time.monotonic_ns(),
            submitted_unix_ns=time.time_ns(),
        )
        self.submitted_unix_ms = self.observation.submitted_unix_ns // 1_000_000
        #: wall-clock ms after which the operation ends with ``request_timeout`` (None: unbounded)
        self.expires_unix_ms: int | None = None
        self._trace: trace.TraceContext | None = None  # operation-scoped override
        self._dispatched = False
        self._op = op
        self._pump = pump
        self._machine = OperationMachine()
        self._lock = threading.Lock()
        # set when the peer cancelled or the transport was lost: no partial, no RESULT_PUSH any more
        self._cancel_detail: str | None = None
        self._terminal_sent = False
        self._unsettled = 2  # the terminal send (pump) and the end of the operation's task (handler)

    def envelope_bytes(self) -> bytes:
        """The JSON envelope carried by the submit. Raises :class:`ProfileError` ``invalid_frame``."""
        submit = self._op.submit
        metadata = submit.metadata.value
        return wire.untyped_payload(metadata.payload_kind_bitmap, metadata.payload_frame_count, submit.tail.body)

    def partial(self, event: dict[str, Any]) -> None:
        """Queue one non-terminal event; ignored once the operation finished or was stopped. When the session's
        outbox is full the operation ends with ``client_too_slow`` instead and the handler is told to stop it."""
        overflow = False
        with self._lock:
            if self._machine.finished:
                return
            if self._pump.outbox_full():
                overflow = True
                action = self._machine.fail(E.client_too_slow(
                    f"{self._pump.limits.max_queued_events} events are waiting to be sent on this session "
                    "(nnrp.max_queued_events): the client reads slower than the model generates"
                ))
            else:
                action = self._machine.partial(event)
        if action is not None:
            self._pump.enqueue(self, action)
        if overflow:
            self._pump.stop_operation(self)

    def complete(self, body: dict[str, Any]) -> None:
        """Queue the terminal ``response.completed``."""
        with self._lock:
            action = self._machine.complete(body)
            if action is not None:
                self.observation.completed()
        if action is not None:
            self._pump.enqueue(self, action)

    def fail(self, err: ProfileError) -> None:
        """Queue the terminal ``response.error``."""
        with self._lock:
            action = self._machine.fail(err)
            if action is not None:
                self.observation.failed(code=err.code, family=err.type, status=err.status)
        if action is not None:
            self._pump.enqueue(self, action)

    def settle(self) -> None:
        """One of the two ends happened (terminal sent; task ended); after both, report ``on_finished``.
        Any thread."""
        with self._lock:
            self._unsettled -= 1
            done = self._unsettled == 0
        if done:
            self._pump.finished(self)

    def limit_time(self, timeout_ms: int) -> None:
        """Bound the operation to ``timeout_ms`` (ms) after its submit (envelope ``nnrp.timeout_ms``)."""
        self._bound(self.submitted_unix_ms + timeout_ms)

    def dispatch(self) -> trace.TraceContext | None:
        """The operation goes to vLLM now: later TRACE_CONTEXT frames no longer change it. Returns the context
        it runs in (its own override, else the session default) and records it in :attr:`observation`."""
        with self._lock:
            self._dispatched = True
            context = trace.for_dispatch(self._pump.session_trace, self._trace)
        self.observation.trace = context
        return context

    def time_out(self) -> None:
        """The bound passed: terminal ``response.error`` ``request_timeout`` (unless one was decided); later
        events are dropped. The caller stops the backend work."""
        self.observation.cancelled(time.monotonic_ns(), source=obs.DEADLINE, reason=REQUEST_TIMEOUT)
        self.fail(ProfileError(REQUEST_TIMEOUT, f"operation {self.operation_id} exceeded its deadline "
                               f"({self.expires_unix_ms - self.submitted_unix_ms} ms after submit)", SERVER_ERROR, 504))

    def _bound(self, expires_unix_ms: int) -> None:
        with self._lock:  # the adapter (loop) and the pump (DEADLINE) both bound it
            if self.expires_unix_ms is not None and expires_unix_ms >= self.expires_unix_ms:
                return
            self.expires_unix_ms = expires_unix_ms
        self._pump.deadline_changed(self)

    # -- pump thread only ---------------------------------------------------------------------------------

    def _override_trace(self, context: trace.TraceContext) -> None:
        with self._lock:
            if not self._dispatched:  # never mutate in-flight work
                self._trace = context

    def _cancel(self, reason: DropReason, detail: str) -> ResultDrop | None:
        """Stop emission at once; returns the drop to send now, if no terminal was decided yet."""
        with self._lock:
            self._cancel_detail = self._cancel_detail or detail
            self.observation.cancelled(time.monotonic_ns(), source=CANCEL_SOURCE[reason], reason=detail)
            return self._machine.cancel(reason, detail)

    def shut_down(self) -> None:
        """Server stopping: the terminal is ``response.error`` ``server_shutdown`` (unless one was decided).
        Any thread."""
        with self._lock:
            self.observation.cancelled(time.monotonic_ns(), source=obs.SERVER, reason=SERVER_SHUTDOWN)
        self.fail(E.server_shutdown())

    def _terminal_body(self, body: bytes, *, dropped: bool) -> bytes:
        """Record the terminal; with ``nnrp.diagnostics: true`` add the record's ``diagnostics`` to its
        event (profile events ignore unknown fields)."""
        record = self.observation
        record.terminal_sent(time.monotonic_ns(), dropped=dropped)
        if not record.diagnostics_requested:
            return body
        event = orjson.loads(body)
        event["diagnostics"] = obs.diagnostics(record)
        return orjson.dumps(event)

    def _late_drop(self) -> ResultDrop:
        """The drop that replaces a terminal push decided before a peer cancel arrived."""
        return self._machine.cancelled_drop(DropReason.PEER_CANCELLED, self._cancel_detail or "client_cancelled")


class SessionPump:
    """Owns one ``NativeRuntimeServerSession`` on a dedicated thread until the client leaves or :meth:`stop`."""

    def __init__(
        self,
        session: NativeRuntimeServerSession,
        handler: SessionHandler,
        loop: asyncio.AbstractEventLoop,
        *,
        idle_poll_ms: int,
        limits: SessionLimits,
        in_flight: Slots,
        on_exit: Callable[[SessionPump], None] | None = None,
    ) -> None:
        self.session = session
        self.limits = limits
        self._in_flight = in_flight
        self._pressured = False  # a BACKPRESSURE frame was sent and no CREDIT_UPDATE since
        self.transport: str = session.active_transport_name
        self.connection_id = next(_SESSION_IDS)
        self._handler = handler
        self._loop = loop
        self._idle_poll_ms = idle_poll_ms
        self._on_exit = on_exit
        self._outbox: collections.deque[tuple[ServerOperation, Action]] = collections.deque()
        self._wakeup = threading.Event()
        self._ops: dict[int, ServerOperation] = {}
        self._frames: dict[int, int] = {}
        self._early_deadlines: dict[int, int] = {}
        #: the session-scoped TRACE_CONTEXT (frame 0), default for operations dispatched later
        self.session_trace: trace.TraceContext | None = None
        self._stopping = False
        self._busy = False  # a frame came in or a partial result went out since the last poll
        self._thread = threading.Thread(target=self._run, name=f"nnrp-session-{self.transport}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the pump to end: in-flight operations get a ``server_shutdown`` error terminal."""
        self._stopping = True
        self._wakeup.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def deadline_changed(self, op: ServerOperation) -> None:
        """Tell the handler (on the loop) that ``op``'s bound moved (any thread)."""
        self._loop.call_soon_threadsafe(self._handler.on_deadline, op)

    def enqueue(self, op: ServerOperation, action: Action) -> None:
        """Queue a send for the pump (any thread, never blocks)."""
        self._outbox.append((op, action))
        self._wakeup.set()

    def finished(self, op: ServerOperation) -> None:
        """Hand a settled operation to the handler on the loop (any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._handler.on_finished, op)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is left to tell
            pass

    def outbox_full(self) -> bool:
        """True when ``limits.max_queued_events`` sends are waiting."""
        return len(self._outbox) >= self.limits.max_queued_events

    def stop_operation(self, op: ServerOperation) -> None:
        """Have the handler stop ``op``'s backend work (any thread)."""
        self._loop.call_soon_threadsafe(self._handler.on_stop, op)

    # -- pump thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        self._handler.on_session(self.transport, True)
        try:
            next_poll, gap = 0.0, ACTIVE_POLL_GAP_S
            while not self._stopping:
                self._flush()
                if self._ops:
                    rest = next_poll - time.monotonic()
                    if rest > 0:  # sends only until the next poll is due
                        if not self._outbox:
                            self._wakeup.wait(rest)
                            self._wakeup.clear()
                        continue
                    # the window that just ended decides the next one: short while events flow
                    gap = ACTIVE_POLL_GAP_S if self._busy else min(gap * 2, MAX_POLL_GAP_S)
                    self._busy = False
                try:
                    polled = self.session.poll_events(
                        max_events=1, timeout_ms=ACTIVE_POLL_MS if self._ops else self._idle_poll_ms
                    )
                except NativeInvalidStateError as exc:
                    # 3/4/0/105 is both "peer gone" and "stale cancel for a finished operation"
                    # (nnrp-sdk.md addendum 2): only repeated failures mean the client is gone.
                    failures += 1
                    if failures >= PEER_GONE_AFTER:
                        logger.info("NNRP session on %s: client gone (%s)", self.transport, exc)
                        self._cancel_all("client_disconnected")
                        return
                    continue
                failures = 0
                if polled:
                    next_poll, self._busy = 0.0, True  # more may be waiting: poll again at once
                    if not self._on_event(polled[0]):
                        return
                else:
                    next_poll = time.monotonic() + gap
            for sop in list(self._ops.values()):
                sop.shut_down()
                self._loop.call_soon_threadsafe(self._handler.on_stop, sop)
            self._flush()
        except NativeRuntimeError as exc:
            logger.warning("NNRP session on %s failed: %s", self.transport, exc)
            self._cancel_all("client_disconnected")
        except Exception:
            logger.exception("NNRP session pump on %s crashed; its operations are stopped", self.transport)
            self._cancel_all("server_error")
        finally:
            try:
                self.session.close()
            except NativeRuntimeError:
                pass
            self._handler.on_session(self.transport, False)
            if self._on_exit is not None:
                self._on_exit(self)

    def _on_event(self, event: Any) -> bool:
        """Handle one polled event; returns False when the session ended."""
        op = event.as_submit()
        if op is not None:
            sop = ServerOperation(op, self)
            refusal = self._admit()
            if refusal is not None:
                sop.fail(refusal)  # the terminal goes out with the next flush; the handler never sees it
                sop.settle()  # no task will run for it
                self._signal_pressure()
                return True
            self._ops[sop.operation_id] = sop
            self._frames[sop.frame_id] = sop.operation_id
            self._loop.call_soon_threadsafe(self._handler.on_submit, sop)
            early = self._early_deadlines.pop(sop.operation_id, None)
            if early is not None:
                sop._bound(early)
            return True
        runtime = event.as_runtime()
        if runtime is None:
            return True  # lifecycle notifications: the runtime events already told us
        kind = runtime.header.message_type
        if kind is MessageType.SESSION_CLOSE:
            self._cancel_all("client_closed_session")
            return False
        if kind is MessageType.DEADLINE:
            self._on_deadline(runtime.metadata.value)
            return True
        if kind is MessageType.TRACE_CONTEXT:
            self._on_trace_context(runtime.header.frame_id, runtime.metadata.value)
            return True
        if kind in CANCEL_DETAIL:
            if kind is MessageType.FRAME_CANCEL:
                operation_id = self._frames.get(runtime.header.frame_id)
            else:
                operation_id = getattr(runtime.metadata.value, "operation_id", None)
            sop = self._ops.get(operation_id) if operation_id is not None else None
            if sop is not None:
                drop = sop._cancel(DropReason.PEER_CANCELLED, CANCEL_DETAIL[kind])
                if drop is not None:
                    self._send(sop, drop)
                # else a terminal is already queued: _flush turns it into a drop
                self._loop.call_soon_threadsafe(self._handler.on_stop, sop)
        return True

    def _on_deadline(self, metadata: Any) -> None:
        deadline = metadata.deadline_unix_ms
        if not deadline:
            return
        sop = self._ops.get(metadata.operation_id)
        if sop is not None:
            sop._bound(deadline)
        else:  # not submitted yet, or already finished: keep the newest few
            self._early_deadlines[metadata.operation_id] = deadline
            if len(self._early_deadlines) > MAX_EARLY_DEADLINES:
                del self._early_deadlines[next(iter(self._early_deadlines))]

    def _on_trace_context(self, frame_id: int, metadata: Any) -> None:
        scope = trace.SESSION if frame_id == 0 else trace.OPERATION
        context = trace.TraceContext(
            metadata.trace_id, metadata.span_id, metadata.parent_span_id,
            metadata.stage_code, metadata.flags, metadata.body_bytes, scope,
        )  # fmt: skip
        if not context.eligible:
            return
        if scope == trace.SESSION:
            self.session_trace = context
            return
        operation_id = self._frames.get(frame_id)
        sop = self._ops.get(operation_id) if operation_id is not None else None
        if sop is not None:
            sop._override_trace(context)

    def _admit(self) -> ProfileError | None:
        """Take an in-flight slot for a new submit, or say why not (``too_many_requests``)."""
        if len(self._ops) >= self.limits.max_in_flight:
            return E.too_many_requests(
                f"this session already has {len(self._ops)} operations in flight; the limit is "
                f"{self.limits.max_in_flight} (nnrp.max_in_flight_per_session)"
            )
        if not self._in_flight.try_take():
            return E.too_many_requests(
                f"this server already runs {self._in_flight.capacity} NNRP operations (nnrp.max_in_flight)"
            )
        return None

    def _signal_pressure(self) -> None:
        """BACKPRESSURE, credit window 0: the client should wait for a terminal before submitting more."""
        self._pressured = True
        self._send_pressure(self.session.send_backpressure, 0, PRESSURE_LEVEL_FULL, PRESSURE_REASON_IN_FLIGHT)

    def _send_pressure(self, send: Callable[[PressureMetadata], None], credit: int, level: int, reason: int) -> None:
        retry_after_ms = RETRY_AFTER_MS if level else 0
        try:
            send(PressureMetadata(0, credit, level, reason, retry_after_ms, 0))
        except NativeRuntimeError as exc:
            logger.debug("NNRP pressure frame not delivered: %s", exc)

    def _cancel_all(self, detail: str) -> None:
        """The client is gone or closed its session: nothing can be delivered; stop every operation."""
        self._pressured = False  # no CREDIT_UPDATE to a session that is going away
        for sop in list(self._ops.values()):
            sop._cancel(DropReason.TRANSPORT_CLOSED, detail)
            sop.observation.terminal_sent(time.monotonic_ns(), dropped=True)
            sop._terminal_sent = True
            self._forget(sop)
            sop.settle()
            self._loop.call_soon_threadsafe(self._handler.on_stop, sop)

    def _flush(self) -> None:
        outbox = self._outbox
        while outbox:
            sop, action = outbox.popleft()
            if sop._terminal_sent:
                continue
            if sop._cancel_detail is not None:
                if isinstance(action, PartialResult):
                    continue  # nothing after a cancel
                if isinstance(action, ResultPush):
                    action = sop._late_drop()
            try:
                self._send(sop, action)
            except (ValueError, TypeError, OverflowError, struct.error):
                # one frame that cannot be built (a bug) costs its operation, never the session and the
                # client's other operations on it (the soak once lost a session this way)
                logger.exception("NNRP frame for operation %d cannot be built; the operation is dropped", sop.operation_id)
                self._drop_unsendable(sop)

    def _drop_unsendable(self, sop: ServerOperation) -> None:
        """End ``sop`` with a TRANSPORT_CLOSED drop (``response.cancelled`` ``server_error``); abort its work."""
        sop._cancel(DropReason.TRANSPORT_CLOSED, "server_error")
        drop = sop._machine.cancelled_drop(DropReason.TRANSPORT_CLOSED, "server_error")
        try:
            metadata, body = wire.result_drop(sop.operation_id, drop)
            sdk_sync.send_result_drop(sop._op, metadata, body)
        except NativeRuntimeError as exc:
            logger.debug("NNRP drop for operation %d not delivered: %s", sop.operation_id, exc)
        sop.observation.terminal_sent(time.monotonic_ns(), dropped=True)
        sop._terminal_sent = True
        self._forget(sop)
        sop.settle()
        self.stop_operation(sop)

    def _send(self, sop: ServerOperation, action: Action) -> None:
        op = sop._op
        try:
            if isinstance(action, PartialResult):
                metadata, body = wire.partial_result(sop.operation_id, action)
                sdk_sync.send_partial_result(op, metadata, body)
                sop.observation.event_sent(time.monotonic_ns())
                self._busy = True
                return
            if isinstance(action, ResultPush):
                elapsed_ms = (time.monotonic_ns() - sop.observation.submitted_ns) // 1_000_000
                action = ResultPush(action.status, sop._terminal_body(action.event, dropped=False))
                metadata, body = wire.result_push(action, elapsed_ms)
                try:
                    sdk_sync.send_result(op, metadata, body)
                except NativeRuntimeError:
                    # refused: the client cancelled before it arrived; a drop is still accepted
                    self._send_drop(sop, sop._late_drop())
            else:
                self._send_drop(sop, action)
        except NativeRuntimeError as exc:
            logger.debug("NNRP send for operation %d not delivered: %s", sop.operation_id, exc)
            if isinstance(action, PartialResult):
                return
        sop._terminal_sent = True
        self._forget(sop)
        sop.settle()

    def _send_drop(self, sop: ServerOperation, action: ResultDrop) -> None:
        diagnostic = sop._terminal_body(action.diagnostic, dropped=True)
        metadata, body = wire.result_drop(sop.operation_id, ResultDrop(action.reason, action.sequence, diagnostic))
        sdk_sync.send_result_drop(sop._op, metadata, body)

    def _forget(self, sop: ServerOperation) -> None:
        if self._ops.pop(sop.operation_id, None) is None:
            return
        self._frames.pop(sop.frame_id, None)
        if self._pressured and not self._stopping:
            self._pressured = False
            credit = self.limits.max_in_flight - len(self._ops)
            self._send_pressure(self.session.send_credit_update, credit, 0, 0)

"""The native carrier (``quic``; TCP, TLS, unix sockets and WebSocket are :mod:`.stream_connection`'s): one pump thread per NNRP server session of nnrp-py's runtime: it polls the session's incoming frames and posts what came off
the wire to vLLM's event loop; what the operations queue is sent by the listener's shared
:class:`.sender.Sender` (or by the pump right after a poll). It decides nothing about an operation's outcome
but the per-session admission.

Why a thread per session: every native call of nnrp-py 1.0.0rc4.post20 blocks, a poll only watches one
session, and nnrp-py's server session (``nnrp.native.NativeRuntimeServerSession``) serializes its native
calls: while a poll waits inside its timeout, every send on the same session waits for it. A poll with
``max_events > 1`` lingers ~2.3 ms before returning, so the pump polls with ``max_events=1``. Whoever touches
the session holds ``io_lock``: the pump while it polls and handles what came in (then it sends what is
queued), a sender while it sends. Empty polls are what a session costs (:mod:`.cadence`): while operations
are active the pump polls with nnrp-py's shortest timeout (1 ms, ~2.2 ms when empty) on a cadence — the
listener's current gap (:meth:`.cadence.PollCadence.active_gap_s`), doubling up to ``MAX_POLL_GAP_S`` (or
the current gap when longer) while no event goes out — and sleeps in between without touching the GIL; when
idle it waits in one long poll (:meth:`.cadence.PollCadence.idle_poll_ms`) that a submit ends at once.

What comes off the wire goes to the session's :class:`.session_policy.SessionPolicy` — admission, cancels,
DEADLINE, TRACE_CONTEXT, a terminal freeing its window, the same rules as every carrier's — which posts the
handler's calls to vLLM's loop (``loop.call_soon_threadsafe``). The pump reads DEADLINE (``SchedulingMetadata``),
TRACE_CONTEXT and the cancels (FRAME_CANCEL by frame, CANCEL and ABORT by operation id) from nnrp-py's runtime
metadata. At most ``SessionLimits.max_queued_events`` decided events wait in the outbox, deltas merged into a
queued one included (the operation that overflows it ends with ``client_too_slow``); terminals are always
queued, so the outbox never exceeds that bound plus one per operation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from nnrp.core import MessageType
from nnrp.native import NativeInvalidStateError, NativeRuntimeError, NativeRuntimeServerSession
from nnrp.runtime import PressureMetadata

from vllm_nnrp_plugin import wire_mapping
from vllm_nnrp_plugin.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding import sdk_sync
from vllm_nnrp_plugin.nnrp_binding.cadence import PollCadence
from vllm_nnrp_plugin.nnrp_binding.handler import (
    CANCEL_DETAIL,
    PRESSURE_LEVEL_FULL,
    PRESSURE_REASON_IN_FLIGHT,
    RETRY_AFTER_MS,
    SessionHandler,
)
from vllm_nnrp_plugin.nnrp_binding.sender import Sender
from vllm_nnrp_plugin.nnrp_binding.server_operation import PRESSURE, SendProbe, ServerOperation, SessionLink
from vllm_nnrp_plugin.nnrp_binding.session_policy import SessionPolicy
from vllm_nnrp_plugin.operation import PartialResult, ResultDrop, ResultPush, Terminal

logger = logging.getLogger(__name__)

ACTIVE_POLL_MS = 1  # the shortest poll nnrp-py offers; an empty one lasts ~2.2 ms and blocks our sends
MAX_POLL_GAP_S = 0.016  # the gap after an empty poll doubles up to this while no event went out
PEER_GONE_AFTER = 3  # consecutive failing polls that mean the client is gone (one can be a stale cancel)

_SESSION_IDS = itertools.count(1)  # the accept counter standing in for a connection id (see Observation)


class SessionPump:
    """Owns one ``NativeRuntimeServerSession`` on a dedicated thread until the client leaves or :meth:`stop`;
    ``sender`` (the listener's) sends what its operations queue; the pump also sends right after each poll. ``probe``
    (benchmarks) is told about every partial result queued and sent."""

    def __init__(
        self,
        session: NativeRuntimeServerSession,
        handler: SessionHandler,
        loop: asyncio.AbstractEventLoop,
        *,
        cadence: PollCadence,
        limits: SessionLimits,
        sender: Sender,
        on_exit: Callable[[SessionPump], None] | None = None,
        probe: SendProbe | None = None,
    ) -> None:
        self.session = session
        self.limits = limits
        self.transport: str = session.active_transport_name
        self.connection_id = next(_SESSION_IDS)
        #: held by whoever touches the native session (the pump polling, a sender sending)
        self.io_lock = threading.Lock()
        self.scheduled = False  # waiting in the sender's queue
        self._sender = sender
        self.link = SessionLink(limits.max_queued_events, self._notify, probe)
        self._probe = probe
        self._handler = handler
        self._loop = loop
        self._cadence = cadence
        self._on_exit = on_exit
        self.policy = SessionPolicy(handler, limits, self.link, send_credit=self._send_credit, post=self._post,
                                    on_activity=self._activity)  # fmt: skip
        self._stopping = False
        self._closed = False  # the native session is closed: nothing more is sent
        self._wake = threading.Event()  # ends the wait between two polls (stop, the last operation finished)
        self._busy = False  # a frame came in or a partial result went out since the last poll
        self._thread = threading.Thread(target=self._run, name=f"nnrp-session-{self.transport}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the pump to end: in-flight operations get a ``server_shutdown`` error terminal."""
        self._stopping = True
        self.policy.closing = True
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    # -- pump thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        cadence = self._cadence
        cadence.opened(1)
        self._handler.on_session(self.transport, True)
        lock = self.io_lock
        try:
            gap = 0.0
            while not self._stopping:
                with lock:
                    self.flush()
                    try:
                        polled = self.session.poll_events(
                            max_events=1, timeout_ms=ACTIVE_POLL_MS if self.policy.ops else cadence.idle_poll_ms()
                        )
                    except NativeInvalidStateError as exc:
                        # nnrp-py reports both "peer gone" and "stale cancel for a finished operation" as
                        # NativeInvalidStateError 3/4/0/105: only repeated failures mean the client is gone.
                        failures += 1
                        if failures >= PEER_GONE_AFTER:
                            logger.info("NNRP session on %s: client gone (%s)", self.transport, exc)
                            self._lose_all("client_disconnected")
                            return
                        continue
                    failures = 0
                    if polled and not self.handle(polled[0]):
                        return
                    self.flush()
                self._sender.after(self)  # what was queued while the lock was held
                if polled:
                    self._busy = True
                    continue  # more may be waiting: poll again at once
                if self.policy.ops:
                    # the window that just ended decides the next one: the listener's gap while events flow
                    floor = cadence.active_gap_s()
                    gap = floor if self._busy else min(max(gap * 2, floor), max(MAX_POLL_GAP_S, floor))
                    self._busy = False
                    self._wake.wait(gap)
                    self._wake.clear()
            with lock:
                self.policy.shut_down()
                self.flush()
        except NativeRuntimeError as exc:
            logger.warning("NNRP session on %s failed: %s", self.transport, exc)
            with lock:
                self._lose_all("client_disconnected")
        except Exception:
            logger.exception("NNRP session pump on %s crashed; its operations are stopped", self.transport)
            with lock:
                self._lose_all("server_error")
        finally:
            with lock:
                self._closed = True
                try:
                    self.session.close()
                except NativeRuntimeError:
                    pass
            if self.policy.ops:
                cadence.activated(-1)
            cadence.opened(-1)
            self._handler.on_session(self.transport, False)
            if self._on_exit is not None:
                self._on_exit(self)

    def pending(self) -> bool:
        """Something waits in the outbox (and the session is still open)."""
        return bool(self.link.items) and not self._closed

    def _notify(self) -> None:
        self._sender.schedule(self)

    def handle(self, event: Any) -> bool:
        """Handle one polled event (pump thread); returns False when the session ended."""
        native = event.as_submit()
        if native is not None:
            self._on_submit(native)
            return True
        runtime = event.as_runtime()
        if runtime is None:
            return True  # lifecycle notifications: the runtime events already told us
        kind = runtime.header.message_type
        if kind is MessageType.SESSION_CLOSE:
            self._lose_all("client_closed_session")
            return False
        if kind is MessageType.DEADLINE:
            metadata = runtime.metadata.value
            self.policy.deadline(metadata.operation_id, metadata.deadline_unix_ms)
            return True
        if kind is MessageType.TRACE_CONTEXT:
            frame_id = runtime.header.frame_id
            self.policy.trace_context(frame_id, self.policy.by_frame(frame_id), runtime.metadata.value)
            return True
        if kind in CANCEL_DETAIL:
            if kind is MessageType.FRAME_CANCEL:
                sop = self.policy.by_frame(runtime.header.frame_id)
            else:
                operation_id = getattr(runtime.metadata.value, "operation_id", None)
                sop = self.policy.ops.get(operation_id) if operation_id is not None else None
            self.policy.cancel(sop, kind)
        return True

    def _on_submit(self, native: Any) -> None:
        sop = ServerOperation.from_native(native, self.link, transport=self.transport, connection_id=self.connection_id,
                              now_ns=time.monotonic_ns(), now_unix_ns=time.time_ns())  # fmt: skip
        self.policy.submit(sop)  # a refusal goes out with the next flush

    def _activity(self, active: bool) -> None:
        """The session got its first operation (``active``) or finished its last one."""
        if active:
            self._cadence.activated(1)
            self._wake.clear()  # set when the last operation finished: not a reason to skip the next sleep
        else:
            self._cadence.activated(-1)
            self._wake.set()  # idle now: back to one long poll that the client's next submit ends

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is left to tell
            pass

    def _signal_pressure(self) -> None:
        """BACKPRESSURE, credit window 0: the client should wait for a terminal before submitting more."""
        self.policy.pressure_signalled()
        self._send_pressure(self.session.send_backpressure, 0, PRESSURE_LEVEL_FULL, PRESSURE_REASON_IN_FLIGHT)

    def _send_credit(self, credit: int) -> None:
        self._send_pressure(self.session.send_credit_update, credit, 0, 0)

    def _send_pressure(self, send: Callable[[PressureMetadata], None], credit: int, level: int, reason: int) -> None:
        retry_after_ms = RETRY_AFTER_MS if level else 0
        try:
            send(PressureMetadata(0, credit, level, reason, retry_after_ms, 0))
        except NativeRuntimeError as exc:
            logger.debug("NNRP pressure frame not delivered: %s", exc)

    def _lose_all(self, detail: str) -> None:
        """The client is gone or closed its session: nothing can be delivered; stop every operation."""
        self.policy.lose_all(detail)

    def flush(self) -> None:
        """Send what the outbox holds, in order (the caller holds ``io_lock``)."""
        if self._closed:
            return
        outbox = self.link.items
        while outbox:
            sop, action = outbox.popleft()
            if action is PRESSURE:
                self._signal_pressure()
                continue
            if isinstance(action, PartialResult) and not sop.rules.admits_partials:
                sop.discard(action)  # nothing after a terminal or a cancel
                continue
            try:
                self._send(sop, action)
            except (ValueError, TypeError, OverflowError, struct.error):
                # one frame that cannot be built (a bug) costs its operation, never the session and the
                # client's other operations on it (the soak once lost a session this way)
                logger.exception("NNRP frame for operation %d cannot be built; the operation is dropped", sop.operation_id)
                self._drop_unsendable(sop)

    def _drop_unsendable(self, sop: ServerOperation) -> None:
        """End ``sop`` with a TRANSPORT_CLOSED drop (``response.cancelled`` ``server_error``); abort its work."""
        try:
            self._send_drop(sop, sop.unsendable())
        except NativeRuntimeError as exc:
            logger.debug("NNRP drop for operation %d not delivered: %s", sop.operation_id, exc)
        self._terminal_done(sop)
        self._post(self._handler.on_stop, sop)

    def _send(self, sop: ServerOperation, action: PartialResult | Terminal) -> None:
        if isinstance(action, PartialResult):
            payload = wire_mapping.partial_result(sop.operation_id, sop.take(action))
            try:
                if self._probe is None:
                    sdk_sync.send_partial_result(sop.native, payload)
                else:
                    started = time.monotonic_ns()
                    sdk_sync.send_partial_result(sop.native, payload)
                    self._probe.sent(action, started, time.monotonic_ns())
            except NativeRuntimeError as exc:
                logger.debug("NNRP send for operation %d not delivered: %s", sop.operation_id, exc)
                return
            sop.observation.event_sent(time.monotonic_ns())
            self._busy = True
            return
        sealed, elapsed_ms = sop.seal(action)
        if sealed is None:
            return  # a terminal went out already
        try:
            if isinstance(sealed, ResultPush):
                metadata, body = wire_mapping.result_push(sealed, elapsed_ms)
                try:
                    sdk_sync.send_result(sop.native, metadata, body)
                except NativeRuntimeError:
                    # refused: the client cancelled before it arrived; a drop is still accepted
                    self._send_drop(sop, sop.refused())
            else:
                self._send_drop(sop, sealed)
        except NativeRuntimeError as exc:
            logger.debug("NNRP send for operation %d not delivered: %s", sop.operation_id, exc)
        self._terminal_done(sop)

    def _send_drop(self, sop: ServerOperation, drop: ResultDrop) -> None:
        metadata, diagnostic = wire_mapping.result_drop(sop.operation_id, drop)
        sdk_sync.send_result_drop(sop.native, metadata, diagnostic)

    def _terminal_done(self, sop: ServerOperation) -> None:
        """``sop``'s terminal went out (or never can): the session's policy frees its window."""
        self.policy.terminal_done(sop)

"""One NNRP connection on vLLM's event loop, whatever its carrier: :class:`NNRPConnection` around the project's
sans-IO wire core (:class:`vllm_nnrp_plugin.nnrp_wire.server.ServerConnection`), attached by composition to the
asyncio shell of its carrier — a TCP, TLS or unix-socket transport (:mod:`.stream`), the byte stream inside
WebSocket messages (:mod:`.websocket`) or the NNRP stream of a QUIC connection (:mod:`.quic`). The shell feeds it
what the client sent (:meth:`NNRPConnection.feed`, :meth:`~NNRPConnection.end_of_stream`, …) and is its
:class:`Carrier`: where its packets go and how it ends.

Everything here runs on the loop, so every piece of state has one owner and nothing is locked:

* reads are event-driven: the shell's ``data_received`` feeds the core (:meth:`NNRPConnection.feed`) and
  handles each event at once (a FRAME_CANCEL reaches its operation, and the operation's task is cancelled, in
  the same loop iteration its bytes arrived);
* sends are batched: a partial result decided while nothing of its session waits is framed into the wire
  core's send buffer at once (the link's ``send_now``); everything else goes to the session's outbox
  (:class:`.server_operation.SessionLink`). The first packet of an iteration puts the connection on the
  listener's :class:`FlushRound`, whose one callback per loop iteration flushes every connection on it: each
  encodes every waiting action of every one of its sessions and hands all its bytes to its carrier in one
  :meth:`Carrier.send` (one ``transport.write``; TCP_NODELAY is set on accepted TCP sockets, :mod:`.stream`);
* write back-pressure: while the carrier's buffer is above its high-water mark (``pause_writing``) nothing
  is sent at once, nothing is taken from the outboxes and nothing is read from the client; deltas decided meanwhile join
  the one still waiting
  (:mod:`vllm_nnrp_plugin.core.operation`) and an outbox holding ``max_queued_events`` decided events ends the
  operation that overflows it with ``client_too_slow`` — the same bound as on every carrier;
* per-session rules (admission, BACKPRESSURE / CREDIT_UPDATE, cancels, deadlines, trace context, a terminal
  freeing its window) are :class:`.session_policy.SessionPolicy`'s, the same for every carrier;
* session opens over the listener's ``max_sessions`` are refused with ``session_limit_reached`` (NNRP
  ``session_error_code`` 0x00010007); a session counts from its SESSION_OPEN_ACK until the client's close
  handshake or the end of the connection;
* bounds (:mod:`.bounds`): a connection that has opened no session and whose client stays silent for the
  handshake timeout is closed (:func:`.bounds.handshake_recheck`: bytes waiting unread in the socket are the
  server's delay, not the client's silence, so a stalled loop never closes a client whose CLIENT_HELLO and
  SESSION_OPEN wait to be read); its
  incomplete packet counts against the listener's buffered-bytes budget; one whose input or flush failed (a
  bug) is aborted rather than left hung or with packets stranded; a lost connection drops its buffers at once.

What came off the wire goes to the session's policy, which reports to the :class:`.handler.SessionHandler`
(the service) directly: a submit (its envelope unwrapped), an NNRP DEADLINE or EXPIRE_AT (``on_deadline``), a
terminal sent (``on_terminal``), an operation whose terminal went out last (``on_finished``); a cancel, a
SUPERSEDE or a lost client goes to the operation's lifecycle, whose decision stops the work through its owner
(the service); PRIORITY_UPDATE and BUDGET_UPDATE change the operation's runtime controls; sessions opened and
closed (``on_session``) and refused keys (``on_auth_refused``) come from the connection.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

from nnrp.core.enums import ErrorCode

from vllm_nnrp_plugin.contract import draining, wire_mapping
from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.core.operation import PartialResult, ResultDrop, ResultPush
from vllm_nnrp_plugin.nnrp_binding.bounds import BufferBudget, CarrierBounds, ViolationBudget, handshake_recheck
from vllm_nnrp_plugin.nnrp_binding.handler import (
    PRESSURE_LEVEL_FULL,
    PRESSURE_REASON_IN_FLIGHT,
    RETRY_AFTER_MS,
    SessionHandler,
)
from vllm_nnrp_plugin.nnrp_binding.server_operation import (
    PRESSURE,
    SendProbe,
    ServerOperation,
    SessionLink,
    envelope_of,
)
from vllm_nnrp_plugin.nnrp_binding.session_policy import SessionPolicy
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.codecs import SESSION_ERROR_SESSION_LIMIT_REACHED
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection
from vllm_nnrp_plugin.observability.log_safety import RefusalLogLimiter, loggable

logger = logging.getLogger(__name__)

_CONNECTION_IDS = itertools.count(1)

#: a carrier's write buffer (bytes) above which the connection stops taking from the outboxes, and below which
#: it starts again (each shell's: ``transport.set_write_buffer_limits``, QUIC's unacknowledged bytes)
WRITE_HIGH_WATER = 1 << 20
WRITE_LOW_WATER = 1 << 18
#: the most bytes of one read the wire core parses at a time (a read holding thousands of packets is handled
#: slice by slice, so a connection ended halfway costs no more parsing)
FEED_BYTES = 1 << 14


class Carrier(Protocol):
    """What an :class:`NNRPConnection` needs of its carrier's shell (:mod:`.stream`, :mod:`.websocket`,
    :mod:`.quic`)."""

    def send(self, data: bytes) -> None:
        """Send ``data``: whole NNRP packets back to back, the wire core's output of one flush."""

    def end(self, cause: str) -> None:
        """End the connection after what was sent; ``cause``: ``handshake_timeout``, ``ended`` (the wire core
        ended it cleanly), ``failed`` (it ended it over bad input), ``violation`` (the client flooded beyond its
        credit), ``shutdown`` (the server stops). The shell says goodbye in its carrier's terms first (a
        WebSocket close code, a QUIC FIN) and reports the loss later (:meth:`NNRPConnection.lost`)."""

    def abort(self) -> None:
        """End the connection at once, dropping what was not sent (a bug in handling it)."""

    def hold_input(self, held: bool) -> None:
        """Stop (``True``) or resume (``False``) reading from the client."""

    def is_closing(self) -> bool:
        """The connection is ending: nothing more is sent."""

    def unread_bytes(self) -> int:
        """Bytes the client sent that wait unread on this side (the kernel's socket buffer; 0 when unknown)."""


class SessionGate:
    """``max_sessions`` over every connection of a listener, every carrier together: :meth:`try_open` /
    :meth:`closed`, on the loop only."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self.open = 0

    def try_open(self) -> bool:
        if self.open >= self.max_sessions:
            return False
        self.open += 1
        return True

    def closed(self) -> None:
        self.open -= 1


class FlushRound:
    """The connections that have packets decided in this loop iteration: one ``loop.call_soon`` callback per
    iteration flushes them all, in the order they were added (one callback per connection and iteration would
    cost a handle each; with one stream per connection that is one per chunk). On the loop only."""

    __slots__ = ("_loop", "_pending", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: list[NNRPConnection] = []
        self._scheduled = False

    def add(self, connection: NNRPConnection) -> None:
        self._pending.append(connection)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        for connection in pending:
            try:
                connection.flush()
            except Exception:  # a bug in one connection's flush must not strand the others on this round
                logger.exception("NNRP connection %d: flush failed; the connection is closed", connection.connection_id)
                connection.abort()


class StreamSession:
    """One NNRP session of a :class:`NNRPConnection`: its outbox and its :class:`.session_policy.SessionPolicy`
    (operations, admission, controls)."""

    __slots__ = ("session_id", "priority_class", "link", "sender", "policy", "drain_timer")

    def __init__(
        self,
        session_id: int,
        handler: SessionHandler,
        limits: SessionLimits,
        mark: Callable[[StreamSession], None],
        send_now: Callable[[StreamSession, ServerOperation, PartialResult], None],
        send_credit: Callable[[int, int], object],
        probe: SendProbe | None,
        *,
        paused: bool,
        priority_class: int,
    ) -> None:
        self.session_id = session_id
        #: the session's NNRP priority class (SESSION_OPEN), its operations' unless they set their own
        self.priority_class = priority_class
        self.link = SessionLink(limits.max_queued_events, functools.partial(mark, self), probe)
        self.sender = functools.partial(send_now, self)  # the link's ``send_now`` while the carrier takes writes
        self.link.send_now = None if paused else self.sender
        self.policy = SessionPolicy(handler, limits, self.link, send_credit=functools.partial(send_credit, session_id))
        #: the drain timeout of a drained SESSION_CLOSE, while it runs
        self.drain_timer: asyncio.TimerHandle | None = None


class NNRPConnection:
    """One accepted connection. ``transport_name`` is the carrier (``tcp``, ``tls``, ``ipc``, ``websocket``,
    ``quic``); ``gate`` the
    listener's session count; ``flush_round`` the listener's :class:`FlushRound`; ``on_lost`` is told when the
    connection ended (the listener forgets it); ``authenticate``: the API-key check of the wire core
    (``None``: no key required); ``bounds``: the listener's :class:`.bounds.CarrierBounds` (the handshake
    timeout runs from :meth:`attach`, after TLS, to the first session's SESSION_OPEN_ACK; the packet
    limit; the client's silence is what it bounds, :func:`.bounds.handshake_recheck`); ``budget``: the listener's
    :class:`.bounds.BufferBudget` of incomplete packets.

    Its carrier's shell drives it: :meth:`attach` once the carrier is up, :meth:`heard` and :meth:`feed` for each
    piece of input and :meth:`read_done` after each read, :meth:`end_of_stream`, :meth:`lose` when the carrier
    failed, :meth:`lost` when it is gone, :meth:`pause_writing` / :meth:`resume_writing` for its write buffer;
    :meth:`data_to_send` for what the wire core queued when the shell ends the connection itself."""

    def __init__(
        self,
        handler: SessionHandler,
        *,
        transport_name: str,
        limits: SessionLimits,
        gate: SessionGate,
        flush_round: FlushRound,
        on_lost: Callable[[NNRPConnection], None],
        probe: SendProbe | None = None,
        authenticate: Callable[[bytes], bool] | None = None,
        bounds: CarrierBounds = CarrierBounds(),
        budget: BufferBudget | None = None,
    ) -> None:
        self._handler = handler
        self._handshake_timeout_s = bounds.handshake_timeout_s
        #: the largest NNRP packet this connection takes (bytes; advertised in SERVER_HELLO_ACK)
        self.max_packet_bytes = bounds.max_packet_bytes
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started_at = 0.0  # loop time the carrier was attached (after TLS)
        self._heard_at = 0.0  # loop time of the last read from the client, while no session is open
        self._budget = budget if budget is not None else BufferBudget(bounds.max_buffered_bytes)
        self._buffered = 0  # this connection's share of the budget
        self.transport_name = transport_name
        self._limits = limits
        self._gate = gate
        self._round = flush_round
        self._on_lost = on_lost
        self._probe = probe
        self.connection_id = next(_CONNECTION_IDS)
        self._core = ServerConnection(
            max_in_flight_per_session=limits.max_in_flight,
            max_packet_bytes=bounds.max_packet_bytes,
            authenticate=authenticate,
        )
        self._core.drain_sessions = True  # a drained SESSION_CLOSE: every operation still gets its terminal
        self._refusals = RefusalLogLimiter()
        self._violations = ViolationBudget()  # submits beyond the granted credit, over all its sessions
        self._ending = False  # ended for flooding: the rest of its input is not handled
        self._sessions: dict[int, StreamSession] = {}
        self._carrier: Carrier | None = None
        self._flush_scheduled = False  # on the round's list
        self._dirty: dict[int, StreamSession] = {}  # sessions whose outbox has entries, in order
        self._paused = False
        self._stopping = False

    # -- what the carrier's shell calls -----------------------------------------------------------------------

    def attach(self, carrier: Carrier) -> None:
        """The carrier is up (after TLS, a WebSocket's TCP connection, a QUIC connection's first packet): the
        handshake timeout starts. Ended at once when the server stopped since the accept."""
        if self._stopping:  # the server stopped between the accept and this call
            carrier.end("shutdown")
            return
        self._carrier = carrier
        loop = self._loop = asyncio.get_running_loop()
        self._started_at = self._heard_at = loop.time()
        self._handshake_timer = loop.call_later(self._handshake_timeout_s, self._handshake_expired)

    def heard(self) -> None:
        """The client sent something (a read): its silence, which the handshake timeout bounds, ends now."""
        if self._handshake_timer is not None:
            self._heard_at = self._loop.time()  # type: ignore[union-attr]  # the timer runs on the loop

    def feed(self, data: bytes | bytearray) -> bool:
        """NNRP bytes from the client: every event they complete is handled at once. False when the rest of
        the input is not to be read: the connection ended for flooding, or handling it failed (a bug: logged,
        and the connection is aborted)."""
        try:
            if len(data) <= FEED_BYTES:
                for event in self._core.receive_data(data):
                    if self._ending:
                        return False
                    self._handle(event)
            else:  # a large read goes to the core in slices: one that floods stops costing at the next slice
                view = memoryview(data)
                for start in range(0, len(data), FEED_BYTES):
                    for event in self._core.receive_data(view[start : start + FEED_BYTES]):
                        if self._ending:
                            return False
                        self._handle(event)
        except Exception:  # a bug while handling this client's input: only this connection ends, logged once
            self.failed_input()
            return False
        return True

    def failed_input(self) -> None:
        """Handling the client's input failed (a bug, in the wire core or the carrier's shell): only this
        connection ends, logged once."""
        logger.exception(
            "NNRP connection %d on %s: handling its input failed; the connection is closed",
            self.connection_id,
            self.transport_name,
        )
        self.abort()

    def read_done(self) -> None:
        """A read was fed: its incomplete packet is accounted against the budget, and what it decided is sent."""
        if self._account():
            self.flush()

    def _account(self) -> bool:
        """Move this connection's incomplete-packet bytes into the budget; over it, the connection ends (as
        for an oversized packet) and False is returned."""
        buffered = self._core.buffered
        within = self._budget.change(buffered - self._buffered)
        self._buffered = buffered
        if within or not buffered:
            return True
        logger.warning(
            "NNRP connection %d on %s closed: its incomplete packet takes the buffered bytes of all "
            "connections over nnrp.max_buffered_bytes (%d)",
            self.connection_id,
            self.transport_name,
            self._budget.limit,
        )
        self.abort()
        return False

    def end_of_stream(self) -> None:
        """The client's end of stream (a FIN, a WebSocket close frame): the wire core ends the connection."""
        for event in self._core.receive_data(b""):
            self._handle(event)

    def lose(self) -> None:
        """The carrier failed the connection (a broken WebSocket message, …): nothing can be delivered any
        more; every operation of every session stops."""
        self._lose_all("client_disconnected")

    def lost(self) -> None:
        """The carrier is gone: every operation stops, the buffers go, the listener forgets the connection."""
        self._cancel_handshake_timer()
        left_out = self._refusals.take_suppressed()
        if left_out:
            logger.info(
                "NNRP connection %d on %s: %d more packets refused (not logged)",
                self.connection_id,
                self.transport_name,
                left_out,
            )
        self._lose_all("client_disconnected")
        self._dirty.clear()
        self._budget.change(-self._buffered)
        self._buffered = 0
        self._core.release()  # its buffers go now, not at the next garbage collection
        self._carrier = None
        self._on_lost(self)

    def refused(self, reason: str) -> None:
        """The carrier refused the client before NNRP began (``reason``: ``origin``, a WebSocket Upgrade from an
        origin not allowed): counted by the handler."""
        self._handler.on_connection_refused(self.transport_name, reason)

    def data_to_send(self) -> bytes:
        """What the wire core queued and was not sent yet (whole packets back to back; ``b""``: nothing)."""
        return self._core.data_to_send()

    def pause_writing(self) -> None:
        """The client does not read what it is sent: nothing more is sent at once, and nothing more is read
        from it (so it cannot make the server answer more) until it caught up."""
        self._paused = True
        for session in self._sessions.values():
            session.link.send_now = None
        if self._carrier is not None and not self._carrier.is_closing():
            self._carrier.hold_input(True)

    def resume_writing(self) -> None:
        self._paused = False
        for session in self._sessions.values():
            session.link.send_now = session.sender
        if self._carrier is not None and not self._carrier.is_closing():
            self._carrier.hold_input(False)
        self._schedule_flush()

    def _handshake_expired(self) -> None:
        """The handshake timer fired before a session opened: close the connection when its client has been
        silent for the handshake timeout (a silent client, half a hello, a refused key held open) or took
        too long (:func:`.bounds.handshake_recheck`); look again later when its bytes wait unread (vLLM's loop
        was busy) or it spoke recently."""
        self._handshake_timer = None
        loop, carrier = self._loop, self._carrier
        if loop is None or carrier is None or carrier.is_closing():
            return
        now = loop.time()
        waiting = 0 if self._paused else carrier.unread_bytes()  # paused: the client is the one not reading
        again = handshake_recheck(now - self._started_at, now - self._heard_at, waiting, self._handshake_timeout_s)
        if again is not None:
            if waiting:
                logger.debug(
                    "NNRP connection %d on %s: %d bytes of its handshake wait to be read; kept",
                    self.connection_id,
                    self.transport_name,
                    waiting,
                )
            self._handshake_timer = loop.call_later(again, self._handshake_expired)
            return
        logger.debug(
            "NNRP connection %d on %s: no session, client silent for %.1f s; closed",
            self.connection_id,
            self.transport_name,
            now - self._heard_at,
        )
        self._handler.on_handshake_timeout(self.transport_name)
        self._end("handshake_timeout")

    def _end(self, cause: str) -> None:
        """End the connection after what is queued (``cause``: :meth:`Carrier.end`)."""
        if self._carrier is not None:
            self._carrier.end(cause)

    def _cancel_handshake_timer(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    # -- the listener ---------------------------------------------------------------------------------------

    @property
    def carrier(self) -> Carrier | None:
        """The carrier's shell this connection is attached to (``None`` before :meth:`attach` and once lost)."""
        return self._carrier

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def abort(self) -> None:
        """Its flush failed (a bug): what it had encoded cannot be trusted to go out, so the connection ends
        (its operations stop as for a lost client) rather than leave packets stranded."""
        if self._carrier is not None:
            self._carrier.abort()

    def drain(self, retry_after_ms: int) -> None:
        """The server drains (:mod:`vllm_nnrp_plugin.contract.draining`): no new session from now on, and every open
        session gets one BACKPRESSURE (credit 0, level paused, reason draining, ``retry_after_ms``); the
        operations running go on (a submit that still comes is refused by the service)."""
        self._stopping = True
        for session in self._sessions.values():
            self._core.send_backpressure(
                session.session_id,
                0,
                draining.PRESSURE_LEVEL_PAUSED,
                draining.PRESSURE_REASON_DRAINING,
                min(retry_after_ms, 0xFFFFFFFF),
            )
        self.flush()

    def shut_down(self) -> None:
        """The server stops: in-flight operations get ``server_shutdown`` (their tasks are the service's to
        cancel), what is queued is written, then the connection is closed."""
        self._stopping = True
        for session in self._sessions.values():
            session.policy.shut_down()
        self.flush()
        self._end("shutdown")

    # -- what came off the wire -------------------------------------------------------------------------------

    def _handle(self, event: object) -> None:
        kind = type(event)
        if kind is ev.OperationSubmitted:
            self._on_submit(event)  # type: ignore[arg-type]  # narrowed by `kind` above
        elif kind is ev.OperationCancelled:
            self._on_cancel(event)  # type: ignore[arg-type]  # narrowed by `kind` above
        elif kind is ev.DeadlineReceived:
            self._on_deadline(event)  # type: ignore[arg-type]  # narrowed by `kind` above
        elif kind is ev.TraceContextReceived:
            self._on_trace_context(event)  # type: ignore[arg-type]  # narrowed by `kind` above
        elif kind is ev.OperationSuperseded or kind is ev.PriorityUpdated or kind is ev.BudgetUpdated:
            self._on_control(event)
        elif kind is ev.SessionOpenRequested:
            self._on_open(event)  # type: ignore[arg-type]  # narrowed by `kind` above
        elif kind is ev.SessionClosed:
            session = self._sessions.pop(event.session_id, None)  # type: ignore[attr-defined]  # narrowed by `kind` above
            if session is not None:
                self._end_session(session, "client_closed_session")
        elif kind is ev.AuthenticationFailed:
            self._handler.on_auth_refused(self.transport_name, event.presented)  # type: ignore[attr-defined]  # narrowed by `kind` above
        elif kind is ev.SessionDraining:
            self._on_draining(event)  # type: ignore[arg-type]  # narrowed by `kind` above
        elif kind is ev.PacketRejected:
            self._log_refusal(event)  # type: ignore[arg-type]  # narrowed by `kind` above
        elif kind is ev.ConnectionEnded:
            if event.error is not None:  # type: ignore[attr-defined]  # narrowed by `kind` above
                logger.warning(
                    "NNRP connection %d on %s closed: %s",
                    self.connection_id,
                    self.transport_name,
                    loggable(event.error),  # type: ignore[attr-defined]  # narrowed by `kind` above
                )
            self._lose_all("client_disconnected")
            self._write()
            self._end("ended" if event.error is None else "failed")  # type: ignore[attr-defined]  # narrowed by `kind` above

    def _log_refusal(self, event: ev.PacketRejected) -> None:
        """One INFO line per refused packet, at most ``RefusalLogLimiter``'s per window and connection; the
        rest are counted into one summary line (and the last one at the connection's end)."""
        write, left_out = self._refusals.admit(time.monotonic())
        if left_out:
            logger.info(
                "NNRP connection %d on %s: %d more packets refused (not logged)",
                self.connection_id,
                self.transport_name,
                left_out,
            )
        if write:
            logger.info(
                "NNRP packet refused on connection %d session %d: %s",
                self.connection_id,
                event.session_id,
                loggable(event.reason),
            )

    def _on_draining(self, draining: ev.SessionDraining) -> None:
        """SESSION_CLOSE with the drain policy while operations run (NNRP/1-preview3 §7.1C): the session takes
        no new work; after ``drain_timeout_ms`` (0: at once, what nnrp-py's and this package's clients send)
        every operation still running ends with its ``peer_cancelled`` drop. The core closes the session behind
        the last terminal (:meth:`_terminal_done`)."""
        session = self._sessions.get(draining.session_id)
        if session is None:
            return
        session.policy.close()
        if draining.drain_timeout_ms:
            loop = asyncio.get_running_loop()
            session.drain_timer = loop.call_later(draining.drain_timeout_ms / 1000, self._drain_expired, session)
        else:
            self._drain_expired(session)

    def _drain_expired(self, session: StreamSession) -> None:
        session.drain_timer = None
        if session.session_id in self._sessions:
            session.policy.cancel_all("client_closed_session")
            self.flush()

    def _on_open(self, request: ev.SessionOpenRequested) -> None:
        if self._stopping:
            self._core.reject_session(
                request.request, SESSION_ERROR_SESSION_LIMIT_REACHED, draining.DRAINING_DIAGNOSTIC
            )
            return
        if not self._gate.try_open():
            self._core.reject_session(
                request.request,
                SESSION_ERROR_SESSION_LIMIT_REACHED,
                f"{self._gate.max_sessions} NNRP sessions are open (nnrp.max_sessions)",
            )
            return
        session_id = self._core.accept_session(request.request)
        if not session_id:  # the connection ended meanwhile, or no session id is left on it: refused by the core
            self._gate.closed()
            return
        self._cancel_handshake_timer()
        session = StreamSession(
            session_id,
            self._handler,
            self._limits,
            self._mark,
            self._send_now,
            self._core.send_credit_update,
            self._probe,
            paused=self._paused,
            priority_class=request.priority_class,
        )
        self._sessions[session_id] = session
        self._handler.on_session(self.transport_name, True)

    def _on_submit(self, submitted: ev.OperationSubmitted) -> None:
        session = self._sessions.get(submitted.session_id)
        if session is None:
            return
        if len(session.policy.ops) >= self._limits.max_in_flight and not self._violations.spend(time.monotonic()):
            self._end_for_violations(session, submitted.frame_id)
            return
        metadata: Any = submitted.metadata
        sop = ServerOperation(
            session.link,
            session_id=session.session_id,
            operation_id=submitted.operation_id,
            frame_id=submitted.frame_id,
            envelope=envelope_of(metadata.payload_kind_bitmap, metadata.payload_frame_count, submitted.body),
            transport=self.transport_name,
            connection_id=self.connection_id,
            now_ns=time.monotonic_ns(),
            now_unix_ns=time.time_ns(),
            priority_class=session.priority_class,
        )
        session.policy.submit(sop)  # a refusal goes out with this read's flush

    def _end_for_violations(self, session: StreamSession, frame_id: int) -> None:
        """The client keeps submitting beyond the credit its sessions were granted (SESSION_OPEN_ACK
        ``granted_operation_credit`` = ``max_in_flight_per_session``, then BACKPRESSURE), past its
        :class:`.bounds.ViolationBudget`: it stops costing the server a refusal per submit. The session that
        broke it gets ERROR_RECOVERABLE ``LIMIT_EXCEEDED`` (the protocol's error for a limit; nnrp-py
        ``nnrp.core.enums.ErrorCode``) on the offending frame, what is queued is written, and the connection
        ends: nothing more of its input is handled, its operations stop as for a lost client (their vLLM
        requests are aborted). Counted and logged by the handler (``credit_violations``)."""
        self._ending = True
        detail = (
            f"connection {self.connection_id} kept submitting beyond its granted credit of "
            f"{self._limits.max_in_flight} operations per session (nnrp.max_in_flight_per_session) "
            f"after {self._violations.burst} refusals; closed"
        )
        self._core.send_recoverable_error(
            session.session_id, frame_id, int(ErrorCode.LIMIT_EXCEEDED), f"submits beyond the granted credit: {detail}"
        )
        self._handler.on_connection_ended(self.transport_name, "credit_violations", detail)
        self.flush()
        self._end("violation")

    def _on_cancel(self, cancelled: ev.OperationCancelled) -> None:
        session = self._sessions.get(cancelled.session_id)
        if session is not None:
            session.policy.cancel(session.policy.ops.get(cancelled.operation_id), cancelled.kind)

    def _on_deadline(self, deadline: ev.DeadlineReceived) -> None:
        session = self._sessions.get(deadline.session_id)
        if session is not None:
            session.policy.deadline(deadline.operation_id, deadline.deadline_unix_ms)

    def _on_control(self, event: Any) -> None:
        """SUPERSEDE, PRIORITY_UPDATE, BUDGET_UPDATE for an active operation: the session's policy applies it."""
        session = self._sessions.get(event.session_id)
        sop = session.policy.ops.get(event.operation_id) if session is not None else None
        if sop is None or session is None:
            return
        kind = type(event)
        if kind is ev.OperationSuperseded:
            session.policy.supersede(sop)
        elif kind is ev.PriorityUpdated:
            session.policy.update_priority(sop, event.priority_class)
        else:
            session.policy.update_budget(sop, event.token_budget)

    def _on_trace_context(self, received: ev.TraceContextReceived) -> None:
        session = self._sessions.get(received.session_id)
        if session is not None:
            operation_id = received.operation_id
            sop = session.policy.ops.get(operation_id) if operation_id is not None else None
            session.policy.trace_context(received.frame_id, sop, received)

    def _lose_all(self, detail: str) -> None:
        """The client is gone: nothing can be delivered; every operation of every session stops."""
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for session in sessions:
            self._end_session(session, detail)

    def _end_session(self, session: StreamSession, detail: str) -> None:
        if session.drain_timer is not None:
            session.drain_timer.cancel()
            session.drain_timer = None
        self._dirty.pop(session.session_id, None)
        session.link.items.clear()
        session.policy.lose_all(detail)
        self._gate.closed()
        self._handler.on_session(self.transport_name, False)

    # -- sending ------------------------------------------------------------------------------------------

    def _mark(self, session: StreamSession) -> None:
        """``session``'s outbox got an entry (the link's ``notify``)."""
        self._dirty[session.session_id] = session
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._carrier is not None:
            self._flush_scheduled = True
            self._round.add(self)

    def flush(self) -> None:
        """Encode every waiting action of every session (unless the carrier's buffer is full), then write."""
        self._flush_scheduled = False
        if not self._paused:
            while self._dirty:
                _, session = self._dirty.popitem()
                if session.session_id in self._sessions:
                    self._drain(session)
        self._write()

    def _write(self) -> None:
        data = self._core.data_to_send()
        if data and self._carrier is not None and not self._carrier.is_closing():
            self._carrier.send(data)

    def _drain(self, session: StreamSession) -> None:
        outbox = session.link.items
        while outbox:
            sop, action = outbox.popleft()
            if action is PRESSURE:
                session.policy.pressure_signalled()
                self._core.send_backpressure(
                    session.session_id, 0, PRESSURE_LEVEL_FULL, PRESSURE_REASON_IN_FLIGHT, RETRY_AFTER_MS
                )
                continue
            if isinstance(action, PartialResult):
                try:
                    self._send_partial(session, sop, action)
                except (ValueError, TypeError, OverflowError, struct.error):
                    self._drop_unsendable(session, sop)
                continue
            try:
                self._send_terminal(session, sop, action)
            except (ValueError, TypeError, OverflowError, struct.error):
                self._drop_unsendable(session, sop)

    def _send_now(self, session: StreamSession, sop: ServerOperation, action: PartialResult) -> None:
        """``action`` was decided while nothing of ``session`` waited: numbered and framed now, written with
        this iteration's flush."""
        if self._probe is not None:
            self._probe.queued(action)
        try:
            self._send_partial(session, sop, action)
        except (ValueError, TypeError, OverflowError, struct.error):
            self._drop_unsendable(session, sop)
        self._schedule_flush()

    def _send_partial(self, session: StreamSession, sop: ServerOperation, action: PartialResult) -> None:
        taken = sop.take(action)
        if taken is None:
            return  # discarded: a drop was decided, or the terminal went out
        probe = self._probe
        started = time.monotonic_ns() if probe is not None else 0  # one clock read per event unless measured
        if self._core.send_partial_result(
            session.session_id, sop.frame_id, sop.operation_id, taken.sequence, taken.body
        ):
            ended = time.monotonic_ns()
            sop.observation.event_sent(ended)
            if probe is not None:
                probe.sent(taken, started, ended)

    def _send_terminal(self, session: StreamSession, sop: ServerOperation, action: Any) -> None:
        sealed, elapsed_ms = sop.seal(action)
        if sealed is None:
            return  # a terminal went out already
        if isinstance(sealed, ResultPush):
            metadata, body = wire_mapping.result_push(sealed, elapsed_ms)
            self._core.send_result_push(session.session_id, sop.frame_id, metadata.pack(), body)
        else:
            self._send_drop(session, sop, sealed)
        self._terminal_done(session, sop)

    def _send_drop(self, session: StreamSession, sop: ServerOperation, drop: ResultDrop) -> None:
        self._core.send_result_drop_reason(
            session.session_id,
            sop.frame_id,
            sop.operation_id,
            drop.sequence,
            wire_mapping.drop_code(drop.reason),
            drop.diagnostic,
        )

    def _drop_unsendable(self, session: StreamSession, sop: ServerOperation) -> None:
        """A frame of ``sop`` cannot be built (a bug): it ends with a TRANSPORT_CLOSED drop and its work stops;
        the session and the client's other operations go on."""
        logger.exception("NNRP frame for operation %d cannot be built; the operation is dropped", sop.operation_id)
        self._send_drop(session, sop, sop.unsendable())
        self._terminal_done(session, sop)

    def _terminal_done(self, session: StreamSession, sop: ServerOperation) -> None:
        """``sop``'s terminal went out (or never can): the session's policy frees its window."""
        if self._stopping:
            session.policy.close()
        session.policy.terminal_done(sop)
        sid = session.session_id
        if sid in self._sessions and not self._core.session_open(sid):  # the last terminal of a drained close
            del self._sessions[sid]
            self._end_session(session, "client_closed_session")

"""One submitted NNRP operation as the adapter sees it, and the session outbox its events wait in.

:class:`ServerOperation` is the operation's lifecycle (:class:`vllm_nnrp_plugin.core.operation.Operation`, whose
table decides) plus the :class:`SessionLink` it shares with its session; it carries out what the table decides:
a terminal to queue goes into the link's outbox, a stop to the operation's owner (the service). Both belong to
vLLM's event loop, whatever the carrier: the adapter and the service decide there, and the connection
(:mod:`.connection`) reads and sends there, so nothing here is locked and nothing may be touched from another
thread.

The envelope is unwrapped from the submit's typed body (:func:`envelope_of`) before the operation is handed to
the service.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, Protocol

from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.core.controls import BALANCED, RuntimeControls
from vllm_nnrp_plugin.core.operation import (
    Decision,
    DropReason,
    Operation,
    PartialResult,
    ResultDrop,
    ResultPush,
    Terminal,
)
from vllm_nnrp_plugin.observability import observation as obs
from vllm_nnrp_plugin.profile import trace
from vllm_nnrp_plugin.profile.errors import ProfileError

#: an outbox entry asking the connection for a BACKPRESSURE frame before the refusal queued after it
PRESSURE = "backpressure"


class SendProbe(Protocol):
    """A benchmark's view of the sends (``bench/server.py``); times are ``time.monotonic_ns()``."""

    def queued(self, action: PartialResult) -> None:
        """A partial result was decided (entered the outbox, or goes out at once)."""

    def sent(self, action: PartialResult, started_ns: int, ended_ns: int) -> None:
        """The wire core framed that partial result from ``started_ns`` to ``ended_ns``."""


class OperationOwner(Protocol):
    """Who runs an operation's backend work (the service, on vLLM's loop): told on that loop, directly."""

    def rearm(self, sop: ServerOperation) -> None:
        """``sop.expires_unix_ms`` moved earlier: (re)arm its timer."""

    def stop_operation(self, sop: ServerOperation) -> None:
        """Stop ``sop``'s backend work (its terminal is decided)."""


class SessionLink:
    """What the operations of one session share with its connection, on the loop: the outbox of decided sends
    (``items``, a ``deque`` of ``(ServerOperation, Action | PRESSURE)``; ``notify`` is called after every
    append), the count of decided events not sent yet (``waiting``, bounded by ``max_queued_events``; a delta
    that joined a queued one counts too) and the session-scoped TRACE_CONTEXT (frame 0), the default of
    operations dispatched later. ``send_now``: set by the connection while its transport takes writes — a
    partial result decided while nothing of the session waits is handed to it at once (``send_now(sop,
    partial)``, which takes it, :meth:`ServerOperation.take`) instead of queued; ``None``: everything queues."""

    __slots__ = ("items", "notify", "max_queued_events", "waiting", "probe", "session_trace", "send_now")

    def __init__(self, max_queued_events: int, notify: Callable[[], None], probe: SendProbe | None = None) -> None:
        self.items: collections.deque[tuple[ServerOperation, Any]] = collections.deque()
        self.notify = notify
        self.max_queued_events = max_queued_events
        self.waiting = 0
        self.probe = probe
        self.session_trace: trace.TraceContext | None = None
        self.send_now: Callable[[ServerOperation, PartialResult], None] | None = None

    def put(self, sop: ServerOperation, action: Any) -> None:
        if self.probe is not None and isinstance(action, PartialResult):
            self.probe.queued(action)
        self.items.append((sop, action))
        self.notify()

    def left(self, events: int) -> None:
        """``events`` waiting events left the outbox (sent or discarded)."""
        self.waiting -= events


class ServerOperation:
    """One submitted operation, owned by vLLM's event loop: ``operation_id`` (u64) and ``frame_id`` (u32) are
    the client's; ``transport`` is the carrier (``tcp``, ``tls``, ``ipc``, ``websocket``, ``quic``);
    ``observation`` is its record; ``rules`` its :class:`~vllm_nnrp_plugin.core.operation.Operation` (read
    ``rules.state`` freely; change it only through this object's methods, which carry out what the rules
    decide); ``owner`` is set by whoever runs its backend work; ``controls`` its
    :class:`~vllm_nnrp_plugin.core.controls.RuntimeControls` (made with its session's ``priority_class``)."""

    __slots__ = ("operation_id", "frame_id", "transport", "envelope", "owner", "rules", "controls", "_abort", "_link")

    def __init__(
        self,
        link: SessionLink,
        *,
        session_id: int,
        operation_id: int,
        frame_id: int,
        envelope: bytes | ProfileError,
        transport: str,
        connection_id: int,
        now_ns: int,
        now_unix_ns: int,
        priority_class: int = BALANCED,
    ) -> None:
        #: the runtime controls (priority, token budget) of its backend request
        self.controls = RuntimeControls(session_class=priority_class, on_budget_end=self._end_budget)
        self.operation_id = operation_id
        self.frame_id = frame_id
        self.transport = transport
        self.owner: OperationOwner | None = None
        self._abort: Callable[[], None] | None = None  # the adapter's, while a backend request runs
        self._link = link
        self.rules = Operation(
            obs.Observation(
                connection_id=connection_id,
                session_id=session_id,
                operation_id=operation_id,
                frame_id=frame_id,
                transport=transport,
                submitted_ns=now_ns,
                submitted_unix_ns=now_unix_ns,
            )
        )
        #: the JSON envelope unwrapped from the submit, or the ``invalid_frame`` error its typed body raised
        self.envelope = envelope

    @property
    def observation(self) -> obs.Observation:
        return self.rules.observation

    @property
    def expires_unix_ms(self) -> int | None:
        """Wall-clock ms after which the operation ends with ``request_timeout`` (``None``: unbounded)."""
        return self.rules.expires_unix_ms

    # -- the adapter (vLLM's loop) --------------------------------------------------------------------------

    def partial(self, event: dict[str, Any]) -> None:
        """Queue one non-terminal event (or let it join the delta still queued), as the table decides (nothing
        once a terminal was decided); it counts as one more waiting event. When the session's outbox already
        holds ``max_queued_events`` the input is the overflow instead (``client_too_slow``, and the owner stops
        the operation). With the link's ``send_now`` set and nothing of the session waiting, a new partial
        result is numbered and sent at once instead."""
        outbox = self._link
        if outbox.waiting >= outbox.max_queued_events:
            self._carry_out(self.rules.overflow(outbox.max_queued_events))
            return
        action = self.rules.partial(event)
        if action is None:  # a terminal was decided
            return
        outbox.waiting += 1
        if action.events > 1:  # it joined the delta still queued
            return
        send_now = outbox.send_now
        if send_now is not None and not outbox.items:
            send_now(self, action)  # nothing waits: out now
        else:
            outbox.put(self, action)

    def complete(self, body: dict[str, Any]) -> None:
        """Queue the terminal ``response.completed``."""
        self._carry_out(self.rules.complete(body))

    def fail(self, err: ProfileError) -> None:
        """Queue the terminal ``response.error``."""
        self._carry_out(self.rules.fail(err))

    def _end_budget(self) -> bool:
        """The backend binding ended the stream at the token budget: True when the table says to abort the
        backend request now (:meth:`Operation.end_budget`)."""
        return self.rules.end_budget().abort

    def limit_time(self, timeout_ms: int) -> None:
        """Bound the operation to ``timeout_ms`` (ms) after its submit (envelope ``nnrp.timeout_ms``)."""
        moved = self.rules.limit_time(timeout_ms)
        if moved and self.owner is not None:
            self.owner.rearm(self)

    def expired(self) -> bool:
        """Before dispatch: True when its bound has passed (it then ended with the ``deadline_expired`` drop, or
        ``request_timeout`` for the envelope's ``nnrp.timeout_ms``, and must not reach vLLM)."""
        if not self.rules.expired(time.time_ns() // 1_000_000):
            return False
        self.time_out()
        return True

    def dispatch(self) -> trace.TraceContext | None:
        """The operation goes to vLLM now: its controls' priority class is fixed; freeze and return its trace
        context (its own override, else the session's default)."""
        return self.rules.dispatch(self._link.session_trace)

    def abort_with(self, abort: Callable[[], None] | None) -> None:
        """What stops the backend request at once (``None``: nothing to stop any more)."""
        self._abort = abort

    def abort_now(self) -> None:
        """The owner stops the operation: abort its backend request now, if one runs."""
        if self._abort is not None:
            self._abort()

    # -- the service (vLLM's loop) ------------------------------------------------------------------------------

    def bound(self, deadline_unix_ms: int) -> bool:
        """An NNRP DEADLINE (wall-clock ms): True when it moved the expiry earlier. (The session's policy
        applies one that came before the submit, before handing the operation on.)"""
        return self.rules.bound(deadline_unix_ms)

    def time_out(self) -> None:
        """The bound passed: terminal ``deadline_expired`` drop (an NNRP deadline; neither the engine nor the
        backend's stream has produced anything yet) or
        ``response.error`` ``request_timeout``, unless one was decided (:meth:`Operation.time_out`)."""
        started = self.controls.engine_started or self.observation.backend_first_chunk_ns is not None
        self._carry_out(self.rules.time_out(time.monotonic_ns(), started=started))

    def shut_down(self) -> None:
        """The server is stopping: terminal ``response.error`` ``server_shutdown`` unless one was decided; its
        backend work stops."""
        self._carry_out(self.rules.shut_down(time.monotonic_ns()))

    def refuse(self, err: ProfileError) -> None:
        """Refused at admission (``too_many_requests``): a BACKPRESSURE frame, then the error terminal."""
        self._carry_out(self.rules.refuse(err))

    def settle(self) -> bool:
        """One of the two ends happened (terminal sent; task ended or none will run). True exactly once, when
        both have: the observation is complete."""
        return self.rules.settle()

    # -- the connection ------------------------------------------------------------------------------------------

    def take(self, partial: PartialResult) -> PartialResult | None:
        """``partial`` leaves the outbox: numbered and encoded to go out now, or ``None`` when the table discards
        it (a drop was decided, or the terminal went out: :meth:`Operation.take`)."""
        self._link.left(partial.events)
        return self.rules.take(partial)

    def override_trace(self, context: trace.TraceContext) -> None:
        """An operation-scoped TRACE_CONTEXT came in; ignored once dispatched."""
        self.rules.override_trace(context)

    def cancel(self, reason: DropReason, detail: str) -> None:
        """The peer cancelled (or superseded) it: its drop is queued (or the terminal already queued becomes it)
        and its backend work stops."""
        self._carry_out(self.rules.cancel(reason, detail, time.monotonic_ns()))

    def lose(self, detail: str) -> None:
        """The client is gone: the operation ends as cancelled with nothing sent; its backend work stops."""
        self._carry_out(self.rules.lose(detail, time.monotonic_ns()))

    def seal(self, terminal: Terminal) -> tuple[ResultPush | ResultDrop | None, int]:
        """The encoded terminal to send (``None``: one was sent already) and the ms since submit."""
        now_ns = time.monotonic_ns()
        return self.rules.seal(terminal, now_ns), self.rules.elapsed_ms(now_ns)

    def unsendable(self) -> ResultDrop:
        """A frame could not be built: the TRANSPORT_CLOSED drop that ends the operation instead (to send now);
        its backend work stops."""
        decision, drop = self.rules.unsendable(time.monotonic_ns())
        self._carry_out(decision)
        return drop

    def _carry_out(self, decision: Decision) -> None:
        """What the lifecycle table decided: a BACKPRESSURE and the terminal into the outbox, then the stop to
        the owner."""
        if decision.pressure:
            self._link.put(self, PRESSURE)
        if decision.terminal is not None:
            self._link.put(self, decision.terminal)
        if decision.stop and self.owner is not None:
            self.owner.stop_operation(self)


def envelope_of(payload_kind_bitmap: int, payload_frame_count: int, body: bytes) -> bytes | ProfileError:
    """The JSON envelope inside a submit's typed body, or the ``invalid_frame`` error that body raises
    (:func:`vllm_nnrp_plugin.contract.wire_mapping.unwrap_typed_body`)."""
    try:
        return wire_mapping.unwrap_typed_body(payload_kind_bitmap, payload_frame_count, body)
    except ProfileError as err:
        return err

"""The operation's rules as plain data (h11 style: events in, actions out; no I/O, no threads, no clock reads).

:class:`Operation` owns one submitted operation's lifecycle: its :class:`State` moves only through the table
:data:`TRANSITIONS`, ``(state, input) -> (effects, new state)`` (the way h2's ``stream.py`` drives a stream).
The adapter, the service and the carrier are its inputs (:class:`Input`); what a transition asks of them comes
back as a :class:`Decision` (:class:`Effect`: queue the terminal for the carrier, stop the backend work, send
now). It numbers partial results from 1, decides exactly one terminal, refuses anything after it, and keeps
every other rule of an operation:

* a peer cancel (or a lost transport) turns the terminal into a drop: NNRP's client refuses partial results and
  a RESULT_PUSH once it cancelled (nnrp-rs ``crates/nnrp-runtime/src/client.rs``; the wire core,
  :mod:`vllm_nnrp_plugin.nnrp_wire.server`, refuses them the same way), so a RESULT_DROP_REASON carrying
  ``response.cancelled`` is the only deliverable terminal, and a push decided just before the cancel arrived
  goes out as that drop instead;
* SUPERSEDE ends the operation with the ``superseded`` drop (``response.cancelled {reason: "superseded"}``), as
  a cancel does;
* an NNRP deadline (DEADLINE, EXPIRE_AT) that passes before the engine produced the operation's first output —
  before dispatch, or while the request waits in vLLM's queue — ends it with the ``deadline_expired`` drop
  (``response.cancelled {reason: "deadline_expired"}``): the result would come too late to be of use and nothing
  of it was produced;
* timeout (``request_timeout``, 504: the envelope's ``nnrp.timeout_ms``, or an NNRP deadline once the engine
  produced output), server shutdown (``server_shutdown``, 503) and a full session outbox
  (``client_too_slow``, 429) each decide a ``response.error`` terminal unless one was decided already;
* the earliest bound wins: envelope ``nnrp.timeout_ms`` (from the submit) and NNRP DEADLINE controls
  (wall-clock ms) only ever move the operation's expiry earlier;
* the TRACE_CONTEXT an operation runs in is frozen when it is dispatched to vLLM (the ``openai-compatible/1``
  profile's trace-context section): later overrides never change in-flight work;
* the terminal event is encoded once, when it is sent (:meth:`Operation.seal`), with the ``diagnostics`` the
  envelope asked for (``nnrp.diagnostics: true``);
* a delta decided while the previous one still waits to be sent joins it (:func:`.profile.events.merge`): a
  client that reads slower than vLLM produces (a busy server, a slow link) gets fewer, larger events instead of
  a growing queue, and nothing waits that would not have waited anyway. Partial results are numbered when they
  are taken for sending (:meth:`Operation.take`), so sequences stay contiguous.

Frames follow the frozen wire mapping of the ``openai-compatible/1`` profile: ``response.completed`` /
``response.error`` as a RESULT_PUSH; a cancellation as a RESULT_DROP_REASON. The NNRP binding
(:mod:`vllm_nnrp_plugin.contract.wire_mapping`) turns the sealed actions into frames; nothing here knows NNRP types.
An :class:`Operation` is not thread-safe: vLLM's event loop owns it, through
:class:`vllm_nnrp_plugin.nnrp_binding.server_operation.ServerOperation`, which carries out its decisions. Every
time is passed in by the caller: ``now_ns`` is ``time.monotonic_ns()``, ``*_unix_ms`` wall-clock ms.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import orjson

from vllm_nnrp_plugin.observability import observation as obs
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events, trace
from vllm_nnrp_plugin.profile.errors import ProfileError

#: the newest DEADLINE controls kept for operations not submitted yet
MAX_EARLY_DEADLINES = 256


class DropReason(enum.Enum):
    """Why an operation ends with a drop instead of a result push (NNRP ResultDropReasonCode names)."""

    PEER_CANCELLED = "peer_cancelled"  # client FRAME_CANCEL / CANCEL / ABORT
    TRANSPORT_CLOSED = "transport_closed"  # client vanished or closed its session mid-operation
    SUPERSEDED = "superseded"  # client SUPERSEDE
    DEADLINE_EXPIRED = "deadline_expired"  # an NNRP deadline passed before the engine produced output


CANCEL_SOURCE = {
    DropReason.PEER_CANCELLED: obs.CLIENT,
    DropReason.TRANSPORT_CLOSED: obs.TRANSPORT,
    DropReason.SUPERSEDED: obs.CLIENT,
    DropReason.DEADLINE_EXPIRED: obs.DEADLINE,
}


@attrs.define(slots=True)
class PartialResult:
    """One non-terminal event: ``event`` the profile event (a delta may still grow, :meth:`Operation.partial`);
    once taken for sending (:meth:`Operation.take`), ``sequence`` (from 1) and ``body`` (the raw UTF-8 JSON
    event) are set."""

    event: dict[str, Any]
    sequence: int = 0
    body: bytes = b""
    #: how many decided events it carries (more than 1 once deltas joined it)
    events: int = 1


@attrs.frozen
class Terminal:
    """A decided terminal, not encoded yet: ``event`` is the profile terminal event (``response.completed``,
    ``response.error`` or ``response.cancelled``); ``status`` informational (200, 4xx, 5xx; 0 for a drop);
    ``drop`` is set when it goes out as a RESULT_DROP_REASON (a cancellation), ``None`` for a RESULT_PUSH."""

    status: int
    event: dict[str, Any]
    drop: DropReason | None = None


@attrs.frozen
class ResultPush:
    """The sealed terminal RESULT_PUSH: ``event`` is the encoded JSON terminal event."""

    status: int
    event: bytes


@attrs.frozen
class ResultDrop:
    """The sealed terminal RESULT_DROP_REASON: ``diagnostic`` is the encoded ``response.cancelled`` event."""

    reason: DropReason
    sequence: int
    diagnostic: bytes


#: what a session outbox holds: decided, not yet sent
Action = PartialResult | Terminal


class State(enum.Enum):
    """Where one operation is in its lifecycle (:data:`TRANSITIONS`)."""

    ADMITTED = "admitted"  # submitted and admitted, not handed to vLLM yet
    RUNNING = "running"  # handed to vLLM (its trace context frozen)
    DECIDED = "decided"  # its terminal push is queued, not sent yet
    DROPPING = "dropping"  # cancelled, superseded or expired: only a drop may go out (queued, or the queued push
    # becomes it)
    SENT = "sent"  # its terminal went out, or can never (the client is gone)

    #: members are singletons, so identity is equality: hashed by identity in C, a table lookup per partial
    #: result calls no Python code (``enum.Enum.__hash__`` hashes the member's name in Python)
    __hash__ = object.__hash__


class Input(enum.Enum):
    """What can happen to an operation, and who says so: the adapter (``DISPATCH``, ``PARTIAL``, ``COMPLETE``,
    ``FAIL``), the backend binding (``BUDGET``), the session outbox (``OVERFLOW``), the admission (``REFUSE``), the
    service (``TIME_OUT``, ``EXPIRE``, ``SHUT_DOWN``), the carrier (``CANCEL``: FRAME_CANCEL, CANCEL, ABORT,
    SUPERSEDE or a session's end; ``LOSE``; ``TAKE``; ``SEAL``; ``UNSENDABLE``)."""

    DISPATCH = "dispatch"  # the request goes to vLLM
    PARTIAL = "partial"  # a non-terminal event
    COMPLETE = "complete"  # response.completed
    FAIL = "fail"  # response.error
    BUDGET = "budget"  # the token budget ended the backend stream (its end, finish "length", still comes: COMPLETE)
    OVERFLOW = "overflow"  # the session outbox is full: response.error client_too_slow
    REFUSE = "refuse"  # over an in-flight limit at admission: BACKPRESSURE, then response.error too_many_requests
    TIME_OUT = "time_out"  # a bound passed: response.error request_timeout
    EXPIRE = "expire"  # an NNRP deadline passed before the engine produced output: the deadline_expired drop
    SHUT_DOWN = "shut_down"  # the server stops: response.error server_shutdown
    CANCEL = "cancel"  # the peer cancelled (or superseded) it: the drop
    LOSE = "lose"  # the client is gone: nothing can be sent
    TAKE = "take"  # the carrier takes a queued partial result to send it (or discards it)
    SEAL = "seal"  # the carrier sends the queued terminal now
    UNSENDABLE = "unsendable"  # a frame of it cannot be built: it ends with a server_error drop

    __hash__ = object.__hash__  # as :class:`State`'s


class Effect(enum.Flag):
    """What a transition asks of the operation's outputs."""

    NONE = 0
    QUEUE = enum.auto()  # what was decided (a partial result, or the terminal) goes into the session outbox
    STOP = enum.auto()  # the backend work stops: the service aborts the vLLM request and cancels its task
    SEND = enum.auto()  # what the carrier takes (a partial result, or the terminal) is encoded to be sent now
    FREEZE = enum.auto()  # the trace context is frozen (dispatch)
    DROP = enum.auto()  # the operation ends with this input's drop (kept); sealing sends the kept drop, so a push
    # queued before it goes out as that drop
    PRESSURE = enum.auto()  # a BACKPRESSURE goes into the session outbox before what is queued
    ABORT = enum.auto()  # the backend request is aborted at once; its stream is still read to its end


_A, _R, _D, _X, _S = State.ADMITTED, State.RUNNING, State.DECIDED, State.DROPPING, State.SENT
_Q, _STOP, _SEND, _DROP, _NONE = Effect.QUEUE, Effect.STOP, Effect.SEND, Effect.DROP, Effect.NONE

#: The lifecycle, ``(state, input) -> (effects, new state)``, the way h2's ``stream.py`` drives an HTTP/2 stream.
#: A pair not listed changes nothing and has no effect: once a terminal is decided, later decisions are no-ops;
#: partial results are decided only before it and a queued one goes out only until a drop was decided or the
#: terminal went out (else it is discarded); a cancel after a decided push turns that push into the drop when
#: it is sealed (NNRP's client refuses partial results and a RESULT_PUSH after it cancelled: nnrp-rs
#: ``crates/nnrp-runtime/src/client.rs``); a stop is asked again whenever a bound or a shutdown comes while the
#: task may still run.
TRANSITIONS: dict[tuple[State, Input], tuple[Effect, State]] = {
    (_A, Input.DISPATCH): (Effect.FREEZE, _R),
    (_A, Input.PARTIAL): (_Q, _A),
    (_R, Input.PARTIAL): (_Q, _R),
    (_A, Input.COMPLETE): (_Q, _D),
    (_R, Input.COMPLETE): (_Q, _D),
    (_A, Input.FAIL): (_Q, _D),
    (_R, Input.FAIL): (_Q, _D),
    (_R, Input.BUDGET): (Effect.ABORT, _R),
    (_A, Input.OVERFLOW): (_Q | _STOP, _D),
    (_R, Input.OVERFLOW): (_Q | _STOP, _D),
    (_A, Input.REFUSE): (Effect.PRESSURE | _Q, _D),
    (_A, Input.TIME_OUT): (_Q | _STOP, _D),
    (_R, Input.TIME_OUT): (_Q | _STOP, _D),
    (_D, Input.TIME_OUT): (_STOP, _D),
    (_X, Input.TIME_OUT): (_STOP, _X),
    (_S, Input.TIME_OUT): (_STOP, _S),
    (_A, Input.EXPIRE): (_Q | _STOP | _DROP, _X),
    (_R, Input.EXPIRE): (_Q | _STOP | _DROP, _X),
    (_D, Input.EXPIRE): (_STOP, _D),
    (_X, Input.EXPIRE): (_STOP, _X),
    (_S, Input.EXPIRE): (_STOP, _S),
    (_A, Input.SHUT_DOWN): (_Q | _STOP, _D),
    (_R, Input.SHUT_DOWN): (_Q | _STOP, _D),
    (_D, Input.SHUT_DOWN): (_STOP, _D),
    (_X, Input.SHUT_DOWN): (_STOP, _X),
    (_S, Input.SHUT_DOWN): (_STOP, _S),
    (_A, Input.CANCEL): (_Q | _STOP | _DROP, _X),
    (_R, Input.CANCEL): (_Q | _STOP | _DROP, _X),
    (_D, Input.CANCEL): (_STOP | _DROP, _X),
    (_X, Input.CANCEL): (_STOP, _X),
    (_A, Input.LOSE): (_STOP, _S),
    (_R, Input.LOSE): (_STOP, _S),
    (_D, Input.LOSE): (_STOP, _S),
    (_X, Input.LOSE): (_STOP, _S),
    (_A, Input.TAKE): (_SEND, _A),
    (_R, Input.TAKE): (_SEND, _R),
    (_D, Input.TAKE): (_SEND, _D),
    (_D, Input.SEAL): (_SEND, _S),
    (_X, Input.SEAL): (_SEND | _DROP, _S),
    (_A, Input.UNSENDABLE): (_SEND | _STOP, _S),
    (_R, Input.UNSENDABLE): (_SEND | _STOP, _S),
    (_D, Input.UNSENDABLE): (_SEND | _STOP, _S),
    (_X, Input.UNSENDABLE): (_SEND | _STOP, _S),
    (_S, Input.UNSENDABLE): (_SEND | _STOP, _S),  # the sealed terminal itself could not be framed
}

#: :data:`TRANSITIONS` by input, then state: a step looks its move up without building a key
_MOVES: dict[Input, dict[State, tuple[Effect, State]]] = {event: {} for event in Input}
for (_state, _event), _move in TRANSITIONS.items():
    _MOVES[_event][_state] = _move
del _state, _event, _move
#: the rows of the two inputs that come once per partial result: their moves never change the state (a test
#: checks it), so being listed is the whole step; :meth:`Operation._step` keeps the current state's moves at
#: hand, so a partial result costs one attribute read, not a lookup
_ON_PARTIAL, _ON_TAKE = _MOVES[Input.PARTIAL], _MOVES[Input.TAKE]


@attrs.frozen
class Decision:
    """What one input decided: ``effect`` (:class:`Effect`) and, with :attr:`Effect.QUEUE`, the ``terminal`` to
    queue."""

    effect: Effect
    terminal: Terminal | None = None

    @property
    def stop(self) -> bool:
        """The backend work must stop."""
        return Effect.STOP in self.effect

    @property
    def abort(self) -> bool:
        """The backend request is aborted at once, its stream read on to its end."""
        return Effect.ABORT in self.effect

    @property
    def pressure(self) -> bool:
        """A BACKPRESSURE goes into the session outbox before the terminal."""
        return Effect.PRESSURE in self.effect


NOTHING = Decision(Effect.NONE)


def cancelled(reason: DropReason, detail: str) -> Terminal:
    """The drop that ends an operation as cancelled: ``response.cancelled {reason: detail}``."""
    return Terminal(0, events.cancelled(detail), reason)


class Operation:
    """One submitted operation's rules (module docstring): its :attr:`state` moves only through
    :data:`TRANSITIONS`, every input through :meth:`_step`; its
    :class:`~vllm_nnrp_plugin.observability.observation.Observation` ``observation`` has the submit times already
    set.

    Decisions (vLLM's event loop in production) return a :class:`Decision` (partial results: the
    :class:`PartialResult` the event went into, or ``None``: :meth:`partial`); the sending side (the connection)
    hands each queued partial result to :meth:`take` (``None``: discarded) and asks :meth:`seal` for the terminal.
    """

    __slots__ = (
        "observation",
        "submitted_unix_ms",
        "expires_unix_ms",
        "state",
        "_sequence",
        "_tail",
        "_drop",
        "_trace",
        "_unsettled",
        "_nnrp_deadline",
        "_on_partial",
        "_on_take",
    )

    def __init__(self, observation: obs.Observation) -> None:
        self.observation = observation
        self.submitted_unix_ms = observation.submitted_unix_ns // 1_000_000
        #: wall-clock ms after which the operation ends with ``request_timeout`` (None: unbounded)
        self.expires_unix_ms: int | None = None
        self.state = State.ADMITTED
        #: the table's PARTIAL and TAKE moves in :attr:`state` (``None``: not listed), set with every state
        self._on_partial, self._on_take = _ON_PARTIAL.get(_A), _ON_TAKE.get(_A)
        self._sequence = 0  # partial results numbered so far
        self._tail: PartialResult | None = None  # the newest partial result decided and not taken yet
        self._drop: Terminal | None = None  # the drop kept by :attr:`Effect.DROP`: what goes out in DROPPING
        self._nnrp_deadline = False  # the current expiry is an NNRP deadline's (not the envelope's timeout_ms)
        self._trace: trace.TraceContext | None = None  # operation-scoped TRACE_CONTEXT, until dispatch
        self._unsettled = 2  # the terminal sent, and the end of the operation's task

    @property
    def events_sent(self) -> int:
        """Partial results numbered so far."""
        return self._sequence

    def _step(self, event: Input) -> Effect:
        """Take ``event`` through :data:`TRANSITIONS`: the effects it asks for (the state moved, and with it the
        PARTIAL and TAKE moves :meth:`partial` and :meth:`take` read once per partial result)."""
        move = _MOVES[event].get(self.state)
        if move is None:
            return _NONE
        effect, state = move
        if state is not self.state:
            self.state = state
            self._on_partial, self._on_take = _ON_PARTIAL.get(state), _ON_TAKE.get(state)
        return effect

    def _decide(self, event: Input, terminal: Terminal) -> Decision:
        effect = self._step(event)
        return Decision(effect, terminal if Effect.QUEUE in effect else None) if effect else NOTHING

    # -- decisions -----------------------------------------------------------------------------------------

    def partial(self, event: dict[str, Any]) -> PartialResult | None:
        """One non-terminal event: the partial result it went into — a new one to queue (``events`` 1), or the
        delta still waiting to be sent that it joined (more) — or ``None`` when a terminal was decided (the
        table queues nothing)."""
        if self._on_partial is None:  # the step of Input.PARTIAL (it never moves the state)
            return None  # a terminal was decided: nothing is queued
        tail = self._tail
        if tail is not None:
            merged = events.merge(tail.event, event)
            if merged is not None:
                tail.event = merged
                tail.events += 1
                return tail
        self._tail = PartialResult(event)
        return self._tail

    def take(self, partial: PartialResult) -> PartialResult | None:
        """The sending side takes ``partial`` (queued by :meth:`partial`): numbered (from 1) and encoded to be
        sent now, or ``None`` when it must be discarded (a drop was decided, or the terminal went out); nothing
        joins it any more."""
        if partial is self._tail:
            self._tail = None
        if self._on_take is None:  # the step of Input.TAKE, as in :meth:`partial`
            return None  # a drop was decided or the terminal went out: discarded
        self._sequence += 1
        partial.sequence, partial.body = self._sequence, events.encode(partial.event)
        return partial

    def overflow(self, max_queued_events: int) -> Decision:
        """The session outbox already holds ``max_queued_events`` events: terminal ``response.error``
        ``client_too_slow``, and the backend work stops (nothing once a terminal was decided)."""
        effect = self._step(Input.OVERFLOW)
        if not effect:
            return NOTHING
        err = E.client_too_slow(
            f"{max_queued_events} events are waiting to be sent on this session (nnrp.max_queued_events): "
            "the client reads slower than the model generates"
        )
        self.observation.failed(code=err.code, family=err.type, status=err.status)
        return Decision(effect, Terminal(err.status, events.error(err)))

    def refuse(self, err: ProfileError) -> Decision:
        """Refused at admission (``too_many_requests``, over an in-flight limit): a BACKPRESSURE, then the
        terminal ``response.error``; it never reaches vLLM."""
        return self._fail(Input.REFUSE, err)

    def complete(self, body: dict[str, Any]) -> Decision:
        """Terminal ``response.completed {body}``, status 200."""
        decision = self._decide(Input.COMPLETE, Terminal(200, events.completed(body)))
        if decision.terminal is not None:
            self.observation.completed()
        return decision

    def fail(self, err: ProfileError) -> Decision:
        """Terminal ``response.error``, status ``err.status``."""
        return self._fail(Input.FAIL, err)

    def end_budget(self) -> Decision:
        """The backend binding ended the request's stream at its token budget (after dispatch): while it runs,
        :attr:`Effect.ABORT` (the engine request is aborted at once, the stream's end — finish ``length``, the
        usage — still comes as :meth:`complete`); nothing otherwise."""
        effect = self._step(Input.BUDGET)
        return Decision(effect) if effect else NOTHING

    def _fail(self, event: Input, err: ProfileError) -> Decision:
        decision = self._decide(event, Terminal(err.status, events.error(err)))
        if decision.terminal is not None:
            self.observation.failed(code=err.code, family=err.type, status=err.status)
        return decision

    def time_out(self, now_ns: int, *, started: bool = True) -> Decision:
        """The bound passed: the ``deadline_expired`` drop when it was an NNRP deadline and the engine has not
        produced output (``started`` False), else ``response.error`` ``request_timeout`` (504); the backend
        work stops either way."""
        if self._nnrp_deadline and not started:
            reason = DropReason.DEADLINE_EXPIRED
            return self._drop_with(Input.EXPIRE, reason, reason.value, now_ns)
        self.observation.cancelled(now_ns, source=obs.DEADLINE, reason=E.REQUEST_TIMEOUT)
        bound_ms = (self.expires_unix_ms or self.submitted_unix_ms) - self.submitted_unix_ms
        return self._fail(
            Input.TIME_OUT,
            ProfileError(
                E.REQUEST_TIMEOUT,
                f"operation {self.observation.operation_id} exceeded its deadline ({bound_ms} ms after submit)",
                E.SERVER_ERROR,
                504,
            ),
        )

    def shut_down(self, now_ns: int) -> Decision:
        """The server is stopping: ``response.error`` ``server_shutdown`` unless a terminal was decided; the
        backend work stops either way."""
        self.observation.cancelled(now_ns, source=obs.SERVER, reason=E.SERVER_SHUTDOWN)
        return self._fail(Input.SHUT_DOWN, E.server_shutdown())

    def cancel(self, reason: DropReason, detail: str, now_ns: int) -> Decision:
        """The peer cancelled (or superseded) it: nothing but a drop goes out from now on, and the backend work
        stops. The drop is queued, unless a terminal was decided already (:meth:`seal` turns a push into the
        drop)."""
        return self._drop_with(Input.CANCEL, reason, detail, now_ns)

    def _drop_with(self, event: Input, reason: DropReason, detail: str, now_ns: int) -> Decision:
        self.observation.cancelled(now_ns, source=CANCEL_SOURCE[reason], reason=detail)
        drop = cancelled(reason, detail)
        decision = self._decide(event, drop)
        if Effect.DROP in decision.effect:
            self._drop = drop
        return decision

    def lose(self, detail: str, now_ns: int) -> Decision:
        """The client is gone: nothing can be delivered; the operation ends as cancelled (``detail``) and its
        backend work stops (nothing once its terminal went out)."""
        effect = self._step(Input.LOSE)
        if not effect:
            return NOTHING
        self.observation.cancelled(now_ns, source=obs.TRANSPORT, reason=detail)
        self.observation.terminal_sent(now_ns, dropped=True)
        return Decision(effect)

    # -- deadlines and trace context -----------------------------------------------------------------------

    def limit_time(self, timeout_ms: int) -> bool:
        """Bound the operation to ``timeout_ms`` (ms) after its submit; True when the expiry moved."""
        return self.bound(self.submitted_unix_ms + timeout_ms, nnrp=False)

    def bound(self, expires_unix_ms: int, *, nnrp: bool = True) -> bool:
        """An NNRP DEADLINE or EXPIRE_AT (wall-clock ms; 0 is no bound; ``nnrp`` False: the envelope's timeout): the
        earliest bound wins. True when it moved."""
        if not expires_unix_ms or (self.expires_unix_ms is not None and expires_unix_ms >= self.expires_unix_ms):
            return False
        self.expires_unix_ms = expires_unix_ms
        self._nnrp_deadline = nnrp
        return True

    def expired(self, now_unix_ms: int) -> bool:
        """The bound passed by ``now_unix_ms`` (wall-clock ms)."""
        return self.expires_unix_ms is not None and self.expires_unix_ms <= now_unix_ms

    @property
    def dispatched(self) -> bool:
        """The operation left ADMITTED: it went to the backend (or ended before it could), so its trace context
        and its priority class are fixed."""
        return self.state is not _A

    def override_trace(self, context: trace.TraceContext) -> None:
        """An operation-scoped TRACE_CONTEXT; ignored once dispatched (in-flight work never changes)."""
        if not self.dispatched:
            self._trace = context

    def dispatch(self, session_trace: trace.TraceContext | None) -> trace.TraceContext | None:
        """The operation goes to vLLM now: its trace context (own override, else ``session_trace``) is frozen,
        recorded in the observation and returned (the frozen one, or ``None``, on a later call)."""
        if not self._step(Input.DISPATCH):
            return self.observation.trace
        context = trace.for_dispatch(session_trace, self._trace)
        self.observation.trace = context
        return context

    # -- sending ----------------------------------------------------------------------------------------------

    def seal(self, terminal: Terminal, now_ns: int) -> ResultPush | ResultDrop | None:
        """The terminal about to be sent, encoded once (with ``diagnostics`` when the envelope asked), and
        recorded as sent at ``now_ns``. ``None`` when a terminal was sent already; in DROPPING the kept drop
        goes out (a push decided before a peer cancel becomes the cancel's drop)."""
        effect = self._step(Input.SEAL)
        if not effect:
            return None
        if Effect.DROP in effect and self._drop is not None:
            terminal = self._drop
        record = self.observation
        record.terminal_sent(now_ns, dropped=terminal.drop is not None)
        event = terminal.event
        if record.diagnostics_requested:
            event = {**event, "diagnostics": obs.diagnostics(record)}
        encoded = orjson.dumps(event)
        if terminal.drop is None:
            return ResultPush(terminal.status, encoded)
        return ResultDrop(terminal.drop, self._sequence + 1, encoded)

    def unsendable(self, now_ns: int) -> tuple[Decision, ResultDrop]:
        """A frame of this operation cannot be built (a bug): what the table decides (:attr:`Effect.SEND` and
        :attr:`Effect.STOP`, in every state: its backend work stops) and the sealed TRANSPORT_CLOSED drop
        ``response.cancelled`` ``server_error`` that ends it, to send now (no diagnostics: they may be what
        failed)."""
        self.observation.cancelled(now_ns, source=obs.TRANSPORT, reason="server_error")
        decision = Decision(self._step(Input.UNSENDABLE))
        self.observation.terminal_sent(now_ns, dropped=True)
        drop = cancelled(DropReason.TRANSPORT_CLOSED, "server_error")
        return decision, ResultDrop(DropReason.TRANSPORT_CLOSED, self._sequence + 1, orjson.dumps(drop.event))

    def elapsed_ms(self, now_ns: int) -> int:
        """Submit -> ``now_ns`` in whole ms (the RESULT_PUSH ``server_total_ms``)."""
        return (now_ns - self.observation.submitted_ns) // 1_000_000

    def settle(self) -> bool:
        """One of the two ends happened (terminal sent; the operation's task ended, or none will run). True
        exactly once: when both have."""
        self._unsettled -= 1
        return self._unsettled == 0


class EarlyDeadlines:
    """DEADLINE controls for operations not submitted yet (nnrp-py's ``submit_and_poll_result(timeout_ms=…)``
    sends the DEADLINE first): the newest :data:`MAX_EARLY_DEADLINES` are kept until their submit."""

    __slots__ = ("_by_operation",)

    def __init__(self) -> None:
        self._by_operation: dict[int, int] = {}

    def keep(self, operation_id: int, deadline_unix_ms: int) -> None:
        """Remember a bound (wall-clock ms; 0 is no bound) for ``operation_id``, forgetting the oldest."""
        if not deadline_unix_ms:
            return
        self._by_operation[operation_id] = deadline_unix_ms
        if len(self._by_operation) > MAX_EARLY_DEADLINES:
            del self._by_operation[next(iter(self._by_operation))]

    def take(self, operation_id: int) -> int | None:
        """The bound kept for ``operation_id`` (then forgotten), or ``None``."""
        return self._by_operation.pop(operation_id, None)

    def __len__(self) -> int:
        return len(self._by_operation)

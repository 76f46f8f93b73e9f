"""The rules of one NNRP session, the same on every carrier: admission of a submit, cancels, DEADLINE and
TRACE_CONTEXT controls, the end of an operation (its window freed, a CREDIT_UPDATE after a BACKPRESSURE) and
the end of the session. The connection (:mod:`.connection`, whatever its carrier) only turns what the wire
core reports into these calls and sends what the session's outbox holds.

* **Admission**: NNRP's credit is advisory (a client may submit beyond it), so this is the enforcement: a
  submit over ``SessionLimits.max_in_flight`` is answered at once with ``response.error`` ``too_many_requests``
  and never reaches the handler (so never vLLM); the session gets a BACKPRESSURE (credit window 0) first and,
  once one of its operations sent its terminal, a CREDIT_UPDATE with the free window.
* **A terminal frees its slot**: the operation leaves the session's window the moment its terminal is sent
  (:meth:`SessionPolicy.terminal_done`), and the handler is told (``on_terminal``) so that the process-wide slot
  is free too: a client that submits as soon as it read a terminal is never refused for capacity it already
  gave back.
* **Cancels** (FRAME_CANCEL, CANCEL, ABORT) end the operation with the ``peer_cancelled`` drop (queued in the
  outbox, or the terminal already queued turns into it when sealed) and stop its vLLM request.
* **SUPERSEDE** ends the operation with the ``superseded`` drop and stops its vLLM request, as a cancel does
  (the newer operation it names runs as submitted).
* **DEADLINE** / **EXPIRE_AT** (wall-clock ms) bound the named operation; a DEADLINE that came before its submit
  waits for it (:class:`vllm_nnrp_plugin.core.operation.EarlyDeadlines`).
* **PRIORITY_UPDATE** and **BUDGET_UPDATE** change the operation's runtime controls
  (:class:`vllm_nnrp_plugin.core.controls.RuntimeControls`): a priority class before dispatch, a lower token budget
  at any time (the vLLM binding applies it).
* **TRACE_CONTEXT** (``openai-compatible/1`` profile, trace-context section): at session scope (frame 0) the
  default context of the session's operations dispatched later; at operation scope it overrides that
  operation's until it is dispatched. Ineligible contexts (zero ids) are ignored.

What each of these does to the operation itself (its terminal, the stop of its vLLM request) is the operation's
lifecycle table's to decide (:data:`vllm_nnrp_plugin.core.operation.TRANSITIONS`); this module decides which operation
and when. Everything here runs on vLLM's event loop: the handler (the service) is called directly.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.core.operation import DropReason, EarlyDeadlines
from vllm_nnrp_plugin.nnrp_binding.handler import CANCEL_DETAIL, SessionHandler
from vllm_nnrp_plugin.nnrp_binding.server_operation import ServerOperation, SessionLink
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import trace


class Credit(enum.Enum):
    """Where a session's credit stands: NNRP's credit is advisory, the server withholds it with a BACKPRESSURE
    (window 0) and gives it back with a CREDIT_UPDATE (NagareWorks/nnrp-doc
    ``docs/en/profiles/runtime-control/control-frames.md``)."""

    GRANTED = "granted"  # no BACKPRESSURE outstanding
    WITHHELD = "withheld"  # a BACKPRESSURE went out: the next terminal sends a CREDIT_UPDATE with the free window
    CLOSING = "closing"  # the session or the server is going away: no CREDIT_UPDATE any more


class SessionPolicy:
    """One session's operations (by id, and by frame for carriers that only see a frame id) and its rules.

    ``link`` is the session's outbox; ``send_credit(window)`` sends a CREDIT_UPDATE. Call :meth:`close` once
    the session or the server is going away: no CREDIT_UPDATE is sent after that (:attr:`credit`)."""

    __slots__ = ("ops", "frames", "early_deadlines", "credit", "_handler", "_limits", "_link", "_send_credit")

    def __init__(
        self,
        handler: SessionHandler,
        limits: SessionLimits,
        link: SessionLink,
        *,
        send_credit: Callable[[int], object],
    ) -> None:
        self._handler = handler
        self._limits = limits
        self._link = link
        self._send_credit = send_credit
        #: operations without a sent terminal, by operation id
        self.ops: dict[int, ServerOperation] = {}
        #: frame id → operation id of those operations
        self.frames: dict[int, int] = {}
        self.early_deadlines = EarlyDeadlines()
        self.credit = Credit.GRANTED

    def submit(self, sop: ServerOperation) -> bool:
        """Admit ``sop`` (True: the handler gets it) or refuse it over the session's limit (False: a
        BACKPRESSURE then its ``too_many_requests`` terminal are queued; it never reaches the handler)."""
        if len(self.ops) >= self._limits.max_in_flight:
            sop.refuse(
                E.too_many_requests(
                    f"this session already has {len(self.ops)} operations in flight; the limit is "
                    f"{self._limits.max_in_flight} (nnrp.max_in_flight_per_session)"
                )
            )
            sop.settle()  # no task will run for it
            return False
        self.ops[sop.operation_id] = sop
        self.frames[sop.frame_id] = sop.operation_id
        early = self.early_deadlines.take(sop.operation_id)
        if early is not None:
            sop.bound(early)
        self._handler.on_submit(sop)
        return True

    def by_frame(self, frame_id: int) -> ServerOperation | None:
        """The active operation of ``frame_id``."""
        operation_id = self.frames.get(frame_id)
        return self.ops.get(operation_id) if operation_id is not None else None

    def cancel(self, sop: ServerOperation | None, kind: int) -> None:
        """The client cancelled ``sop`` with the control ``kind`` (a ``MessageType``): its drop is queued (or
        the terminal already queued becomes it) and its vLLM request stops. ``None``: not active, nothing to do."""
        if sop is not None and sop.operation_id in self.ops:
            sop.cancel(DropReason.PEER_CANCELLED, CANCEL_DETAIL[kind])

    def supersede(self, sop: ServerOperation) -> None:
        """The client superseded ``sop`` (SUPERSEDE): its ``superseded`` drop is queued (or the terminal already
        queued becomes it) and its vLLM request stops."""
        if sop.operation_id in self.ops:
            sop.cancel(DropReason.SUPERSEDED, DropReason.SUPERSEDED.value)

    def update_priority(self, sop: ServerOperation, priority_class: int) -> None:
        """A PRIORITY_UPDATE for ``sop``: its class until it is dispatched; counted after."""
        sop.controls.update_priority(priority_class, dispatched=sop.rules.dispatched)

    def update_budget(self, sop: ServerOperation, token_budget: int) -> None:
        """A BUDGET_UPDATE for ``sop``: its token budget (tokens; 0: none) if lower than the one it has."""
        sop.controls.lower_budget(token_budget)

    def deadline(self, operation_id: int, deadline_unix_ms: int) -> None:
        """An NNRP DEADLINE (wall-clock ms) for ``operation_id``: kept until its submit when not active yet."""
        sop = self.ops.get(operation_id)
        if sop is None:  # not submitted yet, or already finished
            self.early_deadlines.keep(operation_id, deadline_unix_ms)
        elif deadline_unix_ms:
            self._handler.on_deadline(sop, deadline_unix_ms)

    def trace_context(self, frame_id: int, sop: ServerOperation | None, metadata: Any) -> None:
        """A TRACE_CONTEXT on ``frame_id`` (0: session scope) whose operation, if any, is ``sop``."""
        context = trace.received(frame_id, metadata)
        if context is None:
            return
        if context.scope == trace.SESSION:
            self._link.session_trace = context
        elif sop is not None:
            sop.override_trace(context)

    def pressure_signalled(self) -> None:
        """The carrier sent a BACKPRESSURE for this session: a CREDIT_UPDATE follows the next terminal (unless
        the session is closing)."""
        if self.credit is Credit.GRANTED:
            self.credit = Credit.WITHHELD

    def close(self) -> None:
        """The session or the server is going away: no CREDIT_UPDATE is sent any more."""
        self.credit = Credit.CLOSING

    def terminal_done(self, sop: ServerOperation) -> None:
        """``sop``'s terminal went out (or never can): it leaves the window, its slots are free, and its record
        is reported once its task ended too."""
        if self.ops.pop(sop.operation_id, None) is not None:
            self.frames.pop(sop.frame_id, None)
            self._handler.on_terminal(sop)
            if self.credit is Credit.WITHHELD:
                self.credit = Credit.GRANTED
                self._send_credit(self._limits.max_in_flight - len(self.ops))
        if sop.settle():
            self._handler.on_finished(sop)

    def cancel_all(self, detail: str) -> None:
        """The client closed the session and its drain time is up: every operation still running ends with
        the ``peer_cancelled`` drop (``detail`` its reason) and its vLLM request stops."""
        self.close()
        for sop in list(self.ops.values()):
            sop.cancel(DropReason.PEER_CANCELLED, detail)

    def lose_all(self, detail: str) -> None:
        """The client is gone or closed the session: nothing can be delivered; every operation stops."""
        self.close()
        for sop in list(self.ops.values()):
            sop.lose(detail)
            self.terminal_done(sop)

    def shut_down(self) -> None:
        """The server stops: every operation's terminal is ``server_shutdown`` and its work stops."""
        self.close()
        for sop in list(self.ops.values()):
            sop.shut_down()

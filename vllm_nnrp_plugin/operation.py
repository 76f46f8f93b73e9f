"""The per-operation state machine: profile events in, ordered send actions out (no I/O, h11 style).

One :class:`OperationMachine` per submitted operation. It numbers partial results from 1, guarantees exactly
one terminal and refuses anything after it. Terminals follow the frozen wire mapping
(profile-contract.md §5): ``response.completed`` / ``response.error`` as a RESULT_PUSH; a cancellation as a
RESULT_DROP_REASON whose diagnostic bytes carry ``response.cancelled`` — the runtime refuses a RESULT_PUSH
after a peer cancel, so a drop is the only deliverable terminal.

The NNRP binding turns the actions into frames; nothing here knows NNRP types.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from vllm_nnrp_plugin.profile import events
from vllm_nnrp_plugin.profile.errors import ProfileError


class DropReason(enum.Enum):
    """Why an operation ends with a drop instead of a result push (NNRP ResultDropReasonCode names)."""

    PEER_CANCELLED = "peer_cancelled"  # client FRAME_CANCEL / CANCEL / ABORT
    TRANSPORT_CLOSED = "transport_closed"  # client vanished or closed its session mid-operation


@attrs.frozen
class PartialResult:
    """One non-terminal event: ``sequence`` starts at 1; ``body`` is the raw UTF-8 JSON event."""

    sequence: int
    body: bytes


@attrs.frozen
class ResultPush:
    """The terminal RESULT_PUSH: ``event`` is the JSON terminal event; ``status`` informational (200, 4xx, 5xx)."""

    status: int
    event: bytes


@attrs.frozen
class ResultDrop:
    """The terminal RESULT_DROP_REASON: ``diagnostic`` is the JSON ``response.cancelled`` event."""

    reason: DropReason
    sequence: int
    diagnostic: bytes


Action = PartialResult | ResultPush | ResultDrop


class OperationMachine:
    """States: open -> finished. Every method returns the action to send, or ``None`` once finished."""

    __slots__ = ("_sequence", "finished", "outcome")

    def __init__(self) -> None:
        self._sequence = 0
        self.finished = False
        #: "completed", "error:<code>", "cancelled:<reason>" once finished
        self.outcome: str | None = None

    @property
    def events_sent(self) -> int:
        """Partial results emitted so far."""
        return self._sequence

    def partial(self, event: dict[str, Any]) -> PartialResult | None:
        """A non-terminal event (``response.output_text.delta``, ``response.usage`` …)."""
        if self.finished:
            return None
        self._sequence += 1
        return PartialResult(self._sequence, events.encode(event))

    def complete(self, body: dict[str, Any]) -> ResultPush | None:
        """Terminal ``response.completed {body}``, status 200."""
        return self._push(200, events.completed(body), "completed")

    def fail(self, err: ProfileError) -> ResultPush | None:
        """Terminal ``response.error``, status ``err.status``."""
        return self._push(err.status, events.error(err), f"error:{err.code}")

    def cancel(self, reason: DropReason, detail: str) -> ResultDrop | None:
        """Terminal drop carrying ``response.cancelled {reason: detail}`` as diagnostic bytes."""
        if self.finished:
            return None
        self.finished = True
        self.outcome = f"cancelled:{detail}"
        return self.cancelled_drop(reason, detail)

    def cancelled_drop(self, reason: DropReason, detail: str) -> ResultDrop:
        """The drop that ends this operation as cancelled, whatever was decided before: the runtime refuses a
        RESULT_PUSH after a peer cancel (profile-contract.md §5), so a push decided just before the cancel
        arrived must go out as this drop instead."""
        return ResultDrop(reason, self._sequence + 1, events.encode(events.cancelled(detail)))

    def _push(self, status: int, event: dict[str, Any], outcome: str) -> ResultPush | None:
        if self.finished:
            return None
        self.finished = True
        self.outcome = outcome
        return ResultPush(status, events.encode(event))

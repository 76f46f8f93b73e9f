"""Admission limits (issue 6: "no unbounded queue anywhere; nothing over the limit is dispatched to vLLM").

Pure bookkeeping, no I/O; thread-safe because session pumps (their own threads) take slots and vLLM's event
loop gives them back. The NNRP credit and BACKPRESSURE frames are advisory (nnrp-sdk.md §9: the SDK does not
enforce them), so these counters are the enforcement.
"""

from __future__ import annotations

import threading

import attrs


@attrs.frozen
class SessionLimits:
    """Per-session limits: ``max_in_flight`` operations without a terminal yet; ``max_queued_events`` events
    waiting in the session's outbox (the bound that keeps a slow reader from growing memory)."""

    max_in_flight: int
    max_queued_events: int


class Slots:
    """``capacity`` slots; :meth:`try_take` refuses instead of waiting, :meth:`give_back` returns one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def try_take(self) -> bool:
        """Take one slot; False (nothing taken) when all ``capacity`` are in use."""
        with self._lock:
            if self._used >= self.capacity:
                return False
            self._used += 1
            return True

    def give_back(self) -> None:
        """Return a slot taken with :meth:`try_take` (exactly once per successful take)."""
        with self._lock:
            if self._used <= 0:
                raise RuntimeError("give_back without a matching try_take")
            self._used -= 1

"""Admission limits: nothing over a limit is dispatched to vLLM.

Plain bookkeeping, no I/O. nnrp-py's credit and BACKPRESSURE frames are advisory (nnrp-py 1.0.0rc4.post20
enforces no credit window on either side), so these counters are the enforcement: :class:`SessionLimits` by
each session's policy (:mod:`vllm_nnrp_plugin.nnrp_binding.session_policy`), :class:`Slots` by the service on
vLLM's event loop (one thread: no lock). The process-wide limit is off unless the operator sets one: vLLM
queues what its HTTP server would queue.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class SessionLimits:
    """Per-session limits: ``max_in_flight`` operations without a terminal yet; ``max_queued_events`` events
    waiting in the session's outbox (the bound that keeps a slow reader from growing memory)."""

    max_in_flight: int
    max_queued_events: int


class Slots:
    """``capacity`` slots (``None``: unbounded, only counted); :meth:`try_take` refuses instead of waiting,
    :meth:`give_back` returns one."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    def try_take(self) -> bool:
        """Take one slot; False (nothing taken) when all ``capacity`` are in use."""
        if self.capacity is not None and self._used >= self.capacity:
            return False
        self._used += 1
        return True

    def give_back(self) -> None:
        """Return a slot taken with :meth:`try_take` (exactly once per successful take). Raises
        ``RuntimeError`` without a matching take."""
        if self._used <= 0:
            raise RuntimeError("give_back without a matching try_take")
        self._used -= 1

"""How often the session pumps of one listener poll nnrp-py: a budget shared by every session, so that the
polling cost of the API-server process stays bounded however many sessions are open.

Why a budget: nnrp-py 1.0.0rc4.post20 has no way to wait for frames across sessions (its
``nnrp_server_await_events`` takes one session handle; a server or invalid handle is refused) and no
non-blocking poll (``timeout_ms=0`` is sent as 1 ms; 0 at the native call waits forever). Measured on loopback
(2-vCPU VM): an empty ``NativeRuntimeServerSession.poll_events`` costs the process ~120 µs of CPU at
``timeout_ms=1`` (it returns after ~2.2 ms) and ~400 µs at any timeout from ~20 ms up (the CPU is spent per
call, not per ms waited); a poll that finds a frame returns at once. Whatever the number of sessions, empty
polls are therefore what must stay few:

* a session with operations in flight polls on a cadence (its pump sends in between; a poll blocks the
  session's sends): at least every ``ACTIVE_POLL_GAP_S``, and never more often than the listener's
  ``ACTIVE_EMPTY_POLLS_PER_S`` shared by all active sessions allows — a cancel is seen within about one gap
  (2 ms with a few active sessions, ``active / ACTIVE_EMPTY_POLLS_PER_S`` s under load);
* an idle session waits in one long poll that a submit ends at once: ``idle_poll_ms`` (the configured floor),
  longer when many sessions are open so that all idle sessions together make at most ``IDLE_POLLS_PER_S``
  polls, up to ``MAX_IDLE_POLL_MS``. Only stopping waits for it (a pump ends when its poll returns).
"""

from __future__ import annotations

import threading

ACTIVE_POLL_GAP_S = 0.002  # the shortest gap between two polls of a session with operations in flight
ACTIVE_EMPTY_POLLS_PER_S = 500  # polls per second for all active sessions together (~6 % of a core if all empty)
IDLE_POLLS_PER_S = 40  # polls per second for all idle sessions together (~1.6 % of a core)
MAX_IDLE_POLL_MS = 6000  # the longest idle poll: how long stopping may wait for an idle session's pump


class PollCadence:
    """The listener's count of open and active sessions (thread-safe) and the poll timing derived from it."""

    __slots__ = ("_idle_poll_ms", "_open", "_active", "_lock")

    def __init__(self, idle_poll_ms: int) -> None:
        self._idle_poll_ms = idle_poll_ms
        self._open = 0
        self._active = 0
        self._lock = threading.Lock()

    def opened(self, delta: int) -> None:
        """A session opened (+1) or ended (-1)."""
        with self._lock:
            self._open += delta

    def activated(self, delta: int) -> None:
        """A session got its first operation in flight (+1) or its last one finished (-1)."""
        with self._lock:
            self._active += delta

    def active_gap_s(self) -> float:
        """The shortest time (s) between two polls of one active session now."""
        return max(ACTIVE_POLL_GAP_S, self._active / ACTIVE_EMPTY_POLLS_PER_S)

    def idle_poll_ms(self) -> int:
        """The poll timeout (ms) of an idle session now."""
        spread = self._open * 1000 // IDLE_POLLS_PER_S
        return max(self._idle_poll_ms, min(MAX_IDLE_POLL_MS, spread))

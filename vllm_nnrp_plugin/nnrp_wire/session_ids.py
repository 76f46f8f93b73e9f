"""The session ids of one server connection: which are used, and the next one to hand out
(:class:`SessionIds`). Plain data: no I/O, no clock.
"""

from __future__ import annotations

__all__ = ["SessionIds"]


class SessionIds:
    """The session ids used on one connection — opened (open or closed) or reserved by a pending open — with
    O(1) work per open and close and bounded memory, whatever the connection did before.

    Every id below ``next`` is used: the ids this server picks are handed out in increasing order, and ``next``
    moves past each id a client asked for (SESSION_OPEN ``requested_session_id``) as soon as it is reached.
    ``above`` holds the requested ids beyond ``next``; each enters and leaves it once. When more than
    :attr:`MAX_ABOVE` wait there, ``next`` jumps past the largest and ``above`` empties: the ids passed over are
    never handed out (nothing is reused, only skipped; a client that asks for ids far ahead can at worst use up
    its own connection's ids, and :meth:`allocate` then says so). An id is never handed out twice on a
    connection (the native client refuses an id its connection used before: nnrp-rs
    ``crates/nnrp-core/src/lifecycle.rs``)."""

    __slots__ = ("next", "above")

    #: requested ids remembered beyond ``next`` on one connection
    MAX_ABOVE = 1024
    #: the largest session id (u32)
    LAST = 0xFFFFFFFF

    def __init__(self) -> None:
        self.next = 1
        self.above: set[int] = set()

    def __contains__(self, session_id: int) -> bool:
        """``session_id`` is used (or reserved by a pending open)."""
        return session_id < self.next or session_id in self.above

    def add(self, session_id: int) -> None:
        """Mark a requested id used (one not :meth:`__contains__`)."""
        self.above.add(session_id)
        self._advance()
        if len(self.above) > self.MAX_ABOVE:
            self.next = max(self.above) + 1
            self.above.clear()

    def discard(self, session_id: int) -> None:
        """Free a requested id that was never opened (a rejected open), unless ``next`` passed it already."""
        self.above.discard(session_id)

    def allocate(self) -> int:
        """The lowest id nobody used (≥ 1, increasing), now used; 0 when no u32 id is left."""
        session_id = self.next
        if session_id > self.LAST:
            return 0
        self.next = session_id + 1
        self._advance()
        return session_id

    def _advance(self) -> None:
        above, candidate = self.above, self.next
        while candidate in above:
            above.discard(candidate)
            candidate += 1
        self.next = candidate

"""The shared thread(s) that send what the operations of every session queued.

Why not each session's own pump thread: with one thread per session woken for every event, a hundred busy
sessions mean a hundred threads taking vLLM's GIL in turn for each token; here an event wakes a sender only
when its session was not already waiting for one, and a sender sends for session after session. The GIL is
released during each native send (nnrp-py's ctypes call), so several senders could overlap their sends; one
is enough: a native send takes ~45 µs (nnrp-py 1.0.0rc4.post20 on loopback), so one thread sends ~20k events/s,
more than a 2-CPU API server produced in the load benchmark (``bench/load.py``, ≤ 6k tokens/s).

nnrp-py's server session (``nnrp.native.NativeRuntimeServerSession``) blocks a send while a poll of the same
session waits, so whoever touches a session holds its ``io_lock``: a sender only tries it
(``acquire(blocking=False)``) and leaves a session that is being polled to its pump, which flushes after the
poll. Whoever held the lock looks at the outbox again after releasing it (:meth:`Sender.after`), so an event
queued meanwhile is never left behind.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Protocol

logger = logging.getLogger(__name__)

SENDER_THREADS = 1


class Flushable(Protocol):
    """A session as the sender sees it (:class:`.session.SessionPump`)."""

    io_lock: threading.Lock
    scheduled: bool

    def flush(self) -> None:
        """Send everything queued (the caller holds ``io_lock``)."""

    def pending(self) -> bool:
        """Something is queued."""


class Sender:
    """Sessions with queued sends (:meth:`schedule`) are flushed by ``threads`` daemon threads until
    :meth:`close`."""

    def __init__(self, threads: int = SENDER_THREADS) -> None:
        self._ready: collections.deque[Flushable] = collections.deque()
        self._wake = threading.Condition(threading.Lock())
        self._closing = False
        self._threads = [
            threading.Thread(target=self._run, name=f"nnrp-sender-{i}", daemon=True) for i in range(threads)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def schedule(self, session: Flushable) -> None:
        """``session`` has something to send (any thread; cheap when it is already scheduled)."""
        if session.scheduled:
            return
        session.scheduled = True
        with self._wake:
            self._ready.append(session)
            self._wake.notify()

    def after(self, session: Flushable) -> None:
        """The caller just released ``session.io_lock``: schedule it again when something is still queued."""
        if session.pending():
            self.schedule(session)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the threads (what is still queued is the pumps' to send or drop)."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        for thread in self._threads:
            if thread.ident is not None:  # started
                thread.join(timeout_s)

    def _run(self) -> None:
        ready, wake = self._ready, self._wake
        while True:
            with wake:
                while not ready and not self._closing:
                    wake.wait()
                if self._closing:
                    return
                session = ready.popleft()
            session.scheduled = False  # an event queued from now on schedules it again
            if not session.io_lock.acquire(blocking=False):
                continue  # its pump (or another sender) holds it and looks at the outbox after releasing
            try:
                session.flush()
            except Exception:  # a bug: never lose the sender thread (the pump keeps its session served)
                logger.exception("NNRP sender failed to flush a session")
            finally:
                session.io_lock.release()
            self.after(session)

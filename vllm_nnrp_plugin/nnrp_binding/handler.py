"""What every connection (:mod:`.connection`, whatever its carrier) and the session rules
(:mod:`.session_policy`) share: the :class:`SessionHandler` they report to (the service), the BACKPRESSURE
values sent after a refused submit, and what each cancel control is called in an operation's record."""

from __future__ import annotations

from typing import Protocol

from nnrp.core import MessageType

from vllm_nnrp_plugin.nnrp_binding.server_operation import ServerOperation

# BACKPRESSURE frame after a refused submit: this plugin's values (NNRP leaves level and reason to the server)
PRESSURE_LEVEL_FULL = 1
PRESSURE_REASON_IN_FLIGHT = 1
RETRY_AFTER_MS = 100

#: runtime control -> the ``response.cancelled`` reason recorded for the operation it stops
CANCEL_DETAIL = {
    MessageType.FRAME_CANCEL: "client_cancelled",
    MessageType.CANCEL: "client_cancelled",
    MessageType.ABORT: "client_aborted",
}


class SessionHandler(Protocol):
    """What comes off the wire, told on vLLM's loop."""

    def on_submit(self, sop: ServerOperation) -> None: ...

    def on_deadline(self, sop: ServerOperation, deadline_unix_ms: int) -> None:
        """An NNRP DEADLINE (wall-clock ms) for a submitted operation."""

    def on_terminal(self, sop: ServerOperation) -> None:
        """``sop``'s terminal went out (or never can): its admission slot is free."""

    def on_finished(self, sop: ServerOperation) -> None:
        """``sop.observation`` is complete: the terminal went out after the operation's task had ended."""

    def on_session(self, transport: str, opened: bool) -> None:
        """A session started or ended. Must not block."""

    def on_auth_refused(self, transport: str, presented: bool) -> None:
        """A session was refused ``auth_failed``: a key was required and ``presented`` tells whether a wrong
        one (True) or none (False) came. Never given the key."""

    def on_handshake_timeout(self, transport: str) -> None:
        """A connection was closed because no session opened on it within the handshake timeout."""

    def on_connection_refused(self, transport: str, reason: str) -> None:
        """A connection was refused at accept: ``max_connections`` (closed at once) or ``no_descriptor``
        (the process is out of file descriptors; accepting pauses)."""

    def on_connection_ended(self, transport: str, reason: str, detail: str) -> None:
        """The server ended a connection that broke a bound: ``credit_violations`` (it kept submitting beyond
        its granted credit, :class:`.bounds.ViolationBudget`); ``detail`` is one log-safe sentence."""

"""The errors of both wire cores (:mod:`.server`, :mod:`.client`): :class:`LocalProtocolError`, raised at the
application; :class:`PacketError` and :class:`FatalError`, a peer's packet that breaks a rule, which each core turns
into what it reports (never raised at the application)."""

from __future__ import annotations

from nnrp.core.enums import ErrorCode

__all__ = ["FatalError", "LocalProtocolError", "PacketError"]


class LocalProtocolError(ValueError):
    """The application asked a core for something the protocol does not allow now, whatever the peer did: a
    value that does not fit its field or breaks a layout rule (a sequence of 0, an empty PARTIAL_RESULT body, a
    drop reason of 0, an unknown priority class), or a call the connection's state refuses (an unknown
    session-open request; on the client, an ended connection, a session that is not open or is closing, an
    operation that is not active). A bug in the caller; nothing was queued and the connection's state is
    unchanged. A ``ValueError``, so callers that already treat unpackable values as ``ValueError`` catch it too
    (the h11 convention: ``h11.LocalProtocolError`` is the caller's error, the peer's is reported as an event)."""


class PacketError(Exception):
    """A packet the peer sent breaks a rule of its layout (:mod:`.layouts`) or of the operation it names; the
    session and the connection go on. ``reason``: the rule broken, as diagnostic text; ``error_code``: the
    ERROR_RECOVERABLE ``error_code`` from the common error registry (nnrp-py ``nnrp.core.enums.ErrorCode``:
    ``MALFORMED_BODY`` for a layout rule, ``INVALID_STATE`` for operation identity, ``LIMIT_EXCEEDED`` for a
    bound). The server core answers it with :class:`~.events.PacketRejected` and an ERROR_RECOVERABLE carrying
    both; the client core reports :class:`~.events.PacketRejected` with the reason."""

    def __init__(self, reason: str, error_code: int = int(ErrorCode.MALFORMED_BODY)) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error_code = error_code


class FatalError(Exception):
    """A packet the peer sent breaks a rule that ends the connection (a bad hello or handshake ack, a packet
    for a session that is not open, a malformed SESSION_OPEN...): each core reports
    :class:`~.events.ConnectionEnded` with the reason and takes nothing more."""

"""The one error both wire cores (:mod:`.server`, :mod:`.client`) raise at their callers."""

from __future__ import annotations

__all__ = ["LocalProtocolError"]


class LocalProtocolError(ValueError):
    """The application asked a core for something the protocol does not allow now, whatever the peer did: a
    value that does not fit its field or breaks a layout rule (a sequence of 0, an empty PARTIAL_RESULT body, a
    drop reason of 0, an unknown priority class), or a call the connection's state refuses (an unknown
    session-open request; on the client, an ended connection, a session that is not open or is closing, an
    operation that is not active). A bug in the caller; nothing was queued and the connection's state is
    unchanged. A ``ValueError``, so callers that already treat unpackable values as ``ValueError`` catch it too
    (the h11 convention: ``h11.LocalProtocolError`` is the caller's error, the peer's is reported as an event)."""

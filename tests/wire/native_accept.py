"""Accepting sessions from nnrp-py's native server in tests (the oracle's side; the package serves no native
runtime): ``NativeServer.accept`` in nnrp-py 1.0.0rc4.post20 releases its accept ticket at every deadline and
loses a session whose handshake straddles it, so this keeps one ticket until it is claimed (private SDK
members: the SDK version is pinned exactly)."""

from __future__ import annotations

from nnrp.native import (
    NativeRuntimeError,
    NativeRuntimeServerSession,
    NativeWouldBlockError,
    _allocate_native_handle_id,
)
from nnrp.server import NativeServer


class Acceptor:
    """Accepts sessions from a one-carrier ``NativeServer``, keeping one accept ticket until it is claimed."""

    def __init__(self, server: NativeServer) -> None:
        ((_name, self._runtime),) = server._servers
        self._handle_id = _allocate_native_handle_id()

    def accept(self, timeout_ms: int) -> NativeRuntimeServerSession:
        """Wait up to ``timeout_ms`` ms; raises ``NativeWouldBlockError`` on timeout (the ticket is kept)."""
        try:
            session = self._runtime.accept_session(
                session_handle_id=self._handle_id, generation=1, timeout_ms=timeout_ms
            )
        except NativeWouldBlockError:
            raise
        except BaseException:
            try:
                self._runtime._release_pending_accept_ticket()
            except NativeRuntimeError:
                pass
            self._handle_id = _allocate_native_handle_id()
            raise
        self._handle_id = _allocate_native_handle_id()
        return session

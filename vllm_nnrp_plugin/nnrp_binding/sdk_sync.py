"""Synchronous accept and operation sends for our own threads (nnrp-py ``==1.0.0rc4.post20`` internals).

nnrp-py's public ``NativeRuntimeServerOperation.send_partial_result`` / ``send_result`` / ``send_result_drop``
are coroutines that hop to a worker thread per call; on a pump thread that already owns the session that hop
is pure cost (measured with nnrp-py 1.0.0rc4.post20 on loopback: 4–5.6k events/s through it versus 17–22k
with a direct synchronous send). These three functions do what the public methods do, in the same order,
without the hop: mark the reply (so a second terminal or a partial after a terminal is refused exactly as
the SDK refuses it), send, and release the frame correlation after a terminal. They touch private SDK
members, which is why the SDK version is pinned exactly.

:class:`Acceptor` replaces ``NativeServer.accept``, which (a) releases its accept ticket at every deadline,
losing a session whose handshake straddles it, and (b) closes the whole server on any accept error, so one
bad handshake would take the listener down. :func:`direct_policy` lets the session-open decision run as a
plain function: nnrp-py runs the public ``application_policy.evaluate`` coroutine in a fresh
``asyncio.run()`` event loop per session open (``nnrp.server.native``), which made a burst of opens queue.
All of them raise nnrp-py's ``NativeRuntimeError`` subclasses unchanged (``NativeInvalidStateError``
3/4/0/105 when the operation was cancelled or the peer is gone).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from nnrp.core import MessageType, ResultPushMetadata
from nnrp.native import (
    NativeRuntimeError,
    NativeRuntimeServerOperation,
    NativeRuntimeServerSession,
    NativeWouldBlockError,
    _allocate_native_handle_id,
    _buffer_view_from_payload,
    _NnrpBufferView,
    _NnrpRuntimeFrameSendRequest,
    _NnrpServerSendResultRequest,
    raise_for_native_status,
)
from nnrp.runtime import ResultDropReasonMetadata
from nnrp.server import NativeServer

_PARTIAL_RESULT = int(MessageType.PARTIAL_RESULT)


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
            self.reset()
            raise
        self._handle_id = _allocate_native_handle_id()
        return session

    def reset(self) -> None:
        """Drop the pending ticket after a failed handshake; the next accept starts a fresh one."""
        try:
            self._runtime._release_pending_accept_ticket()
        except NativeRuntimeError:
            pass
        self._handle_id = _allocate_native_handle_id()


def direct_policy(server: NativeServer, decide: Callable[[object], tuple[bool, int, str | None]]) -> None:
    """Every carrier of ``server`` (listened with an ``application_policy``) decides session opens with
    ``decide(open_metadata) -> (accepted, session_error_code, diagnostic)``, called on nnrp-py's policy threads."""
    for _name, runtime in server._servers:
        runtime._policy_dispatcher._application_policy = decide


def send_partial_result(native: NativeRuntimeServerOperation, payload: bytes) -> None:
    """One PARTIAL_RESULT (non-terminal); ``payload`` is its packed metadata followed by the body
    (:func:`vllm_nnrp_plugin.wire_mapping.partial_result`). One native call and nothing else: what nnrp-py's
    ``_send_operation_runtime_frame`` does after it validated and packed the metadata (one event per token
    makes each µs count)."""
    native._begin_reply(terminal=False)
    view = _NnrpBufferView(ctypes.cast(ctypes.c_char_p(payload), ctypes.c_void_p), len(payload))
    status = native._owner.entrypoints.runtime_frame_send(
        _NnrpRuntimeFrameSendRequest(native._handle.to_ffi(), _PARTIAL_RESULT, native.frame_id, view)
    )
    if status.status_code != 0:
        raise_for_native_status(status)


def send_result(native: NativeRuntimeServerOperation, metadata: ResultPushMetadata, body: bytes) -> None:
    """The terminal RESULT_PUSH."""
    payload_view, payload_owner = _buffer_view_from_payload(metadata.pack() + body)
    request = _NnrpServerSendResultRequest(native._handle.to_ffi(), payload_view)
    _terminal(native, lambda: native._send_result_blocking(request, payload_owner))


def send_result_drop(
    native: NativeRuntimeServerOperation, metadata: ResultDropReasonMetadata, diagnostic: bytes
) -> None:
    """The terminal RESULT_DROP_REASON (the only terminal the runtime accepts after a peer cancel)."""
    _terminal(
        native,
        lambda: native._owner._send_operation_runtime_frame(
            native._handle, native.frame_id, MessageType.RESULT_DROP_REASON, metadata, diagnostic
        ),
    )


def _terminal(native: NativeRuntimeServerOperation, send) -> None:
    native._begin_reply(terminal=True)
    try:
        send()
    except BaseException:
        native._restore_terminal_reply()
        raise
    native._complete_terminal_reply()

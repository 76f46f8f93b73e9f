"""The wire core's bookkeeping under a client that opens, submits and closes without end: session ids in O(1)
per open/close with bounded memory, finished operation ids refused on reuse, and a drained SESSION_CLOSE that
gives every in-flight operation its terminal before the closing ack."""

from __future__ import annotations

import struct
import time

from nnrp.core.enums import MessageType as T
from nnrp.runtime.types import RecoverableErrorMetadata, ResultDropReasonMetadata

from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.codecs import SessionCloseAckMetadata, SessionOpenAckMetadata
from vllm_nnrp_plugin.nnrp_wire.framing import encode
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection
from vllm_nnrp_plugin.nnrp_wire.session_ids import SessionIds

from . import wirekit as w

# -- session ids ---------------------------------------------------------------------------------------------

_OPEN = w.session_open(0)
_OPEN_META_AT = len(_OPEN) - 48  # the metadata follows the 40-byte header; requested_session_id is its first u32
_CLOSE = w.session_close(1)


def _opens(first: int, count: int) -> bytes:
    """SESSION_OPEN packets asking for ids ``first`` … ``first + count - 1``."""
    out = bytearray(_OPEN * count)
    for i in range(count):
        struct.pack_into("<I", out, i * len(_OPEN) + _OPEN_META_AT, first + i)
    return bytes(out)


def _closes(first: int, count: int) -> bytes:
    out = bytearray()
    for sid in range(first, first + count):
        out += w.session_close(sid)
    return bytes(out)


def _connection() -> ServerConnection:
    server = ServerConnection(max_in_flight_per_session=4)
    server.receive_data(w.hello())
    server.data_to_send()
    return server


def _open_and_close(server: ServerConnection, first: int, count: int, batch: int = 2000) -> None:
    """``count`` open/close cycles asking for ids ``first``… (the shape that made allocation quadratic)."""
    for start in range(first, first + count, batch):
        n = min(batch, first + count - start)
        for request in server.receive_data(_opens(start, n)):
            assert server.accept_session(request.request) == request.requested_session_id
        assert all(isinstance(e, ev.SessionClosed) for e in server.receive_data(_closes(start, n)))
        server.data_to_send()


def _time_256_opens(server: ServerConnection) -> tuple[float, list[int]]:
    ids = []
    started = time.perf_counter()
    for _ in range(256):
        (request,) = server.receive_data(_OPEN)
        ids.append(server.accept_session(request.request))
    elapsed = time.perf_counter() - started
    server.data_to_send()
    return elapsed, ids


def test_opens_after_150000_open_close_cycles_cost_what_they_cost_on_a_fresh_connection() -> None:
    fresh_s = min(_time_256_opens(_connection())[0] for _ in range(3))
    server = _connection()
    _open_and_close(server, 1, 150_000)
    after_s, ids = _time_256_opens(server)
    assert ids == list(range(150_001, 150_257))  # never an id used before, in order
    # before the id counter: a scan of all 150,000 used ids per open (~2 s for 256 here, ~300 x fresh)
    assert after_s < 10 * fresh_s + 0.05, (after_s, fresh_s)
    assert len(server._handshake.session_ids.above) == 0  # the bookkeeping did not grow with the cycles


def test_ids_picked_by_the_server_and_asked_for_by_the_client_never_collide() -> None:
    server = _connection()
    granted: list[int] = []
    for requested in (0, 3, 0, 0, 7, 0, 0, 0, 0):
        (request,) = server.receive_data(w.session_open(requested))
        granted.append(server.accept_session(request.request))
    assert granted == [1, 3, 2, 4, 7, 5, 6, 8, 9]
    server.data_to_send()
    assert all(_refused_as_in_use(server, used) for used in (1, 2, 3, 7, 9)) and not server.ended


def _refused_as_in_use(server: ServerConnection, requested: int) -> bool:
    if server.receive_data(w.session_open(requested)):
        return False
    (ack,) = w.sent(server)
    meta = SessionOpenAckMetadata.unpack(ack.meta)
    return meta.session_status == 1 and meta.session_error_code == 0x00010007


def test_a_client_asking_for_ids_far_ahead_cannot_grow_the_bookkeeping() -> None:
    server = _connection()
    for i in range(3 * SessionIds.MAX_ABOVE):
        (request,) = server.receive_data(w.session_open(1_000_000 + 2 * i))  # sparse: nothing is ever contiguous
        assert server.accept_session(request.request) == 1_000_000 + 2 * i
        server.receive_data(w.session_close(1_000_000 + 2 * i))
        assert len(server._handshake.session_ids.above) <= SessionIds.MAX_ABOVE
    server.data_to_send()
    (request,) = server.receive_data(_OPEN)
    fresh = server.accept_session(request.request)
    assert fresh > 1_000_000  # ids it skipped over are never handed out: none is used twice
    server.data_to_send()
    assert _refused_as_in_use(server, 1_000_000) and _refused_as_in_use(server, 5)


def test_when_no_session_id_is_left_the_open_is_refused_and_the_connection_goes_on() -> None:
    server = _connection()
    (request,) = server.receive_data(w.session_open(0xFFFFFFFF))
    assert server.accept_session(request.request) == 0xFFFFFFFF
    for i in range(SessionIds.MAX_ABOVE):  # enough far-ahead asks to move the counter past the last id
        (request,) = server.receive_data(w.session_open(0xFFFFF000 + i))
        server.accept_session(request.request)
    server.data_to_send()
    (request,) = server.receive_data(_OPEN)
    assert server.accept_session(request.request) == 0
    (ack,) = w.sent(server)
    meta = SessionOpenAckMetadata.unpack(ack.meta)
    assert (ack.session_id, meta.session_status, meta.session_error_code) == (0, 1, 0x00010007)
    assert ack.body == b"no session id is left on this connection" and not server.ended


# -- finished operation ids ----------------------------------------------------------------------------------


def _refusal(server: ServerConnection, packet: bytes) -> str:
    (event,) = server.receive_data(packet)
    assert isinstance(event, ev.PacketRejected), event
    (error,) = w.sent(server)
    assert error.msg_type == T.ERROR_RECOVERABLE
    assert RecoverableErrorMetadata.unpack(error.meta).error_code == 3  # INVALID_STATE, as for an active duplicate
    return event.reason


def test_a_finished_operation_id_or_frame_is_refused_like_an_active_duplicate() -> None:
    server, sid = w.opened()
    server.receive_data(w.submit(sid, 1, 101))
    assert server.send_result_push(sid, 1, bytes(64), b"")
    server.data_to_send()
    assert "finished" in _refusal(server, w.submit(sid, 1, 101))  # the same pair again
    assert "finished" in _refusal(server, w.submit(sid, 2, 101))  # its operation id on a new frame
    assert "finished" in _refusal(server, w.submit(sid, 1, 102))  # its frame for a new operation
    (submitted,) = server.receive_data(w.submit(sid, 2, 102))  # fresh ids: fine, the session went on
    assert isinstance(submitted, ev.OperationSubmitted)
    assert server.send_result_drop_reason(sid, 2, 102, 0, 3, b"")
    assert server.receive_data(w.frame_cancel(sid, 2)) == []  # a late control is still only ignored


def test_finished_ids_are_remembered_in_bounded_memory() -> None:
    server, sid = w.opened(max_in_flight=4)
    for k in range(1, 1001):
        server.receive_data(w.submit(sid, k, 10_000 + k))
        assert server.send_result_push(sid, k, bytes(64), b"")
    server.data_to_send()
    session = server._operations.sessions[sid]
    memory = max(64, 4 * 4)
    assert len(session.finished) == len(session.finished_frames) == len(session.finished_ops) == memory
    assert "finished" in _refusal(server, w.submit(sid, 1000, 11_000))


# -- SESSION_CLOSE with the drain policy ---------------------------------------------------------------------


def _draining_server() -> tuple[ServerConnection, int]:
    server, sid = w.opened()
    server.drain_sessions = True  # the application handles SessionDraining
    return server, sid


def test_a_drained_close_gives_each_operation_its_terminal_then_the_closed_ack() -> None:
    server, sid = _draining_server()
    server.receive_data(w.submit(sid, 1, 101) + w.submit(sid, 2, 102))
    (draining,) = server.receive_data(w.session_close(sid, 102, drain_timeout_ms=250))
    assert draining == ev.SessionDraining(sid, 1, 250, (101, 102))
    assert w.sent(server) == []  # no ack (not even close_status draining) before the terminals
    assert server.session_open(sid) and server.sessions == 1
    # the operations go on: results, the client's controls, pings; a new submit is refused
    assert server.send_partial_result(sid, 1, 101, 1, b"more")
    (cancelled,) = server.receive_data(w.control(T.CANCEL, sid, 2, 102))
    assert cancelled == ev.OperationCancelled(sid, 2, 102, int(T.CANCEL), b"")
    server.data_to_send()
    assert "closing" in _refusal(server, w.submit(sid, 3, 103))
    assert server.send_result_push(sid, 1, bytes(64), b"done")
    assert [p.msg_type for p in w.sent(server)] == [T.RESULT_PUSH]  # one operation still runs
    assert server.send_result_drop_reason(sid, 2, 102, 0, 3, b"")
    drop, closed = w.sent(server)
    assert drop.msg_type == T.RESULT_DROP_REASON and closed.msg_type == T.SESSION_CLOSE_ACK
    assert (closed.session_id, closed.frame_id, closed.body) == (sid, 0, b"")
    assert SessionCloseAckMetadata.unpack(closed.meta) == SessionCloseAckMetadata(2, 102, 0)  # closed
    assert not server.session_open(sid) and server.sessions == 0
    assert not server.send_credit_update(sid, 4) and server.data_to_send() == b""
    (ended,) = server.receive_data(encode(T.PING, sid, 0))
    assert isinstance(ended, ev.ConnectionEnded) and "closed session" in ended.error


def test_a_drained_close_with_nothing_in_flight_closes_at_once() -> None:
    server, sid = _draining_server()
    server.receive_data(w.submit(sid, 1, 101))
    server.send_result_push(sid, 1, bytes(64), b"")
    server.data_to_send()
    assert server.receive_data(w.session_close(sid, 101)) == [ev.SessionClosed(sid, 1)]
    (ack,) = w.sent(server)
    assert SessionCloseAckMetadata.unpack(ack.meta).close_status == 2 and not server.session_open(sid)


def test_an_abort_close_ends_a_drain_and_a_second_drain_is_refused() -> None:
    server, sid = _draining_server()
    server.receive_data(w.submit(sid, 1, 101))
    server.receive_data(w.session_close(sid, 101))
    server.data_to_send()
    assert "already draining" in _refusal(server, w.session_close(sid, 101))
    assert server.receive_data(w.session_close(sid, 101, policy=1)) == [ev.SessionClosed(sid, 1)]
    drop, ack = w.sent(server)
    assert (drop.msg_type, drop.frame_id) == (T.RESULT_DROP_REASON, 1)
    assert SessionCloseAckMetadata.unpack(ack.meta).close_status == 2
    assert not server.send_result_push(sid, 1, bytes(64), b"") and server.sessions == 0


def test_an_abort_close_ends_every_operation_with_a_drop_before_the_ack() -> None:
    """in_flight_policy abort: the core itself queues a peer_cancelled RESULT_DROP_REASON for each running
    operation (submit order, result_sequence one past its last partial), then the one closed ack; the
    application's late sends for those operations and the session return False and queue nothing."""
    server, sid = _draining_server()
    server.receive_data(w.submit(sid, 2, 102) + w.submit(sid, 1, 101))
    assert server.send_partial_result(sid, 2, 102, 1, b"a") and server.send_partial_result(sid, 2, 102, 2, b"b")
    server.data_to_send()
    assert server.receive_data(w.session_close(sid, 102, policy=1)) == [ev.SessionClosed(sid, 1)]
    first, second, ack = w.sent(server)
    for packet, frame, operation, sequence in ((first, 2, 102, 3), (second, 1, 101, 1)):
        assert (packet.msg_type, packet.session_id, packet.frame_id, packet.body) == (
            T.RESULT_DROP_REASON,
            sid,
            frame,
            b"",
        )
        meta = ResultDropReasonMetadata.unpack(packet.meta)
        assert (meta.operation_id, meta.result_sequence, meta.drop_reason_code, int(meta.source_role)) == (
            operation,
            sequence,
            3,
            2,
        )
    assert ack.msg_type == T.SESSION_CLOSE_ACK
    assert SessionCloseAckMetadata.unpack(ack.meta) == SessionCloseAckMetadata(2, 102, 0)
    assert not server.send_partial_result(sid, 2, 102, 3, b"late")
    assert not server.send_result_drop_reason(sid, 1, 101, 0, 3, b"")
    assert not server.send_result_push(sid, 2, bytes(64), b"") and not server.send_credit_update(sid, 1)
    assert server.data_to_send() == b""


def test_without_drain_sessions_a_drain_close_ends_the_operations_as_an_abort() -> None:
    server, sid = w.opened()
    server.receive_data(w.submit(sid, 1, 101))
    assert server.receive_data(w.session_close(sid, 101)) == [ev.SessionClosed(sid, 1)]
    drop, ack = w.sent(server)
    assert drop.msg_type == T.RESULT_DROP_REASON
    assert SessionCloseAckMetadata.unpack(ack.meta).close_status == 2
    assert not server.send_result_push(sid, 1, bytes(64), b"")

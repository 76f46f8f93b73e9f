"""The wire core's close ordering, as a property over random orders of events: two sessions on one connection,
the client submitting, cancelling and closing (drain or abort, with or without a drain window, twice), the
backend answering for any operation it ever saw — partial results, progress, terminals, credit, pressure — in
any order, early or late (after the operation's session closed, after its terminal).

Checked on the bytes the core queues, as a native client would read them (nnrp-rs
``crates/nnrp-runtime/src/multiplex.rs``: a packet for a session after its SESSION_CLOSE_ACK ends the whole
connection; NagareWorks/nnrp-doc ``docs/en/design/v1-preview3.md`` §7.1C for the close handshake):

* a closed session gets exactly one SESSION_CLOSE_ACK, close_status closed, echoing ``last_operation_id``;
* every operation of the session has exactly one terminal (RESULT_PUSH or RESULT_DROP_REASON) on the wire
  before that ack;
* nothing at all is sent for the session after the ack;
* the other session's operations are served as before (their sends are taken while it is open), and a
  closing session whose backend finishes every operation is always acknowledged in the end.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnrp.core.enums import MessageType as T

from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.codecs import SessionCloseAckMetadata
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader, encode
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

from . import wirekit as w

SCALE = int(os.environ.get("NNRP_FUZZ_SCALE", "1"))
SESSIONS = (7, 8)
TERMINALS = (T.RESULT_PUSH, T.RESULT_DROP_REASON)


class Wire:
    """What a client reading the core's bytes knows, checked packet by packet."""

    def __init__(self) -> None:
        self.reader = PacketReader()
        self.open: set[int] = set()
        self.acked: dict[int, int] = {}  # session → last_operation_id of its one ack
        self.running: set[tuple[int, int]] = set()  # (session, frame) submitted, no terminal on the wire yet
        self.terminals: dict[tuple[int, int], int] = {}

    def read(self, data: bytes) -> None:
        for packet in self.reader.feed(data):
            sid = packet.session_id
            if packet.msg_type in (T.SERVER_HELLO_ACK, T.TRANSPORT_PROBE_ACK):
                continue
            if packet.msg_type == T.SESSION_OPEN_ACK:
                self.open.add(sid)
                continue
            assert sid not in self.acked, f"{T(packet.msg_type).name} for session {sid} after its SESSION_CLOSE_ACK"
            assert sid in self.open, packet
            if packet.msg_type in TERMINALS:
                key = (sid, packet.frame_id)
                assert key in self.running, f"second or stray terminal {packet}"
                self.running.discard(key)
                self.terminals[key] = self.terminals.get(key, 0) + 1
            elif packet.msg_type == T.SESSION_CLOSE_ACK:
                meta = SessionCloseAckMetadata.unpack(packet.meta)
                assert meta.close_status == 2, meta  # never draining (0/1): the terminals come first
                assert not any(s == sid for s, _ in self.running), f"session {sid} acked before every terminal"
                self.acked[sid] = meta.last_operation_id
                self.open.discard(sid)


@settings(max_examples=400 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), drain_sessions=st.sampled_from([True, True, True, False]), steps=st.integers(1, 40))
def test_every_operation_has_its_terminal_before_the_close_ack_and_nothing_follows_it(data, drain_sessions, steps):
    server = ServerConnection(max_in_flight_per_session=3)
    server.drain_sessions = drain_sessions
    wire = Wire()
    submitted: dict[tuple[int, int], int] = {}  # (session, frame) → operation id, every one the core reported
    closing: dict[int, int] = {}  # session → last_operation_id of the client's SESSION_CLOSE
    next_frame = dict.fromkeys(SESSIONS, 1)
    partial_sequence: dict[tuple[int, int], int] = {}

    def feed(packet: bytes) -> None:
        for event in server.receive_data(packet):
            assert not isinstance(event, ev.ConnectionEnded), event  # the client here never breaks the protocol
            if isinstance(event, ev.SessionOpenRequested):
                server.accept_session(event.request)
            elif isinstance(event, ev.OperationSubmitted):
                submitted[(event.session_id, event.frame_id)] = event.operation_id
        wire.read(server.data_to_send())

    feed(w.hello() + w.session_open(SESSIONS[0]))
    feed(w.session_open(SESSIONS[1]))
    assert wire.open == set(SESSIONS)

    def client_step() -> None:
        sid = data.draw(st.sampled_from([s for s in SESSIONS if s not in wire.acked] or [None]))
        if sid is None:
            return
        mine = sorted(f for s, f in submitted if s == sid)
        shape = data.draw(st.sampled_from(["submit", "submit", "frame_cancel", "cancel", "drain", "abort", "ping"]))
        if sid in closing and shape != "abort":
            return  # after its SESSION_CLOSE a client sends nothing more for the session but an abort close
        if shape == "submit":
            frame = next_frame[sid]
            next_frame[sid] += 1
            wire.running.add((sid, frame))  # taken or refused: a refused one is not reported and not expected
            feed(w.submit(sid, frame, 1000 * sid + frame))
            if (sid, frame) not in submitted:
                wire.running.discard((sid, frame))
        elif shape in ("frame_cancel", "cancel") and mine:
            frame = data.draw(st.sampled_from(mine))
            if (sid, frame) in wire.running:
                feed(
                    w.frame_cancel(sid, frame)
                    if shape == "frame_cancel"
                    else w.control(T.CANCEL, sid, frame, submitted[(sid, frame)])
                )
        elif shape in ("drain", "abort"):
            last = max((submitted[(s, f)] for s, f in submitted if s == sid), default=0)
            closing[sid] = last
            feed(
                w.session_close(
                    sid,
                    last,
                    policy=0 if shape == "drain" else 1,
                    drain_timeout_ms=data.draw(st.sampled_from([0, 250])),
                )
            )
        elif shape == "ping":
            feed(encode(T.PING, sid, 0))

    def backend_step() -> None:
        if not submitted:
            return
        sid, frame = key = data.draw(st.sampled_from(sorted(submitted)))
        operation = submitted[key]
        action = data.draw(st.sampled_from(["partial", "partial", "progress", "push", "drop", "credit", "pressure"]))
        live = server.session_open(sid) and key in wire.running
        if action == "partial":
            sequence = partial_sequence.get(key, 0) + 1
            if server.send_partial_result(sid, frame, operation, sequence, b"x"):
                partial_sequence[key] = sequence
                assert live
        elif action == "progress":
            server.send_progress(sid, frame, operation, 1, 0, 0xFFFF)
        elif action == "push":
            assert server.send_result_push(sid, frame, bytes(64), b"") == live
        elif action == "drop":
            assert server.send_result_drop_reason(sid, frame, operation, 0, 3, b"") == live
        elif action == "credit":
            assert server.send_credit_update(sid, 3) == server.session_open(sid)
        else:
            assert server.send_backpressure(sid, 0, 3, 1, 100) == server.session_open(sid)
        wire.read(server.data_to_send())

    for _ in range(steps):
        (client_step if data.draw(st.booleans()) else backend_step)()

    # the backend finishes what it still runs, in any order; every closing session is then acknowledged
    for key in data.draw(st.permutations(sorted(submitted))):
        sid, frame = key
        assert server.send_result_push(sid, frame, bytes(64), b"") == (key in wire.running)
        wire.read(server.data_to_send())
    assert not wire.running
    for sid, last in closing.items():
        assert wire.acked.get(sid) == last, (sid, wire.acked)
        assert not server.session_open(sid)
    for key in submitted:
        assert wire.terminals.get(key) == 1, key
    for sid in set(SESSIONS) - set(closing):  # the neighbour is untouched
        assert server.session_open(sid) and sid not in wire.acked

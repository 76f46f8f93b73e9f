"""Property tests: whatever bytes arrive and whatever the application answers, the core never raises, emits only
its event classes, stops after ConnectionEnded, never reuses a session id, never takes a finished operation's frame
or operation id again, sends at most one terminal per operation, and only ever queues well-formed packets that a
native client can route (after the handshake every packet carries a session id except a rejected SESSION_OPEN_ACK
and TRANSPORT_PROBE_ACK; one SESSION_CLOSE_ACK per closed session, close_status closed, only once each of its
operations had its terminal, and nothing for the session after it). Each fuzz also proves its generator reached what it
is there for (every packet shape generated, every event the core reports provoked: see "coverage of the
generators"), and the fixed cases check the documented outcome exactly: a silent drop or a call that raises
nothing fails them."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnrp.core.enums import MessageType as T
from nnrp.runtime.types import RecoverableErrorMetadata

from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.codecs import SessionCloseAckMetadata, SessionOpenAckMetadata
from vllm_nnrp_plugin.nnrp_wire.errors import LocalProtocolError
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader, encode
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

from . import wirekit as w
from .fuzz_rounds import run_until

SCALE = int(os.environ.get("NNRP_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=150 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])

C2S = {name: w.stream(name, "c2s", 0) for name in w.CAPTURE_NAMES}
META_LEN = {
    T.CLIENT_HELLO: 64,
    T.SESSION_OPEN: 48,
    T.SESSION_CLOSE: 24,
    T.FRAME_SUBMIT: 72,
    T.TRANSPORT_PROBE: 16,
    T.RESULT_HINT: 16,
    T.RESULT_PUSH: 64,
    T.PARTIAL_RESULT: 40,
    T.SESSION_OPEN_ACK: 56,
    T.SESSION_CLOSE_ACK: 16,
    T.SERVER_HELLO_ACK: 80,
    T.BUDGET_UPDATE: 40,
}
KINDS = [int(k) for k in T]


def _open_ends(data: bytes) -> list[int]:
    ends, offset = [], 0
    for packet in w.split(data):
        offset += len(w.raw(packet))
        if packet.msg_type == T.SESSION_OPEN:
            ends.append(offset)
    return ends


OPEN_ENDS = {name: _open_ends(data) for name, data in C2S.items()}


class Harness:
    """Drives one ServerConnection like an application would and checks the invariants after every step."""

    def __init__(self, draw=None, max_in_flight: int = 3, drain: bool = False) -> None:
        self.server = ServerConnection(max_in_flight_per_session=max_in_flight)
        self.server.drain_sessions = drain
        self.draw = draw
        self.ended = False
        self.accepted: list[int] = []
        self.ops: dict[tuple[int, int], int] = {}  # (session, frame) → operation id, as the events told
        self.terminals: dict[tuple[int, int, int], int] = {}
        self.out = PacketReader()
        self.handshaken = False
        self.closed_on_wire: set[int] = set()
        self.open_on_wire: set[int] = set()
        self.draining: set[int] = set()  # sessions closed with drain while operations ran
        self.on_wire: set[tuple[int, int]] = set()  # (session, frame) submitted and without a terminal on the wire
        self.events: list = []
        self.sent: list = []  # every packet the core queued, in order

    def feed(self, data: bytes) -> list:
        was_ended = self.ended
        events = self.server.receive_data(data)  # must never raise
        if was_ended:
            assert events == []
        for event in events:
            assert isinstance(event, w.SERVER_EVENTS), event
            assert not self.ended, f"event after ConnectionEnded: {event}"
            if isinstance(event, ev.ConnectionEnded):
                self.ended = True
                assert event.error is None or "internal error" not in event.error, event.error
            elif isinstance(event, ev.OperationSubmitted):
                sid = event.session_id
                assert sid not in self.draining, event
                assert not any(  # the frame and operation ids of a finished operation are never taken again
                    s == sid and (f == event.frame_id or o == event.operation_id) for s, f, o in self.terminals
                ), event
                self.ops[(sid, event.frame_id)] = event.operation_id
                self.on_wire.add((sid, event.frame_id))
            elif isinstance(event, ev.SessionClosed):
                self.ops = {k: v for k, v in self.ops.items() if k[0] != event.session_id}
                self.draining.discard(event.session_id)
            elif isinstance(event, ev.SessionDraining):
                running = [(f, o) for (s, f), o in self.ops.items() if s == event.session_id]
                assert running and sorted(o for _, o in running) == sorted(event.operation_ids), event
                self.draining.add(event.session_id)
            self.events.append(event)
            if isinstance(event, ev.SessionOpenRequested):
                self.answer(event)
        if self.ended and not was_ended:
            assert isinstance(events[-1], ev.ConnectionEnded)
            assert self.server.ended
            assert self.server.receive_data(b"\0" * 8) == []
        self.maybe_send()
        self.check_output()
        return events

    def answer(self, request: ev.SessionOpenRequested) -> None:
        if self.draw is None or self.draw(st.booleans()):
            sid = self.server.accept_session(request.request)
            if self.server.ended:  # the same read ended the connection after the open: nothing to accept
                assert sid == 0
                return
            assert sid not in self.accepted and sid > 0
            if request.requested_session_id:
                assert sid == request.requested_session_id
            self.accepted.append(sid)
        else:
            self.server.reject_session(request.request, 0x00010001, "no")

    def maybe_send(self) -> None:
        if self.draw is None or not self.ops:
            return
        for _ in range(self.draw(st.integers(0, 3))):
            if not self.ops:
                break
            key = self.draw(st.sampled_from(sorted(self.ops)))
            sid, frame = key
            op = self.ops[key]
            action = self.draw(st.sampled_from(["partial", "progress", "push", "drop", "credit", "bp"]))
            if action == "partial":
                self.server.send_partial_result(sid, frame, op, self.draw(st.integers(1, 9)), b"p")
            elif action == "progress":
                self.server.send_progress(sid, frame, op, 1, 5, 100)
            elif action in ("push", "drop"):
                ok = (
                    self.server.send_result_push(sid, frame, bytes(64), b"")
                    if action == "push"
                    else self.server.send_result_drop_reason(sid, frame, op, 0, 3, b"d")
                )
                if ok:
                    self.terminals[(sid, frame, op)] = self.terminals.get((sid, frame, op), 0) + 1
                    del self.ops[key]
                    if sid in self.draining and not any(s == sid for s, _ in self.ops):
                        assert not self.server.session_open(sid)  # its last terminal closed it
                        self.draining.discard(sid)
                # a second terminal for the same operation is refused
                assert not self.server.send_result_push(sid, frame, bytes(64), b"")
                assert not self.server.send_result_drop_reason(sid, frame, op, 0, 3, b"")
            elif action == "credit":
                self.server.send_credit_update(sid, 4)
            else:
                self.server.send_backpressure(sid, 1, 1, 1, 5)

    def check_output(self) -> None:
        for packet in self.out.feed(self.server.data_to_send()):  # FramingError would fail the test
            self.sent.append(packet)
            assert packet.flags == 0 and packet.view_id == 0 and packet.route_id == 0
            kind = packet.msg_type
            if kind == T.SERVER_HELLO_ACK:
                assert not self.handshaken
                self.handshaken = True
                continue
            if kind == T.TRANSPORT_PROBE_ACK:
                assert packet.session_id == 0
                continue
            assert self.handshaken, packet
            if kind == T.SESSION_OPEN_ACK:
                meta = SessionOpenAckMetadata.unpack(packet.meta)
                assert len(packet.body) == meta.body_length
                if meta.session_status == 0:
                    assert packet.session_id == meta.session_id != 0
                    assert packet.session_id not in self.open_on_wire | self.closed_on_wire
                    self.open_on_wire.add(packet.session_id)
                else:
                    assert packet.session_id == meta.session_id == 0
                continue
            assert packet.session_id in self.open_on_wire, f"{packet} for a session the client does not know"
            if kind in (T.RESULT_PUSH, T.RESULT_DROP_REASON):
                key = (packet.session_id, packet.frame_id)
                assert key in self.on_wire, f"a terminal for no running operation: {packet}"
                self.on_wire.discard(key)
            if kind == T.SESSION_CLOSE_ACK:  # the only one for the session: closed, behind every terminal
                assert SessionCloseAckMetadata.unpack(packet.meta).close_status == 2
                assert not any(s == packet.session_id for s, _ in self.on_wire), "ack before every terminal"
                self.open_on_wire.discard(packet.session_id)
                self.closed_on_wire.add(packet.session_id)
        for count in self.terminals.values():
            assert count == 1
        assert self.server.sessions == len(self.open_on_wire) or self.ended


@FUZZ
@given(name=st.sampled_from(w.CAPTURE_NAMES), cuts=st.lists(st.integers(0, 3000), max_size=30))
def test_random_splits_of_a_valid_stream_give_the_same_events(name: str, cuts: list[int]) -> None:
    # a native client waits for SESSION_OPEN_ACK before it uses the session, so a read always ends with the open
    data = C2S[name]
    whole = Harness()
    split = Harness()
    previous = 0
    for point in OPEN_ENDS[name] + [len(data)]:
        whole.feed(data[previous:point])
        previous = point
    previous = 0
    for point in sorted({c % (len(data) + 1) for c in cuts} | set(OPEN_ENDS[name])) + [len(data)]:
        if point > previous:  # b"" would mean end of stream
            split.feed(data[previous:point])
        previous = point
    assert split.events == whole.events
    assert split.accepted == whole.accepted


@FUZZ
@given(name=st.sampled_from(w.CAPTURE_NAMES), cut=st.integers(0, 3000))
def test_truncated_streams_end_cleanly(name: str, cut: int) -> None:
    data = C2S[name]
    harness = Harness()
    prefix = data[: cut % (len(data) + 1)]
    if prefix:
        harness.feed(prefix)
    harness.feed(b"")
    assert harness.ended


@FUZZ
@given(data=st.data(), name=st.sampled_from(w.CAPTURE_NAMES), position=st.integers(0, 5000), value=st.integers(0, 255))
def test_a_corrupted_byte_anywhere(data, name: str, position: int, value: int) -> None:
    stream = bytearray(C2S[name])
    stream[position % len(stream)] = value
    harness = Harness(data.draw)
    harness.feed(bytes(stream))
    harness.feed(b"")
    assert harness.ended


# -- coverage of the generators ------------------------------------------------------------------------------
#
# A property that holds for every example proves little if the generator never makes the interesting inputs.
# The fuzz runs below count what they generated (packet shapes), what the core reported (event classes) and
# some outcomes over all the examples of a run, and the test that runs them asserts every expected one was
# seen: the coverage is computed inside the same test, so a test run alone or in any order checks its own.
# Hypothesis's examples cluster (it mutates earlier examples), so a rare event can be missing from one run of
# max_examples by chance: the run is repeated (fresh examples, every invariant still checked; see .fuzz_rounds
# for derandomized profiles) while something is missing, at most COVERAGE_ROUNDS times. Something the generator
# cannot reach fails every time.

#: most hypothesis runs one coverage test makes before it fails for what its examples never produced
COVERAGE_ROUNDS = 6


class Coverage:
    """What the runs of one hypothesis test generated and provoked, counted over all their examples."""

    def __init__(self) -> None:
        self.shapes: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.runs = 0

    def saw_events(self, harness: Harness) -> None:
        self.events.update(type(e).__name__ for e in harness.events)

    def missing(self, shapes=(), events=(), outcomes=()) -> dict[str, list[str]]:
        gaps = {
            "shapes": sorted(set(shapes) - set(self.shapes)),
            "events": sorted(set(events) - set(self.events)),
            "outcomes": sorted(set(outcomes) - set(self.outcomes)),
        }
        return {k: v for k, v in gaps.items() if v}


SEEN = Coverage()  # the running fuzz's counts (reset by _covering)


def _covering(fuzz, *, shapes=(), events=(), outcomes=()) -> Coverage:
    """Run the hypothesis test ``fuzz`` (every example; a failing one raises) until its examples generated every
    one of ``shapes`` and provoked every one of ``events`` and ``outcomes`` (counted into :data:`SEEN`), at most
    :data:`COVERAGE_ROUNDS` times; fail with what is still missing."""
    global SEEN
    SEEN = seen = Coverage()
    seen.runs = run_until(fuzz, COVERAGE_ROUNDS, lambda: not seen.missing(shapes, events, outcomes))
    if not seen.missing(shapes, events, outcomes):
        return seen
    gaps = seen.missing(shapes, events, outcomes)
    raise AssertionError(
        f"in {seen.runs} runs the generator never produced {gaps}: shapes {dict(seen.shapes)}, "
        f"events {dict(seen.events)}, outcomes {dict(seen.outcomes)}"
    )


#: the packet shapes :func:`_random_packet` makes (``submit`` three times as often)
SHAPES = (
    "submit",
    "cancel",
    "abort",
    "frame_cancel",
    "deadline",
    "expire",
    "priority",
    "supersede",
    "budget",
    "trace",
    "close",
    "ping",
    "open",
    "random",
)
#: every event class a ServerConnection without ``authenticate`` can report
SERVER_EVENT_NAMES = tuple(cls.__name__ for cls in w.SERVER_EVENTS)


def _random_packet(draw, sessions: list[int], active: dict[tuple[int, int], int]) -> bytes:
    """One client packet: a well-formed or slightly wrong control, submit, close, open... ``sessions``: the
    accepted ones; ``active``: (session, frame) → operation id of the operations running now, which a packet
    names two times in three (else ids that are mostly those of operation k on frame k, or wrong ones)."""
    if active and draw(st.sampled_from([True, True, False])):
        (session, frame), op = draw(st.sampled_from(sorted(active.items())))
    else:
        session = draw(st.sampled_from(sessions * 8 + [0, 1, 99] if sessions else [0, 1, 7, 99]))
        k = draw(st.integers(1, 4))  # operation k lives on frame k, mostly
        frame = draw(st.sampled_from([k, k, k, 0, draw(st.integers(0, 5))]))
        op = draw(st.sampled_from([k, k, k, 0, draw(st.integers(0, 5))]))
    shape = draw(st.sampled_from(["submit"] * 2 + list(SHAPES) + ["random"]))
    SEEN.shapes[shape] += 1
    if shape == "submit":
        return w.submit(session, frame, op, draw(st.binary(max_size=8)), trace_id=draw(st.sampled_from([0, 5])))
    if shape in ("cancel", "abort"):
        kind = T.CANCEL if shape == "cancel" else T.ABORT
        return w.control(
            kind, session, frame, op, draw(st.sampled_from([b"", b"why"])), flags=draw(st.sampled_from([0, 0, 4]))
        )
    if shape == "frame_cancel":
        return w.frame_cancel(session, frame)
    if shape in ("deadline", "expire", "priority"):
        kind = {"deadline": T.DEADLINE, "expire": T.EXPIRE_AT, "priority": T.PRIORITY_UPDATE}[shape]
        return w.scheduling(kind, session, frame, op, deadline=draw(st.sampled_from([0, 5, 5])))
    if shape == "supersede":
        return w.supersede(
            session,
            frame,
            op,
            draw(st.integers(0, 5)),
            draw(st.sampled_from([b"", b"why"])),
            code=draw(st.sampled_from([2, 2, 0, 10])),
            flags=draw(st.sampled_from([0, 0, 2])),
        )
    if shape == "budget":
        return w.budget_update(session, frame, op, draw(st.integers(0, 9)), flags=draw(st.sampled_from([0, 0, 4])))
    if shape == "trace":
        return w.trace_context(
            session, draw(st.sampled_from([0, frame])), header_trace=draw(st.sampled_from([None, 0, 3]))
        )
    if shape == "close":
        return w.session_close(session, op, policy=draw(st.sampled_from([0, 0, 1])))
    if shape == "ping":
        return encode(draw(st.sampled_from([T.PING, T.PONG])), session, frame)
    if shape == "open":
        return w.session_open(draw(st.sampled_from([0, 0, 1, 5, 7])), profile_id=draw(st.sampled_from([2, 2, 1])))
    kind = draw(st.sampled_from(KINDS))
    meta_len = META_LEN.get(kind, 32 if kind >= 0x30 or kind == T.FLOW_UPDATE else 0)
    meta_len = draw(st.sampled_from([meta_len, meta_len, 0, draw(st.integers(0, 80))]))
    meta = draw(st.binary(min_size=meta_len, max_size=meta_len))
    body = draw(st.sampled_from([b"", b"", draw(st.binary(max_size=40))]))
    return encode(kind, session, frame, meta, body, trace_id=draw(st.sampled_from([0, 0, 91])))


@settings(max_examples=300 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), handshake=st.sampled_from([True, True, True, False]), count=st.integers(1, 30))
def _random_packet_sequences(data, handshake: bool, count: int) -> None:
    harness = Harness(data.draw, drain=data.draw(st.sampled_from([True, True, False])))
    if handshake:
        harness.draw = None  # session 7 is accepted (so most examples get past the handshake); later opens are drawn
        harness.feed(w.hello() + w.session_open(7))
        harness.draw = data.draw
        harness.feed(w.session_open(0))
        for sid in harness.accepted:  # operations k on frames k already running, for the controls to name
            if not harness.ended:
                harness.feed(b"".join(w.submit(sid, k, k) for k in range(1, data.draw(st.integers(1, 3)) + 1)))
    for _ in range(count):
        if harness.ended:
            break
        packet = _random_packet(data.draw, harness.accepted, harness.ops)
        if data.draw(st.booleans()):
            harness.feed(packet)
        else:
            cut = data.draw(st.integers(1, len(packet) - 1))
            harness.feed(packet[:cut])
            harness.feed(packet[cut:])
    harness.feed(b"")
    assert harness.ended
    SEEN.saw_events(harness)


def test_random_packet_sequences_keep_the_invariants() -> None:
    # every shape was generated, and every event the core can report came out of the examples: cancels,
    # deadlines, priorities, supersedes, budgets and traces reached an active operation, a drain ran...
    _covering(_random_packet_sequences, shapes=SHAPES, events=SERVER_EVENT_NAMES)


@FUZZ
@given(data=st.data(), count=st.integers(1, 3))
def _closes_while_operations_run(data, count: int) -> None:
    harness = Harness(data.draw, drain=data.draw(st.sampled_from([True, True, False])))
    harness.feed(w.hello() + w.session_open(7))
    harness.feed(b"".join(w.submit(7, k, 100 + k) for k in range(1, count + 1)))
    for _ in range(data.draw(st.integers(1, 10))):
        k = data.draw(st.integers(1, count + 1))
        shape = data.draw(st.sampled_from(["drain", "drain", "abort", "submit", "cancel", "ping", "nothing"]))
        SEEN.shapes[shape] += 1
        packet = {
            "drain": lambda: w.session_close(7, 100 + count),
            "abort": lambda: w.session_close(7, 100 + count, policy=1),
            "submit": lambda k=k: w.submit(7, k, 100 + k),
            "cancel": lambda k=k: w.control(T.CANCEL, 7, k, 100 + k),
            "ping": lambda: encode(T.PING, 7, 0),
            "nothing": lambda: b"",
        }[shape]()
        if packet:
            harness.feed(packet)
        else:
            harness.maybe_send()
            harness.check_output()
        if harness.ended or 7 in harness.closed_on_wire:
            break
    drained = 7 in harness.draining
    for (sid, frame), op in sorted(harness.ops.items()):  # the application ends what still runs
        assert harness.server.send_result_push(sid, frame, bytes(64), b"")
        harness.terminals[(sid, frame, op)] = harness.terminals.get((sid, frame, op), 0) + 1
        del harness.ops[(sid, frame)]
        harness.check_output()
    if 7 in harness.draining or 7 in harness.closed_on_wire:
        assert 7 in harness.closed_on_wire and not harness.server.session_open(7)
    if drained:  # the closing ack came right behind the last terminal the application sent here
        SEEN.outcomes["drain closed by its last terminal"] += 1
    SEEN.saw_events(harness)


#: the packets :func:`_closes_while_operations_run` sends, and the events its run must provoke
CLOSE_SHAPES = ("drain", "abort", "submit", "cancel", "ping", "nothing")
CLOSE_EVENTS = (
    "SessionOpenRequested",
    "OperationSubmitted",
    "OperationCancelled",
    "SessionDraining",
    "SessionClosed",
    "PacketRejected",
)


def test_closes_while_operations_run_keep_the_invariants() -> None:
    """SESSION_CLOSE (drain or abort, once or twice) among submits, cancels and the application's sends: every
    operation of a draining session gets its terminal before the closing ack, and nothing follows that ack."""
    _covering(
        _closes_while_operations_run,
        shapes=CLOSE_SHAPES,
        events=CLOSE_EVENTS,
        outcomes=["drain closed by its last terminal"],
    )


def test_unknown_sessions_and_types_are_fatal_or_rejected_never_raised() -> None:
    """Every msg_type byte (header-only, frame 0) on the open session 7 and on sessions never opened, checked
    against the module contract (:mod:`.server`): a header error (unknown type) or a packet for a session that is
    not open ends the connection, with an error and nothing sent; on the open session a second CLIENT_HELLO ends
    it too, PING is answered with PONG, PONG is taken silently, and every other type breaks a rule (a type a
    client must not send on a session, or a missing metadata block): exactly one PacketRejected, answered with
    one ERROR_RECOVERABLE, and the session goes on. Nothing may pass by producing no reaction at all."""
    seen: Counter[str] = Counter()
    for kind in range(256):
        for session in (7, 8, 1 << 31):
            harness = Harness()
            harness.feed(w.hello() + w.session_open(7))
            assert harness.accepted == [7]
            harness.sent.clear()
            header = bytearray(encode(T.PING, session, 0))
            header[6] = kind  # the msg_type byte
            events = harness.feed(bytes(header))
            where = f"msg_type {kind:#04x} on session {session}"
            if kind not in KINDS or session != 7 or kind == T.CLIENT_HELLO:
                outcome = "header error" if kind not in KINDS else "unknown session" if session != 7 else "second hello"
                assert harness.ended, where
                assert len(events) == 1 and isinstance(events[0], ev.ConnectionEnded), (where, events)
                assert events[0].error, where  # a protocol violation, not an end of stream
                assert harness.sent == [], (where, harness.sent)
            elif kind == T.PING:
                outcome = "pong"
                assert events == [] and not harness.ended, (where, events)
                assert [(p.msg_type, p.session_id, p.frame_id) for p in harness.sent] == [(T.PONG, 7, 0)], where
            elif kind == T.PONG:
                outcome = "ignored pong"
                assert events == [] and harness.sent == [] and not harness.ended, (where, events, harness.sent)
            else:
                outcome = "rejected"
                assert not harness.ended, (where, events)
                assert len(events) == 1, (where, events)  # never nothing, never more
                (rejected,) = events
                assert isinstance(rejected, ev.PacketRejected), (where, rejected)
                assert (rejected.session_id, rejected.frame_id, rejected.msg_type) == (7, 0, kind), where
                (answer,) = harness.sent
                assert (answer.msg_type, answer.session_id, answer.frame_id) == (T.ERROR_RECOVERABLE, 7, 0), where
                assert RecoverableErrorMetadata.unpack(answer.meta).error_scope == 1  # session scope: frame 0
                assert harness.server.session_open(7)
            seen[outcome] += 1
    assert set(seen) == {"header error", "unknown session", "second hello", "pong", "ignored pong", "rejected"}, seen


def _opened_with_one_operation() -> ServerConnection:
    harness = Harness()
    harness.feed(w.hello() + w.session_open(7))
    harness.feed(w.submit(7, 1, 101))
    server = harness.server
    assert server.data_to_send() == b""  # the harness took the acks
    return server


MISUSE = {
    "partial sequence -1": lambda s: s.send_partial_result(7, 1, 101, -1, b"x"),
    "progress stage_code over u16": lambda s: s.send_progress(7, 1, 101, 1, 1 << 20, 5),
    "drop reason over u16": lambda s: s.send_result_drop_reason(7, 1, 101, 0, 1 << 16, b""),
    "backpressure credit over u64": lambda s: s.send_backpressure(7, 1 << 64, 1, 0, 0),
}


@pytest.mark.parametrize("call", MISUSE.values(), ids=MISUSE.keys())
def test_application_misuse_raises_local_protocol_error_and_changes_nothing(call) -> None:
    """Calls that are wrong whatever the peer did raise LocalProtocolError (module docstring "Errors"), and the
    connection's state is unchanged: nothing queued, the operation still active (its terminal still goes)."""
    server = _opened_with_one_operation()
    with pytest.raises(LocalProtocolError):
        call(server)
    assert server.data_to_send() == b""
    assert server.send_result_push(7, 1, bytes(64), b"")


def test_an_operation_id_over_u64_is_misuse_not_a_lost_race() -> None:
    """A value that fits no field raises even when no operation matches it (found by the fuzz)."""
    server = _opened_with_one_operation()
    with pytest.raises(LocalProtocolError):
        server.send_result_drop_reason(7, 1, 1 << 64, 0, 1, b"")
    with pytest.raises(LocalProtocolError):
        server.send_partial_result(7, 1, 1 << 64, 1, b"x")
    with pytest.raises(LocalProtocolError):
        server.send_progress(7, 1, 1 << 64, 1, 0, 0)
    assert server.send_result_drop_reason(7, 1, 101, 0, 1, b"")  # the operation itself is untouched

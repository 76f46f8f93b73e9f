"""When the stream carrier sends a partial result (:mod:`vllm_nnrp_plugin.nnrp_binding.connection`): at once,
framed into the wire core's buffer while nothing of its session waits, all of one iteration's packets in one
write; queued while the transport is paused, where deltas merge; and after a resume nothing decided later
overtakes what still waits, so every operation's results stay in order and numbered from 1 without gaps.
Driven over a fake transport, with the sans-IO client core reading the bytes."""

from __future__ import annotations

import asyncio

import orjson

from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding.connection import FlushRound, NNRPConnection, SessionGate
from vllm_nnrp_plugin.nnrp_binding.stream import StreamConnection
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.profile import events


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.reading = True

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_extra_info(self, name: str) -> None:
        return None

    def close(self) -> None:
        pass


class Handler:
    def __init__(self) -> None:
        self.submitted = []

    def on_submit(self, sop) -> None:
        self.submitted.append(sop)

    def on_deadline(self, sop, deadline_unix_ms) -> None:
        pass

    def on_finished(self, sop) -> None:
        pass

    def on_terminal(self, sop) -> None:
        pass

    def on_session(self, transport, opened) -> None:
        pass


ENVELOPE = orjson.dumps({"operation": "chat.completions.create", "body": {"model": "m", "messages": []}})


def connected(operations: int):
    """A connection on the running loop with one open session and ``operations`` submitted operations."""
    handler, transport, client = Handler(), Transport(), ClientConnection()
    protocol = StreamConnection(
        NNRPConnection(
            handler,
            transport_name="tcp",
            limits=SessionLimits(max_in_flight=16, max_queued_events=64),
            gate=SessionGate(8),
            flush_round=FlushRound(asyncio.get_running_loop()),
            on_lost=lambda c: None,
        )
    )
    protocol.connection_made(transport)  # type: ignore[arg-type]
    client.open_session()
    protocol.data_received(client.data_to_send())
    (accepted,) = client.receive_data(b"".join(transport.writes))
    transport.writes.clear()
    for _ in range(operations):
        client.submit(accepted.session_id, wire_mapping.typed_body(ENVELOPE))
    protocol.data_received(client.data_to_send())
    return protocol, transport, client, handler.submitted


def partials(client: ClientConnection, data: bytes) -> list[tuple[int, int, str]]:
    """(operation id, result sequence, text or None) of every PARTIAL_RESULT in ``data``."""
    out = []
    for event in client.receive_data(data):
        assert isinstance(event, ev.PartialResultReceived), event
        out.append((event.operation_id, event.result_sequence, orjson.loads(event.body).get("delta")))
    return out


def test_partials_decided_in_one_iteration_go_out_each_in_its_own_packet_in_one_write():
    async def main():
        protocol, transport, client, (a, b) = connected(2)
        for sop, text in ((a, "Hel"), (b, "One"), (a, "lo"), (b, " two")):
            sop.partial(events.output_text_delta(0, text))
        assert transport.writes == []  # framed, not yet written: the write is the iteration's flush
        await asyncio.sleep(0)
        assert len(transport.writes) == 1
        assert partials(client, transport.writes[0]) == [
            (a.operation_id, 1, "Hel"),
            (b.operation_id, 1, "One"),
            (a.operation_id, 2, "lo"),
            (b.operation_id, 2, " two"),
        ]

    asyncio.run(main())


def test_while_paused_deltas_wait_and_merge_and_after_resume_nothing_overtakes_them():
    async def main():
        protocol, transport, client, (a,) = connected(1)
        a.partial(events.output_text_delta(0, "Hel"))
        await asyncio.sleep(0)
        protocol.pause_writing()
        a.partial(events.output_text_delta(0, "lo"))
        a.partial(events.output_text_delta(0, " wor"))
        await asyncio.sleep(0)
        assert len(transport.writes) == 1  # nothing while paused
        assert not transport.reading  # and nothing read from a client that does not read what it is sent
        protocol.resume_writing()
        assert transport.reading
        a.partial(events.output_text_delta(0, "ld"))  # decided before the resumed flush ran: joins what waits
        a.partial(events.usage({"prompt_tokens": 1, "completion_tokens": 4}))
        await asyncio.sleep(0)
        got = partials(client, b"".join(transport.writes))
        assert [(seq, text) for _, seq, text in got[:2]] == [(1, "Hel"), (2, "lo world")]
        ((_, seq, _),) = got[2:]
        assert seq == 3
        a.partial(events.output_text_delta(0, "!"))  # nothing waits any more: out at once again
        transport.writes.clear()
        await asyncio.sleep(0)
        assert partials(client, b"".join(transport.writes)) == [(a.operation_id, 4, "!")]

    asyncio.run(main())

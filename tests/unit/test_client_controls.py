"""The asyncio client's runtime controls (:mod:`vllm_nnrp_plugin.client.aio.connection`) against the package's server
core on a local TCP socket: the session's priority class, the envelope's ``nnrp.priority_class``,
PRIORITY_UPDATE / SUPERSEDE / BUDGET_UPDATE / DEADLINE / EXPIRE_AT of an operation, the drops that answer them
decoded as ``response.cancelled`` events, and the errors of each call."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from nnrp.core import PayloadKind, ResultFlags, ResultPushMetadata

from vllm_nnrp_plugin.client import ClientError, connect
from vllm_nnrp_plugin.client.aio.priority import with_priority_class
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

SUPERSEDED = {"type": "response.cancelled", "reason": "superseded"}
EXPIRED = {"type": "response.cancelled", "reason": "deadline_expired"}
PUSH = ResultPushMetadata(
    status_code=200,
    result_flags=ResultFlags(0),
    section_count=0,
    tile_count=0,
    active_profile_id=0,
    reserved0=0,
    inference_ms=0,
    queue_ms=0,
    server_total_ms=0,
    reserved1=0,
    tile_base_id=0,
    tile_index_bytes=0,
    payload_kind_bitmap=PayloadKind.STRUCTURED_EVENT,
    payload_frame_count=1,
).pack()


class Server:
    """A ServerConnection per accepted connection. Accepts every session; answers SUPERSEDE with a drop 2 and
    EXPIRE_AT / DEADLINE with a drop 1 (the diagnostics above), a FRAME_CANCEL with a drop 3 of a non-JSON
    diagnostic, and a submit for which ``answer(envelope)`` gives an event with a RESULT_PUSH of it; records every
    event and envelope."""

    def __init__(self, answer=lambda envelope: None) -> None:
        self.answer = answer
        self.events: list = []
        self.envelopes: list[dict] = []
        self.received = asyncio.Condition()  # notified after each read's events were recorded
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        core = ServerConnection(max_in_flight_per_session=4)
        while not core.ended:
            for event in core.receive_data(await reader.read(65536)):
                self.events.append(event)
                if isinstance(event, ev.SessionOpenRequested):
                    core.accept_session(event.request)
                elif isinstance(event, ev.OperationSubmitted):
                    kinds, count = int(event.metadata.payload_kind_bitmap), event.metadata.payload_frame_count
                    self.envelopes.append(orjson.loads(wire_mapping.unwrap_typed_body(kinds, count, event.body)))
                    terminal = self.answer(self.envelopes[-1])
                    if terminal is not None:
                        body = wire_mapping.typed_body(orjson.dumps(terminal))
                        core.send_result_push(event.session_id, event.frame_id, PUSH, body)
                elif isinstance(event, (ev.OperationSuperseded, ev.DeadlineReceived)):
                    code, body = (2, SUPERSEDED) if isinstance(event, ev.OperationSuperseded) else (1, EXPIRED)
                    core.send_result_drop_reason(
                        event.session_id, event.frame_id, event.operation_id, 0, code, orjson.dumps(body)
                    )
                elif isinstance(event, ev.OperationCancelled):
                    core.send_result_drop_reason(event.session_id, event.frame_id, event.operation_id, 0, 3, b"x")
            writer.write(core.data_to_send())
            async with self.received:
                self.received.notify_all()
        writer.close()

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


async def settle(server: Server, kind: type, count: int = 1) -> list:
    """The server's events of ``kind`` once there are ``count``; AssertionError after 5 s."""
    try:
        async with server.received:
            await asyncio.wait_for(server.received.wait_for(lambda: len(server.of(kind)) >= count), 5)
    except TimeoutError:
        raise AssertionError(f"no {kind.__name__}: {server.events}") from None
    return server.of(kind)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_priority_classes_reach_the_session_open_and_the_envelope() -> None:
    async def main() -> None:
        server = Server()
        async with server as uri:
            conn = await connect(uri)
            session = await conn.open_session(priority_class="background")
            envelope = {"operation": "x", "nnrp": {"trace": 1}}
            op = session.submit(envelope, priority_class="interactive")
            plain = session.submit({"operation": "y"})
            await settle(server, ev.OperationSubmitted, 2)
            assert server.of(ev.SessionOpenRequested)[0].priority_class == 2
            assert server.envelopes == [
                {"operation": "x", "nnrp": {"trace": 1, "priority_class": "interactive"}},
                {"operation": "y"},
            ]
            assert envelope == {"operation": "x", "nnrp": {"trace": 1}}  # the caller's dict is unchanged
            with pytest.raises(ValueError):
                await conn.open_session(priority_class="urgent")
            with pytest.raises(ValueError):
                session.submit(b"{}", priority_class="interactive")
            with pytest.raises(ValueError):
                session.submit({"nnrp": 1}, priority_class="interactive")
            op.supersede()
            plain.supersede()
            assert await op.result() == await plain.result() == SUPERSEDED
            await conn.close()

    run(main())


def test_operation_controls_go_out_and_their_drops_decode() -> None:
    async def main() -> None:
        server = Server()
        async with server as uri:
            conn = await connect(uri)
            session = await conn.open_session()
            old = session.submit({"q": 1})
            new = session.submit({"q": 2})
            late = session.submit({"q": 3})
            old.update_priority("background")
            old.update_budget(300)
            (priority,) = await settle(server, ev.PriorityUpdated)
            (budget,) = await settle(server, ev.BudgetUpdated)
            sid = session.session_id
            assert priority == ev.PriorityUpdated(sid, old.frame_id, old.operation_id, 2, 0)
            assert budget == ev.BudgetUpdated(sid, old.frame_id, old.operation_id, 300, 0, 0, 0)
            old.supersede(new)
            (superseded,) = await settle(server, ev.OperationSuperseded)
            assert superseded == ev.OperationSuperseded(sid, old.frame_id, old.operation_id, new.operation_id, 2, b"")
            assert [e async for e in old] == [SUPERSEDED] and old.drop_reason_code == 2
            new.expire_at(1_796_147_824_844)
            assert await new.result() == EXPIRED and new.drop_reason_code == 1
            late.deadline(1_796_147_824_845)
            assert await late.result() == EXPIRED
            assert [(e.deadline_unix_ms, e.submitted) for e in server.of(ev.DeadlineReceived)] == [
                (1_796_147_824_844, True),
                (1_796_147_824_845, True),
            ]
            for call in (
                lambda: old.update_priority("balanced"),
                lambda: old.supersede(),
                lambda: old.update_budget(1),
                lambda: old.deadline(1),
                lambda: old.expire_at(1),
            ):
                with pytest.raises(ClientError, match="already ended"):
                    call()
            assert not server.of(ev.PacketRejected)
            await conn.close()

    run(main())


def test_bad_control_values_raise_before_anything_is_sent() -> None:
    async def main() -> None:
        server = Server()
        async with server as uri:
            conn = await connect(uri)
            session = await conn.open_session()
            other = await conn.open_session()
            op = session.submit({"q": 1})
            foreign = other.submit({"q": 2})
            for call, error in (
                (lambda: op.update_priority("urgent"), ValueError),
                (lambda: op.update_budget(0), ValueError),
                (lambda: op.update_budget(1 << 32), ValueError),
                (lambda: op.deadline(0), ValueError),
                (lambda: op.expire_at(-5), ValueError),
                (lambda: op.supersede(foreign), ClientError),
            ):
                with pytest.raises(error):
                    call()
            await settle(server, ev.OperationSubmitted, 2)
            op.cancel()
            foreign.cancel()
            # a drop whose diagnostic is not JSON: named by its code, as before
            assert await op.result() == {"type": "response.cancelled", "reason": "peer_cancelled"}
            await foreign.result()
            assert [type(e) for e in server.events if not isinstance(e, ev.SessionOpenRequested)][:4] == [
                ev.OperationSubmitted,
                ev.OperationSubmitted,
                ev.OperationCancelled,
                ev.OperationCancelled,
            ]
            await conn.close()

    run(main())


def test_with_priority_class_copies() -> None:
    envelope = {"a": 1}
    assert with_priority_class(envelope, "balanced") == {"a": 1, "nnrp": {"priority_class": "balanced"}}
    assert envelope == {"a": 1}
    with pytest.raises(ValueError):
        with_priority_class(envelope, "fast")

"""Runtime controls between nnrp-py's NATIVE client (through :class:`ProfileClient`) and the package's server core
(:class:`ServerConnection` behind a plain TCP socket): PRIORITY_UPDATE, BUDGET_UPDATE, SUPERSEDE and EXPIRE_AT
come out as events, the RESULT_DROP_REASON superseded / deadline_expired that answer them reach the native client,
a session's priority class arrives in SESSION_OPEN, and the client core's bytes for the same calls are the native
client's."""

from __future__ import annotations

import asyncio
import socket
import threading

import orjson
from nnrp.core import MessageType as T

from tests.support import wait_until
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

from . import wirekit as w
from .test_client_core import opened as client_core_opened

SUPERSEDED = b'{"type":"response.cancelled","reason":"superseded"}'
EXPIRED = b'{"type":"response.cancelled","reason":"deadline_expired"}'
CONTROLS = (T.PRIORITY_UPDATE, T.EXPIRE_AT, T.SUPERSEDE, T.BUDGET_UPDATE)


class CoreServer:
    """One connection served by a ServerConnection on its own thread. The application accepts every session,
    answers OperationSuperseded with RESULT_DROP_REASON superseded (2) and an EXPIRE_AT (DeadlineReceived) with
    deadline_expired (1), and records the events and the bytes the client sent."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.uri = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.events: list = []
        self.c2s = bytearray()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock, _ = self._listener.accept()
        server = ServerConnection(max_in_flight_per_session=4)
        with sock:
            while not server.ended:
                data = sock.recv(65536)
                self.c2s += data
                for event in server.receive_data(data):
                    self.events.append(event)
                    if isinstance(event, ev.SessionOpenRequested):
                        server.accept_session(event.request)
                    elif isinstance(event, ev.OperationSuperseded):
                        server.send_result_drop_reason(
                            event.session_id, event.frame_id, event.operation_id, 0, 2, SUPERSEDED
                        )
                    elif isinstance(event, ev.DeadlineReceived):
                        server.send_result_drop_reason(
                            event.session_id, event.frame_id, event.operation_id, 0, 1, EXPIRED
                        )
                out = server.data_to_send()
                if out:
                    sock.sendall(out)
        self._listener.close()

    def join(self) -> None:
        self._thread.join(10)
        assert not self._thread.is_alive()


def wait_for(server: CoreServer, kind: type, count: int = 1) -> list:
    """The server core's events of ``kind`` once there are ``count``; AssertionError after 10 s."""

    def found() -> list:
        return [e for e in server.events if isinstance(e, kind)]

    assert wait_until(lambda: len(found()) >= count, 10), f"no {kind.__name__} in {server.events}"
    return found()


def test_native_client_controls_reach_the_server_core_and_their_drops_come_back() -> None:
    server = CoreServer()
    client = asyncio.run(ProfileClient.connect(server.uri, priority_class="interactive"))
    try:
        (opened,) = wait_for(server, ev.SessionOpenRequested)
        assert opened.priority_class == 0
        first = client.submit({"q": 1})
        second = client.submit({"q": 2})
        submitted = wait_for(server, ev.OperationSubmitted, 2)
        sid = submitted[0].session_id
        client.update_priority(first, "background")
        client.update_budget(first, 512)
        (priority,) = wait_for(server, ev.PriorityUpdated)
        assert priority == ev.PriorityUpdated(sid, 1, 1, 2, 0)
        (budget,) = wait_for(server, ev.BudgetUpdated)
        assert budget == ev.BudgetUpdated(sid, 1, 1, 512, 0, 0, 0)
        client.supersede(first, second)
        (superseded,) = wait_for(server, ev.OperationSuperseded)
        assert superseded == ev.OperationSuperseded(sid, 1, 1, 2, 2, b"")
        *_, drop = client.events(first, timeout_s=10)
        assert (drop.frame, drop.drop_reason, drop.event) == ("result_drop", 2, orjson.loads(SUPERSEDED))
        client.connection.expire_runtime_operation_at(
            client.session, operation_id=2, control_sequence=1, expire_at_unix_ms=1_796_147_824_844
        )
        (expire,) = wait_for(server, ev.DeadlineReceived)
        assert expire == ev.DeadlineReceived(sid, 2, 2, 1_796_147_824_844, True)
        *_, drop = client.events(second, timeout_s=10)
        assert (drop.frame, drop.drop_reason, drop.event) == ("result_drop", 1, orjson.loads(EXPIRED))
        assert not [e for e in server.events if isinstance(e, ev.PacketRejected)]
    finally:
        client.close()
    server.join()
    # the client core's bytes for the same calls (same ids, same per-operation control_sequence)
    native = [w.raw(p) for p in w.split(bytes(server.c2s)) if p.msg_type in CONTROLS]
    core = client_core_opened(sid)
    core.submit(sid, wire_mapping.typed_body(b"{}"))
    core.data_to_send()
    core.priority_update(sid, 1, 2)
    core.budget_update(sid, 1, 512)
    core.supersede(sid, 1, 2)
    core.expire_at(sid, 2, 1_796_147_824_844)
    assert core.data_to_send().hex() == b"".join(native).hex()
    assert [w.split(p)[0].msg_type for p in native] == [T.PRIORITY_UPDATE, T.BUDGET_UPDATE, T.SUPERSEDE, T.EXPIRE_AT]

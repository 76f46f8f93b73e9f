"""Session churn and exposure over the real NNRP path (nnrp-py native server and client on loopback)."""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import socket
import stat
import struct

import pytest

from tests.support import ServedNNRP, envelope, free_port, wait_until
from vllm_nnrp_plugin.client import ProfileClient

QUICK = envelope({"model": "c-nonstream-text", "messages": []})
CHURN = 300  # sessions per carrier, opened and closed one after the other


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}", f"unix://{tmp_path_factory.mktemp('nnrp')}/nnrp.sock"))
    yield served
    served.stop()


@pytest.mark.parametrize("transport", [0, 1], ids=["tcp", "ipc"])
def test_hundreds_of_short_sessions_are_all_served_and_none_is_leaked(served, transport):
    """nnrp-py 1.0.0rc4.post20's own accept gives up its ticket at each deadline, losing a session whose handshake
    straddles it (the listener keeps the ticket: sdk_sync.Acceptor)."""
    uri = served.bound[transport]
    for i in range(CHURN):
        client = asyncio.run(ProfileClient.connect(uri))
        (terminal,) = list(client.events(client.submit(QUICK), timeout_s=10))
        assert terminal.event["type"] == "response.completed", f"session {i}"
        client.session.close()  # a clean close: raises if the server does not complete the handshake
        client.close()
    assert wait_until(lambda: served.service.sessions == 0), f"{served.service.sessions} sessions leaked"
    assert served.service.in_flight.used == 0


def test_a_closed_session_with_work_in_flight_gets_its_backend_request_aborted(served):
    client = asyncio.run(ProfileClient.connect(served.bound[1]))
    op = client.submit(envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.1}))
    assert next(client.events(op, timeout_s=10)).frame == "partial_result"
    client.session.close()
    client.close()
    request_id = served.backend.started[-1]
    assert wait_until(lambda: request_id in served.backend.aborted)
    assert wait_until(lambda: served.service.sessions == 0)


def test_the_unix_socket_is_owner_only(served):
    mode = os.stat(served.bound[1][len("unix://") :]).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_the_unix_socket_group_is_configurable(tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name
    served = ServedNNRP((f"unix://{tmp_path}/g.sock",), ipc_socket_group=group)
    try:
        st = os.stat(tmp_path / "g.sock")
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    finally:
        served.stop()


def test_a_stale_socket_file_from_a_crashed_run_is_replaced(tmp_path):
    path = tmp_path / "stale.sock"
    crashed = socket.socket(socket.AF_UNIX)
    crashed.bind(str(path))
    crashed.close()  # the file stays, nobody listens: what a killed server leaves behind
    served = ServedNNRP((f"unix://{path}",))
    try:
        client = asyncio.run(ProfileClient.connect(f"unix://{path}"))
        (terminal,) = list(client.events(client.submit(QUICK), timeout_s=10))
        assert terminal.event["type"] == "response.completed"
        client.close()
    finally:
        served.stop()


def test_a_non_loopback_address_without_tls_is_logged_as_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_nnrp_plugin"):
        served = ServedNNRP((f"tcp://0.0.0.0:{free_port()}",), allow_non_loopback=True)
        served.stop()
    assert any("without TLS" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_stop_ends_every_in_flight_operation_once_and_aborts_it(tmp_path):
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}", f"unix://{tmp_path}/nnrp.sock"))
    clients = [asyncio.run(ProfileClient.connect(uri)) for uri in served.bound]
    try:
        slow = envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.1, "repeat": 50})
        streams = [c.events(c.submit(slow), timeout_s=20) for c in clients for _ in range(2)]
        for stream in streams:
            assert next(stream).frame == "partial_result"
        served.stop()
        for stream in streams:
            rest = list(stream)
            assert [e.terminal for e in rest].count(True) == 1 and rest[-1].terminal
            assert rest[-1].event["error"]["code"] == "server_shutdown" and rest[-1].status == 503
        assert sorted(served.backend.aborted) == sorted(served.backend.started)
        assert served.backend.open_streams == 0 and served.service.in_flight.used == 0
        with pytest.raises(Exception):  # noqa: B017 - whatever nnrp-py's native connect raises for a closed port
            asyncio.run(ProfileClient.connect(served.bound[0]))  # nothing listens any more
    finally:
        for c in clients:
            c.close()


def test_a_frame_that_cannot_be_built_costs_its_operation_not_the_session(served, monkeypatch):
    from vllm_nnrp_plugin.contract import wire_mapping

    real, calls = wire_mapping.result_push, []

    def first_push_fails(action, server_total_ms=0):
        calls.append(action)
        if len(calls) == 1:
            raise struct.error("ushort format requires 0 <= number <= 65535")
        return real(action, server_total_ms)

    monkeypatch.setattr(wire_mapping, "result_push", first_push_fails)
    client = asyncio.run(ProfileClient.connect(served.bound[0]))
    try:
        slow = client.submit(envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.05}))
        assert next(client.events(slow, timeout_s=10)).frame == "partial_result"
        (dropped,) = list(client.events(client.submit(QUICK), timeout_s=10))
        assert dropped.frame == "result_drop" and dropped.drop_reason == 8  # TRANSPORT_CLOSED
        assert dropped.event == {"type": "response.cancelled", "reason": "server_error"}
        assert list(client.events(slow, timeout_s=10))[-1].event["type"] == "response.completed"
        (again,) = list(client.events(client.submit(QUICK), timeout_s=10))
        assert again.event["type"] == "response.completed"
    finally:
        client.close()

"""The stream listener's own accepting (:mod:`vllm_nnrp_plugin.nnrp_binding.listener`): every waiting
connection is accepted in one callback and the bytes it already sent are its first read, over real TCP and
unix sockets, with raw sockets speaking the project's sans-IO client core."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.support import ServedNNRP, free_port, wait_until
from vllm_nnrp_plugin.nnrp_binding import stream
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection


@pytest.fixture
def served(tmp_path):
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}", f"unix://{tmp_path}/nnrp.sock"))
    yield served
    served.stop()


def raw_socket(uri: str) -> socket.socket:
    if uri.startswith("unix://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(uri.removeprefix("unix://"))
    else:
        host, port = uri.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    return sock


def handshake(sock: socket.socket) -> ClientConnection:
    """CLIENT_HELLO + SESSION_OPEN sent at once."""
    core = ClientConnection()
    core.open_session(max_in_flight_operations=1)
    sock.sendall(core.data_to_send())
    return core


def opened(sock: socket.socket, core: ClientConnection) -> ev.SessionOpenAccepted:
    while True:
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        for event in core.receive_data(data):
            if isinstance(event, ev.SessionOpenAccepted):
                return event
            assert not isinstance(event, ev.SessionOpenRejected), event


def stall(served: ServedNNRP, seconds: float) -> None:
    """Hold the service's loop for ``seconds`` (connections wait in the kernel's accept queue meanwhile);
    returns once the loop is held."""
    held = threading.Event()

    def hold() -> None:
        held.set()
        time.sleep(seconds)  # the busy loop itself: what the tests below are about

    served.loop.call_soon_threadsafe(hold)
    assert held.wait(5)


def accepted_with(monkeypatch) -> list[bytes]:
    """The bytes each connection accepted from now on starts from (the listener's read at accept), in order."""
    firsts: list[bytes] = []
    made = stream.StreamConnection.__init__

    def recording(self, *args, **kwargs):
        firsts.append(kwargs.get("first", b""))
        made(self, *args, **kwargs)

    monkeypatch.setattr(stream.StreamConnection, "__init__", recording)
    return firsts


@pytest.mark.parametrize("transport", [0, 1], ids=["tcp", "ipc"])
def test_a_burst_that_sent_its_handshake_before_it_was_accepted_is_answered_from_what_accept_read(
    served, transport, monkeypatch
):
    """32 clients connect and send CLIENT_HELLO + SESSION_OPEN while the loop is busy: once it runs, each of
    their connections starts from the bytes the listener read as it accepted it, and every session opens."""
    firsts = accepted_with(monkeypatch)
    uri = served.bound[transport]
    stall(served, 0.5)
    clients = [raw_socket(uri) for _ in range(32)]
    cores = [handshake(sock) for sock in clients]
    for sock, core in zip(clients, cores, strict=True):
        opened(sock, core)
    assert len(firsts) == 32 and all(firsts), [len(f) for f in firsts]
    assert wait_until(lambda: served.service.sessions == 32)
    for sock in clients:
        sock.close()
    assert wait_until(lambda: served.service.sessions == 0)


@pytest.mark.parametrize("transport", [0, 1], ids=["tcp", "ipc"])
def test_a_client_gone_before_it_was_accepted_costs_only_its_socket(served, transport):
    uri = served.bound[transport]
    stall(served, 0.3)
    gone = raw_socket(uri)
    gone.close()
    stays = raw_socket(uri)
    core = handshake(stays)
    assert opened(stays, core).session_id
    stays.close()
    assert wait_until(lambda: served.service.sessions == 0)


@pytest.mark.parametrize("transport", [0, 1], ids=["tcp", "ipc"])
def test_a_client_that_sends_its_handshake_after_it_was_accepted_is_served(served, transport, monkeypatch):
    firsts = accepted_with(monkeypatch)
    uri = served.bound[transport]
    sock = raw_socket(uri)
    assert wait_until(lambda: firsts)
    assert firsts == [b""]  # accepted with nothing to read yet: the transport reads the handshake
    core = handshake(sock)
    assert opened(sock, core).session_id
    sock.close()


def test_after_stop_nothing_is_accepted(tmp_path):
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}", f"unix://{tmp_path}/nnrp.sock"))
    uris = served.bound
    served.stop()
    for uri in uris:
        with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
            raw_socket(uri)

"""nnrp-py's native client (the protocol's oracle) against the plugin's own wire core on TCP, a unix socket and
TLS over TCP (``nnrps``):
the exchanges a native client can make beyond one operation on one session — several sessions on one
connection, a session asking for resume, a session asking for more operations in flight than nnrp-py's own
server grants — each ending as the protocol says. (One operation per session, cancels, DEADLINE, TRACE_CONTEXT,
limits and churn: tests/test_loopback.py, test_limits.py, test_sessions.py, over the same server.)"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest
from nnrp.client import (
    NativeClientOptions,
    NativeClientProviderRoute,
    NativeClientSessionOptions,
    connect_native_client_connection,
)
from nnrp.core import TransportPolicy
from nnrp.core.enums import MessageType
from nnrp.native import NativeTransportClientSecurity
from nnrp.runtime.types import ResultDropReasonMetadata

from tests.support import ServedNNRP, envelope, free_port, self_signed, wait_until
from vllm_nnrp_plugin.client import ProfileClient
from vllm_nnrp_plugin.contract.endpoints import parse_endpoint
from vllm_nnrp_plugin.nnrp_wire.codecs import CLOSE_STATUS_CLOSED, SessionCloseAckMetadata
from vllm_nnrp_plugin.nnrp_wire.framing import PacketReader

QUICK = envelope({"model": "c-nonstream-text", "messages": []})
SLOW = envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.2, "repeat": 50})
POLICY = {"tcp": TransportPolicy.FORCE_TCP, "ipc": TransportPolicy.FORCE_IPC}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nnrp")
    cert, key, der = self_signed(tmp)
    served = ServedNNRP(
        (f"tcp://127.0.0.1:{free_port()}", f"unix://{tmp}/nnrp.sock", f"nnrps://127.0.0.1:{free_port()}"),
        tls_cert_file=cert,
        tls_key_file=key,
    )
    served.der = der
    yield served
    served.stop()


@contextlib.contextmanager
def native_connection(uri: str, trusted_cert_der: bytes | None = None):
    carrier = parse_endpoint(uri)
    security = None
    if carrier.tls:
        security = NativeTransportClientSecurity(server_name=carrier.host, trusted_certificate_der=trusted_cert_der)
    route = NativeClientProviderRoute(provider_endpoint=carrier.provider_uri, security=security)
    options = NativeClientOptions(
        endpoint=carrier.endpoint,
        provider_routes={carrier.transport: route},
        transport_policy=POLICY[carrier.transport],
    )
    with connect_native_client_connection(options) as connection:
        yield connection


def profile_client(connection, options: NativeClientSessionOptions | None = None) -> ProfileClient:
    """A :class:`ProfileClient` on a new session of ``connection`` (which the caller closes)."""
    session = asyncio.run(connection.open_session(options))
    return ProfileClient(contextlib.ExitStack(), connection, session)


def completed(client: ProfileClient, payload: dict = QUICK) -> bool:
    (terminal,) = list(client.events(client.submit(payload), timeout_s=10))
    return terminal.event["type"] == "response.completed"


@pytest.mark.parametrize("transport", [0, 1, 2], ids=["tcp", "ipc", "nnrps"])
def test_several_sessions_on_one_native_connection_are_served_apart(served, transport):
    with native_connection(served.bound[transport], served.der) as connection:
        first, second = profile_client(connection), profile_client(connection)
        assert wait_until(lambda: served.service.sessions == 2)
        slow = first.submit(SLOW)
        assert next(first.events(slow, timeout_s=10)).frame == "partial_result"
        assert completed(second)  # operation and frame id 1 again, on another session
        second.session.close()
        assert wait_until(lambda: served.service.sessions == 1)
        first.cancel(slow)
        assert list(first.events(slow, timeout_s=10))[-1].frame == "result_drop"
        request_id = served.backend.started[-2]
        assert wait_until(lambda: request_id in served.backend.aborted)
        assert completed(first)
        first.session.close()
    assert wait_until(lambda: served.service.sessions == 0)


def test_a_session_asking_for_resume_opens_without_a_ticket(served):
    """The plugin never grants resume (a resume attempt is refused with ``resume_rejected``: the core's tests);
    a native client that asks for it still opens its session, with no recovery ticket, and is served."""
    with native_connection(served.bound[0]) as connection:
        client = profile_client(connection, NativeClientSessionOptions(allow_resume=True))
        assert client.session.recovery_ticket() is None  # asked, not granted
        assert completed(client)
        client.session.close()


def test_a_session_may_ask_for_as_many_operations_as_the_plugin_allows(served):
    """nnrp-py's own server refuses a SESSION_OPEN asking for more than its 4 in-flight operations; the plugin
    grants up to ``nnrp.max_in_flight_per_session`` (16 by default) and serves them at once."""
    with native_connection(served.bound[1]) as connection:
        client = profile_client(connection, NativeClientSessionOptions(max_in_flight_operations=16))
        ops = [client.submit(QUICK) for _ in range(16)]
        for op in ops:
            assert list(client.events(op, timeout_s=10))[-1].event["type"] == "response.completed"
        client.session.close()


class Relay:
    """A TCP relay between a client and ``upstream`` (``host:port``) that records what the server sent:
    ``address`` is where clients connect, ``server_bytes`` every byte from the server, in order."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.server_bytes = bytearray()
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(self._upstream)
        for source, sink, record in ((client, server, None), (server, client, self.server_bytes)):
            thread = threading.Thread(target=self._pump, args=(source, sink, record), daemon=True)
            thread.start()
            self._threads.append(thread)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, record: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if record is not None:
                    record += data
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()
        for thread in self._threads[1:]:
            thread.join(5)


def test_closing_a_session_with_an_operation_in_flight_leaves_its_neighbour_streaming(served):
    """nnrp-py's native client closes session A while A's stream runs; session B on the same connection keeps
    streaming to its end and the connection takes new work. On the wire (recorded by a relay): A's operation
    gets its terminal (a peer_cancelled RESULT_DROP_REASON) before A's one SESSION_CLOSE_ACK (close_status
    closed), and nothing is sent for A after that ack — the native client unregisters the id at the ack and a
    later packet for it ends the whole connection, its other sessions included (nnrp-rs
    ``crates/nnrp-runtime/src/multiplex.rs``). A's vLLM request is aborted."""
    streamed = envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.01, "repeat": 8})
    relay = Relay(served.bound[0].removeprefix("tcp://"))
    try:
        with native_connection(relay.address) as connection:
            first, second = profile_client(connection), profile_client(connection)
            slow = first.submit(SLOW)
            assert next(first.events(slow, timeout_s=10)).frame == "partial_result"
            request_id = served.backend.started[-1]
            running = second.submit(streamed)
            events = second.events(running, timeout_s=20)
            assert next(events).frame == "partial_result"  # B is streaming while A closes
            first.session.close()  # SESSION_CLOSE (drain, timeout 0) with A's operation in flight
            assert wait_until(lambda: request_id in served.backend.aborted)
            rest = list(events)
            assert rest[-1].frame == "result_push" and rest[-1].event["type"] == "response.completed"
            assert len(rest) > 10  # the stream went on after A's close
            assert completed(second)  # and the connection still takes new work
            second.session.close()
        assert wait_until(lambda: served.service.sessions == 0)
    finally:
        relay.close()
    packets = PacketReader().feed(bytes(relay.server_bytes))
    a = next(p.session_id for p in packets if p.msg_type == MessageType.SESSION_OPEN_ACK)  # A opened first
    of_a = [(p.msg_type, p.meta) for p in packets if p.session_id == a]
    acks = [i for i, (kind, _) in enumerate(of_a) if kind == MessageType.SESSION_CLOSE_ACK]
    assert len(acks) == 1 and acks[0] == len(of_a) - 1, [MessageType(k).name for k, _ in of_a]
    assert SessionCloseAckMetadata.unpack(of_a[-1][1]).close_status == CLOSE_STATUS_CLOSED
    terminal = of_a[-2]
    assert terminal[0] == MessageType.RESULT_DROP_REASON
    assert ResultDropReasonMetadata.unpack(terminal[1]).drop_reason_code == 3  # peer_cancelled

"""``quic://`` on the project's wire core (``vllm_nnrp_plugin/nnrp_binding/quic.py``), driven by an aioquic client
carrying the project's sans-IO client core: ALPN (``nnrp/1`` when offered, refused when only something else is,
served without when none is — nnrp-py's native client, tests/test_transports.py), one NNRP stream per
connection, misuse (other streams, a reset NNRP stream) ending the connection and aborting in-flight work, the
connection bound and the handshake timeout."""

from __future__ import annotations

import asyncio
import ssl
import time

import orjson
import pytest
from aioquic.asyncio import QuicConnectionProtocol
from aioquic.asyncio.client import connect
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import QuicErrorCode

from tests.support import ServedNNRP, envelope, free_port, metric, recorded_chunks, self_signed, wait_until
from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection

STREAM = envelope({"model": "a-stream-text", "messages": [], "stream": True})
#: a stream that runs for seconds unless stopped
SLOW = envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.2})
NO_APPLICATION_PROTOCOL = QuicErrorCode.CRYPTO_ERROR + 120  # 0x178, RFC 9001 §8.1


class NNRPOverQuic(QuicConnectionProtocol):
    """An aioquic client whose stream 0 carries :class:`ClientConnection`'s bytes; ``nnrp_events`` collects what
    the client core reports, ``terminated`` the connection's end."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nnrp = ClientConnection()
        self.nnrp_events: list[object] = []
        self.alpn: str | None = None
        self.terminated: asyncio.Future = asyncio.get_running_loop().create_future()
        self._changed = asyncio.Event()

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        if isinstance(event, qe.HandshakeCompleted):
            self.alpn = event.alpn_protocol
        elif isinstance(event, qe.StreamDataReceived) and event.stream_id == 0:
            self.nnrp_events += self.nnrp.receive_data(event.data) if event.data else []
            if event.end_stream:
                self.nnrp_events += self.nnrp.receive_data(b"")
        elif isinstance(event, qe.ConnectionTerminated) and not self.terminated.done():
            self.terminated.set_result(event)
        self._changed.set()

    def send(self) -> None:
        data = self.nnrp.data_to_send()
        if data:
            self._quic.send_stream_data(0, data)
            self.transmit()

    async def wait_for(self, kind: type, timeout_s: float = 10.0) -> object:
        async def found():
            while True:
                for event in self.nnrp_events:
                    if isinstance(event, kind):
                        return event
                if self.terminated.done():
                    raise AssertionError(f"connection ended before {kind.__name__}: {self.terminated.result()}")
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(found(), timeout_s)

    async def open_and_submit(self, body: dict) -> int:
        """Open a session and submit ``body``; returns the session id once the first partial result came."""
        self.nnrp.open_session()
        self.send()
        opened = await self.wait_for(ev.SessionOpenAccepted)
        self.nnrp.submit(opened.session_id, wire_mapping.typed_body(orjson.dumps(body)))
        self.send()
        await self.wait_for(ev.PartialResultReceived)
        return opened.session_id


def configuration(alpn: list[str] | None) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=alpn, server_name="localhost")
    config.verify_mode = ssl.CERT_NONE
    return config


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cert, key, _ = self_signed(tmp_path_factory.mktemp("quic"))
    served = ServedNNRP(
        (f"quic://127.0.0.1:{free_port()}",), tls_cert_file=cert, tls_key_file=key, handshake_timeout_ms=1000
    )
    yield served
    served.stop()


def port_of(served: ServedNNRP) -> int:
    return int(served.bound[0].rsplit(":", 1)[1])


def client_of(served: ServedNNRP, alpn: list[str] | None = None):
    """aioquic's ``connect`` (an async context manager) to ``served`` as :class:`NNRPOverQuic`, offering ``alpn``
    (default ``nnrp/1``)."""
    return connect(
        "127.0.0.1", port_of(served), configuration=configuration(alpn or ["nnrp/1"]), create_protocol=NNRPOverQuic
    )


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


@pytest.mark.parametrize("alpn", [["nnrp/1"], ["h3", "nnrp/1"]])
def test_a_client_offering_nnrp_1_gets_it_and_streams_an_operation(served, alpn):
    async def main():
        async with client_of(served, alpn) as client:
            await client.open_and_submit(STREAM)
            pushed = await client.wait_for(ev.ResultPushed)
            return client.alpn, client.nnrp_events, pushed

    alpn_selected, events, pushed = run(main())
    assert alpn_selected == "nnrp/1"
    text = "".join(orjson.loads(e.body).get("delta", "") for e in events if isinstance(e, ev.PartialResultReceived))
    assert text == "".join(c["choices"][0]["delta"]["content"] for c in recorded_chunks("a-stream-text"))
    assert b"response.completed" in pushed.body


def test_a_client_offering_only_another_protocol_is_refused_no_application_protocol(served):
    async def main():
        with pytest.raises(ConnectionError):
            async with client_of(served, ["h3"]):
                pass

    run(main())
    assert served.service.sessions == 0


@pytest.mark.parametrize("stream", ["second bidirectional", "unidirectional"])
def test_a_second_stream_ends_the_connection_and_aborts_its_operations(served, stream):
    async def main():
        async with client_of(served) as client:
            await client.open_and_submit(SLOW)
            started = len(served.backend.started)
            other = client._quic.get_next_available_stream_id(is_unidirectional=stream == "unidirectional")
            client._quic.send_stream_data(other, b"NNRP")
            client.transmit()
            return started, await asyncio.wait_for(client.terminated, 10)

    aborted_before = len(served.backend.aborted)
    started, terminated = run(main())
    assert terminated.error_code == QuicErrorCode.PROTOCOL_VIOLATION
    assert "one stream" in terminated.reason_phrase
    assert wait_until(lambda: len(served.backend.aborted) == aborted_before + 1)  # the vLLM request stops
    assert served.backend.aborted[-1] == served.backend.started[started - 1]
    assert wait_until(lambda: served.service.sessions == 0)


def test_a_reset_nnrp_stream_is_a_lost_client(served):
    async def main():
        async with client_of(served) as client:
            await client.open_and_submit(SLOW)
            client._quic.reset_stream(0, 0)
            client.transmit()
            return await asyncio.wait_for(client.terminated, 10)

    aborted_before = len(served.backend.aborted)
    run(main())
    assert wait_until(lambda: len(served.backend.aborted) == aborted_before + 1)
    assert wait_until(lambda: served.service.sessions == 0)


def test_the_end_of_the_clients_stream_stops_its_operations_and_closes_cleanly(served):
    async def main():
        async with client_of(served) as client:
            await client.open_and_submit(SLOW)
            client._quic.send_stream_data(0, b"", end_stream=True)
            client.transmit()
            return await asyncio.wait_for(client.terminated, 10)

    aborted_before = len(served.backend.aborted)
    terminated = run(main())
    assert terminated.error_code == QuicErrorCode.NO_ERROR
    assert wait_until(lambda: len(served.backend.aborted) == aborted_before + 1)


def test_a_client_that_dies_silently_is_taken_for_gone_and_its_operations_stop(served, monkeypatch):
    """A killed client sends no CONNECTION_CLOSE: its socket just goes. While packets wait for its
    acknowledgement the server gives it ``PEER_SILENT_S`` (shortened here), then aborts its work (not the 60 s
    idle timeout)."""
    from vllm_nnrp_plugin.nnrp_binding import quic

    PEER_SILENT_S = 1.5
    monkeypatch.setattr(quic, "PEER_SILENT_S", PEER_SILENT_S)

    async def main():
        opening = client_of(served)
        client = await opening.__aenter__()  # never left: a dead client closes nothing
        await client.open_and_submit(SLOW)
        if client._timer is not None:
            client._timer.cancel()
        client._transport.abort()  # gone: nothing more is sent or read
        return time.monotonic()

    aborted_before = len(served.backend.aborted)
    gone_at = run(main())
    assert wait_until(lambda: len(served.backend.aborted) == aborted_before + 1, timeout_s=PEER_SILENT_S + 5)
    assert PEER_SILENT_S - 0.5 < time.monotonic() - gone_at < PEER_SILENT_S + 3
    assert wait_until(lambda: served.service.sessions == 0)


def test_a_connection_that_opens_no_session_in_time_is_closed_and_counted(served):
    before = metric("nnrp_handshake_timeouts_total", transport="quic")

    async def main():
        async with client_of(served) as client:
            return await asyncio.wait_for(client.terminated, 10)

    assert run(main()).error_code == QuicErrorCode.NO_ERROR
    assert metric("nnrp_handshake_timeouts_total", transport="quic") == before + 1


def test_connections_over_max_connections_are_refused_and_counted(tmp_path):
    cert, key, _ = self_signed(tmp_path)
    served = ServedNNRP((f"quic://127.0.0.1:{free_port()}",), tls_cert_file=cert, tls_key_file=key, max_connections=1)

    async def main():
        async with client_of(served) as first:
            await first.open_and_submit(STREAM)
            try:  # closed at its first packet: its handshake may complete before the CONNECTION_CLOSE is read
                async with client_of(served) as second:
                    second.nnrp.open_session()
                    second.send()
                    terminated = await asyncio.wait_for(second.terminated, 10)
                    assert terminated.error_code == QuicErrorCode.CONNECTION_REFUSED
                    assert not second.nnrp_events  # no session, no answer
            except ConnectionError:
                pass
            await first.wait_for(ev.ResultPushed)  # the first one is still served

    try:
        run(main())
        assert metric("nnrp_connections_refused_total", transport="quic", reason="max_connections") == 1
    finally:
        served.stop()


def test_a_server_stop_delivers_the_shutdown_terminal_then_closes_the_connection(tmp_path):
    """The stop's ``server_shutdown`` terminal and the stream's FIN go out before the UDP socket closes (aioquic
    paces packets: closing the socket at once lost them), then CONNECTION_CLOSE with NO_ERROR."""
    import threading

    cert, key, _ = self_signed(tmp_path)
    served = ServedNNRP((f"quic://127.0.0.1:{free_port()}",), tls_cert_file=cert, tls_key_file=key)

    async def main():
        async with client_of(served) as client:
            await client.open_and_submit(SLOW)
            threading.Thread(target=served.stop).start()
            pushed = await client.wait_for(ev.ResultPushed)
            return pushed, await asyncio.wait_for(client.terminated, 10)

    pushed, terminated = run(main())
    assert b"server_shutdown" in pushed.body
    assert terminated.error_code == QuicErrorCode.NO_ERROR


def test_a_stop_that_outlasts_a_silent_client_leaves_no_task_pending(tmp_path, caplog):
    """A client gone silent never acknowledges the stop's last packets: the stop gives up on it after its grace
    time and leaves no waiting task behind (asyncio would log it as destroyed while pending)."""
    import gc
    import logging

    cert, key, _ = self_signed(tmp_path)
    served = ServedNNRP((f"quic://127.0.0.1:{free_port()}",), tls_cert_file=cert, tls_key_file=key)

    async def main():
        opening = client_of(served)
        client = await opening.__aenter__()  # never left: the client goes silent
        await client.open_and_submit(SLOW)
        if client._timer is not None:
            client._timer.cancel()
        client._transport.close()

    run(main())
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        served.stop()
        served.loop.close()
        served = None  # the last reference gone: gc below collects the service's tasks
        gc.collect()  # a task still pending is destroyed (and logged) now
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]

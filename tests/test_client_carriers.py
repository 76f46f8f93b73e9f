"""The project's asyncio client (:func:`vllm_nnrp_plugin.client.connect`) over WebSocket (``ws://``, ``wss://``) and
QUIC (``quic://``) against the project's own server (the service with a recorded backend, vLLM's API key
required): streams, the key, two sessions, cancel, certificates, the Upgrade path, a server that stops or
vanishes. A scripted WebSocket server (wsproto + the project's sans-IO server core) checks what the plugin's
server never does (pings, text messages, a message ending inside a packet) and the client's close frame.
nnrp-py's native server over ``ws`` and ``quic`` is ``tests/wire/test_client_interop.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Ping, Pong, Request, TextMessage

from tests.support import ROOT, ServedNNRP, envelope, free_port, recorded_chunks, self_signed, until, wait_until
from vllm_nnrp_plugin.client import (
    AsyncNNRPTransport,
    AuthenticationFailed,
    ClientAddressError,
    ClientConnectionError,
    NNRPTransport,
    connect,
)
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.codecs import SESSION_ERROR_AUTH_FAILED
from vllm_nnrp_plugin.nnrp_wire.framing import HEADER_LENGTH, PacketBoundary, split_packets
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

KEY = "sk-carrier-key-0123"
STREAM = envelope({"model": "a-stream-text", "messages": [], "stream": True})
#: a stream that runs for about a second unless stopped
SLOW = envelope({"model": "a-stream-text", "messages": [], "stream": True, "pace_s": 0.05, "repeat": 2})
EXPECTED = "".join(c["choices"][0]["delta"]["content"] for c in recorded_chunks("a-stream-text"))
SCHEMES = ["ws", "wss", "quic"]


def listen_addresses() -> tuple[str, ...]:
    return (f"ws://127.0.0.1:{free_port()}", f"wss://127.0.0.1:{free_port()}/nnrp", f"quic://127.0.0.1:{free_port()}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("carriers")
    cert, key, der = self_signed(tmp)
    return {"cert": cert, "key": key, "der": der, "other_der": self_signed(tmp, "other")[2]}


@pytest.fixture(scope="module")
def served(certs):
    served = ServedNNRP(listen_addresses(), api_keys=(KEY,), tls_cert_file=certs["cert"], tls_key_file=certs["key"])
    served.der = certs["der"]
    yield served
    served.stop()


def uri_of(served: ServedNNRP, scheme: str) -> str:
    (uri,) = [u for u in served.bound if u.startswith(f"{scheme}://")]
    return uri


def run(coro, timeout_s: float = 15.0):
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


async def text_of(session) -> str:
    events = [event async for event in session.submit(STREAM)]
    assert events[-1]["type"] == "response.completed"
    return "".join(e.get("delta", "") for e in events)


# -- against the project's server ------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_stream_equals_the_recorded_text(served, scheme):
    async def scenario():
        conn = await connect(uri_of(served, scheme), api_key=KEY, trusted_cert_der=served.der)
        try:
            alpn = conn.get_extra_info("alpn_protocol")
            ssl_object = conn.get_extra_info("ssl_object")
            return await text_of(await conn.open_session()), alpn, ssl_object and ssl_object.selected_alpn_protocol()
        finally:
            await conn.close()

    text, quic_alpn, tls_alpn = run(scenario())
    assert text == EXPECTED
    assert quic_alpn == ("nnrp/1" if scheme == "quic" else None)  # offered, and the plugin's server selects it
    assert tls_alpn == ("http/1.1" if scheme == "wss" else None)  # WebSocket runs over HTTP/1.1 (RFC 6455 §4.1)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_wrong_or_missing_key_is_refused_at_open_and_the_right_one_served(served, scheme):
    async def open_with(api_key):
        conn = await connect(uri_of(served, scheme), api_key=api_key, trusted_cert_der=served.der)  # connects
        try:
            return await text_of(await conn.open_session())
        finally:
            await conn.close()

    started = len(served.backend.started)
    for api_key in (None, "sk-wrong"):
        with pytest.raises(AuthenticationFailed) as refused:
            run(open_with(api_key))
        assert refused.value.session_error_code == SESSION_ERROR_AUTH_FAILED
    assert len(served.backend.started) == started  # refused before any model work
    assert run(open_with(KEY)) == EXPECTED


@pytest.mark.parametrize("scheme", SCHEMES)
def test_two_sessions_on_one_connection(served, scheme):
    async def scenario():
        conn = await connect(uri_of(served, scheme), api_key=KEY, trusted_cert_der=served.der)
        a, b = await asyncio.gather(conn.open_session(), conn.open_session())
        texts = await asyncio.gather(text_of(a), text_of(b), text_of(a))
        await a.close()
        last = await text_of(b)  # b goes on after a closed
        await conn.close()
        return a, b, texts, last

    a, b, texts, last = run(scenario())
    assert a.session_id != b.session_id
    assert texts == [EXPECTED] * 3 and last == EXPECTED


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cancel_ends_the_operation_and_aborts_its_request(served, scheme):
    async def scenario():
        conn = await connect(uri_of(served, scheme), api_key=KEY, trusted_cert_der=served.der)
        session = await conn.open_session()
        op = session.submit(SLOW)
        first = await op.__anext__()
        op.cancel()
        rest = [event async for event in op]
        after = await text_of(session)  # the session goes on
        await conn.close()
        return first, rest, after

    first, rest, after = run(scenario())
    assert first["type"] != "response.cancelled", first
    assert rest[-1]["type"] == "response.cancelled" and after == EXPECTED
    request_id = served.backend.started[-2]  # the cancelled one (the last is ``after``'s)
    assert wait_until(lambda: request_id in served.backend.aborted)


@pytest.mark.parametrize("scheme", ["wss", "quic"])
def test_an_untrusted_certificate_fails_the_connect(served, certs, scheme):
    with pytest.raises(ClientConnectionError) as failed:
        run(connect(uri_of(served, scheme), api_key=KEY, trusted_cert_der=certs["other_der"]))
    assert not isinstance(failed.value, ClientAddressError)
    assert "certificate" in str(failed.value) or "issuer" in str(failed.value)


@pytest.mark.parametrize("scheme", ["ws", "wss"])
def test_a_wrong_websocket_path_fails_the_connect(served, scheme):
    uri = uri_of(served, scheme).rsplit("/nnrp", 1)[0] + "/elsewhere"
    with pytest.raises(ClientConnectionError, match="404"):
        run(connect(uri, api_key=KEY, trusted_cert_der=served.der))


@pytest.mark.parametrize("uri", [f"ws://127.0.0.1:{free_port()}/nnrp", f"quic://127.0.0.1:{free_port()}"])
def test_nothing_listening_fails_the_connect_at_once(uri, certs):
    """TCP answers with a reset; QUIC's Initial with an ICMP port unreachable on the connected UDP socket."""
    with pytest.raises(ClientConnectionError):
        run(connect(uri, trusted_cert_der=certs["der"]), timeout_s=5)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_server_that_stops_ends_the_connection(certs, scheme):
    """The plugin's server stops (``service.stop()``): the running operation gets its terminal or fails, the
    connection is lost at once — the WebSocket's close 1001, QUIC's CONNECTION_CLOSE — and what follows fails."""
    served = ServedNNRP(listen_addresses(), api_keys=(KEY,), tls_cert_file=certs["cert"], tls_key_file=certs["key"])
    stopped = False

    async def scenario():
        nonlocal stopped
        conn = await connect(uri_of(served, scheme), api_key=KEY, trusted_cert_der=certs["der"])
        session = await conn.open_session()
        op = session.submit(SLOW)
        await op.__anext__()
        await asyncio.to_thread(served.stop)
        stopped = True
        try:
            terminal = await op.result()
        except ClientConnectionError as exc:
            terminal = exc
        await until(lambda: conn.lost, 2.0)  # the server's end reaches the client (asserted below)
        with pytest.raises(ClientConnectionError):
            await conn.open_session()
        await conn.close()
        return terminal, conn.lost

    try:
        terminal, lost = run(scenario())
    finally:
        if not stopped:
            served.stop()
    assert isinstance(terminal, ClientConnectionError) or terminal["type"] == "response.error"
    assert lost


class _TcpRelay:
    """Bytes both ways between clients and ``target``; :meth:`kill` drops every connection without a word (a
    server that vanished)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, up_writer]

        async def pipe(src, dst):
            while data := await src.read(65536):
                dst.write(data)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    def kill(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()


class _UdpRelay(asyncio.DatagramProtocol):
    """Datagrams both ways between one client and ``target``; :meth:`kill` closes both sockets (a server that
    vanished: the client's next datagram meets an ICMP port unreachable)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._client = None
        self._front: asyncio.DatagramTransport | None = None
        self._back: asyncio.DatagramTransport | None = None
        self.closed: list[asyncio.Future] = []  # each socket's close (asyncio closes it after close() returns)

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        relay = self

        self.closed = [loop.create_future(), loop.create_future()]

        class Back(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                relay._front.sendto(data, relay._client)

            def connection_lost(self, exc):
                relay.closed[1].set_result(None)

        self._back, _ = await loop.create_datagram_endpoint(Back, remote_addr=self._target)
        self._front, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        return self._front.get_extra_info("sockname")[1]

    def datagram_received(self, data, addr):
        self._client = addr
        self._back.sendto(data)

    def connection_lost(self, exc):
        self.closed[0].set_result(None)

    def kill(self) -> None:
        self._front.close()
        self._back.close()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_server_that_vanishes_fails_pending_operations(served, scheme):
    """No close frame, no CONNECTION_CLOSE: the relay in front of the server drops everything. Over TCP the
    client reads the end at once; over QUIC its next datagram (here: a new submit) finds nothing there."""
    host, port = uri_of(served, scheme).split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)

    async def scenario():
        relay = _UdpRelay((host, int(port))) if scheme == "quic" else _TcpRelay((host, int(port)))
        relayed = await relay.start()
        path = "/nnrp" if scheme != "quic" else ""
        conn = await connect(f"{scheme}://127.0.0.1:{relayed}{path}", api_key=KEY, trusted_cert_der=served.der)
        session = await conn.open_session()
        pending = session.submit(SLOW)
        await pending.__anext__()
        relay.kill()
        late = None
        if scheme == "quic":
            await asyncio.gather(*relay.closed)  # the relay's sockets are gone: nothing answers there
            with contextlib.suppress(ClientConnectionError):  # unless an ACK of the client's already met it
                late = session.submit(STREAM)  # goes out, meets the ICMP error
        failures = []
        for op in (pending, late):
            if op is not None:
                with pytest.raises(ClientConnectionError) as failed:
                    await op.result()
                failures.append(str(failed.value))
        with pytest.raises(ClientConnectionError):
            session.submit(STREAM)
        assert conn.lost
        await conn.close()
        return failures

    failures = run(scenario(), timeout_s=10)
    assert failures and all(failures)


# -- addresses ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri",
    [
        "ws://127.0.0.1",
        "wss://:9401/nnrp",
        "quic://127.0.0.1:9402/nnrp",
        "quic://127.0.0.1:0",
        "ws://127.0.0.1:99999/nnrp",
        "udp://127.0.0.1:9400",
        "http://127.0.0.1:9400",
    ],
)
def test_an_unusable_address_is_a_client_address_error(uri):
    with pytest.raises(ClientAddressError) as raised:
        asyncio.run(connect(uri))
    assert isinstance(raised.value, ClientConnectionError)
    if uri.startswith(("udp", "http")):
        assert "ws://HOST:PORT[/PATH]" in str(raised.value) and "quic://HOST:PORT" in str(raised.value)
    with pytest.raises(ValueError):
        NNRPTransport(uri)


def test_the_openai_transports_take_every_carrier(served):
    import openai

    for scheme in SCHEMES:
        NNRPTransport(uri_of(served, scheme))  # accepted

    async def ask(uri: str) -> str:
        import httpx

        transport = AsyncNNRPTransport(uri, trusted_cert_der=served.der)
        async with openai.AsyncOpenAI(
            base_url="http://nnrp.invalid/v1",
            api_key=KEY,
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        ) as sdk:
            stream = await sdk.chat.completions.create(model="a-stream-text", messages=[], stream=True)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

    assert run(ask(uri_of(served, "quic"))) == EXPECTED


def test_the_command_line_sends_its_key_over_quic(served, certs):
    uri = uri_of(served, "quic")
    command = [
        sys.executable,
        "-m",
        "vllm_nnrp_plugin.client.cli",
        "chat",
        "--endpoint",
        uri,
        "--tls-ca",
        certs["cert"],
        "--model",
        "a-stream-text",
        "--timeout",
        "10",
        "hi",
    ]

    def chat(api_key: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*command[:4], "--api-key", api_key, *command[4:]], capture_output=True, text=True, cwd=ROOT, timeout=60
        )

    ok = chat(KEY)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(EXPECTED)
    refused = chat("sk-wrong")
    assert refused.returncode == 2 and "refused" in refused.stderr


@pytest.mark.parametrize("trusted", ["both", "other"])
def test_the_command_line_over_a_fleet_trusts_every_certificate_of_its_ca_file(served, certs, tmp_path, trusted):
    """``--tls-ca`` naming a PEM bundle over a fleet (``wss`` and ``quic`` replicas of one server): the server's
    certificate second in the bundle is trusted, as on one address; a bundle without it is exit 2."""
    import ssl

    other = ssl.DER_cert_to_PEM_cert(certs["other_der"])
    bundle = tmp_path / "bundle.pem"
    bundle.write_text(other + (open(certs["cert"]).read() if trusted == "both" else ""))
    fleet = f"{uri_of(served, 'wss')},{uri_of(served, 'quic')}"
    command = ["--endpoint", fleet, "--tls-ca", str(bundle), "--api-key", KEY, "--model", "a-stream-text"]
    done = subprocess.run(
        [sys.executable, "-m", "vllm_nnrp_plugin.client.cli", "chat", *command, "--timeout", "10", "hi"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    if trusted == "both":
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(EXPECTED)
    else:
        assert done.returncode == 2 and "cannot reach the fleet" in done.stderr, done.stderr


# -- the WebSocket mapping against a scripted server -------------------------------------------------------------


def test_packets_are_split_and_boundaries_tracked():
    def packet(meta: bytes, body: bytes) -> bytes:
        header = bytearray(HEADER_LENGTH)
        header[12:20] = len(meta).to_bytes(4, "little") + len(body).to_bytes(4, "little")
        return bytes(header) + meta + body

    packets = [packet(b"m" * 8, b""), packet(b"", b"b" * 300), packet(b"x" * 3, b"y" * 70000)]
    assert split_packets(b"".join(packets)) == packets
    assert split_packets(packets[1]) == [packets[1]]
    stream = b"".join(packets)
    for cut in (1, 7, 39, 40, 41, 48, 49, 388, 70001):
        boundary = PacketBoundary()
        boundary.feed(stream[:cut])
        boundary.feed(stream[cut : cut + 11])
        boundary.feed(stream[cut + 11 :])
        assert boundary.at_boundary
        partial = PacketBoundary()
        partial.feed(stream[:cut])
        assert partial.at_boundary == (cut in (48, 388))


class _ScriptedWebSocket:
    """One WebSocket server connection: wsproto's server, the project's sans-IO server core behind it (sessions
    accepted). ``misbehave``: ``"ping"`` sends a ping first; ``"text"`` answers the first submit with a text
    message; ``"split"`` sends the SESSION_OPEN_ACK in two messages. ``got``: the wsproto events received."""

    def __init__(self, misbehave: str | None) -> None:
        self.misbehave = misbehave
        self.got: list[object] = []
        self._ws = WSConnection(ConnectionType.SERVER)
        self._core = ServerConnection(max_in_flight_per_session=4)

    async def serve(self, reader, writer) -> None:
        while data := await reader.read(65536):
            self._ws.receive_data(data)
            for event in self._ws.events():
                self.got.append(event)
                if isinstance(event, Request):
                    writer.write(self._ws.send(AcceptConnection()))
                    if self.misbehave == "ping":
                        writer.write(self._ws.send(Ping(payload=b"are you there")))
                elif isinstance(event, BytesMessage):
                    for nnrp in self._core.receive_data(event.data):
                        if isinstance(nnrp, ev.SessionOpenRequested):
                            self._core.accept_session(nnrp.request)
                        elif isinstance(nnrp, ev.OperationSubmitted) and self.misbehave == "text":
                            writer.write(self._ws.send(TextMessage(data="not NNRP")))
                    out = self._core.data_to_send()
                    for packet in split_packets(out) if out else ():
                        if self.misbehave == "split" and len(self.got) > 2:
                            pieces = [packet[:50], packet[50:]]
                        else:
                            pieces = [packet]
                        for piece in pieces:
                            writer.write(self._ws.send(BytesMessage(data=piece)))
                elif isinstance(event, CloseConnection):
                    writer.write(self._ws.send(event.response()))
                    writer.close()
                    return
        writer.close()


@pytest.mark.parametrize("misbehave", [None, "ping", "text", "split"])
def test_the_websocket_mapping_against_a_scripted_server(misbehave):
    scripted = _ScriptedWebSocket(misbehave)

    async def scenario():
        server = await asyncio.start_server(scripted.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = await connect(f"ws://127.0.0.1:{port}")  # the default path
        outcome = None
        try:
            session = await conn.open_session()
            op = session.submit({"n": 1})
            await asyncio.wait_for(op.result(), 0.3)  # the scripted server never answers a submit
        except (ClientConnectionError, TimeoutError) as exc:
            outcome = exc
        await conn.close()
        server.close()
        return outcome

    outcome = run(scenario(), timeout_s=10)
    request = scripted.got[0]
    assert isinstance(request, Request) and request.target == "/nnrp" and not request.subprotocols
    assert not request.extensions
    closes = [e for e in scripted.got if isinstance(e, CloseConnection)]
    if misbehave in (None, "ping"):
        assert isinstance(outcome, TimeoutError)  # nothing went wrong on the wire
        assert closes[0].code == 1005  # a close frame without a status code, as the native client's
        assert (misbehave == "ping") == any(isinstance(e, Pong) and e.payload == b"are you there" for e in scripted.got)
    else:
        code = 1003 if misbehave == "text" else 1002
        assert isinstance(outcome, ClientConnectionError) and f"({code})" in str(outcome)
        assert closes[0].code == code

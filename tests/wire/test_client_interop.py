"""Our asyncio client (``vllm_nnrp_plugin.client.aio.connection``) against nnrp-py's NATIVE server, over TCP, a unix
socket, WebSocket (``ws://…/nnrp``, ``wss://…/nnrp``) and QUIC (the TLS ones with a self-signed certificate the
client trusts): hello, open, submit -> partial results -> RESULT_PUSH, FRAME_CANCEL -> RESULT_DROP_REASON (also
by cancelling the task that iterates), two sessions on one connection, close; and connection loss."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading

import orjson
import pytest
from nnrp.core import MessageType, PayloadKind, ResultFlags, ResultPushMetadata, TransportPolicy
from nnrp.native import NativeRuntimeError, NativeTransportServerSecurity, NativeWouldBlockError
from nnrp.runtime import PartialResultMetadata, ResultDropReasonCode, ResultDropReasonMetadata, RuntimeRole
from nnrp.server import (
    NativeServerBootstrapOptions,
    NativeServerProviderRoute,
    NativeServerSessionOptions,
    listen_native_server,
)

from tests.support import self_signed, wait_until
from tests.wire.native_accept import Acceptor
from vllm_nnrp_plugin.client import ClientConnectionError, connect
from vllm_nnrp_plugin.contract import wire_mapping

DATA = pathlib.Path(__file__).parent / "data" / "captures"
CANCELLED = b'{"type":"response.cancelled","reason":"client"}'


class NativeEcho:
    """nnrp-py's native server on its own thread and event loop. A submit ``{"n": N, "hold": bool}`` gets N
    ``response.output_text.delta`` partial results, then ``response.completed`` — or, with ``hold``, waits
    for the client's FRAME_CANCEL and answers it with RESULT_DROP_REASON PEER_CANCELLED."""

    #: per carrier: nnrp-py's carrier name, its provider route, the policy that forces it, TLS (nnrp-sdk notes §2)
    CARRIERS = {
        "tcp": ("tcp", "tcp://127.0.0.1:0", TransportPolicy.FORCE_TCP, False),
        "ipc": ("ipc", "unix://{tmp}/native.sock", TransportPolicy.FORCE_IPC, False),
        "ws": ("websocket", "ws://127.0.0.1:0/nnrp", TransportPolicy.FORCE_WEBSOCKET, False),
        "wss": ("websocket", "wss://127.0.0.1:0/nnrp", TransportPolicy.FORCE_WEBSOCKET, True),
        "quic": ("quic", "quic://127.0.0.1:0", TransportPolicy.FORCE_QUIC, True),
    }

    def __init__(self, carrier: str, tmp_path) -> None:
        transport, provider, policy, tls = self.CARRIERS[carrier]
        security = None
        #: the certificate (DER) a client must trust on a TLS carrier (self-signed for 127.0.0.1 here)
        self.der: bytes | None = None
        if tls:
            security, self.der = _native_security(tmp_path)
        route = NativeServerProviderRoute(provider_endpoint=provider.format(tmp=tmp_path), security=security)
        self._options = NativeServerBootstrapOptions(
            endpoint="nnrps://127.0.0.1" if tls and transport != "quic" else "nnrp://127.0.0.1",
            provider_routes={transport: route},
            transport_policy=policy,
            session_defaults=NativeServerSessionOptions(),
        )
        self._transport = transport
        #: nnrp-py's name of the carrier each accepted session used (``active_transport_name``)
        self.carriers_seen: set[str] = set()
        self._ready = threading.Event()
        self._stop = False
        self.closed_sessions = 0
        self.uri = ""
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "native server did not start"

    def close(self) -> None:
        self._stop = True
        self._thread.join(30)

    async def _serve(self) -> None:
        try:
            await self._loop_until_stopped()
        except NativeRuntimeError:  # closing sessions the client already closed: nothing to release
            pass

    async def _loop_until_stopped(self) -> None:
        with listen_native_server(self._options) as server:
            bound = server.bound_provider_endpoints[self._transport].uri
            self.uri = str(getattr(bound, "uri", bound))
            self._ready.set()
            sessions, held = [], {}
            # The Acceptor keeps its accept ticket across deadlines: nnrp-py's own
            # NativeServer.accept gives it up at each one and loses a session whose handshake straddles it.
            acceptor = Acceptor(server)
            accept = asyncio.ensure_future(asyncio.to_thread(acceptor.accept, 50))
            while not self._stop:
                if accept.done():
                    try:
                        sessions.append(accept.result())
                        self.carriers_seen.add(sessions[-1].active_transport_name)
                    except NativeWouldBlockError:
                        pass
                    accept = asyncio.ensure_future(asyncio.to_thread(acceptor.accept, 50))
                for session in list(sessions):
                    try:
                        polled = session.poll_events(max_events=16, timeout_ms=1)
                    except NativeRuntimeError:
                        continue
                    for event in polled:
                        if not await self._handle(session, event, held):
                            sessions.remove(session)
                            with contextlib.suppress(NativeRuntimeError):  # the client already went away
                                session.close()
                            self.closed_sessions += 1
                await asyncio.sleep(0.001)  # the native sessions are polled (no wake-up on this loop)
            with contextlib.suppress(NativeWouldBlockError):
                await accept  # not cancelled: the thread would still hold the native accept

    async def _handle(self, session, event, held) -> bool:
        submit = event.as_submit()
        if submit is not None:
            meta = submit.submit.metadata.value
            request = orjson.loads(
                wire_mapping.unwrap_typed_body(
                    int(meta.payload_kind_bitmap), meta.payload_frame_count, submit.submit.tail.body
                )
            )
            for seq in range(1, request["n"] + 1):
                body = orjson.dumps({"type": "response.output_text.delta", "delta": f"t{seq}"})
                await submit.send_partial_result(
                    PartialResultMetadata(submit.operation_id, seq, 0, seq, len(body), 0), body
                )
            if request.get("hold"):
                held[id(session), submit.frame_id] = submit
            else:
                await submit.send_result(
                    _push_metadata(), wire_mapping.typed_body(b'{"type":"response.completed","n":%d}' % request["n"])
                )
            return True
        runtime = event.as_runtime()
        if runtime is None:
            return True
        kind = runtime.header.message_type
        if kind is MessageType.FRAME_CANCEL:
            op = held.pop((id(session), runtime.header.frame_id))
            drop = ResultDropReasonMetadata(
                op.operation_id, 0, ResultDropReasonCode.PEER_CANCELLED, RuntimeRole.SERVER, 0, len(CANCELLED)
            )
            await op.send_result_drop(drop, CANCELLED)
        return kind is not MessageType.SESSION_CLOSE


def _native_security(tmp_path) -> tuple[NativeTransportServerSecurity, bytes]:
    """A self-signed certificate for 127.0.0.1 (``tests.support.self_signed``) as nnrp-py's native server takes
    it (DER certificate, PKCS#8 DER key), and the certificate's DER for the client to trust."""
    from cryptography.hazmat.primitives import serialization

    _, key_file, der = self_signed(tmp_path)
    key = serialization.load_pem_private_key(pathlib.Path(key_file).read_bytes(), password=None)
    pkcs8 = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return NativeTransportServerSecurity(certificate_der=der, private_key_pkcs8_der=pkcs8), der


def _push_metadata() -> ResultPushMetadata:
    return ResultPushMetadata(
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
    )


@pytest.fixture(scope="module", params=["tcp", "ipc", "ws", "wss", "quic"])
def native(request, tmp_path_factory):
    server = NativeEcho(request.param, tmp_path_factory.mktemp("native"))
    yield server
    server.close()


def run(coro, timeout_s: float = 20.0):
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


def test_open_submit_partials_push_close(native):
    async def scenario():
        conn = await connect(native.uri, trusted_cert_der=native.der)
        session = await conn.open_session(max_in_flight_operations=4)
        op = session.submit({"n": 3})
        events = [event async for event in op]
        closed_before = native.closed_sessions
        await session.close()
        await conn.close()
        return session, op, events, closed_before

    session, op, events, closed_before = run(scenario())
    assert session.session_id >= 1 and (op.frame_id, op.operation_id) == (1, 1) and op.status_code == 200
    assert events == [
        {"type": "response.output_text.delta", "delta": "t1"},
        {"type": "response.output_text.delta", "delta": "t2"},
        {"type": "response.output_text.delta", "delta": "t3"},
        {"type": "response.completed", "n": 3},
    ]
    assert wait_until(lambda: native.closed_sessions > closed_before)  # the native server saw SESSION_CLOSE
    assert native.carriers_seen == {native._transport}  # over the carrier asked for, nothing else


def test_frame_cancel_gets_the_drop_reason(native):
    async def scenario():
        conn = await connect(native.uri, trusted_cert_der=native.der)
        session = await conn.open_session(max_in_flight_operations=4)
        op = session.submit({"n": 1, "hold": True})
        first = await op.__anext__()
        op.cancel()
        rest = [event async for event in op]
        after = await session.submit({"n": 0}).result()  # the session goes on
        await conn.close()
        return op, first, rest, after

    op, first, rest, after = run(scenario())
    assert first["type"] == "response.output_text.delta"
    assert rest == [orjson.loads(CANCELLED)] and op.drop_reason_code == ResultDropReasonCode.PEER_CANCELLED
    assert after == {"type": "response.completed", "n": 0}


def test_cancelling_the_iterating_task_sends_frame_cancel(native):
    async def scenario():
        conn = await connect(native.uri, trusted_cert_der=native.der)
        session = await conn.open_session(max_in_flight_operations=4)
        op = session.submit({"n": 1, "hold": True})
        seen = asyncio.Event()

        async def consume():
            async for _ in op:
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        terminal = await op.result()  # FRAME_CANCEL went out: the server's drop arrives
        await conn.close()
        return terminal

    assert run(scenario()) == orjson.loads(CANCELLED)


def test_two_sessions_on_one_connection(native):
    async def scenario():
        conn = await connect(native.uri, trusted_cert_der=native.der)
        a, b = await asyncio.gather(
            conn.open_session(max_in_flight_operations=4), conn.open_session(max_in_flight_operations=4)
        )
        ops = [s.submit({"n": n}) for s in (a, b) for n in (2, 5)]
        results = await asyncio.gather(*(op.result() for op in ops))
        await a.close()
        last = await b.submit({"n": 1}).result()  # b still works after a closed
        await conn.close()
        return a, b, ops, results, last

    a, b, ops, results, last = run(scenario())
    assert a.session_id != b.session_id
    assert [(op.session.session_id, op.frame_id) for op in ops] == [
        (a.session_id, 1),
        (a.session_id, 2),
        (b.session_id, 1),
        (b.session_id, 2),
    ]
    assert [r["n"] for r in results] == [2, 5, 2, 5] and last["n"] == 1


def test_connection_loss_fails_pending_operations(tmp_path):
    """A server that answers the handshake from the tcp-basic capture, takes a submit, then hangs up."""
    records = [orjson.loads(line) for line in (DATA / "tcp-basic.jsonl").read_text().splitlines()]
    handshake = b"".join(bytes.fromhex(r["hex"]) for r in records if r["dir"] == "s2c" and "hex" in r)[
        : (40 + 80) + (40 + 56)
    ]

    async def scenario():
        async def handler(reader, writer):
            await reader.readexactly(104 + 88)  # CLIENT_HELLO + SESSION_OPEN
            writer.write(handshake)  # SERVER_HELLO_ACK + SESSION_OPEN_ACK (session 7)
            await reader.readexactly(40 + 72)  # a FRAME_SUBMIT's header and metadata
            writer.close()

        server = await asyncio.start_unix_server(handler, str(tmp_path / "raw.sock"))
        conn = await connect(f"unix://{tmp_path}/raw.sock")
        session = await conn.open_session()
        op = session.submit({"n": 1})
        with pytest.raises(ClientConnectionError):
            await op.result()
        with pytest.raises(ClientConnectionError):
            session.submit({"n": 1})
        await conn.close()
        server.close()

    run(scenario())

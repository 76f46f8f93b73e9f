"""Authentication in the wire cores, with plain bytes: the hello's and the session open's auth blocks, the
``auth_status`` verdict, ``auth_failed`` refusals before any session exists, and malformed blocks."""

from __future__ import annotations

import pytest
from nnrp.core.enums import MessageType as T
from nnrp.core.messages.control import ClientHelloMetadata, ServerHelloAckMetadata, SessionOpenMetadata

from vllm_nnrp_plugin.contract import auth_block
from vllm_nnrp_plugin.nnrp_binding.authentication import APIKeys, authenticator_for
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.nnrp_wire.client import ClientConnection
from vllm_nnrp_plugin.nnrp_wire.codecs import SESSION_ERROR_AUTH_FAILED, SessionOpenAckMetadata
from vllm_nnrp_plugin.nnrp_wire.framing import Packet, PacketReader, encode
from vllm_nnrp_plugin.nnrp_wire.server import ServerConnection

KEYS = APIKeys(["sk-one", "sk-two"])


def packets(data: bytes) -> list[Packet]:
    return PacketReader().feed(data)


def exchange(server: ServerConnection, client: ClientConnection) -> tuple[list, list]:
    """Client bytes → server, server bytes → client; both sides' events."""
    server_events = server.receive_data(client.data_to_send())
    client_events = client.receive_data(server.data_to_send())
    return server_events, client_events


def hello_packet(
    block: bytes = b"", *, auth_bytes: int | None = None, body: bytes | None = None, ext: int = 0
) -> bytes:
    meta = ClientHelloMetadata(
        1,
        1,
        1,
        0x3,
        0x73,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        1,
        0,
        0,
        0,
        500,
        0,
        0,
        0,
        len(block) if auth_bytes is None else auth_bytes,
        ext,
    )
    return encode(T.CLIENT_HELLO, 0, 0, meta.pack(), block if body is None else body)


def open_packet(block: bytes = b"", *, token: bytes = b"") -> bytes:
    meta = SessionOpenMetadata(0, 2, 1, 0x01 if token else 0, 4097, 3, 500, 4, 30000, len(token), len(block), 0, 0)
    return encode(T.SESSION_OPEN, 0, 0, meta.pack(), token + block)


def hello_ack(server: ServerConnection) -> ServerHelloAckMetadata:
    (ack,) = packets(server.data_to_send())
    assert ack.msg_type == T.SERVER_HELLO_ACK
    return ServerHelloAckMetadata.unpack(ack.meta)


# -- the block's encoding --------------------------------------------------------------------------------------


def test_the_block_is_the_authorization_header_value() -> None:
    assert auth_block.bearer_block("sk-one") == b"Bearer sk-one"
    assert auth_block.block_of_authorization("Bearer sk-one") == b"Bearer sk-one"
    assert auth_block.block_of_authorization("Bearer ") == b""  # the SDK's api_key="" sends no key
    assert auth_block.block_of_authorization(None) == b""
    assert auth_block.bearer_key(b"bEaReR sk-one") == "sk-one"  # the scheme is case-insensitive, as vLLM's
    for bad in (b"Basic abc", b"Bearersk-one", b"\xff\xfe", b"Bearer " + b"k" * auth_block.MAX_AUTH_BYTES):
        with pytest.raises(auth_block.AuthBlockError):
            auth_block.bearer_key(bad)
    for key in ("", "a\nb", "k" * auth_block.MAX_AUTH_BYTES):
        with pytest.raises(auth_block.AuthBlockError):
            auth_block.bearer_block(key)


def test_the_key_check_is_vllms_and_never_shows_a_key() -> None:
    assert KEYS(b"Bearer sk-one") and KEYS(b"Bearer sk-two")
    assert not KEYS(b"Bearer sk-on") and not KEYS(b"Bearer sk-one ") and not KEYS(b"Bearer ")
    assert "sk-" not in repr(KEYS)
    with pytest.raises(ValueError):
        APIKeys(["", ""])
    assert authenticator_for("tcp", KEYS) is KEYS and authenticator_for("ipc", KEYS) is None


def test_every_key_is_compared_in_constant_time_whatever_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's loop: each digest goes through ``secrets.compare_digest``, even after a match (no early exit)."""
    import vllm_nnrp_plugin.nnrp_binding.authentication as authentication

    calls = []
    real = authentication.secrets.compare_digest
    monkeypatch.setattr(authentication.secrets, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    keys = APIKeys(["a", "b", "c"])
    assert keys(b"Bearer a") and len(calls) == 3
    assert not keys(b"Bearer z") and len(calls) == 6


# -- the server core ---------------------------------------------------------------------------------------------


def test_without_keys_nothing_changes_and_a_presented_key_is_ignored() -> None:
    server = ServerConnection(max_in_flight_per_session=4)
    client = ClientConnection(auth_block=b"Bearer whatever")
    client.open_session()
    server_events, client_events = exchange(server, client)
    assert [type(e) for e in server_events] == [ev.SessionOpenRequested]
    assert client.auth_status == auth_block.AUTH_STATUS_NOT_REQUIRED
    server.accept_session(server_events[0].request)
    assert [type(e) for e in client.receive_data(server.data_to_send())] == [ev.SessionOpenAccepted]


@pytest.mark.parametrize(
    ("block", "status", "presented"),
    [
        (b"", auth_block.AUTH_STATUS_MISSING, False),
        (b"Bearer wrong", auth_block.AUTH_STATUS_REJECTED, True),
    ],
)
def test_a_connection_without_a_valid_key_opens_no_session(block: bytes, status: int, presented: bool) -> None:
    server = ServerConnection(max_in_flight_per_session=4, authenticate=KEYS)
    client = ClientConnection(auth_block=block)
    client.open_session()
    server_events, client_events = exchange(server, client)
    assert server_events == [ev.AuthenticationFailed(presented)]  # never a SessionOpenRequested: no model work
    assert client.auth_status == status
    (refusal,) = client_events
    assert isinstance(refusal, ev.SessionOpenRejected) and refusal.session_error_code == SESSION_ERROR_AUTH_FAILED
    assert "wrong" not in refusal.diagnostic
    assert server.sessions == 0 and not server.ended  # the connection goes on: the client may try again


def test_a_valid_key_in_the_hello_opens_every_session_of_the_connection() -> None:
    server = ServerConnection(max_in_flight_per_session=4, authenticate=KEYS)
    client = ClientConnection(auth_block=auth_block.bearer_block("sk-two"))
    client.open_session()
    client.open_session()
    server_events, _ = exchange(server, client)
    assert client.auth_status == auth_block.AUTH_STATUS_ACCEPTED
    assert [type(e) for e in server_events] == [ev.SessionOpenRequested, ev.SessionOpenRequested]


def test_a_session_open_may_carry_its_own_key() -> None:
    """After a hello without a key, a SESSION_OPEN whose block (after the resume token) holds a key opens."""
    server = ServerConnection(max_in_flight_per_session=4, authenticate=KEYS)
    server.receive_data(hello_packet())
    assert hello_ack(server).auth_status == auth_block.AUTH_STATUS_MISSING
    events = server.receive_data(open_packet(b"Bearer sk-one"))
    assert [type(e) for e in events] == [ev.SessionOpenRequested]
    events = server.receive_data(open_packet(b"Bearer nope"))
    assert events == [ev.AuthenticationFailed(True)]
    (ack,) = packets(server.data_to_send())
    assert SessionOpenAckMetadata.unpack(ack.meta).session_error_code == SESSION_ERROR_AUTH_FAILED


def test_an_authenticated_hello_does_not_excuse_a_wrong_key_in_the_open() -> None:
    server = ServerConnection(max_in_flight_per_session=4, authenticate=KEYS)
    server.receive_data(hello_packet(b"Bearer sk-one"))
    assert hello_ack(server).auth_status == auth_block.AUTH_STATUS_ACCEPTED
    assert server.receive_data(open_packet(b"Bearer nope")) == [ev.AuthenticationFailed(True)]


@pytest.mark.parametrize(
    "hello",
    [
        hello_packet(b"Basic abc"),  # not the bearer scheme
        hello_packet(b"Bearer \xff"),  # not UTF-8
        hello_packet(b"Bearer " + b"k" * auth_block.MAX_AUTH_BYTES),  # oversized
        hello_packet(b"Bearer sk-one", auth_bytes=5),  # body and auth_bytes disagree
        hello_packet(auth_bytes=12),  # declared, absent
        hello_packet(b"Bearer sk-one", ext=4, body=b"\0\0\0\0Bearer sk-one"),  # a control extension
    ],
)
def test_a_malformed_hello_block_ends_the_connection_with_nothing_sent(hello: bytes) -> None:
    server = ServerConnection(max_in_flight_per_session=4, authenticate=KEYS)
    (ended,) = server.receive_data(hello)
    assert isinstance(ended, ev.ConnectionEnded) and ended.error
    assert "sk-one" not in ended.error
    assert server.data_to_send() == b"" and server.ended


def test_auth_bytes_in_a_session_open_when_no_key_is_required_end_the_connection() -> None:
    server = ServerConnection(max_in_flight_per_session=4)
    server.receive_data(hello_packet())
    hello_ack(server)
    (ended,) = server.receive_data(open_packet(b"Bearer sk-one"))
    assert isinstance(ended, ev.ConnectionEnded) and "requires no authentication" in ended.error


def test_a_malformed_session_open_block_ends_the_connection() -> None:
    server = ServerConnection(max_in_flight_per_session=4, authenticate=KEYS)
    server.receive_data(hello_packet())
    hello_ack(server)
    (ended,) = server.receive_data(open_packet(b"Token abc"))
    assert isinstance(ended, ev.ConnectionEnded) and server.ended

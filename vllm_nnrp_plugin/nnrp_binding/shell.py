"""What the asyncio shells of an accepted socket (:class:`.stream.StreamConnection`,
:class:`.websocket.WebSocketConnection`) share: the transport ``loop.connect_accepted_socket`` makes of the socket
(TLS by asyncio for ``nnrps`` / ``wss``), set up as every connection over it wants it (:func:`prepare`), and the
parts of the :class:`.connection.Carrier` that are that transport's own (abort, hold input, closing, unread bytes).
Reading and sending are each shell's (its carrier's mapping), written there without a layer between the transport
and the NNRP connection.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios

from vllm_nnrp_plugin.nnrp_binding.connection import WRITE_HIGH_WATER, WRITE_LOW_WATER, NNRPConnection


class SocketShell(asyncio.Protocol):
    """The ``asyncio.Protocol`` of one accepted socket, and its NNRP connection's :class:`.connection.Carrier`
    but for what a subclass writes in its carrier's terms: reading (``data_received``, ``eof_received``) and
    sending (``send``, ``end``). ``nnrp``: the NNRP connection; ``first``: bytes the listener read from the
    socket as it accepted it, taken as the connection's first read; ``tcp_nodelay``: set TCP_NODELAY."""

    def __init__(self, nnrp: NNRPConnection, *, first: bytes = b"", tcp_nodelay: bool = True) -> None:
        self.nnrp = nnrp
        self._first = first
        self._tcp_nodelay = tcp_nodelay
        self._transport: asyncio.Transport | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream protocol gets a Transport
        prepare(transport, self._tcp_nodelay)
        self.nnrp.attach(self)
        first, self._first = self._first, b""
        if first and not transport.is_closing():
            self.data_received(first)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.nnrp.lost()

    def pause_writing(self) -> None:
        self.nnrp.pause_writing()

    def resume_writing(self) -> None:
        self.nnrp.resume_writing()

    # -- the NNRP connection's carrier ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        raise NotImplementedError  # the carrier's mapping: each subclass's

    def end(self, cause: str) -> None:
        raise NotImplementedError  # the carrier's goodbye: each subclass's

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def hold_input(self, held: bool) -> None:
        if self._transport is not None:
            if held:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def is_closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def unread_bytes(self) -> int:
        return unread_bytes(self._transport)


def prepare(transport: asyncio.BaseTransport, tcp_nodelay: bool) -> None:
    """An accepted socket's transport as every connection over it wants it: the write buffer limits of
    :mod:`.connection`, and TCP_NODELAY on a TCP socket when ``tcp_nodelay``."""
    transport.set_write_buffer_limits(WRITE_HIGH_WATER, WRITE_LOW_WATER)  # type: ignore[attr-defined]  # a stream transport
    sock = transport.get_extra_info("socket")
    if tcp_nodelay and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def unread_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes received by the kernel on ``transport``'s socket and not read yet (``FIONREAD``, ioctl(2) /
    tcp(7) / unix(7)); 0 without a transport or a socket, or when the query fails."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    try:
        fd = sock.fileno() if sock is not None else -1
        if fd < 0:
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return 0

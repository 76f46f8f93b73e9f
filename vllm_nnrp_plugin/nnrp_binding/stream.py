"""The byte-stream carriers (``tcp://``, ``nnrps://``, ``unix://``) on vLLM's event loop: the asyncio shell of an
:class:`.connection.NNRPConnection` over the transport ``loop.connect_accepted_socket`` makes of an accepted
socket (TLS by asyncio for ``nnrps``). The stream's bytes are the NNRP stream, packets back to back (NNRP/1
common header, :mod:`vllm_nnrp_plugin.nnrp_wire.framing`): nothing to map. TCP_NODELAY is set on TCP sockets
(one write per loop iteration carries every packet decided in it); the transport's write buffer limits are
:data:`.connection.WRITE_HIGH_WATER` / :data:`.connection.WRITE_LOW_WATER`.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios

from vllm_nnrp_plugin.nnrp_binding.connection import WRITE_HIGH_WATER, WRITE_LOW_WATER, NNRPConnection


class StreamConnection(asyncio.Protocol):
    """The ``asyncio.Protocol`` of one accepted byte-stream connection, and its NNRP connection's
    :class:`.connection.Carrier`. ``nnrp``: the NNRP connection; ``first``: bytes the listener read from the
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

    def data_received(self, data: bytes) -> None:
        nnrp = self.nnrp
        nnrp.heard()
        if nnrp.feed(data):
            nnrp.read_done()

    def eof_received(self) -> bool:
        self.nnrp.end_of_stream()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.nnrp.lost()

    def pause_writing(self) -> None:
        self.nnrp.pause_writing()

    def resume_writing(self) -> None:
        self.nnrp.resume_writing()

    # -- the NNRP connection's carrier ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def end(self, cause: str) -> None:
        if self._transport is not None:
            self._transport.close()

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

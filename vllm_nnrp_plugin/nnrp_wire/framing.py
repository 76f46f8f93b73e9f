"""NNRP/1 packet framing: a byte stream in → whole packets out; one packet's fields in → its bytes out.

A connection carries packets back to back, each ``40-byte common header | metadata (meta_len) | body
(body_len)``, little-endian, with no preface, length prefix, padding or checksum (NNRP/1 common header,
nnrp-doc ``docs/en/common-header/index.md``; nnrp-rs ``crates/nnrp-core/src/header.rs``). The header is
nnrp-py's ``nnrp.core.header.HEADER_STRUCT`` (``<4sBBBBIIIIIHHQ``).

The reader rejects, in the order nnrp-rs' header parser does (``header.rs`` ``NnrpHeader::parse``): bad magic,
``version_major != 1``, ``wire_format != 0``, ``header_len != 40``, flag bits outside ``0x3f``
(``crates/nnrp-core/src/enums.rs`` ``HeaderFlags``), an unknown ``msg_type``; and a packet over
:data:`MAX_PACKET_BYTES` (header + metadata + body, ``crates/nnrp-runtime/src/transport.rs``), checked as soon
as the header is read, before its metadata and body are buffered. Each of these ends the connection: the
reader raises :class:`FramingError` and stays failed.

A carrier that cuts the stream into messages (WebSocket: one binary message per packet) walks the same headers
for the packets' lengths only: :func:`packet_length`, :func:`split_packets` (whole packets out of a run of them)
and :class:`PacketBoundary` (whether a received run ends between packets). Plain data: no sockets, threads or
clocks.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from nnrp.core.enums import MessageType
from nnrp.core.header import HEADER_LENGTH, HEADER_MAGIC, HEADER_STRUCT

__all__ = [
    "HEADER_LENGTH",
    "MAX_PACKET_BYTES",
    "FramingError",
    "Packet",
    "PacketBoundary",
    "PacketReader",
    "encode",
    "packet_length",
    "split_packets",
]

#: the largest packet (header + metadata + body, bytes) either native peer accepts; also what a server
#: advertises in SERVER_HELLO_ACK ``max_body_bytes``
MAX_PACKET_BYTES = 64 * 1024 * 1024
#: header flag bits NNRP/1 defines (ACK_REQUIRED … KEYFRAME); any other bit is a header error
HEADER_FLAG_MASK = 0x3F
KNOWN_MESSAGE_TYPES = frozenset(int(kind) for kind in MessageType)

_unpack_header = HEADER_STRUCT.unpack_from
_pack_header: Callable[..., bytes] = HEADER_STRUCT.pack
#: ``meta_len``, ``body_len`` (u32 little-endian) of a common header, at :data:`_LENGTHS_AT` from its start
_unpack_lengths = struct.Struct("<II").unpack_from
_LENGTHS_AT = 12


class FramingError(Exception):
    """The byte stream is not NNRP/1 (a header error or an oversized packet): the connection must end."""


class Packet:
    """One whole packet: the header's fields (``msg_type`` as an int, see ``nnrp.core.enums.MessageType``),
    ``meta`` (exactly ``meta_len`` bytes) and ``body`` (exactly ``body_len`` bytes)."""

    __slots__ = ("msg_type", "flags", "session_id", "frame_id", "view_id", "route_id", "trace_id", "meta", "body")

    def __init__(
        self,
        msg_type: int,
        flags: int,
        session_id: int,
        frame_id: int,
        view_id: int,
        route_id: int,
        trace_id: int,
        meta: bytes,
        body: bytes,
    ) -> None:
        self.msg_type = msg_type
        self.flags = flags
        self.session_id = session_id
        self.frame_id = frame_id
        self.view_id = view_id
        self.route_id = route_id
        self.trace_id = trace_id
        self.meta = meta
        self.body = body

    def __repr__(self) -> str:
        try:
            name = MessageType(self.msg_type).name
        except ValueError:
            name = hex(self.msg_type)
        return (
            f"Packet({name}, session={self.session_id}, frame={self.frame_id}, trace={self.trace_id:#x}, "
            f"flags={self.flags:#x}, meta={len(self.meta)} B, body={len(self.body)} B)"
        )


def encode(
    msg_type: int,
    session_id: int,
    frame_id: int,
    meta: bytes = b"",
    body: bytes = b"",
    *,
    trace_id: int = 0,
    flags: int = 0,
    view_id: int = 0,
    route_id: int = 0,
) -> bytes:
    """The bytes of one packet. Raises ``struct.error`` when a field does not fit its width."""
    return (
        _pack_header(
            HEADER_MAGIC,
            1,
            0,
            msg_type,
            HEADER_LENGTH,
            flags,
            len(meta),
            len(body),
            session_id,
            frame_id,
            view_id,
            route_id,
            trace_id,
        )
        + meta
        + body
    )


class PacketReader:
    """Reassembles packets from reads of any size. :meth:`feed` returns the packets completed by ``data``
    (possibly none); the rest waits for the next read. ``max_packet_bytes`` bounds one packet (bytes)."""

    __slots__ = ("_buffer", "_max", "_failed")

    def __init__(self, max_packet_bytes: int = MAX_PACKET_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_packet_bytes
        self._failed: FramingError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received that are not part of a returned packet yet."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Packet]:
        """Add ``data``; return the packets it completed, in order. Raises :class:`FramingError` (again on
        every later call) once the stream broke a header rule; packets completed before the bad one in the
        same ``data`` are lost with the connection."""
        if self._failed is not None:
            raise self._failed
        buffer = self._buffer
        buffer += data
        packets: list[Packet] = []
        offset = 0
        size = len(buffer)
        while size - offset >= HEADER_LENGTH:
            (
                magic,
                major,
                wire_format,
                msg_type,
                header_len,
                flags,
                meta_len,
                body_len,
                session_id,
                frame_id,
                view_id,
                route_id,
                trace_id,
            ) = _unpack_header(buffer, offset)
            error = _header_error(magic, major, wire_format, msg_type, header_len, flags, meta_len, body_len, self._max)
            if error is not None:
                self._failed = FramingError(error)
                del buffer[:]
                raise self._failed
            end = offset + HEADER_LENGTH + meta_len + body_len
            if end > size:
                break
            meta_end = offset + HEADER_LENGTH + meta_len
            packets.append(
                Packet(
                    msg_type,
                    flags,
                    session_id,
                    frame_id,
                    view_id,
                    route_id,
                    trace_id,
                    bytes(buffer[offset + HEADER_LENGTH : meta_end]),
                    bytes(buffer[meta_end:end]),
                )
            )
            offset = end
        if offset:
            del buffer[:offset]
        return packets


def _header_error(
    magic: bytes,
    major: int,
    wire_format: int,
    msg_type: int,
    header_len: int,
    flags: int,
    meta_len: int,
    body_len: int,
    max_packet_bytes: int,
) -> str | None:
    if magic != HEADER_MAGIC:
        return f"bad magic {magic!r} (expected {HEADER_MAGIC!r})"
    if major != 1:
        return f"unsupported version_major {major} (NNRP/1 is 1)"
    if wire_format != 0:
        return f"unsupported wire_format {wire_format} (NNRP/1 is 0)"
    if header_len != HEADER_LENGTH:
        return f"header_len {header_len} (must be {HEADER_LENGTH})"
    if flags & ~HEADER_FLAG_MASK:
        return f"unknown header flag bits {flags & ~HEADER_FLAG_MASK:#x}"
    if msg_type not in KNOWN_MESSAGE_TYPES:
        return f"unknown msg_type {msg_type:#04x}"
    if HEADER_LENGTH + meta_len + body_len > max_packet_bytes:
        return f"packet of {HEADER_LENGTH + meta_len + body_len} bytes exceeds {max_packet_bytes}"
    return None


def packet_length(data: bytes | bytearray | memoryview, offset: int = 0) -> int:
    """The length (bytes: header + ``meta_len`` + ``body_len``) of the packet whose common header starts at
    ``offset`` of ``data``. Nothing of the header is checked (that is :class:`PacketReader`'s). Raises
    ``struct.error`` when fewer than the 20 bytes up to ``body_len`` are there."""
    meta_len, body_len = _unpack_lengths(data, offset + _LENGTHS_AT)
    length: int = HEADER_LENGTH + meta_len + body_len  # HEADER_LENGTH: nnrp-py's, untyped
    return length


def split_packets(data: bytes) -> list[bytes]:
    """``data``, whole packets back to back (a wire core's ``data_to_send()``), as one ``bytes`` per packet
    (lengths from :func:`packet_length`). A trailing partial packet — which a core never queues — is returned as
    it is, as the last item."""
    end = len(data)
    if end < HEADER_LENGTH or packet_length(data) >= end:  # one packet: the usual write of a streamed token
        return [data]
    packets = []
    pos = 0
    while pos < end:
        if end - pos < HEADER_LENGTH:
            packets.append(data[pos:])
            break
        size = packet_length(data, pos)
        packets.append(data[pos : pos + size])
        pos += size
    return packets


class PacketBoundary:
    """Where a received run of bytes stands against packet boundaries, read from reads of any size:
    :attr:`at_boundary` is true between packets (where every WebSocket message must end, RFC 6455 messages
    carrying NNRP: :mod:`vllm_nnrp_plugin.carriers.websocket`)."""

    __slots__ = ("_head", "_rest")

    def __init__(self) -> None:
        self._head = bytearray()  # the header bytes of the packet being received, while fewer than 40
        self._rest = 0  # metadata + body bytes of the packet being received still to come

    @property
    def at_boundary(self) -> bool:
        return not self._rest and not self._head

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        pos, end = 0, len(data)
        while pos < end:
            if self._rest:
                step = min(self._rest, end - pos)
                self._rest -= step
                pos += step
                continue
            if not self._head and end - pos >= HEADER_LENGTH:  # a whole header at hand: no copy
                self._rest = packet_length(data, pos) - HEADER_LENGTH
                pos += HEADER_LENGTH
            else:
                take = min(HEADER_LENGTH - len(self._head), end - pos)
                self._head += data[pos : pos + take]
                pos += take
                if len(self._head) < HEADER_LENGTH:
                    return
                self._rest = packet_length(self._head) - HEADER_LENGTH
                self._head.clear()

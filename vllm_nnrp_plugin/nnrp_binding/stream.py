"""The byte-stream carriers (``tcp://``, ``nnrps://``, ``unix://``) on vLLM's event loop: the asyncio shell of an
:class:`.connection.NNRPConnection` over the transport ``loop.connect_accepted_socket`` makes of an accepted
socket (TLS by asyncio for ``nnrps``). The stream's bytes are the NNRP stream, packets back to back (NNRP/1
common header, :mod:`vllm_nnrp_plugin.nnrp_wire.framing`): nothing to map. TCP_NODELAY is set on TCP sockets
(one write per loop iteration carries every packet decided in it); the transport's write buffer limits are
:data:`.connection.WRITE_HIGH_WATER` / :data:`.connection.WRITE_LOW_WATER` (:mod:`.shell`).
"""

from __future__ import annotations

from vllm_nnrp_plugin.nnrp_binding.shell import SocketShell


class StreamConnection(SocketShell):
    """The ``asyncio.Protocol`` of one accepted byte-stream connection, and its NNRP connection's
    :class:`.connection.Carrier`. ``nnrp``: the NNRP connection; ``first``: bytes the listener read from the
    socket as it accepted it, taken as the connection's first read; ``tcp_nodelay``: set TCP_NODELAY."""

    # -- asyncio.Protocol ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        nnrp = self.nnrp
        nnrp.heard()
        if nnrp.feed(data):
            nnrp.read_done()

    def eof_received(self) -> bool:
        self.nnrp.end_of_stream()
        return False  # close the transport

    # -- the NNRP connection's carrier ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def end(self, cause: str) -> None:
        if self._transport is not None:
            self._transport.close()

"""NNRP listeners on vLLM's own event loop for the byte-stream carriers: ``tcp://HOST:PORT`` and
``unix:///ABS/PATH`` (plain, :func:`.endpoints.Carrier.own_wire`). Each address is one listening socket served
by ``loop.create_server`` / ``loop.create_unix_server``; every accepted connection is a
:class:`.stream_connection.ConnectionProtocol` speaking the project's own wire core. No thread, no poll: an
idle connection costs nothing but its socket.

The exposure rules are :mod:`.exposure`'s (the non-loopback warning, stale socket files removed, socket files
made owner-only or group-shared right after the bind); a bind failure raises :class:`~.exposure.ListenError`
naming the address, the cause and the fix, so ``vllm serve`` stops at start-up instead of running without a
listener. ``max_sessions`` bounds the sessions open over every connection of this listener plus
``other_sessions()`` (those of the native carriers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import urllib.parse
from collections.abc import Callable

from vllm_nnrp_plugin.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding import exposure
from vllm_nnrp_plugin.nnrp_binding.endpoints import Carrier
from vllm_nnrp_plugin.nnrp_binding.exposure import Exposure, ListenError
from vllm_nnrp_plugin.nnrp_binding.server_operation import SendProbe
from vllm_nnrp_plugin.nnrp_binding.handler import SessionHandler
from vllm_nnrp_plugin.nnrp_binding.stream_connection import ConnectionProtocol, FlushRound, SessionGate

#: pending connections the kernel queues per listening socket (a burst of clients connecting at once)
BACKLOG = 1024


class StreamListener:
    """Serves ``carriers`` (TCP and unix-socket :class:`~.endpoints.Carrier` s) until :meth:`close`."""

    def __init__(
        self,
        carriers: list[Carrier],
        handler: SessionHandler,
        *,
        max_sessions: int,
        session_limits: SessionLimits,
        exposure: Exposure = Exposure(),
        probe: SendProbe | None = None,
        tcp_nodelay: bool = True,
        other_sessions: Callable[[], int] = lambda: 0,
    ) -> None:
        self._carriers = carriers
        self._handler = handler
        self._limits = session_limits
        self._exposure = exposure
        self._probe = probe
        self._tcp_nodelay = tcp_nodelay
        self._gate = SessionGate(max_sessions, other_sessions)
        self._round: FlushRound | None = None  # made on the loop, by start()
        self._servers: list[asyncio.Server] = []
        self._connections: set[ConnectionProtocol] = set()
        self._socket_files: list[str] = []
        #: the bound addresses, in the order of ``carriers`` (``:0`` replaced by the real port)
        self.bound: list[str] = []

    @property
    def sessions(self) -> int:
        """Sessions open right now."""
        return self._gate.open

    async def start(self) -> list[str]:
        """Bind every address and start accepting. Raises :class:`ListenError`; binds nothing on failure."""
        self._round = FlushRound(asyncio.get_running_loop())
        try:
            for carrier in self._carriers:
                await self._bind(carrier)
        except BaseException:
            await self.close()
            raise
        return self.bound

    async def _bind(self, carrier: Carrier) -> None:
        exposure.before_bind(carrier, self._exposure)
        loop = asyncio.get_running_loop()
        if carrier.transport == "ipc":
            path = urllib.parse.urlsplit(carrier.provider_uri).path
            sock = _bound_socket(carrier, socket.AF_UNIX, path)
            self._socket_files.append(path)
            exposure.after_bind(carrier, self._exposure)
            server = await loop.create_unix_server(lambda: self._protocol("ipc"), sock=sock, backlog=BACKLOG)
            self.bound.append(carrier.uri)
        else:
            host = carrier.host or "127.0.0.1"
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            port = urllib.parse.urlsplit(carrier.provider_uri).port
            sock = _bound_socket(carrier, family, (host, port))
            server = await loop.create_server(lambda: self._protocol("tcp"), sock=sock, backlog=BACKLOG)
            bound_port = sock.getsockname()[1]
            configured = urllib.parse.urlsplit(carrier.uri)
            self.bound.append(configured._replace(netloc=f"{configured.netloc.rsplit(':', 1)[0]}:{bound_port}").geturl())
        self._servers.append(server)

    def _protocol(self, transport_name: str) -> ConnectionProtocol:
        connection = ConnectionProtocol(
            self._handler, transport_name=transport_name, limits=self._limits, gate=self._gate,
            flush_round=self._round, on_lost=self._connections.discard, probe=self._probe, tcp_nodelay=self._tcp_nodelay,
        )  # fmt: skip
        self._connections.add(connection)
        return connection

    def stop_accepting(self) -> None:
        """No new connection from now on; open ones go on until :meth:`close`."""
        for server in self._servers:
            server.close()

    async def close(self) -> None:
        """Stop accepting, end every connection (in-flight operations get ``server_shutdown``, what is queued
        is written first), unbind and remove the socket files."""
        self.stop_accepting()
        for connection in list(self._connections):
            connection.shut_down()
        self._servers.clear()
        for path in self._socket_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._socket_files.clear()


def _bound_socket(carrier: Carrier, family: int, address: object) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ListenError(
            f"cannot listen for NNRP on {carrier.uri}: {exc.strerror or exc}. Fix: free that address (is another "
            "server using it?) or choose another one with nnrp.listen / VLLM_NNRP_LISTEN."
        ) from None
    return sock

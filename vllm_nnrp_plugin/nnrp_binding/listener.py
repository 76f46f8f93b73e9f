"""NNRP listeners on vLLM's own event loop, one runtime for every carrier: ``tcp://HOST:PORT``,
``nnrps://HOST:PORT`` (TLS over TCP), ``unix:///ABS/PATH``, ``ws://`` / ``wss://HOST:PORT/PATH`` (WebSocket,
:mod:`.websocket`) and ``quic://HOST:PORT`` (:mod:`.quic`). Every connection is a
:class:`.connection.NNRPConnection` speaking the project's own wire core, attached to its carrier's asyncio shell
(:class:`.stream.StreamConnection`, :class:`.websocket.WebSocketConnection`, :class:`.quic.NNRPQuicConnection`):
over the transport ``loop.connect_accepted_socket`` makes of an accepted socket (with asyncio's TLS for ``nnrps``
and ``wss``: the certificate and key of ``nnrp.tls_cert_file`` / ``tls_key_file``,
:func:`.exposure.server_ssl_context`), or over the NNRP stream of a QUIC connection (aioquic on a UDP socket of the
loop). No thread, no poll: an idle connection costs nothing but its socket (or its QUIC state).

What a client can make the listener hold is bounded (:mod:`.bounds`, ``bounds``): a TLS handshake that has not
completed within the handshake timeout is abandoned by asyncio (``ssl_handshake_timeout``), and a connection
whose first session has not opened within the same time after that is closed by its protocol (on QUIC the
time runs from the client's first packet); incomplete packets share one budget of bytes; over
``max_connections`` (every carrier together) a new connection is closed at once; out of file descriptors,
accepting pauses for :data:`.bounds.ACCEPT_PAUSE_S` instead of spinning on a readable listening socket. Keys:
a network carrier's connections check vLLM's API keys (``keys``, :mod:`.authentication`); unix sockets never do.

Accepting is the listener's own (``loop.add_reader`` on the listening socket), not ``loop.create_server``'s:
one callback accepts every connection waiting and (plain carriers) reads the bytes each already sent (a client sends its
CLIENT_HELLO and SESSION_OPEN right after connecting), which the connection takes as its first read, so a
session can open without an I/O callback of its connection's own. uvloop, vLLM's loop, takes the GIL again for
every I/O callback, and while vLLM's tokenizer and chat-template executor threads serve a burst's first
requests each such callback waits for it: with one accept and one first read per connection, the last
sessions of a connect burst under load opened long after their TCP handshakes had completed
(``python -m bench load``, ``load.burst_under_load``; ``docs/benchmarks/README.md``, Load).

The exposure rules are :mod:`.exposure`'s (the non-loopback warning, stale socket files removed, socket files
made owner-only or group-shared right after the bind); a bind failure raises :class:`~.exposure.ListenError`
naming the address, the cause and the fix, so ``vllm serve`` stops at start-up instead of running without a
listener. ``max_sessions`` bounds the sessions open over every connection of this listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import urllib.parse
from typing import TYPE_CHECKING, Any

import attrs

from vllm_nnrp_plugin.contract.endpoints import ALPN_WEBSOCKET, Carrier
from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding import exposure
from vllm_nnrp_plugin.nnrp_binding.authentication import APIKeys, authenticator_for
from vllm_nnrp_plugin.nnrp_binding.bounds import ACCEPT_PAUSE_S, BufferBudget, CarrierBounds
from vllm_nnrp_plugin.nnrp_binding.connection import FlushRound, NNRPConnection, SessionGate
from vllm_nnrp_plugin.nnrp_binding.exposure import Exposure, ListenError
from vllm_nnrp_plugin.nnrp_binding.handler import SessionHandler
from vllm_nnrp_plugin.nnrp_binding.server_operation import SendProbe
from vllm_nnrp_plugin.nnrp_binding.stream import StreamConnection
from vllm_nnrp_plugin.nnrp_binding.websocket import WebSocketConnection, allowed_origins

if TYPE_CHECKING:
    from vllm_nnrp_plugin.nnrp_binding.quic import NNRPQuicServer

logger = logging.getLogger(__name__)

#: pending connections the kernel queues per listening socket (a burst of clients connecting at once)
BACKLOG = 1024
#: bytes read from a connection as it is accepted (a client's CLIENT_HELLO + SESSION_OPEN take 150)
FIRST_READ_BYTES = 64 * 1024


@attrs.frozen
class ListenerHooks:
    """Explicit hooks for benchmarks (``bench/server.py``): ``send_probe`` is told about each partial result
    queued and sent; ``tcp_nodelay=False`` leaves Nagle's algorithm on accepted TCP sockets."""

    send_probe: SendProbe | None = None
    tcp_nodelay: bool = True


class Listener:
    """Serves ``carriers`` (:class:`~vllm_nnrp_plugin.contract.endpoints.Carrier` s of every form) until
    :meth:`close`."""

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
        keys: APIKeys | None = None,
        bounds: CarrierBounds = CarrierBounds(),
    ) -> None:
        self._carriers = carriers
        self._keys = keys
        self._bounds = bounds
        self._budget = BufferBudget(bounds.max_buffered_bytes)
        self._paused_accepts: dict[int, asyncio.TimerHandle] = {}  # listening fd → its resume timer
        self._handler = handler
        self._limits = session_limits
        self._exposure = exposure
        self._probe = probe
        self._tcp_nodelay = tcp_nodelay
        self._gate = SessionGate(max_sessions)
        self._round: FlushRound | None = None  # made on the loop, by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening: list[socket.socket] = []  # read by the loop (add_reader) until stop_accepting
        self._adopting: set[asyncio.Task] = set()  # accepted sockets becoming transports (held: tasks are weak)
        self._closed = False
        self._refusing = False  # stop_accepting was called
        self._connections: set[NNRPConnection] = set()
        self._quic: list[NNRPQuicServer] = []  # bound QUIC addresses
        self._socket_files: list[str] = []
        #: the bound addresses, in the order of ``carriers`` (``:0`` replaced by the real port)
        self.bound: list[str] = []

    @property
    def sessions(self) -> int:
        """Sessions open right now."""
        return self._gate.open

    async def start(self) -> list[str]:
        """Bind every address and start accepting. Raises :class:`ListenError`; binds nothing on failure."""
        self._loop = asyncio.get_running_loop()
        self._round = FlushRound(self._loop)
        try:
            for carrier in self._carriers:
                await self._bind(carrier)
        except BaseException:
            await self.close()
            raise
        return self.bound

    async def _bind(self, carrier: Carrier) -> None:
        exposure.before_bind(carrier)
        tls = exposure.server_ssl_context(self._exposure) if carrier.tls else None
        if tls is not None and carrier.transport == "websocket":
            tls.set_alpn_protocols([ALPN_WEBSOCKET])
        if carrier.transport == "quic":
            await self._bind_quic(carrier)
        elif carrier.transport == "ipc":
            path = urllib.parse.urlsplit(carrier.provider_uri).path
            sock = _bound_socket(carrier, socket.AF_UNIX, path)
            self._socket_files.append(path)
            exposure.after_bind(carrier, self._exposure)
            self._listen(sock, carrier, tls)
            self.bound.append(carrier.uri)
        else:
            host = carrier.host or "127.0.0.1"
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            port = urllib.parse.urlsplit(carrier.provider_uri).port
            sock = _bound_socket(carrier, family, (host, port))
            self._listen(sock, carrier, tls)
            self.bound.append(_with_port(carrier.uri, sock.getsockname()[1]))

    async def _bind_quic(self, carrier: Carrier) -> None:
        """A UDP socket on the loop whose datagrams aioquic's server protocol takes (:mod:`.quic`, imported here:
        aioquic takes about 0.1 s to import, which a server without a QUIC address need not pay at start-up)."""
        from vllm_nnrp_plugin.nnrp_binding.quic import NNRPQuicServer, server_configuration

        configuration = server_configuration(self._exposure)
        door = _Door(None, carrier.label, None, authenticator_for(carrier.transport, self._keys))
        host = carrier.host or "127.0.0.1"
        port = urllib.parse.urlsplit(carrier.provider_uri).port
        assert port is not None  # parse_endpoint refuses a network address without a port
        try:
            transport, server = await self._loop.create_datagram_endpoint(  # type: ignore[union-attr]  # start() set it
                lambda: NNRPQuicServer(configuration, lambda: self._attach_quic(door)),
                local_addr=(host, port),
            )
        except OSError as exc:
            raise ListenError(
                f"cannot listen for NNRP on {carrier.uri}: {exc.strerror or exc}. Fix: free that UDP port (is another "
                "server using it?) or choose another address with nnrp.listen / VLLM_NNRP_LISTEN."
            ) from None
        self._quic.append(server)
        self.bound.append(_with_port(carrier.uri, transport.get_extra_info("sockname")[1]))

    def _attach_quic(self, door: _Door) -> NNRPConnection | None:
        """The NNRP connection of a new QUIC connection (``None``: over ``max_connections`` or closing)."""
        if self._refusing or len(self._connections) + len(self._adopting) >= self._bounds.max_connections:
            self._handler.on_connection_refused(door.name, "max_connections")
            return None
        return self._connection(door)

    def _listen(self, sock: socket.socket, carrier: Carrier, tls: ssl.SSLContext | None) -> None:
        sock.listen(BACKLOG)
        self._listening.append(sock)
        door = _Door(
            sock,
            carrier.label,
            tls,
            authenticator_for(carrier.transport, self._keys),
            urllib.parse.urlsplit(carrier.provider_uri).path if carrier.transport == "websocket" else None,
        )
        self._loop.add_reader(sock.fileno(), self._accept, door)  # type: ignore[union-attr]  # start() set it

    def _accept(self, door: _Door) -> None:
        """Every connection waiting on ``door``'s socket, each with the bytes it already sent unless TLS (module
        docstring); over ``max_connections`` each is closed at once."""
        while True:
            try:
                conn, _ = door.sock.accept()  # type: ignore[union-attr]  # a stream door: it has a socket
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, ...: pause instead of spinning on a readable socket
                self._pause_accepting(door, exc)
                return
            if len(self._connections) + len(self._adopting) >= self._bounds.max_connections:
                conn.close()
                self._handler.on_connection_refused(door.name, "max_connections")
                continue
            if door.tls is None:
                first = _first_bytes(conn)
                if first is None:  # the client already left
                    conn.close()
                    continue
            else:
                conn.setblocking(False)
                first = b""
            task = self._loop.create_task(self._adopt(conn, door, first))  # type: ignore[union-attr]  # start() set it
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _pause_accepting(self, door: _Door, exc: OSError) -> None:
        """Accepting on ``door`` failed (out of descriptors, ...): off the loop for :data:`ACCEPT_PAUSE_S`, one log
        line and one count per pause."""
        fd = door.sock.fileno()  # type: ignore[union-attr]  # a stream door: it has a socket
        if fd in self._paused_accepts:
            return
        logger.warning(
            "NNRP cannot accept connections on %s (%s); accepting pauses for %.1f s",
            door.name,
            exc.strerror or exc,
            ACCEPT_PAUSE_S,
        )
        self._handler.on_connection_refused(door.name, "no_descriptor")
        self._loop.remove_reader(fd)  # type: ignore[union-attr]  # start() set it

        def resume() -> None:
            del self._paused_accepts[fd]
            if door.sock in self._listening:
                self._loop.add_reader(fd, self._accept, door)  # type: ignore[union-attr]  # start() set it

        self._paused_accepts[fd] = self._loop.call_later(ACCEPT_PAUSE_S, resume)  # type: ignore[union-attr]  # start() set it

    async def _adopt(self, conn: socket.socket, door: _Door, first: bytes) -> None:
        """``conn`` becomes a transport of the loop (after its TLS handshake, bounded by the handshake timeout)
        with a new connection protocol that reads ``first`` first (unless the listener closed meanwhile: then it
        is closed). The protocol is made before the first wait; a close that comes after that shuts the
        protocol down with the others."""
        if self._closed:
            conn.close()
            return
        tls: dict[str, Any] = (
            {} if door.tls is None else {"ssl": door.tls, "ssl_handshake_timeout": self._bounds.handshake_timeout_s}
        )
        try:
            await self._loop.connect_accepted_socket(  # type: ignore[union-attr]  # start() set it
                lambda: self._protocol(door, first), sock=conn, **tls
            )
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
            # a failed or abandoned TLS handshake, or a client that left during it: only this connection
            logger.debug("NNRP connection on %s not established: %s", door.name, exc)
            conn.close()
        except Exception:  # the socket failed before it became a transport: only this connection is lost
            logger.warning("NNRP connection on %s lost while being set up", door.name, exc_info=True)
            conn.close()

    def _protocol(self, door: _Door, first: bytes) -> asyncio.Protocol:
        """The asyncio shell of an accepted socket's new NNRP connection: a byte stream's, or a WebSocket's."""
        nnrp = self._connection(door)
        if door.websocket_path is None:
            return StreamConnection(nnrp, first=first, tcp_nodelay=self._tcp_nodelay)
        origins = allowed_origins(self._exposure.ws_allowed_origins, door.keys is not None)
        return WebSocketConnection(
            nnrp, path=door.websocket_path, origins=origins, first=first, tcp_nodelay=self._tcp_nodelay
        )

    def _connection(self, door: _Door) -> NNRPConnection:
        """A new NNRP connection on ``door``, counted until it is lost."""
        connection = NNRPConnection(
            self._handler,
            transport_name=door.name,
            limits=self._limits,
            gate=self._gate,
            flush_round=self._round,  # type: ignore[arg-type]  # start() made it
            on_lost=self._connections.discard,
            probe=self._probe,
            authenticate=door.keys,
            bounds=self._bounds,
            budget=self._budget,
        )
        self._connections.add(connection)
        return connection

    def stop_accepting(self) -> None:
        """No new connection from now on; open ones go on until :meth:`close`."""
        for timer in self._paused_accepts.values():
            timer.cancel()
        self._paused_accepts.clear()
        for sock in self._listening:
            if self._loop is not None:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._listening.clear()
        self._refusing = True  # new QUIC connections are refused (their UDP socket stays until close)

    def drain(self, retry_after_ms: int) -> None:
        """Stop accepting; every open connection refuses new sessions and tells its sessions the server drains
        (:meth:`.connection.NNRPConnection.drain`); running operations go on until :meth:`close`. QUIC
        connections are only refused new ones."""
        self.stop_accepting()
        for connection in list(self._connections):
            connection.drain(retry_after_ms)

    async def close(self) -> None:
        """Stop accepting, end every connection (in-flight operations get ``server_shutdown``, what is queued
        is written first), unbind and remove the socket files."""
        self.stop_accepting()
        self._closed = True  # connections accepted but not adopted yet are closed (_adopt)
        for connection in list(self._connections):
            connection.shut_down()
        quic, self._quic = self._quic, []
        # every QUIC connection closes (CONNECTION_CLOSE after what it had queued), then its UDP socket
        await asyncio.gather(*(server.shut_down() for server in quic))
        for path in self._socket_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._socket_files.clear()


@attrs.frozen
class _Door:
    """One listening socket and what its connections get: the carrier's ``name`` (``tcp``, ``tls``, ``ipc``),
    the server's TLS context (``None``: plain) and the API-key check (``None``: no key required)."""

    sock: socket.socket | None  # None: a QUIC address (its UDP socket is aioquic's server's)
    name: str
    tls: ssl.SSLContext | None
    keys: APIKeys | None
    #: a WebSocket address's path, the one its Upgrade must request (``None``: not WebSocket)
    websocket_path: str | None = None


def _with_port(uri: str, port: int) -> str:
    """``uri`` with the bound ``port`` (``:0`` replaced by the real one)."""
    configured = urllib.parse.urlsplit(uri)
    return configured._replace(netloc=f"{configured.netloc.rsplit(':', 1)[0]}:{port}").geturl()


def _first_bytes(conn: socket.socket) -> bytes | None:
    """What the client of the just-accepted ``conn`` already sent (``b""``: nothing yet, the transport reads
    it), or ``None`` when it already left; ``conn`` is made non-blocking."""
    conn.setblocking(False)
    try:
        return conn.recv(FIRST_READ_BYTES) or None
    except (BlockingIOError, InterruptedError):
        return b""
    except OSError:
        return None


def _bound_socket(carrier: Carrier, family: int, address: str | tuple[Any, ...]) -> socket.socket:
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

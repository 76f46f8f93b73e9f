"""NNRP listeners: one nnrp-py native server per configured address, each with its own accept thread.

Every accepted session gets a :class:`SessionPump`. TCP sessions get TCP_NODELAY (see :mod:`.nodelay`).
Binding problems raise :class:`ListenError` with the cause and the fix, so ``vllm serve`` stops at start-up
instead of running without a listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import urllib.parse

from nnrp.core import TransportPolicy
from nnrp.native import NativeRuntimeError, NativeWouldBlockError, load_native_transport_binding
from nnrp.server import NativeServerBootstrapOptions, NativeServerProviderRoute, listen_native_server

from vllm_nnrp_plugin.nnrp_binding import sdk_sync
from vllm_nnrp_plugin.nnrp_binding.endpoints import Carrier, EndpointError, parse_endpoint
from vllm_nnrp_plugin.nnrp_binding.nodelay import NoDelaySetter
from vllm_nnrp_plugin.nnrp_binding.session import SessionHandler, SessionPump

logger = logging.getLogger(__name__)

_POLICY = {"tcp": TransportPolicy.FORCE_TCP, "ipc": TransportPolicy.FORCE_IPC}


class ListenError(RuntimeError):
    """An address could not be bound; the message names the address, the cause and the fix."""


class Listener:
    """Binds every URI of ``listen`` (``tcp://…``, ``unix:///…``) and serves sessions until :meth:`close`.

    ``accept_timeout_ms``: how long one accept call waits (ms); long waits avoid losing sessions whose
    handshake straddles an accept deadline (nnrp-sdk.md addendum 4), and bound how long :meth:`close` waits.
    ``idle_poll_ms``: poll timeout of an idle session pump (ms).
    """

    def __init__(
        self,
        listen: tuple[str, ...],
        handler: SessionHandler,
        loop: asyncio.AbstractEventLoop,
        *,
        accept_timeout_ms: int,
        idle_poll_ms: int,
    ) -> None:
        self._listen = listen
        self._handler = handler
        self._loop = loop
        self._accept_timeout_ms = accept_timeout_ms
        self._idle_poll_ms = idle_poll_ms
        self._stack = contextlib.ExitStack()
        self._threads: list[threading.Thread] = []
        self._pumps: set[SessionPump] = set()
        self._pumps_lock = threading.Lock()
        self._closing = threading.Event()
        #: the actually bound addresses, e.g. ``["tcp://127.0.0.1:9400", "unix:///tmp/vllm-nnrp.sock"]``
        self.bound: list[str] = []

    def start(self) -> list[str]:
        """Bind all addresses and start accepting. Raises :class:`ListenError`; binds nothing on failure."""
        try:
            carriers = [parse_endpoint(uri) for uri in self._listen]
        except EndpointError as exc:
            raise ListenError(f"bad NNRP listen address {exc}. Fix nnrp.listen or VLLM_NNRP_LISTEN.") from None
        try:
            for carrier in carriers:
                self._bind(carrier)
        except BaseException:
            self.close()
            raise
        for thread in self._threads:
            thread.start()
        return self.bound

    def _bind(self, carrier: Carrier) -> None:
        if carrier.transport == "ipc":
            _remove_stale_socket(carrier.provider_uri)
        else:
            _check_tcp_free(carrier)
        options = NativeServerBootstrapOptions(
            endpoint=carrier.endpoint,
            provider_routes={carrier.transport: NativeServerProviderRoute(provider_endpoint=carrier.provider_uri)},
            transport_policy=_POLICY[carrier.transport],
        )
        try:
            server = self._stack.enter_context(
                listen_native_server(options, transports=(load_native_transport_binding(carrier.transport),))
            )
        except (NativeRuntimeError, OSError, ValueError) as exc:
            raise ListenError(
                f"cannot listen for NNRP on {carrier.uri}: {exc}. Fix: free that address (is another server "
                "using it?) or choose another one with nnrp.listen / VLLM_NNRP_LISTEN."
            ) from exc
        bound = server.bound_provider_endpoints[carrier.transport].uri
        self.bound.append(bound)
        nodelay = None
        if carrier.transport == "tcp":
            nodelay = NoDelaySetter(urllib.parse.urlsplit(bound).port)
        self._threads.append(
            threading.Thread(
                target=self._accept_loop, args=(server, nodelay), name=f"nnrp-accept-{carrier.transport}", daemon=True
            )
        )

    def _accept_loop(self, server, nodelay: NoDelaySetter | None) -> None:
        acceptor = sdk_sync.Acceptor(server)
        while not self._closing.is_set():
            try:
                session = acceptor.accept(self._accept_timeout_ms)
            except NativeWouldBlockError:
                continue
            except NativeRuntimeError as exc:
                # one failed handshake (client died mid-open): keep serving everybody else
                logger.warning("NNRP session handshake failed: %s", exc)
                self._closing.wait(0.01)
                continue
            if nodelay is not None:
                nodelay.apply()
            pump = SessionPump(
                session, self._handler, self._loop, idle_poll_ms=self._idle_poll_ms, on_exit=self._forget_pump
            )
            with self._pumps_lock:
                if self._closing.is_set():
                    pump.stop()
                self._pumps.add(pump)
            pump.start()

    def _forget_pump(self, pump: SessionPump) -> None:
        with self._pumps_lock:
            self._pumps.discard(pump)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every session (in-flight operations get ``server_shutdown``), unbind."""
        self._closing.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(self._accept_timeout_ms / 1000 + 1)
        with self._pumps_lock:
            pumps = list(self._pumps)
        for pump in pumps:
            pump.stop()
        for pump in pumps:
            pump.join(timeout_s)
        self._stack.close()


def _check_tcp_free(carrier: Carrier) -> None:
    """The native carrier reports a taken port only as an opaque status; say it plainly first."""
    parts = urllib.parse.urlsplit(carrier.provider_uri)
    if not parts.port:
        return
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((parts.hostname, parts.port))
        except OSError as exc:
            raise ListenError(
                f"cannot listen for NNRP on {carrier.uri}: {exc.strerror}. Fix: stop whatever holds that "
                "address, or choose another one with nnrp.listen / VLLM_NNRP_LISTEN."
            ) from None


def _remove_stale_socket(provider_uri: str) -> None:
    """A socket file left by a crashed run blocks the bind; remove it if nobody answers on it."""
    path = urllib.parse.urlsplit(provider_uri).path
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        logger.info("removing stale NNRP socket file %s", path)
        os.unlink(path)
    except OSError:
        pass  # not a socket we can judge: let the bind report it
    finally:
        probe.close()

"""NNRP listeners: one nnrp-py native server per configured address, each with its own accept thread.

Every accepted session gets a :class:`SessionPump`. TCP sessions get TCP_NODELAY (see :mod:`.nodelay`).
Binding problems raise :class:`ListenError` with the cause and the fix, so ``vllm serve`` stops at start-up
instead of running without a listener.

Exposure (issue 6): TLS carriers (``nnrps``, ``wss``, ``quic``) get the configured PEM certificate and key;
a plain address other hosts can reach is logged as a warning (config.py refuses it unless
``allow_non_loopback``); a unix socket file is made owner-only (0600), or 0660 owned by
``ipc_socket_group``, right after the bind; a stale socket file from a crashed run is removed first.
Sessions over ``max_sessions`` are refused at open with NNRP's ``SESSION_ERROR_LIMIT_REACHED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import socket
import threading
import urllib.parse

import attrs
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import load_pem_x509_certificate
from nnrp.core import TransportPolicy
from nnrp.native import (
    SESSION_ERROR_LIMIT_REACHED,
    NativeRuntimeError,
    NativeTransportServerSecurity,
    NativeWouldBlockError,
    load_native_transport_binding,
)
from nnrp.server import (
    NativeServerBootstrapOptions,
    NativeServerProviderRoute,
    NativeServerSessionOptions,
    NativeServerSessionPolicyDecision,
    listen_native_server,
)

from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.limits import SessionLimits, Slots
from vllm_nnrp_plugin.nnrp_binding import sdk_sync
from vllm_nnrp_plugin.nnrp_binding.endpoints import (
    Carrier,
    EndpointError,
    is_loopback,
    parse_endpoint,
)
from vllm_nnrp_plugin.nnrp_binding.nodelay import NoDelaySetter
from vllm_nnrp_plugin.nnrp_binding.session import SessionHandler, SessionPump

logger = logging.getLogger(__name__)

POLICY = {
    "tcp": TransportPolicy.FORCE_TCP,
    "ipc": TransportPolicy.FORCE_IPC,
    "websocket": TransportPolicy.FORCE_WEBSOCKET,
    "quic": TransportPolicy.FORCE_QUIC,
}


class ListenError(NNRPStartupError):
    """An address could not be bound; the message names the address, the cause and the fix."""


@attrs.frozen
class Exposure:
    """``tls_cert_file`` / ``tls_key_file``: PEM paths for TLS carriers; ``ipc_socket_group``: group of unix
    socket files (``None``: owner-only)."""

    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    ipc_socket_group: str | None = None


class Listener:
    """Binds every URI of ``listen`` (forms in :mod:`.endpoints`) and serves sessions until :meth:`close`.

    ``accept_timeout_ms``: how long one accept call waits (ms); long waits avoid losing sessions whose
    handshake straddles an accept deadline (nnrp-sdk.md addendum 4), and bound how long :meth:`close` waits.
    ``idle_poll_ms``: poll timeout of an idle session pump (ms). ``max_sessions``: open sessions over all
    addresses. ``session_limits`` / ``in_flight``: handed to every session pump.
    """

    def __init__(
        self,
        listen: tuple[str, ...],
        handler: SessionHandler,
        loop: asyncio.AbstractEventLoop,
        *,
        accept_timeout_ms: int,
        idle_poll_ms: int,
        max_sessions: int,
        session_limits: SessionLimits,
        in_flight: Slots,
        exposure: Exposure = Exposure(),
    ) -> None:
        self._listen = listen
        self._handler = handler
        self._loop = loop
        self._accept_timeout_ms = accept_timeout_ms
        self._idle_poll_ms = idle_poll_ms
        self._max_sessions = max_sessions
        self._session_limits = session_limits
        self._in_flight = in_flight
        self._exposure = exposure
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

    @property
    def sessions(self) -> int:
        """Sessions open right now."""
        return len(self._pumps)

    async def evaluate(self, _open: object) -> NativeServerSessionPolicyDecision:
        """nnrp-py session admission (runs on the SDK's policy thread): refuse over ``max_sessions``."""
        if len(self._pumps) >= self._max_sessions:
            return NativeServerSessionPolicyDecision.reject(
                SESSION_ERROR_LIMIT_REACHED, f"{self._max_sessions} NNRP sessions are open (nnrp.max_sessions)"
            )
        return NativeServerSessionPolicyDecision.accept()

    def _bind(self, carrier: Carrier) -> None:
        if carrier.transport == "ipc":
            _remove_stale_socket(carrier.provider_uri)
        elif carrier.transport != "quic":
            _check_tcp_free(carrier)
        if not carrier.tls and not is_loopback(carrier):
            logger.warning(
                "NNRP listens on %s without TLS: any host that reaches it can use the model (nnrp.allow_non_loopback)",
                carrier.uri,
            )
        security = _server_security(self._exposure) if carrier.tls else None
        options = NativeServerBootstrapOptions(
            endpoint=carrier.endpoint,
            provider_routes={
                carrier.transport: NativeServerProviderRoute(provider_endpoint=carrier.provider_uri, security=security)
            },
            transport_policy=POLICY[carrier.transport],
            session_defaults=NativeServerSessionOptions(application_policy=self),
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
        if carrier.transport == "ipc":
            _restrict_socket(urllib.parse.urlsplit(carrier.provider_uri).path, self._exposure.ipc_socket_group)
        self.bound.append(_public_uri(carrier, bound))
        nodelay = None
        if carrier.transport in ("tcp", "websocket"):
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
                session,
                self._handler,
                self._loop,
                idle_poll_ms=self._idle_poll_ms,
                limits=self._session_limits,
                in_flight=self._in_flight,
                on_exit=self._forget_pump,
            )
            with self._pumps_lock:
                if self._closing.is_set():
                    pump.stop()
                self._pumps.add(pump)
            pump.start()

    def _forget_pump(self, pump: SessionPump) -> None:
        with self._pumps_lock:
            self._pumps.discard(pump)

    def stop_accepting(self) -> None:
        """No new session from now on (one accepted meanwhile is ended at once); returns without waiting."""
        self._closing.set()

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


def _public_uri(carrier: Carrier, bound: str) -> str:
    """The configured URI with the port actually bound (``:0`` becomes the real port)."""
    if carrier.transport == "ipc":
        return bound
    configured = urllib.parse.urlsplit(carrier.uri)
    return configured._replace(netloc=urllib.parse.urlsplit(bound).netloc).geturl()


def _server_security(exposure: Exposure) -> NativeTransportServerSecurity:
    """The PEM certificate and key as the DER bytes nnrp-py wants. Raises :class:`ListenError`."""
    try:
        with open(exposure.tls_cert_file, "rb") as f:
            cert = load_pem_x509_certificate(f.read())
        with open(exposure.tls_key_file, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ListenError(
            f"cannot load the NNRP TLS certificate/key ({exposure.tls_cert_file}, {exposure.tls_key_file}): {exc}. "
            "Fix: nnrp.tls_cert_file must be a PEM certificate and nnrp.tls_key_file an unencrypted PEM key."
        ) from None
    return NativeTransportServerSecurity(
        certificate_der=cert.public_bytes(serialization.Encoding.DER),
        private_key_pkcs8_der=key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _restrict_socket(path: str, group: str | None) -> None:
    """Owner-only (0600) socket file, or 0660 owned by ``group``. Raises :class:`ListenError`."""
    try:
        if group is None:
            os.chmod(path, 0o600)
        else:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
            os.chmod(path, 0o660)
    except (OSError, KeyError) as exc:
        raise ListenError(
            f"cannot restrict the NNRP socket file {path} (group {group}): {exc}. Fix: nnrp.ipc_socket_group must "
            "be a group this user belongs to."
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

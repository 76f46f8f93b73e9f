"""NNRP listeners on nnrp-py's native runtime for the carrier the project's own wire core does not serve yet
(``quic``; TCP, TLS, unix sockets and WebSocket are :mod:`.stream_listener`'s): one nnrp-py native server per
configured address, each with its own accept thread.

Every accepted session gets a :class:`SessionPump` (its polls), started by one starter thread so that the
accept threads only accept; one :class:`.sender.Sender` sends for all of them, with the polls' budget shared
through one :class:`.cadence.PollCadence`. TCP and WebSocket sessions get TCP_NODELAY (see
:mod:`.nodelay`). What each address exposes (TLS credentials, socket file mode, the non-loopback warning,
stale socket files) is :mod:`.exposure`'s; binding problems raise :class:`~.exposure.ListenError` with the
cause and the fix, so ``vllm serve`` stops at start-up instead of running without a listener. Sessions over
``max_sessions`` are refused at open with nnrp-py's ``SESSION_ERROR_LIMIT_REACHED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import urllib.parse
from collections.abc import Callable

import attrs
from nnrp.core import TransportPolicy
from nnrp.native import (
    SESSION_ERROR_LIMIT_REACHED,
    NativeRuntimeError,
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

from vllm_nnrp_plugin.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding import exposure, sdk_sync
from vllm_nnrp_plugin.nnrp_binding.cadence import PollCadence
from vllm_nnrp_plugin.endpoints import Carrier, EndpointError, parse_endpoint
from vllm_nnrp_plugin.nnrp_binding.exposure import Exposure, ListenError
from vllm_nnrp_plugin.nnrp_binding.nodelay import NoDelaySetter
from vllm_nnrp_plugin.nnrp_binding.sender import Sender
from vllm_nnrp_plugin.nnrp_binding.server_operation import SendProbe
from vllm_nnrp_plugin.nnrp_binding.handler import SessionHandler
from vllm_nnrp_plugin.nnrp_binding.session import SessionPump

logger = logging.getLogger(__name__)

POLICY = {
    "tcp": TransportPolicy.FORCE_TCP,
    "ipc": TransportPolicy.FORCE_IPC,
    "websocket": TransportPolicy.FORCE_WEBSOCKET,
    "quic": TransportPolicy.FORCE_QUIC,
}


@attrs.frozen
class ListenerHooks:
    """Explicit hooks for benchmarks (``bench/server.py``): ``send_probe`` is given to every session pump
    (told about each partial result queued and sent); ``tcp_nodelay=False`` skips the TCP_NODELAY step,
    leaving nnrp-py's TCP carrier as it is (Nagle on)."""

    send_probe: SendProbe | None = None
    tcp_nodelay: bool = True


class Listener:
    """Binds every URI of ``listen`` (forms in :mod:`vllm_nnrp_plugin.endpoints`) and serves sessions until
    :meth:`close`.

    ``accept_timeout_ms``: how long one accept call waits (ms); long waits avoid losing sessions whose
    handshake straddles an accept deadline (nnrp-py 1.0.0rc4.post20's ``NativeServer.accept`` gives up its
    pending accept ticket at every deadline; :class:`.sdk_sync.Acceptor` keeps it), and bound how long
    :meth:`close` waits.
    ``idle_poll_ms``: the shortest poll timeout of an idle session pump (ms; longer when many sessions are open,
    :class:`.cadence.PollCadence`). ``max_sessions``: open sessions over all
    addresses plus ``other_sessions()`` (those of the loop's own listener). ``session_limits``: handed to every
    session pump; ``hooks``: :class:`ListenerHooks`.
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
        exposure: Exposure = Exposure(),
        hooks: ListenerHooks = ListenerHooks(),
        other_sessions: Callable[[], int] = lambda: 0,
    ) -> None:
        self._listen = listen
        self._handler = handler
        self._loop = loop
        self._accept_timeout_ms = accept_timeout_ms
        self._cadence = PollCadence(idle_poll_ms)
        self._sender = Sender()
        #: accepted sessions' pumps waiting to be started (``None``: the listener is closing)
        self._starting: queue.SimpleQueue[tuple[SessionPump | None, NoDelaySetter | None]] = queue.SimpleQueue()
        self._starter = threading.Thread(target=self._start_loop, name="nnrp-start", daemon=True)
        self._max_sessions = max_sessions
        self._session_limits = session_limits
        self._exposure = exposure
        self._hooks = hooks
        self._other_sessions = other_sessions
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
        self._sender.start()
        self._starter.start()
        for thread in self._threads:
            thread.start()
        return self.bound

    @property
    def sessions(self) -> int:
        """Sessions open right now."""
        return len(self._pumps)

    async def evaluate(self, _open: object) -> NativeServerSessionPolicyDecision:
        """nnrp-py's session policy interface (``application_policy``); replaced by :meth:`decide` once bound
        (:func:`.sdk_sync.direct_policy`), so that an open does not cost a new event loop."""
        accepted, code, diagnostic = self.decide(_open)
        if accepted:
            return NativeServerSessionPolicyDecision.accept()
        return NativeServerSessionPolicyDecision.reject(code, diagnostic)

    def decide(self, _open: object) -> tuple[bool, int, str | None]:
        """Session admission (on nnrp-py's policy threads): refuse over ``max_sessions`` with
        ``SESSION_ERROR_LIMIT_REACHED``."""
        if len(self._pumps) + self._other_sessions() >= self._max_sessions:
            return False, SESSION_ERROR_LIMIT_REACHED, f"{self._max_sessions} NNRP sessions are open (nnrp.max_sessions)"
        return True, 0, None

    def _bind(self, carrier: Carrier) -> None:
        exposure.before_bind(carrier)
        security = exposure.server_security(self._exposure) if carrier.tls else None
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
        sdk_sync.direct_policy(server, self.decide)
        bound = server.bound_provider_endpoints[carrier.transport].uri
        exposure.after_bind(carrier, self._exposure)
        self.bound.append(_public_uri(carrier, bound))
        nodelay = None
        if carrier.transport in ("tcp", "websocket") and self._hooks.tcp_nodelay:
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
            pump = SessionPump(
                session,
                self._handler,
                self._loop,
                cadence=self._cadence,
                sender=self._sender,
                limits=self._session_limits,
                on_exit=self._forget_pump,
                probe=self._hooks.send_probe,
            )
            with self._pumps_lock:
                if self._closing.is_set():
                    pump.stop()
                self._pumps.add(pump)
            self._starting.put((pump, nodelay))

    def _start_loop(self) -> None:
        """Start the pumps of accepted sessions, so that the accept loops only accept (starting a thread
        waits for it to run, and a burst of connects must not queue behind that). TCP_NODELAY is set once per
        batch of sessions accepted meanwhile (one scan of the process's sockets covers them all)."""
        while True:
            batch = [self._starting.get()]
            while not self._starting.empty():
                batch.append(self._starting.get())
            for nodelay in {id(n): n for _, n in batch if n is not None}.values():
                nodelay.apply()
            for pump, _ in batch:
                if pump is None:
                    return
                pump.start()

    def _forget_pump(self, pump: SessionPump) -> None:
        with self._pumps_lock:
            self._pumps.discard(pump)

    def stop_accepting(self) -> None:
        """No new session from now on (one accepted meanwhile is ended at once); returns without waiting."""
        self._closing.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every session (in-flight operations get ``server_shutdown``), unbind. Waits for
        the session pumps up to ``timeout_s`` (s) or, when longer, the idle sessions' poll timeout plus 1 s
        (a pump ends when its poll returns, :mod:`.cadence`)."""
        self._closing.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(self._accept_timeout_ms / 1000 + 1)
        if self._starter.is_alive():
            self._starting.put((None, None))
            self._starter.join()
        with self._pumps_lock:
            pumps = list(self._pumps)
        deadline = time.monotonic() + max(timeout_s, self._cadence.idle_poll_ms() / 1000 + 1)
        for pump in pumps:
            pump.stop()
        for pump in pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        self._sender.close()
        self._stack.close()


def _public_uri(carrier: Carrier, bound: str) -> str:
    """The configured URI with the port actually bound (``:0`` becomes the real port)."""
    if carrier.transport == "ipc":
        return bound
    configured = urllib.parse.urlsplit(carrier.uri)
    return configured._replace(netloc=urllib.parse.urlsplit(bound).netloc).geturl()



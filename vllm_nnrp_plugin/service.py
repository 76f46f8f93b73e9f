"""The NNRP service: listeners (NNRP side) + the adapter + a backend (vLLM side), on one event loop.

Runs on vLLM's API-server event loop: operations are asyncio tasks there, and every carrier (TCP, TLS, unix
sockets, WebSocket, QUIC) is served on the loop itself by the project's own wire core
(:mod:`.nnrp_binding.listener`), which tells this service what came off the wire directly: a submit with its
envelope unwrapped, a cancel or a closed session, a DEADLINE, an operation whose terminal went out last;
everything else an operation needs on this side is owned here, on the loop:

* the process-wide in-flight slots (``nnrp.max_in_flight``; unbounded by default, as vLLM's HTTP server
  queues whatever comes): taken at submit, given back as soon as the operation's terminal went out (the client
  may submit again at once) or its task ended, whichever is first; a submit over the limit is refused with
  ``too_many_requests``;
* the timers of operation deadlines (envelope ``nnrp.timeout_ms``, NNRP DEADLINE and EXPIRE_AT; the earliest
  wins): on expiry the operation's terminal is decided (the ``deadline_expired`` drop or ``response.error``
  ``request_timeout``: :meth:`vllm_nnrp_plugin.core.operation.Operation.time_out`) and its task is cancelled, which
  aborts the vLLM request;
* finishing: once the terminal was sent and the task ended, the operation's record is reported.

One service per API-server process: its limits and its shutdown are that process's.

Every finished operation's :class:`~vllm_nnrp_plugin.observability.observation.Observation` goes, on the loop, to: one
log line (DEBUG when completed, INFO otherwise), the Prometheus collectors (:mod:`.observability.metrics`), one span
(:mod:`.observability.tracing`), then any extra ``observers`` (benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from vllm_nnrp_plugin.config import NNRPConfig
from vllm_nnrp_plugin.contract.endpoints import Carrier, EndpointError, parse_endpoint
from vllm_nnrp_plugin.core.adapter import AdapterLimits, Backend, run_operation
from vllm_nnrp_plugin.core.limits import SessionLimits, Slots
from vllm_nnrp_plugin.nnrp_binding.authentication import APIKeys
from vllm_nnrp_plugin.nnrp_binding.bounds import CarrierBounds, packet_limit
from vllm_nnrp_plugin.nnrp_binding.exposure import Exposure, ListenError
from vllm_nnrp_plugin.nnrp_binding.listener import Listener, ListenerHooks
from vllm_nnrp_plugin.nnrp_binding.server_operation import ServerOperation
from vllm_nnrp_plugin.observability import metrics, tracing
from vllm_nnrp_plugin.observability.log_safety import RefusalLogLimiter
from vllm_nnrp_plugin.observability.observation import COMPLETED, Observation, log_fields, log_line
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import with_limits

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 5.0  # longest wait at shutdown for the adapters to abort their vLLM requests
#: operations one session may have in flight when neither ``nnrp.max_in_flight_per_session`` nor the server's
#: scheduler (vLLM's ``max_num_seqs``, :mod:`.vllm_binding.lifecycle`) says otherwise
DEFAULT_IN_FLIGHT_PER_SESSION = 256


class NNRPService:
    """Start with :meth:`start` (binds, raises ``ListenError``; with ``metrics_listen`` also ``MetricsListenError``;
    both are ``NNRPStartupError``), stop with :meth:`stop`.

    ``registry``: where the NNRP metrics are registered (default ``prometheus_client.REGISTRY``, the one
    vLLM's ``/metrics`` serves); ``tracer``: where spans go (default: the package's tracer from the global
    provider); ``observers``: extra callables given each finished operation's record; ``hooks``: the
    listener's benchmark hooks (:class:`~vllm_nnrp_plugin.nnrp_binding.listener.ListenerHooks`); ``keys``:
    vLLM's API keys, required on every network carrier (``None``: no key required; :mod:`.nnrp_binding.authentication`).
    """

    def __init__(
        self,
        config: NNRPConfig,
        backend: Backend,
        loop: asyncio.AbstractEventLoop,
        *,
        registry: CollectorRegistry | None = None,
        tracer: Tracer | None = None,
        observers: Sequence[Callable[[Observation], None]] = (),
        hooks: ListenerHooks = ListenerHooks(),
        keys: APIKeys | None = None,
    ) -> None:
        self._keys = keys
        self._auth_log = RefusalLogLimiter()
        self._ended_log = RefusalLogLimiter()  # connections ended for flooding beyond their credit
        self._backend = backend
        self._config = config
        self._registry = registry
        self._metrics = metrics.metrics_for(registry)
        self._tracer = tracer or tracing.tracer()
        self._observers = tuple(observers)
        self._metrics_server: metrics.MetricsServer | None = None
        #: ``HOST:PORT`` of the standalone ``/metrics`` server, when ``metrics_listen`` is set
        self.metrics_address: str | None = None
        self._limits = AdapterLimits(max_envelope_bytes=config.max_envelope_bytes)
        #: the runtime capability document, read once from the backend (vLLM's configuration is fixed)
        per_session = config.max_in_flight_per_session or DEFAULT_IN_FLIGHT_PER_SESSION
        self.capabilities = with_limits(
            self._backend.capabilities(),
            max_in_flight=config.max_in_flight,
            max_in_flight_per_session=per_session,
            max_sessions=config.max_sessions,
        )
        self._tasks: dict[ServerOperation, asyncio.Task] = {}
        self._timers: dict[ServerOperation, asyncio.TimerHandle] = {}
        self._stopping = False
        self._stopped: asyncio.Future | None = None
        #: set while :meth:`drain` waits for the running operations (no new session or operation meanwhile)
        self._draining = False
        self._idle: asyncio.Future | None = None  # set when the last operation's task ended during a drain
        self._drain_until = 0.0  # time.monotonic() at which the drain's grace ends
        #: process-wide in-flight operations (``nnrp.max_in_flight``): taken at submit, given back when the
        #: operation's terminal went out or its task ended, whichever is first; both on the loop
        self.in_flight = Slots(config.max_in_flight)
        self._holding: set[ServerOperation] = set()  # operations holding one of those slots
        self._loop = loop
        self._hooks = hooks
        self._session_limits = SessionLimits(per_session, config.max_queued_events)
        self._exposure = Exposure(
            config.tls_cert_file, config.tls_key_file, config.ipc_socket_group, config.ws_allowed_origins
        )
        self._listener: Listener | None = None

    @property
    def sessions(self) -> int:
        """Open NNRP sessions."""
        return self._listener.sessions if self._listener is not None else 0

    async def start(self) -> list[str]:
        """Bind every configured address (on the loop); returns the bound URIs in the configured order.
        Raises ``ListenError`` (and ``MetricsListenError`` with ``metrics_listen``), binding nothing."""
        carriers = _carriers(self._config.listen)
        config = self._config
        self._listener = Listener(
            carriers,
            self,
            max_sessions=config.max_sessions,
            session_limits=self._session_limits,
            exposure=self._exposure,
            probe=self._hooks.send_probe,
            tcp_nodelay=self._hooks.tcp_nodelay,
            keys=self._keys,
            bounds=CarrierBounds(
                handshake_timeout_s=config.handshake_timeout_ms / 1000,
                max_packet_bytes=packet_limit(config.max_envelope_bytes),
                max_buffered_bytes=config.max_buffered_bytes,
                max_connections=config.max_connections,
            ),
        )
        bound = await self._listener.start()
        try:
            if config.metrics_listen is not None:
                self._metrics_server = metrics.serve_metrics(config.metrics_listen, self._registry)
                self.metrics_address = self._metrics_server.address
        except BaseException:
            await self._listener.close()
            raise
        return bound

    async def drain(self, grace_s: float) -> None:
        """Drain, then :meth:`stop` (vLLM's shutdown on SIGTERM, ``nnrp.drain_timeout_ms``): at once, no new
        connection, session or operation, said on the wire as :mod:`vllm_nnrp_plugin.contract.draining` describes (new
        submits get ``server_shutdown`` before reaching vLLM; every open session a BACKPRESSURE credit 0,
        level paused, reason draining); the running operations finish for at most ``grace_s`` (s; 0: not at
        all); then :meth:`stop` ends the rest with ``server_shutdown``. Idempotent with :meth:`stop`."""
        if self._stopped is None and not self._draining:
            self._draining = True
            if self._listener is not None:
                self._listener.drain(int(grace_s * 1000))
            running = len(self._tasks)
            logger.info(
                "NNRP draining: no new sessions or operations; %d running get up to %.0f s to finish", running, grace_s
            )
            if running and grace_s > 0:
                self._idle = asyncio.get_running_loop().create_future()
                self._drain_until = time.monotonic() + grace_s
                await self._drained()
                if self._tasks:
                    logger.info(
                        "NNRP drain: %d operations still running at the end of the grace time", len(self._tasks)
                    )
        await self.stop()

    async def _drained(self) -> None:
        """Wait until the drain's running operations ended or its grace is over."""
        remaining = self._drain_until - time.monotonic()
        if self._idle is None or self._idle.done() or remaining <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._idle), remaining)

    async def stop(self) -> None:
        """Graceful stop, in this order: stop accepting sessions; give every in-flight operation its one
        terminal (``response.error`` ``server_shutdown``) and abort its vLLM request; end the sessions; unbind.
        Idempotent: a second call waits for the first. During a :meth:`drain` (uvicorn's own SIGTERM handling
        stops the app while vLLM's shutdown runs the drain), it first waits for the drain's grace."""
        await self._drained()
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            self._stopping = True
            if self._listener is not None:
                self._listener.stop_accepting()
            tasks = list(self._tasks.items())
            logger.info("NNRP stopping: no new sessions; ending %d in-flight operations", len(tasks))
            for sop, _task in tasks:
                sop.shut_down()  # decided now, before the engine's own shutdown can fail the stream; stops it
            if tasks:
                await asyncio.wait([task for _sop, task in tasks], timeout=ABORT_WAIT_S)
            if self._listener is not None:
                await self._listener.close()
            if self._metrics_server is not None:
                await asyncio.to_thread(self._metrics_server.close)
        finally:
            self._stopped.set_result(None)

    # SessionHandler: what came off the wire, told by the connections on the loop

    def on_submit(self, sop: ServerOperation) -> None:
        if self._stopping or self._draining:
            sop.shut_down()
            self._settle(sop)  # no task will run
            return
        if not self.in_flight.try_take():
            sop.refuse(
                E.too_many_requests(
                    f"this server already runs {self.in_flight.capacity} NNRP operations (nnrp.max_in_flight)"
                )
            )
            self._settle(sop)  # no task will run; it never reaches vLLM
            return
        self._holding.add(sop)
        task = asyncio.get_running_loop().create_task(
            run_operation(sop, sop.envelope, self._backend, self._limits, self.capabilities)
        )
        self._tasks[sop] = task
        task.add_done_callback(lambda _t, sop=sop: self._done(sop))  # type: ignore[misc]  # sop bound as a default
        sop.owner = self
        if sop.expires_unix_ms is not None:  # a DEADLINE that came before the submit
            self.rearm(sop)

    def on_deadline(self, sop: ServerOperation, deadline_unix_ms: int) -> None:
        if sop.bound(deadline_unix_ms):
            self.rearm(sop)

    def on_finished(self, sop: ServerOperation) -> None:
        record = sop.observation
        level = logging.DEBUG if record.outcome == COMPLETED else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, "%s", log_line(record), extra={"nnrp": log_fields(record)})
        self._metrics.observe(record)
        tracing.emit_span(self._tracer, record)
        for observer in self._observers:
            observer(record)

    def on_session(self, transport: str, opened: bool) -> None:
        self._metrics.session(transport, opened)

    def on_terminal(self, sop: ServerOperation) -> None:
        """``sop``'s terminal went out: its slot is free for the client's next submit (its task may still be
        finishing its vLLM abort)."""
        self._release(sop)

    def on_auth_refused(self, transport: str, presented: bool) -> None:
        """Counted always; logged (never with the key) at most ``RefusalLogLimiter``'s lines per window, the
        rest summed into one line."""
        reason = "wrong_key" if presented else "missing_key"
        self._metrics.auth_refusals.labels(transport, reason).inc()
        write, left_out = self._auth_log.admit(time.monotonic())
        if left_out:
            logger.info("NNRP: %d more sessions refused auth_failed (not logged)", left_out)
        if write:
            logger.info("NNRP session refused on %s: auth_failed (%s)", transport, reason.replace("_", " "))

    def on_handshake_timeout(self, transport: str) -> None:
        self._metrics.handshake_timeouts.labels(transport).inc()

    def on_connection_refused(self, transport: str, reason: str) -> None:
        self._metrics.connections_refused.labels(transport, reason).inc()

    def on_connection_ended(self, transport: str, reason: str, detail: str) -> None:
        """The server ended a connection for breaking a bound (``reason``: ``credit_violations``): counted
        always; logged as a warning at most ``RefusalLogLimiter``'s lines per window, the rest summed."""
        self._metrics.connections_ended.labels(transport, reason).inc()
        write, left_out = self._ended_log.admit(time.monotonic())
        if left_out:
            logger.warning("NNRP: %d more connections ended for %s (not logged)", left_out, reason)
        if write:
            logger.warning("NNRP connection on %s ended: %s", transport, detail)

    # OperationOwner: told directly by the operation, on the loop

    def rearm(self, sop: ServerOperation) -> None:
        """(Re)arm ``sop``'s timer for its current ``expires_unix_ms``."""
        if sop not in self._tasks or sop.expires_unix_ms is None:
            return
        old = self._timers.pop(sop, None)
        if old is not None:
            old.cancel()
        delay_s = max(0.0, sop.expires_unix_ms / 1000 - time.time())
        self._timers[sop] = asyncio.get_running_loop().call_later(delay_s, self._expire, sop)

    def stop_operation(self, sop: ServerOperation) -> None:
        """Abort ``sop``'s vLLM request at once (in this very callback), then cancel its task (the adapter
        releases vLLM's stream and makes sure of the abort)."""
        task = self._tasks.get(sop)
        if task is not None:
            sop.abort_now()
            task.cancel()

    def _expire(self, sop: ServerOperation) -> None:
        self._timers.pop(sop, None)
        sop.time_out()  # its terminal, and the stop of its work

    def _done(self, sop: ServerOperation) -> None:
        self._tasks.pop(sop, None)
        if self._idle is not None and not self._tasks and not self._idle.done():
            self._idle.set_result(None)  # the drain's last running operation ended
        timer = self._timers.pop(sop, None)
        if timer is not None:
            timer.cancel()
        self._release(sop)
        self._settle(sop)

    def _release(self, sop: ServerOperation) -> None:
        if sop in self._holding:
            self._holding.discard(sop)
            self.in_flight.give_back()

    def _settle(self, sop: ServerOperation) -> None:
        """The operation's task ended (or none will run); report it if its terminal went out already."""
        if sop.settle():
            self.on_finished(sop)


def _carriers(listen: tuple[str, ...]) -> list[Carrier]:
    try:
        return [parse_endpoint(uri) for uri in listen]
    except EndpointError as exc:
        raise ListenError(f"bad NNRP listen address {exc}. Fix nnrp.listen or VLLM_NNRP_LISTEN.") from None

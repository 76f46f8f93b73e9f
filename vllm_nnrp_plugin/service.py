"""The NNRP service: listeners (NNRP side) + the adapter + a chat backend (vLLM side), on one event loop.

Runs on vLLM's API-server event loop: operations are asyncio tasks there; every native NNRP call runs on
the listener's and session pumps' own threads, never on the loop. Operation deadlines (envelope
``nnrp.timeout_ms``, NNRP DEADLINE) are loop timers: on expiry the operation's terminal is ``response.error``
``request_timeout`` and its task is cancelled, which aborts the vLLM request. One service per API-server
process: its limits and its shutdown are that process's.

Every finished operation's :class:`~vllm_nnrp_plugin.observation.Observation` goes, on the loop, to: one log
line (DEBUG when completed, INFO otherwise), the Prometheus collectors (:mod:`.metrics`), one span
(:mod:`.tracing`), then any extra ``observers`` (benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from vllm_nnrp_plugin import metrics, tracing
from vllm_nnrp_plugin.adapter import AdapterLimits, ChatBackend, run_operation
from vllm_nnrp_plugin.config import NNRPConfig
from vllm_nnrp_plugin.fault_injection import with_fault_injection
from vllm_nnrp_plugin.limits import SessionLimits, Slots
from vllm_nnrp_plugin.nnrp_binding.listener import Exposure, Listener
from vllm_nnrp_plugin.nnrp_binding.session import ServerOperation
from vllm_nnrp_plugin.observation import COMPLETED, Observation, log_fields, log_line

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 5.0  # longest wait at shutdown for the adapters to abort their vLLM requests


class NNRPService:
    """Start with :meth:`start` (binds, raises ``ListenError``; with ``metrics_listen`` also ``OSError``),
    stop with :meth:`stop`.

    ``registry``: where the NNRP metrics are registered (default ``prometheus_client.REGISTRY``, the one
    vLLM's ``/metrics`` serves); ``tracer``: where spans go (default: the package's tracer from the global
    provider); ``observers``: extra callables given each finished operation's record.
    """

    def __init__(
        self,
        config: NNRPConfig,
        backend: ChatBackend,
        loop: asyncio.AbstractEventLoop,
        *,
        registry: CollectorRegistry | None = None,
        tracer: Tracer | None = None,
        observers: Sequence[Callable[[Observation], None]] = (),
    ) -> None:
        self._backend = with_fault_injection(backend, config.fault_injection_backend_error_model)
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
        self.capabilities = self._backend.capabilities()
        self._tasks: dict[ServerOperation, asyncio.Task] = {}
        self._timers: dict[ServerOperation, asyncio.TimerHandle] = {}
        self._stopping = False
        self._stopped: asyncio.Future | None = None
        #: process-wide in-flight operations (``nnrp.max_in_flight``): taken by the session pumps at submit,
        #: given back here when the operation's task (including its vLLM abort) is done
        self.in_flight = Slots(config.max_in_flight)
        self._listener = Listener(
            config.listen,
            self,
            loop,
            accept_timeout_ms=config.accept_timeout_ms,
            idle_poll_ms=config.idle_poll_ms,
            max_sessions=config.max_sessions,
            session_limits=SessionLimits(config.max_in_flight_per_session, config.max_queued_events),
            in_flight=self.in_flight,
            exposure=Exposure(config.tls_cert_file, config.tls_key_file, config.ipc_socket_group),
        )

    @property
    def sessions(self) -> int:
        """Open NNRP sessions."""
        return self._listener.sessions

    def start(self) -> list[str]:
        """Bind every configured address; returns the bound URIs."""
        bound = self._listener.start()
        if self._config.metrics_listen is not None:
            try:
                self._metrics_server = metrics.serve_metrics(self._config.metrics_listen, self._registry)
            except BaseException:
                self._listener.close()
                raise
            self.metrics_address = self._metrics_server.address
        return bound

    async def stop(self) -> None:
        """Graceful stop, in this order: stop accepting sessions; give every in-flight operation its one
        terminal (``response.error`` ``server_shutdown``) and abort its vLLM request; end the sessions; unbind.
        Idempotent: a second call waits for the first."""
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            self._stopping = True
            self._listener.stop_accepting()
            tasks = list(self._tasks.items())
            logger.info("NNRP stopping: no new sessions; ending %d in-flight operations", len(tasks))
            for op, task in tasks:
                op.shut_down()  # decided now, before the engine's own shutdown can fail the stream
                task.cancel()
            if tasks:
                await asyncio.wait([task for _op, task in tasks], timeout=ABORT_WAIT_S)
            await asyncio.to_thread(self._listener.close)
            if self._metrics_server is not None:
                await asyncio.to_thread(self._metrics_server.close)
        finally:
            self._stopped.set_result(None)

    # SessionHandler (called on the loop by the session pumps)

    def on_submit(self, op: ServerOperation) -> None:
        if self._stopping:
            op.shut_down()
            self.in_flight.give_back()
            op.settle()  # no task will run
            return
        task = asyncio.get_running_loop().create_task(
            run_operation(op, self._backend, self._limits, self.capabilities)
        )
        self._tasks[op] = task
        task.add_done_callback(lambda _t, op=op: self._done(op))

    def on_stop(self, op: ServerOperation) -> None:
        task = self._tasks.get(op)
        if task is not None:
            task.cancel()

    def on_deadline(self, op: ServerOperation) -> None:
        if op not in self._tasks or op.expires_unix_ms is None:
            return
        old = self._timers.pop(op, None)
        if old is not None:
            old.cancel()
        delay_s = max(0.0, op.expires_unix_ms / 1000 - time.time())
        self._timers[op] = asyncio.get_running_loop().call_later(delay_s, self._expire, op)

    def _expire(self, op: ServerOperation) -> None:
        self._timers.pop(op, None)
        op.time_out()
        task = self._tasks.get(op)
        if task is not None:
            task.cancel()

    def on_finished(self, op: ServerOperation) -> None:
        record = op.observation
        level = logging.DEBUG if record.outcome == COMPLETED else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, "%s", log_line(record), extra={"nnrp": log_fields(record)})
        self._metrics.observe(record)
        tracing.emit_span(self._tracer, record)
        for observer in self._observers:
            observer(record)

    def on_session(self, transport: str, opened: bool) -> None:
        self._metrics.session(transport, opened)

    def _done(self, op: ServerOperation) -> None:
        self._tasks.pop(op, None)
        timer = self._timers.pop(op, None)
        if timer is not None:
            timer.cancel()
        self.in_flight.give_back()
        op.settle()

"""The asyncio shell of :mod:`vllm_nnrp_plugin.client.fleet.policy`: one pool of sessions
(:class:`vllm_nnrp_plugin.client.aio.pool.Pool`) per replica, a call placed on the replica with the most free
capacity, and a call whose replica went away before it produced anything submitted once more elsewhere.

::

    pool = FleetPool(["tcp://127.0.0.2:9400", "tcp://127.0.0.3:9400"])   # or "tcp://a:9400,tcp://b:9400",
                                                                          # or ["tcp://replicas.internal:9400"]
    op = await pool.submit(envelope)      # a FailoverOperation: async for, batch(), result(), cancel()
    async for event in op: ...
    await pool.aclose()

It is also what the ``openai`` transports run on when given several addresses or a list
(:mod:`vllm_nnrp_plugin.client.openai.transport`): :meth:`FleetPool.acquire` / :meth:`FleetPool.release` are the
single-replica pool's, and the lane it hands out submits :class:`FailoverOperation` s.

* **Placement and health**: :class:`vllm_nnrp_plugin.client.fleet.policy.Fleet` with each replica's
  :class:`~vllm_nnrp_plugin.client.fleet.policy.Load` read from its pool (the first session's grant, the pool's
  operations in flight, its BACKPRESSURE holds).
  A replica whose connect or first session fails is out (the call tries the next replica at once; a wrong API
  key is not a replica's fault and is raised); one that sends the drain BACKPRESSURE
  (:mod:`vllm_nnrp_plugin.contract.draining`) is draining: its pool is retired (running operations finish on it;
  it is closed once they did) and the next call there opens a fresh pool.
* **Failover**: :class:`FailoverOperation` reads the first event of its operation; when the first read says the
  replica went away (:func:`vllm_nnrp_plugin.client.fleet.policy.unstarted_failure`) the same envelope is
  submitted on another replica (at most :func:`~vllm_nnrp_plugin.client.fleet.policy.max_attempts` submits),
  transparently to the reader. Once an event was read, a failure is the reader's (``ClientConnectionError``; the
  SDK's ``APIConnectionError``): never retried.
* **Names**: a ``tcp://`` / ``ws://`` address whose host is a name is resolved (``loop.getaddrinfo``) before the
  first call and again every :data:`~vllm_nnrp_plugin.client.fleet.policy.RESOLVE_EVERY_S`; each address found is a
  replica. A failed
  resolution keeps the last addresses (the first one failing fails the call with ``ClientConnectionError``).

Everything runs on the loop the pool is made on (no locks). Time: ``time.monotonic`` seconds.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from vllm_nnrp_plugin.client.aio.connection import address_of
from vllm_nnrp_plugin.client.aio.pool import Lane, Pool
from vllm_nnrp_plugin.client.errors import AuthenticationFailed, ClientConnectionError, ClientError
from vllm_nnrp_plugin.client.fleet import policy
from vllm_nnrp_plugin.contract import draining

__all__ = ["FailoverOperation", "FleetLane", "FleetPool", "check_spec", "is_fleet"]

_BACKPRESSURE_KIND = 0x39  # NNRP/1 message type BACKPRESSURE
Resolver = Callable[[str, int], Awaitable[list[str]]]


def check_spec(spec: str | Sequence[str]) -> tuple[str, ...]:
    """The addresses of ``spec`` (:func:`vllm_nnrp_plugin.client.fleet.policy.addresses_of`), each checked as
    :func:`vllm_nnrp_plugin.client.aio.connection.connect` would. Raises
    :class:`~vllm_nnrp_plugin.client.errors.ClientAddressError` (a ``ValueError``)."""
    addresses = policy.addresses_of(spec)
    for address in addresses:
        address_of(address)
    return addresses


def is_fleet(spec: str | Sequence[str]) -> bool:
    """``spec`` asks for fleet mode: a list (even of one address), or a string naming several."""
    return not isinstance(spec, str) or len(policy.addresses_of(spec)) > 1


async def _resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (TCP), in the resolver's order, duplicates dropped."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _ReplicaPool(Pool):
    """The pool of one replica: a :class:`Pool` that tells the fleet about the drain BACKPRESSURE."""

    def __init__(self, address: str, on_drain: Callable[[_ReplicaPool], None], **options: Any) -> None:
        super().__init__(address, **options)
        self.address = address
        self.retired = False
        self._on_drain = on_drain

    def _pressure(self, lane: Lane, event: Any) -> None:
        super()._pressure(lane, event)
        if draining.is_drain_signal(
            event.kind == _BACKPRESSURE_KIND, event.credit_window, event.pressure_level, event.pressure_reason
        ):
            self._on_drain(self)

    def load(self, now: float) -> policy.Load:
        """What NNRP told the client about this replica (:class:`vllm_nnrp_plugin.client.fleet.policy.Load`)."""
        lanes = [lane for link in self._live_links() for lane in link.lanes]
        if not lanes:
            return policy.Load(None, self.in_flight)
        held = all(lane.held_until is not None and now < lane.held_until for lane in lanes)
        return policy.Load(lanes[0].session.max_in_flight_operations, self.in_flight, held)


class FleetLane:
    """One slot taken on a replica: ``session.submit(...)`` submits a :class:`FailoverOperation` there (the
    object the ``openai`` exchange uses as a pool's lane)."""

    __slots__ = ("fleet_pool", "pool", "lane", "session")

    def __init__(self, fleet_pool: FleetPool, pool: _ReplicaPool, lane: Lane) -> None:
        self.fleet_pool, self.pool, self.lane = fleet_pool, pool, lane
        self.session = self  # the exchange calls ``lane.session.submit``

    def submit(self, envelope: dict[str, Any] | bytes, **options: Any) -> FailoverOperation:
        """Submit ``envelope`` on this lane's session (``options`` as
        :meth:`vllm_nnrp_plugin.client.aio.connection.Session.submit`); raises as that method (the slot is then
        given back)."""
        return FailoverOperation(self.fleet_pool, self, envelope, options)


class FleetPool:
    """Sessions to a fleet of replicas (module docstring). ``spec``: a list of NNRP addresses or a string of
    comma-separated ones; ``options``: every replica pool's (:class:`vllm_nnrp_plugin.client.aio.pool.Pool`:
    ``api_key``, ``trusted_cert_der``, ``tls_ca_file``, ``priority_class``, ``max_connections``,
    ``max_sessions_per_connection``); ``resolve``: ``await resolve(host, port)`` → addresses (default
    ``loop.getaddrinfo``). Made on the running loop that runs it. Raises ``ValueError`` for an unusable spec."""

    def __init__(self, spec: str | Sequence[str], *, resolve: Resolver | None = None, **options: Any) -> None:
        self.specs = check_spec(spec)
        self.loop = asyncio.get_running_loop()
        self._options = options
        self._resolve = resolve or _resolve
        self._names = {s: policy.resolvable(s) for s in self.specs}
        self._resolved_at: float | None = None if any(self._names.values()) else float("inf")
        self._resolving: asyncio.Task | None = None
        self.fleet = policy.Fleet(self.specs)  # replaced by the resolved addresses before the first call
        self._pools: dict[str, _ReplicaPool] = {}
        self._retired: list[_ReplicaPool] = []
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.failovers = 0  # calls submitted once more after their replica went away unstarted

    # -- API -----------------------------------------------------------------------------------------------

    @property
    def sessions(self) -> int:
        """Sessions open over every replica."""
        return sum(pool.sessions for pool in [*self._pools.values(), *self._retired])

    @property
    def in_flight(self) -> int:
        """Operations without their terminal yet, over every replica."""
        return sum(pool.in_flight for pool in [*self._pools.values(), *self._retired])

    def loads(self) -> dict[str, policy.Load]:
        """Each replica's :class:`~vllm_nnrp_plugin.client.fleet.policy.Load` now."""
        now = time.monotonic()
        return {a: (self._pools[a].load(now) if a in self._pools else policy.Load()) for a in self.fleet.addresses}

    async def submit(
        self, envelope: dict[str, Any] | bytes, *, timeout_s: float | None = None, **options: Any
    ) -> FailoverOperation:
        """Submit ``envelope`` on the replica with the most free capacity (waiting at most ``timeout_s`` for a
        slot); ``options`` as :meth:`vllm_nnrp_plugin.client.aio.connection.Session.submit`. The operation gives
        its slot back when its terminal arrived. Raises as :meth:`acquire`."""
        lane = await self.acquire(timeout_s)
        try:
            op = lane.session.submit(envelope, **options)
        except BaseException:
            self.release(lane)
            raise
        op.when_done(lambda: self.release(lane))
        return op

    async def acquire(
        self, timeout_s: float | None = None, *, exclude: Sequence[str] = (), **options: Any
    ) -> FleetLane:
        """A slot on the replica :meth:`Fleet.choose` picks (not one of ``exclude``), trying the next one
        at once when a replica cannot give one (it is then out). ``timeout_s``: the longest wait for a slot
        on the replica chosen (s; None: unbounded); ``options``: passed to the replica pool's ``acquire``.
        Raises ``TimeoutError``, :class:`AuthenticationFailed`, :class:`ClientConnectionError` when no replica
        gives a slot (naming each one's state)."""
        if self._closed:
            raise ClientConnectionError("the NNRP fleet client is closed")
        await self._refresh()
        tried = set(exclude)
        last: ClientError | None = None
        while True:
            address = self.fleet.choose(time.monotonic(), self.loads(), tried)
            if address is None:
                raise ClientConnectionError(f"no replica could take the call: {self.fleet.summary()}") from last
            tried.add(address)
            pool = self._pool_of(address)
            try:
                lane = await pool.acquire(timeout_s, **options)
            except AuthenticationFailed:
                self.fleet.reached(address)  # it answered
                raise
            except ClientError as exc:
                self._lost(pool, str(exc))
                last = exc
                continue
            except BaseException:  # the caller's pool timeout, a cancel: the replica's health is not known
                self.fleet.abandoned(address)
                raise
            self.fleet.reached(address)
            return FleetLane(self, pool, lane)

    def release(self, lane: FleetLane) -> None:
        """The call on ``lane`` ended (its slots on the replicas are given back by the operations themselves)."""

    async def aclose(self) -> None:
        """Close every replica's pool (idempotent)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        pools = [*self._pools.values(), *self._retired]
        self._pools, self._retired = {}, []
        await asyncio.gather(*(pool.aclose() for pool in pools), return_exceptions=True)

    def abort(self) -> None:
        """:meth:`aclose` without the close handshakes (a loop about to stop)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for pool in [*self._pools.values(), *self._retired]:
            pool.abort()
        self._pools, self._retired = {}, []

    # -- replicas ----------------------------------------------------------------------------------------------

    def _pool_of(self, address: str) -> _ReplicaPool:
        pool = self._pools.get(address)
        if pool is None:
            pool = self._pools[address] = _ReplicaPool(address, self._drained, **self._options)
        return pool

    def _drained(self, pool: _ReplicaPool) -> None:
        """``pool``'s replica drains: new calls elsewhere; its running operations finish on it."""
        self.fleet.draining(pool.address, time.monotonic())
        self._retire(pool)

    def _lost(self, pool: _ReplicaPool, reason: str) -> None:
        """``pool``'s replica is out (connect refused, session refused, connection lost)."""
        self.fleet.failed(pool.address, time.monotonic(), reason)
        self._retire(pool)

    def _retire(self, pool: _ReplicaPool) -> None:
        if self._pools.get(pool.address) is pool:
            del self._pools[pool.address]
        if not pool.retired:
            pool.retired = True
            self._retired.append(pool)
            self._close_when_idle(pool)

    def _close_when_idle(self, pool: _ReplicaPool) -> None:
        """Close a retired pool once its operations ended (their own slots are given back as they end)."""
        if pool.retired and pool.in_flight == 0 and pool in self._retired:
            self._retired.remove(pool)
            self._spawn(pool.aclose())

    def _slot_freed(self, pool: _ReplicaPool, lane: Lane) -> None:
        pool.release(lane)
        if pool.retired:
            self._close_when_idle(pool)

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh(self) -> None:
        """Resolve the names of the spec when due (the first time before any call, later in the background)."""
        if self._resolved_at is None:
            await self._resolve_names()
            if self._resolved_at is None:
                raise ClientConnectionError(f"cannot resolve {', '.join(self.specs)}")
        elif time.monotonic() - self._resolved_at >= policy.RESOLVE_EVERY_S and self._resolving is None:
            self._resolving = self.loop.create_task(self._resolve_names())
            self._resolving.add_done_callback(lambda _t: setattr(self, "_resolving", None))

    async def _resolve_names(self) -> None:
        """Resolve every name of the spec; the addresses found replace the replica set (kept ones keep their
        health and pools; removed ones are retired). A name that fails keeps the last set, except the first
        time, when whatever was found is used (nothing found: the call fails)."""
        addresses: list[str] = []
        failed = False
        for spec in self.specs:
            name = self._names[spec]
            if name is None:
                addresses.append(spec)
                continue
            try:
                ips = await self._resolve(*name)
            except (OSError, UnicodeError):
                failed = True
                continue
            addresses.extend(policy.with_host(spec, ip) for ip in ips)
        addresses = list(dict.fromkeys(addresses))
        first = self._resolved_at is None
        if not addresses or failed and not first:
            if not first:
                self._resolved_at = time.monotonic()  # keep the last set; try again later
            return
        if first:
            self.fleet = policy.Fleet(addresses)
        else:
            _added, removed = self.fleet.set_addresses(addresses)
            for address in removed:
                pool = self._pools.get(address)
                if pool is not None:
                    self._retire(pool)
        self._resolved_at = time.monotonic()


class FailoverOperation:
    """One call's operation over a fleet: :class:`vllm_nnrp_plugin.client.aio.connection.Operation`'s reading API
    (``async for``, :meth:`batch`, :meth:`result`, :meth:`cancel`, :meth:`when_done`, ``finished``, ``done``,
    ``status_code``, ``drop_reason_code``; the runtime controls act on the current submit) over one submit, or
    more when the replica of the first went away before it produced anything (module docstring)."""

    def __init__(
        self, fleet_pool: FleetPool, lane: FleetLane, envelope: dict[str, Any] | bytes, options: dict[str, Any]
    ) -> None:
        self._fleet_pool = fleet_pool
        self._envelope = envelope
        self._options = options
        self._attempts = policy.Attempts()
        self._on_done: list[Callable[[], None]] = []
        self._finished_failover = False  # no more submits will come (the callbacks ran or will run)
        self._op: Any = None
        self._submit(lane)

    def _submit(self, lane: FleetLane) -> None:
        pool, inner = lane.pool, lane.lane
        self._attempts.submitted(pool.address)
        self._pool = pool
        try:
            op = inner.session.submit(self._envelope, **self._options)
        except ClientError as exc:  # the connection was lost just now: the first read moves the call
            self._fleet_pool._slot_freed(pool, inner)
            self._op = _Failed(exc)
            return
        except BaseException:
            self._fleet_pool._slot_freed(pool, inner)
            raise
        self._op = op
        op.when_done(lambda: self._inner_done(pool, inner, op))

    def _inner_done(self, pool: _ReplicaPool, inner: Lane, op: Any) -> None:
        """One submit ended: its slot is given back; the call is done unless the reader may still move it."""
        self._fleet_pool._slot_freed(pool, inner)
        if op is self._op and (self._attempts.started or self._attempts.cancelled):
            self._done()

    def _done(self) -> None:
        if self._finished_failover:
            return
        self._finished_failover = True
        callbacks, self._on_done = self._on_done, []
        for callback in callbacks:
            callback()

    # -- the Operation API ---------------------------------------------------------------------------------

    @property
    def operation_id(self) -> int:
        return self._op.operation_id

    @property
    def status_code(self) -> int | None:
        return self._op.status_code

    @property
    def drop_reason_code(self) -> int | None:
        return self._op.drop_reason_code

    @property
    def done(self) -> bool:
        """The call's last submit has its terminal (or failed)."""
        return self._finished_failover or self._attempts.started and self._op.done

    @property
    def finished(self) -> bool:
        return self._op.finished

    @property
    def attempts(self) -> int:
        """Submits so far (1 unless the call was moved to another replica)."""
        return self._attempts.count

    @property
    def replica(self) -> str:
        """The address of the replica the current submit runs on."""
        return self._pool.address

    def when_done(self, callback: Callable[[], None]) -> None:
        """``callback()`` once the call's last submit has its terminal (or failed), read or not."""
        if self._finished_failover:
            callback()
        else:
            self._on_done.append(callback)

    def cancel(self) -> None:
        self._attempts.cancelled = True
        self._op.cancel()
        if self._op.done:
            self._done()

    def __getattr__(self, name: str) -> Any:  # update_priority, supersede, update_budget, deadline, expire_at
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._op, name)

    def __aiter__(self) -> FailoverOperation:
        return self

    async def __anext__(self) -> dict[str, Any]:
        (event,) = await self._read(self._next_event)
        return event

    async def batch(self) -> list[dict[str, Any]]:
        """As :meth:`vllm_nnrp_plugin.client.aio.connection.Operation.batch`, over the submits of the call."""
        return await self._read(lambda: self._op.batch())

    async def result(self) -> dict[str, Any]:
        """The terminal event of the call's last submit (partials skipped)."""
        while True:
            event = await self.__anext__()
            if self._op.finished:
                return event

    async def _next_event(self) -> list[dict[str, Any]]:
        return [await self._op.__anext__()]

    async def _read(self, read: Callable[[], Awaitable[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
        """The next events of the call: ``await read()`` on the current submit (one event, or a batch; [] once
        its events ended), read again on another replica while the submit ended before producing anything
        (:meth:`_moved`). Raises what ``read`` raises when the call is not moved (``StopAsyncIteration``,
        :class:`ClientError`)."""
        while True:
            try:
                events = await read()
            except ClientError as exc:
                if await self._moved(exc):
                    continue
                self._done()
                raise
            if not events:
                return events
            if not self._attempts.started and await self._moved(
                events[0], terminal=self._op.finished and len(events) == 1
            ):  # only a call's first read may move it (no coroutine per event after that)
                continue
            self._attempts.started = True
            if self._op.finished:
                self._done()
            return events

    async def _moved(self, failure: dict[str, Any] | ClientError, *, terminal: bool = True) -> bool:
        """The current submit's first read gave ``failure`` (the failure it raised, or its first event,
        ``terminal`` when its only one): when :meth:`vllm_nnrp_plugin.client.fleet.policy.Attempts.may_move`
        allows, its replica is out (a failure) or draining (an event), the call is submitted once more on another
        replica and True; else False (the failure or event is the caller's)."""
        fleet_pool, pool = self._fleet_pool, self._pool
        replicas = fleet_pool.fleet.replicas
        if not self._attempts.may_move(
            failure, len(replicas), drop_reason=self._op.drop_reason_code, terminal=terminal
        ):
            return False
        if isinstance(failure, ClientError):
            fleet_pool._lost(pool, str(failure))
        else:
            fleet_pool._drained(pool)
        try:
            lane = await fleet_pool.acquire(None, exclude=self._attempts.excluded(replicas))
        except ClientError:
            self._done()
            return False
        if self._attempts.cancelled:
            fleet_pool._slot_freed(lane.pool, lane.lane)
            self._done()
            return False
        fleet_pool.failovers += 1
        self._submit(lane)
        return True


class _Failed:
    """A submit that raised (its connection was lost as it was sent): read, it raises that failure."""

    operation_id = 0
    status_code = None
    drop_reason_code = None
    done = True
    finished = False

    def __init__(self, error: ClientError) -> None:
        self._error = error

    async def __anext__(self) -> dict[str, Any]:
        raise self._error

    async def batch(self) -> list[dict[str, Any]]:
        raise self._error

    def cancel(self) -> None:
        pass

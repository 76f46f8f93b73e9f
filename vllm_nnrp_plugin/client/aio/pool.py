"""A fan-out of the asyncio client: NNRP sessions on connections to one endpoint, on one event loop, sized by the
server's credit, so that N concurrent calls of one client all run, as over HTTP, instead of being refused. What the
``openai`` transports (:mod:`vllm_nnrp_plugin.client.openai`) run on, one per replica under a fleet
(:mod:`vllm_nnrp_plugin.client.fleet.pool`).

::

    pool = Pool("tcp://127.0.0.1:9400")        # on the loop that will run it
    lane = await pool.acquire(timeout_s=600)   # a session with a free operation slot (waits FIFO when none)
    op = lane.session.submit(envelope)
    op.when_done(lambda: pool.release(lane))   # the slot is free once the server's terminal arrived
    ...
    await pool.aclose()

Policy (the server's side is docs/operating.md *Limits and backpressure*; its defaults are the ``nnrp.*`` settings):

* **Credit of a session** = what its SESSION_OPEN_ACK granted (``max_in_flight_operations``; the plugin's server
  grants ``nnrp.max_in_flight_per_session``, by default vLLM's ``max_num_seqs``) minus its operations without a
  terminal yet; 0 while a BACKPRESSURE (credit window 0) holds: until the session's CREDIT_UPDATE or the
  BACKPRESSURE's ``retry_after_ms`` (at most :data:`HOLD_MAX_S` when it names none).
* **Total**: the operations in flight over the whole pool stay at most the capability document's
  ``limits.max_in_flight`` (the server's ``nnrp.max_in_flight``, none by default; fetched once per connection
  with ``nnrp.capabilities``, :func:`vllm_nnrp_plugin.profile.capabilities.with_limits`), and the sessions at most
  its ``limits.max_sessions``. A server whose document has no ``limits`` bounds only by credit.
* **Growing**: a call that finds no credit waits in one FIFO queue; while more calls wait than the sessions being
  opened will take (:data:`SESSION_CREDIT_GUESS` each), the pool opens another session on a connection with fewer
  than ``max_sessions_per_connection`` (default :data:`MAX_SESSIONS_PER_CONNECTION`), else another connection (at
  most ``max_connections``, default :data:`MAX_CONNECTIONS`). With the defaults one client runs up to 16 × 16 =
  256 operations at once, the server's default process limit; more wait here.
* **Shrinking**: a session other than the pool's first that stays idle :data:`IDLE_CLOSE_S` is closed (its
  server-side session ends, so idle clients do not hold ``nnrp.max_sessions``), and a connection other than the
  first once it has no session.
* **Refused opens**: a session the server refuses (``max_sessions`` reached) is not asked for again on that
  connection for :data:`REFUSED_OPEN_BACKOFF_S`; waiting calls keep their place. A call fails
  (:class:`~vllm_nnrp_plugin.client.errors.ClientError`) only when the pool has no session at all and cannot
  open one: the connect failed or the server refused the first session.
* **Lost connections** are forgotten when found lost; their operations fail (the connection fails them) and the
  next call connects again, so a restarted server is picked up.

Everything runs on the pool's loop (no locks). Time in seconds, ``time.monotonic``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

from nnrp.core.enums import MessageType

from vllm_nnrp_plugin.client.aio.connection import Connection, Session, connect
from vllm_nnrp_plugin.client.errors import ClientConnectionError, ClientError
from vllm_nnrp_plugin.core.controls import priority_class_of
from vllm_nnrp_plugin.nnrp_wire import events as ev
from vllm_nnrp_plugin.profile import SCHEMA_VERSION
from vllm_nnrp_plugin.profile.capabilities import CAPABILITIES_OPERATION

__all__ = ["IDLE_CLOSE_S", "MAX_CONNECTIONS", "MAX_SESSIONS_PER_CONNECTION", "Lane", "Pool"]

#: connections per pool (one NNRP connection multiplexes its sessions; one is enough for one client process)
MAX_CONNECTIONS = 1
#: sessions per connection: with the server's 16 operations per session, 256 in flight (its default process limit)
MAX_SESSIONS_PER_CONNECTION = 16
#: operations a session asks for in its SESSION_OPEN: nnrp-py's own default, the most nnrp-py's native server (the
#: ``nnrps`` carrier) accepts; the plugin's own wire core grants its per-session limit whatever is asked, and the
#: pool uses what the acknowledgement grants
REQUESTED_IN_FLIGHT = 4
#: the credit a session still being opened is expected to bring (the server's default per-session limit)
SESSION_CREDIT_GUESS = 16
#: idle time after which an extra session (not the pool's first) is closed, s
IDLE_CLOSE_S = 5.0
#: how long a connection whose session open was refused is not asked for another, s
REFUSED_OPEN_BACKOFF_S = 1.0
#: the longest a BACKPRESSURE without ``retry_after_ms`` holds a session without its CREDIT_UPDATE, s
HOLD_MAX_S = 1.0
#: the longest a connect (the carrier's — TCP, TLS, WebSocket Upgrade, QUIC handshake —, then the first session and the
#: capability document) may take when the caller names no connect timeout, s (the openai SDK's default connect
#: timeout, ``openai._constants.DEFAULT_TIMEOUT``)
CONNECT_TIMEOUT_S = 5.0

_BACKPRESSURE = int(MessageType.BACKPRESSURE)


class Lane:
    """One pooled session: ``session`` and its operations in flight; held by a BACKPRESSURE until
    ``held_until`` (monotonic s)."""

    __slots__ = ("session", "link", "in_flight", "held_until", "idle_timer")

    def __init__(self, session: Session, link: _Link) -> None:
        self.session = session
        self.link = link
        self.in_flight = 0
        self.held_until: float | None = None
        self.idle_timer: asyncio.TimerHandle | None = None

    def free(self, now: float) -> int:
        if self.held_until is not None:
            if now < self.held_until:
                return 0
            self.held_until = None
        return self.session.max_in_flight_operations - self.in_flight


class _Link:
    """One connection of the pool and its lanes."""

    __slots__ = ("conn", "lanes", "opening", "refused_until")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lanes: list[Lane] = []
        self.opening = 0  # session opens under way
        self.refused_until = 0.0


class Pool:
    """Sessions to ``uri`` (any form of :func:`vllm_nnrp_plugin.client.aio.connection.connect`: ``tcp://``,
    ``unix://``, ``ws://``, and the TLS ones ``nnrps://``, ``wss://``, ``quic://`` with ``trusted_cert_der`` (DER),
    ``tls_ca_file`` (PEM) or the system's trust store) for one client and one ``api_key`` (sent by
    every connection it makes), on the running loop it is made on (module docstring for the policy). Every
    session opens with ``priority_class`` (``"interactive"`` / ``"balanced"`` / ``"background"``; ``ValueError``
    for another)."""

    def __init__(
        self,
        uri: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_sessions_per_connection: int = MAX_SESSIONS_PER_CONNECTION,
        trusted_cert_der: bytes | None = None,
        tls_ca_file: str | None = None,
        api_key: str | None = None,
        priority_class: str = "balanced",
    ) -> None:
        priority_class_of(priority_class)
        self.priority_class = priority_class
        self.uri = uri
        self.trusted_cert_der = trusted_cert_der
        self.tls_ca_file = tls_ca_file
        self.api_key = api_key
        self.max_connections = max_connections
        self.max_sessions_per_connection = max_sessions_per_connection
        self.loop = asyncio.get_running_loop()
        self._links: list[_Link] = []
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[Lane]] = collections.deque()
        self._in_flight = 0
        #: the server's ``limits`` (capability document), None until known or when it declares none
        self._max_in_flight: int | None = None
        self._max_sessions: int | None = None
        self._tasks: set[asyncio.Task] = set()
        self._connect_timeout_s: float | None = CONNECT_TIMEOUT_S  # the latest call's connect timeout
        self._wake_timer: asyncio.TimerHandle | None = None
        self._closed = False
        # cancelled when the loop shuts down (``asyncio.run`` cancels every task): the connections are dropped
        # then, so a pool nobody closed leaves no open socket behind
        self._keeper = self.loop.create_task(self._keep())

    async def _keep(self) -> None:
        try:
            await self.loop.create_future()
        except asyncio.CancelledError:
            self.abort()
            raise

    # -- API -----------------------------------------------------------------------------------------------

    @property
    def sessions(self) -> int:
        """Sessions open in the pool."""
        return sum(len(link.lanes) for link in self._links)

    @property
    def in_flight(self) -> int:
        """Operations submitted through the pool without their terminal yet."""
        return self._in_flight

    async def acquire(
        self, timeout_s: float | None = None, *, connect_timeout_s: float | None = CONNECT_TIMEOUT_S
    ) -> Lane:
        """A lane with one operation slot taken for the caller (give it back with :meth:`release`). Waits FIFO
        for at most ``timeout_s`` (the request's pool timeout, s; None: unbounded); a connection the pool opens
        for it has ``connect_timeout_s`` (the request's connect timeout, s; None: unbounded) for the carrier's
        connect, then again for its first session and the capability document. Raises ``TimeoutError``,
        :class:`ClientError` when no session can be had (cannot connect, the server refused every session, the
        pool is closed)."""
        if self._closed:
            raise ClientConnectionError("the NNRP transport is closed")
        self._connect_timeout_s = connect_timeout_s
        if not self._waiters:
            lane = self._find(time.monotonic())
            if lane is not None:
                self._take(lane)
                return lane
        waiter = self.loop.create_future()
        self._waiters.append(waiter)
        self._pump()
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # given a slot just as the caller stopped waiting
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def release(self, lane: Lane) -> None:
        """Give back the slot :meth:`acquire` took (its operation's terminal arrived, or it was never submitted)."""
        lane.in_flight -= 1
        self._in_flight -= 1
        if lane.in_flight == 0 and not self._is_first(lane) and not self._closed:
            lane.idle_timer = self.loop.call_later(IDLE_CLOSE_S, self._close_idle, lane)
        self._pump()

    async def aclose(self) -> None:
        """Fail every waiting call, close every session and connection (operations still running get their
        terminals until their session's close is acknowledged). Idempotent."""
        self._closed = True
        self._keeper.cancel()
        self._fail_waiters(ClientConnectionError("the NNRP transport was closed"))
        for task in list(self._tasks):
            task.cancel()
        if self._wake_timer is not None:
            self._wake_timer.cancel()
        links, self._links = self._links, []
        for link in links:
            for lane in link.lanes:
                if lane.idle_timer is not None:
                    lane.idle_timer.cancel()
        await asyncio.gather(*(link.conn.close() for link in links), return_exceptions=True)

    def abort(self) -> None:
        """:meth:`aclose` without the close handshakes, for a loop that is about to stop: every connection's
        transport is aborted now (their sockets are closed in the loop's next iteration)."""
        self._closed = True
        if self._keeper is not asyncio.current_task():
            self._keeper.cancel()
        self._fail_waiters(ClientConnectionError("the NNRP transport was closed"))
        for task in list(self._tasks):
            task.cancel()
        links, self._links = self._links, []
        for link in links:
            link.conn.abort()

    # -- taking and giving -----------------------------------------------------------------------------------

    def _is_first(self, lane: Lane) -> bool:
        return bool(self._links) and self._links[0] is lane.link and lane.link.lanes[:1] == [lane]

    def _live_links(self) -> list[_Link]:
        live = [link for link in self._links if not link.conn.lost]
        if len(live) != len(self._links):
            self._links = live
        return live

    def _find(self, now: float) -> Lane | None:
        if self._max_in_flight is not None and self._in_flight >= self._max_in_flight:
            return None
        for link in self._live_links():
            for lane in link.lanes:
                if not lane.session.closing and lane.free(now) > 0:
                    return lane
        return None

    def _take(self, lane: Lane) -> None:
        lane.in_flight += 1
        self._in_flight += 1
        if lane.idle_timer is not None:
            lane.idle_timer.cancel()
            lane.idle_timer = None

    def _pump(self) -> None:
        """Give free slots to the waiting calls in order, then grow the pool for the ones left."""
        if self._closed:
            return
        now = time.monotonic()
        waiters = self._waiters
        while waiters:
            if waiters[0].done():  # the caller gave up
                waiters.popleft()
                continue
            lane = self._find(now)
            if lane is None:
                break
            self._take(lane)
            waiters.popleft().set_result(lane)
        if waiters:
            self._grow(now)
            self._wake_when_held(now)

    def _wake_when_held(self, now: float) -> None:
        """Pump again when the earliest BACKPRESSURE hold ends (no CREDIT_UPDATE may come)."""
        holds = [lane.held_until for link in self._links for lane in link.lanes if lane.held_until is not None]
        if holds and self._wake_timer is None:
            self._wake_timer = self.loop.call_later(max(0.0, min(holds) - now), self._woken)

    def _woken(self) -> None:
        self._wake_timer = None
        self._pump()

    def _grow(self, now: float) -> None:
        waiting = sum(1 for waiter in self._waiters if not waiter.done())
        opening = self._connecting + sum(link.opening for link in self._links)
        if waiting <= opening * SESSION_CREDIT_GUESS:
            return
        if self._max_sessions is not None and self.sessions + opening >= self._max_sessions:
            return
        links = self._live_links()
        for link in links:
            if len(link.lanes) + link.opening < self.max_sessions_per_connection and now >= link.refused_until:
                link.opening += 1
                self._spawn(self._open_session(link))
                return
        if len(links) + self._connecting < self.max_connections:
            self._connecting += 1
            self._spawn(self._connect())

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- growing ---------------------------------------------------------------------------------------------

    async def _connect(self) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                conn = await connect(
                    self.uri, api_key=self.api_key, trusted_cert_der=self.trusted_cert_der, tls_ca_file=self.tls_ca_file
                )
        except (ClientError, TimeoutError) as exc:
            exc = (
                exc
                if isinstance(exc, ClientError)
                else ClientConnectionError(f"cannot connect to {self.uri}: timed out")
            )
            self._connecting -= 1
            self._fail_if_stranded(exc)
            return
        link = _Link(conn)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                session = await conn.open_session(
                    max_in_flight_operations=REQUESTED_IN_FLIGHT, priority_class=self.priority_class
                )
                await self._read_limits(session)
        except (ClientError, TimeoutError) as exc:
            exc = exc if isinstance(exc, ClientError) else ClientConnectionError(f"{self.uri}: no session in time")
            self._connecting -= 1
            await conn.close()
            self._fail_if_stranded(exc)
            return
        self._connecting -= 1
        if self._closed:
            await conn.close()
            return
        self._links.append(link)
        self._add_lane(link, session)

    async def _read_limits(self, session: Session) -> None:
        """The server's ``limits`` from its capability document (none when it declares none or refuses)."""
        op = session.submit({"schema_version": SCHEMA_VERSION, "operation": CAPABILITIES_OPERATION, "body": {}})
        terminal = await op.result()
        limits = (terminal.get("body") or {}).get("limits") if terminal.get("type") == "response.completed" else None
        limits = limits if isinstance(limits, dict) else {}
        self._max_in_flight = _positive(limits.get("max_in_flight"))
        self._max_sessions = _positive(limits.get("max_sessions"))

    async def _open_session(self, link: _Link) -> None:
        try:
            session = await link.conn.open_session(
                max_in_flight_operations=REQUESTED_IN_FLIGHT, priority_class=self.priority_class
            )
        except ClientError as exc:
            link.opening -= 1
            link.refused_until = time.monotonic() + REFUSED_OPEN_BACKOFF_S
            self._fail_if_stranded(exc)
            return
        link.opening -= 1
        if self._closed or link not in self._links:
            with contextlib.suppress(ClientError):
                await session.close()
            return
        self._add_lane(link, session)

    def _add_lane(self, link: _Link, session: Session) -> None:
        lane = Lane(session, link)
        session.on_pressure = lambda event: self._pressure(lane, event)
        link.lanes.append(lane)
        self._pump()
        if lane.in_flight == 0 and not self._is_first(lane):
            lane.idle_timer = self.loop.call_later(IDLE_CLOSE_S, self._close_idle, lane)

    def _fail_if_stranded(self, exc: ClientError) -> None:
        """A connect or open failed: the waiting calls fail when nothing else can serve them, else they wait on."""
        if any(link.lanes for link in self._live_links()) or self._connecting:
            self._pump()
            return
        self._fail_waiters(exc)

    def _fail_waiters(self, exc: ClientError) -> None:
        waiters, self._waiters = self._waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc)

    # -- credit and shrinking ----------------------------------------------------------------------------------

    def _pressure(self, lane: Lane, event: ev.PressureReceived) -> None:
        if event.kind == _BACKPRESSURE and event.credit_window == 0:
            wait_s = event.retry_after_ms / 1000 if event.retry_after_ms else HOLD_MAX_S
            lane.held_until = time.monotonic() + wait_s
        else:  # CREDIT_UPDATE, or BACKPRESSURE with a window: the session takes work again
            lane.held_until = None
            self._pump()

    def _close_idle(self, lane: Lane) -> None:
        lane.idle_timer = None
        link = lane.link
        if lane.in_flight or self._closed or self._is_first(lane) or lane not in link.lanes:
            return
        link.lanes.remove(lane)
        if not link.lanes and link is not (self._links[0] if self._links else None) and not link.opening:
            with contextlib.suppress(ValueError):
                self._links.remove(link)
            self._spawn(link.conn.close())
        elif not lane.session.closing and not link.conn.lost:
            self._spawn(_close_quietly(lane.session))


async def _close_quietly(session: Session) -> None:
    with contextlib.suppress(ClientError):
        await session.close()


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

"""A fleet of replicas for the NNRP clients: which replica a new call goes to, which replicas are out and when
they are tried again, and which failures leave a call safe to submit once more elsewhere. Sans-IO: plain data in,
decisions out; time is passed in (``time.monotonic`` seconds). The asyncio shell is
:mod:`vllm_nnrp_plugin.client.fleet.pool`.

::

    fleet = Fleet(["tcp://127.0.0.2:9400", "tcp://127.0.0.3:9400"])
    address = fleet.choose(now, {"tcp://127.0.0.2:9400": Load(granted=8, in_flight=3), ...})
    fleet.reached(address)                 # a session is open there
    fleet.failed(address, now, "refused")  # connect refused, connection lost: out, tried again after a backoff
    fleet.draining(address, now)           # the replica said it drains (vllm_nnrp_plugin.contract.draining)

Addresses (:func:`addresses_of`): a list of NNRP URIs, or one string of comma-separated URIs; each is an address
:func:`vllm_nnrp_plugin.client.aio.connection.connect` takes. A ``tcp://`` or ``ws://`` URI whose host is a name is
resolved by the shell (every A/AAAA record becomes one replica, re-resolved every :data:`RESOLVE_EVERY_S`, as
gRPC's DNS resolver re-resolves; :func:`with_host`); TLS URIs (``nnrps://``, ``wss://``, ``quic://``) and
``unix://`` are taken as they are, since the certificate names the host (behind a balancer they are one replica
whose connections land where the balancer sends them).

Placement (:meth:`Fleet.choose`): among the replicas that are up, the one with the most free capacity, measured
by what NNRP told the client: ``granted`` is what the replica's SESSION_OPEN_ACK granted a session
(``max_in_flight_operations``; the plugin's server grants ``nnrp.max_in_flight_per_session``, by default vLLM's
``--max-num-seqs``, what its scheduler runs at once), ``in_flight`` the client's operations there without their
terminal, and a replica whose sessions are all held by a BACKPRESSURE has no free capacity. A replica not connected
yet counts :data:`UNKNOWN_FREE`. Ties go to the replica chosen least recently.

Health: ``up`` → ``out`` when a connect fails, a session is refused or the connection is lost (tried again after
:data:`BACKOFF_FIRST_S`, doubling up to :data:`BACKOFF_MAX_S`: one call then probes it, others go elsewhere);
``up`` → ``draining`` on the drain BACKPRESSURE (no new call there; after :data:`DRAIN_RECHECK_S` a fresh
connection is tried, which behind a balancer or a re-used name may reach another replica); back to ``up`` on
the next session opened there.

Saving calls (:func:`unstarted_failure`): a call whose first read ends in a lost connection, a closed session,
``response.error`` ``server_shutdown`` (the replica stopped or drains: docs/operating.md *Shutdown*) or a drop
with reason ``transport_closed`` (NNRP/1 drop reason 8) produced nothing, so it may be submitted again on another
replica; once any event was read it never is (the output would repeat). :class:`Attempts` keeps one call's submits
and says when it may be submitted once more (at most :func:`max_attempts` submits) and where not to.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs

from vllm_nnrp_plugin.client.errors import ClientAddressError, ClientError, ClientResponseError, ClientTimeout

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "DRAIN_RECHECK_S",
    "RESOLVE_EVERY_S",
    "UNKNOWN_FREE",
    "Attempts",
    "Fleet",
    "Load",
    "Replica",
    "addresses_of",
    "max_attempts",
    "resolvable",
    "unstarted_failure",
    "with_host",
]

#: first wait before a replica that failed is tried again, s
BACKOFF_FIRST_S = 0.25
#: longest wait before a replica that failed is tried again, s
BACKOFF_MAX_S = 5.0
#: how long a draining replica gets no call before a fresh connection to its address is tried, s
DRAIN_RECHECK_S = 1.0
#: how often a host name is resolved again, s (gRPC's DNS resolver: at most every 30 s)
RESOLVE_EVERY_S = 30.0
#: the free capacity assumed for a replica not connected yet (the plugin's default per-session credit guess)
UNKNOWN_FREE = 16
#: most submits of one call (the first one and the ones after a failure that left it unstarted)
MAX_ATTEMPTS = 4
#: NNRP/1 drop reason ``transport_closed`` (value registry "Reason And Stage Codes")
DROP_TRANSPORT_CLOSED = 8
#: the profile's error code of an operation the server ended because it stops or drains
SERVER_SHUTDOWN = "server_shutdown"

UP, DRAINING, OUT = "up", "draining", "out"
_RESOLVED_SCHEMES = ("tcp", "ws")


def addresses_of(spec: str | Sequence[str]) -> tuple[str, ...]:
    """The addresses of ``spec``: a list (tuple) of URIs, or a string of one or more comma-separated URIs;
    whitespace around each is dropped, duplicates keep their first place. Raises :class:`ClientAddressError` for
    an empty spec or one that is neither (each URI is checked by the caller with
    :func:`vllm_nnrp_plugin.client.aio.connection.address_of`)."""
    if isinstance(spec, str):
        items: Iterable[Any] = spec.split(",")
    elif isinstance(spec, Sequence):
        items = spec
    else:
        raise ClientAddressError(f"{spec!r}: give an NNRP address, several comma-separated, or a list of them")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ClientAddressError(f"{spec!r}: every address must be a non-empty string")
        if item.strip() not in out:
            out.append(item.strip())
    if not out:
        raise ClientAddressError(f"{spec!r}: no address given")
    return tuple(out)


def resolvable(uri: str) -> tuple[str, int] | None:
    """(host name, port) of a ``tcp://`` / ``ws://`` URI whose host is a name (not an IP literal), which the
    shell resolves into one replica per address; None for any other URI."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in _RESOLVED_SCHEMES or not parts.hostname or parts.port is None:
        return None
    try:
        ipaddress.ip_address(parts.hostname)
    except ValueError:
        return parts.hostname, parts.port
    return None


def with_host(uri: str, ip: str) -> str:
    """``uri`` with its host replaced by the address ``ip`` (IPv6 in brackets), port and path kept."""
    parts = urllib.parse.urlsplit(uri)
    host = f"[{ip}]" if ":" in ip else ip
    netloc = f"{host}:{parts.port}"
    if parts.username is not None:
        netloc = f"{parts.username}@{netloc}"
    return parts._replace(netloc=netloc).geturl()


def max_attempts(replicas: int) -> int:
    """Most submits of one call over ``replicas`` replicas: one per replica plus one (a fresh connection to an
    address behind a balancer may land elsewhere), at least 2, at most :data:`MAX_ATTEMPTS`."""
    return max(2, min(MAX_ATTEMPTS, replicas + 1))


def unstarted_failure(
    first: dict[str, Any] | ClientError, *, drop_reason: int | None = None, terminal: bool = True
) -> bool:
    """The first thing a call read, ``first`` (its first event, or the failure its first read raised), says the
    replica went away before the call produced anything (module docstring), so one more submit elsewhere is safe:
    a :class:`ClientError` other than a timeout (:class:`ClientTimeout`: the call was cancelled) or an undecodable
    answer (:class:`ClientResponseError`), or a terminal that is ``response.error`` ``server_shutdown`` or a drop
    with reason ``transport_closed`` (``drop_reason``, the NNRP code)."""
    if isinstance(first, ClientError):
        return not isinstance(first, ClientTimeout | ClientResponseError)
    if not terminal:
        return False
    if drop_reason is not None:
        return drop_reason == DROP_TRANSPORT_CLOSED
    error = first.get("error") if first.get("type") == "response.error" else None
    return isinstance(error, dict) and error.get("code") == SERVER_SHUTDOWN


@attrs.frozen
class Load:
    """What NNRP told the client about one replica: ``granted`` operations per session (SESSION_OPEN_ACK; None
    while not connected), ``in_flight`` operations of the client there, ``held``: every session is held by a
    BACKPRESSURE."""

    granted: int | None = None
    in_flight: int = 0
    held: bool = False

    @property
    def free(self) -> int:
        """Free capacity (operations; negative when the client runs more there than a session was granted)."""
        if self.held:
            return min(0, -self.in_flight)
        return (UNKNOWN_FREE if self.granted is None else self.granted) - self.in_flight


@attrs.define
class Replica:
    """One address's health: ``state`` ``up`` / ``draining`` / ``out``; ``retry_at`` (monotonic s) when an
    ``out`` or ``draining`` replica is tried again; ``failures`` in a row; ``reason`` of the last one;
    ``probing``: one call is trying it again now; ``chosen_at`` (monotonic s) of its last choice."""

    address: str
    state: str = UP
    retry_at: float = 0.0
    failures: int = 0
    reason: str = ""
    probing: bool = False
    chosen_at: float = float("-inf")


@attrs.define
class Attempts:
    """One call's submits over a fleet, and the rule that moves it to another replica (module docstring): the
    shell records what happened and asks; it does the submitting, the marking of the replica and the waiting.
    ``tried``: the address of each submit so far, in order; ``started``: an event was read (the call is never
    submitted again); ``cancelled``: the caller cancelled it."""

    tried: list[str] = attrs.field(factory=list)
    started: bool = False
    cancelled: bool = False

    @property
    def count(self) -> int:
        """Submits so far."""
        return len(self.tried)

    def submitted(self, address: str) -> None:
        """The call was submitted (once more) on ``address``."""
        self.tried.append(address)

    def may_move(
        self,
        failure: dict[str, Any] | ClientError,
        replicas: int,
        *,
        drop_reason: int | None = None,
        terminal: bool = True,
    ) -> bool:
        """The current submit's first read gave ``failure``: the failure it raised, or its first event
        (``terminal``: the submit's only one; ``drop_reason``: the NNRP code of its drop, None for none). True
        when the call may be submitted once more on another of ``replicas`` replicas: nothing was read and it
        was not cancelled, ``failure`` is an :func:`unstarted_failure`, and it had fewer than
        :func:`max_attempts` submits; False when the failure or event is the caller's."""
        return (
            not self.started
            and not self.cancelled
            and unstarted_failure(failure, drop_reason=drop_reason, terminal=terminal)
            and self.count < max_attempts(replicas)
        )

    def excluded(self, replicas: Collection[str]) -> list[str]:
        """The addresses of ``replicas`` (the fleet's now) that the next submit must not go to: the ones tried,
        when there are several; none when there is one (a balancer's address, or a name resolved again, may
        lead to another replica on a fresh connection)."""
        return [address for address in self.tried if address in replicas] if len(replicas) > 1 else []


class Fleet:
    """The replicas of one client (module docstring). ``addresses``: at least one."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ClientAddressError("a fleet needs at least one address")
        self.replicas: dict[str, Replica] = {address: Replica(address) for address in addresses}

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(self.replicas)

    def set_addresses(self, addresses: Sequence[str]) -> tuple[list[str], list[str]]:
        """Replace the replica set (a re-resolution): kept addresses keep their health. Returns (added,
        removed). An empty ``addresses`` changes nothing (a resolution that found nothing keeps the last set)."""
        if not addresses:
            return [], []
        added = [a for a in addresses if a not in self.replicas]
        removed = [a for a in self.replicas if a not in addresses]
        self.replicas = {a: self.replicas.get(a) or Replica(a) for a in addresses}
        return added, removed

    def choose(self, now: float, loads: Mapping[str, Load], exclude: Iterable[str] = ()) -> str | None:
        """The address a new call goes to (module docstring), or None when every address is in ``exclude``.
        Usable: ``up`` replicas, and one ``out`` / ``draining`` replica whose ``retry_at`` passed and that no
        other call probes (it is then marked ``probing``); when none is usable, the one tried again soonest."""
        excluded = set(exclude)
        candidates = [r for r in self.replicas.values() if r.address not in excluded]
        if not candidates:
            return None
        up = [r for r in candidates if r.state == UP]
        due = [r for r in candidates if r.state != UP and r.retry_at <= now and not r.probing]
        if due:  # probe one replica that is due, whatever the others' load
            chosen = min(due, key=lambda r: r.retry_at)
            chosen.probing = True
        elif up:
            chosen = max(up, key=lambda r: (loads.get(r.address, Load()).free, -r.chosen_at))
        else:
            chosen = min(candidates, key=lambda r: r.retry_at)
        chosen.chosen_at = now
        return chosen.address

    def reached(self, address: str) -> None:
        """A session is open on ``address``: it is up."""
        replica = self.replicas.get(address)
        if replica is not None:
            replica.state, replica.failures, replica.probing, replica.reason = UP, 0, False, ""

    def abandoned(self, address: str) -> None:
        """The call that chose ``address`` stopped waiting before it learnt anything (its pool timeout, a
        cancel): another call may probe it."""
        replica = self.replicas.get(address)
        if replica is not None:
            replica.probing = False

    def failed(self, address: str, now: float, reason: str) -> None:
        """``address`` cannot be reached or lost its connection: out until the backoff passed (doubling with
        each failure in a row, :data:`BACKOFF_FIRST_S` … :data:`BACKOFF_MAX_S`)."""
        replica = self.replicas.get(address)
        if replica is None:
            return
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**replica.failures)
        replica.state, replica.retry_at, replica.probing, replica.reason = OUT, now + backoff, False, reason
        replica.failures += 1

    def draining(self, address: str, now: float) -> None:
        """``address`` said it drains: no new call there for :data:`DRAIN_RECHECK_S`."""
        replica = self.replicas.get(address)
        if replica is not None and replica.state != OUT:
            replica.state, replica.retry_at, replica.probing = DRAINING, now + DRAIN_RECHECK_S, False
            replica.reason = "draining"

    def summary(self) -> str:
        """One line naming every replica's state (and its last failure), for error messages."""
        return "; ".join(
            f"{r.address} {r.state}" + (f" ({r.reason})" if r.reason else "") for r in self.replicas.values()
        )

"""Client process of :mod:`bench.value`: one role of a scenario on one asyncio event loop, one task per call, with
the lightest client of its protocol (HTTP: aiohttp; NNRP: :mod:`vllm_nnrp_plugin.client.aio.connection`), as
:mod:`bench.load_client` (whose envelope and clock it uses).

    python -m bench.value_client ROLE http|nnrp TARGET BODY_JSON --start-at UNIX_S [--stop-at UNIX_S] [options…]

The processes of one scenario start together and meet at ``--start-at`` (wall clock, s): each connects first
(set-up is not timed), then waits for it. One JSON line ``{"requests": [...]}`` is printed at the end. Roles:

* ``background``: ``--streams`` streams kept in flight from ``--start-at`` to ``--stop-at`` or until
  ``--stop-file`` exists (which the scenario's ``interactive`` / ``deadline`` process makes once its calls all
  ended), each replaced by a new one as it ends; the streams still running then are cancelled (NNRP) or
  closed (HTTP) and not recorded;
* ``interactive``: a call every 1 / ``--rate`` s from ``--start-at`` while before ``--stop-at``;
* ``agent``: ``--calls`` calls, ``--concurrency`` at a time; a seeded ``--stale-fraction`` of them go stale after
  ``--stale-after`` text deltas: ``--stale-action`` ``supersede`` (NNRP SUPERSEDE; FRAME_CANCEL where the
  client has no ``Operation.supersede``), ``cancel`` (NNRP FRAME_CANCEL), ``close`` (HTTP: the response and its
  connection closed), ``read`` (HTTP: read to the end anyway);
* ``deadline``: as ``interactive``, every call with a deadline ``--deadline-ms`` after its submit: over NNRP the
  envelope's ``nnrp.timeout_ms`` and, where the client has ``Operation.deadline``, an NNRP DEADLINE at the
  same wall-clock instant; over HTTP nothing tells the server (the client reads to the end).

NNRP calls go on one connection, one session per priority class (``--class``: the session's class where
``Connection.open_session`` takes ``priority_class``, the submit's where ``Session.submit`` does, and the
envelope's ``nnrp.priority_class`` hint always; HTTP sends no priority). Per call: ``ttft_ms`` (sent -> first
non-empty text delta), ``total_ms``, ``tokens`` (the usage's output tokens; 0 when the call did not complete),
``deltas``, ``stale``, ``outcome`` (``completed``, ``stale`` — ended by the client —, ``expired`` — the server
ended it for its deadline —, ``failed``), ``late`` (completed after its deadline), ``error`` and ``terminal``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import random
import sys
import time
from typing import Any

import orjson

from bench.e2e import Clock
from bench.load_client import CHAT_PATH, _envelope
from vllm_nnrp_plugin.client import connect
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE

CALL_TIMEOUT_S = 300.0
#: how long a stale or stopped NNRP operation may take to get its terminal after SUPERSEDE / FRAME_CANCEL
END_TIMEOUT_S = 10.0


def _record(
    clock: Clock,
    deltas: int,
    tokens: int,
    outcome: str,
    error: str | None = None,
    *,
    stale: bool = False,
    late: bool = False,
    terminal: Any = None,
) -> dict[str, Any]:
    timing = clock.done(tokens)
    return {
        "ttft_ms": timing.ttft_ms,
        "total_ms": timing.total_ms,
        "tokens": tokens,
        "deltas": deltas,
        "stale": stale,
        "outcome": outcome,
        "late": late,
        "error": error,
        "terminal": None if terminal is None else str(terminal)[:200],
    }


class Call:
    """What one call is asked to do: go stale after ``stale_after`` text deltas (None: never) by
    ``stale_action``; end by ``deadline_ms`` after its submit (None: no deadline)."""

    def __init__(self, stale_after: int | None = None, stale_action: str = "read", deadline_ms: int | None = None):
        self.stale_after, self.stale_action, self.deadline_ms = stale_after, stale_action, deadline_ms
        self.submitted_unix_ms = 0.0

    def late(self) -> bool:
        return self.deadline_ms is not None and time.time() * 1000 > self.submitted_unix_ms + self.deadline_ms


# -- HTTP/SSE: aiohttp ------------------------------------------------------------------------------------


class Http:
    """One aiohttp session (a pool of keep-alive connections) for every call of the process."""

    def __init__(self, base: str, body: dict[str, Any], warm: int) -> None:
        self.base, self.body, self.warm = base, orjson.dumps(body), warm

    async def __aenter__(self) -> Http:
        import aiohttp

        self.http = aiohttp.ClientSession(
            self.base, connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        )

        async def health() -> None:  # connections in the pool before the start
            async with self.http.get("/health") as response:
                response.raise_for_status()
                await response.read()

        await asyncio.gather(*(health() for _ in range(self.warm)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()

    async def call(self, call: Call) -> dict[str, Any]:
        clock, deltas, tokens, error = Clock(), 0, 0, None
        call.submitted_unix_ms = time.time() * 1000
        async with self.http.post(CHAT_PATH, data=self.body, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                return _record(clock, 0, 0, "failed", f"HTTP {response.status}: {(await response.text())[:300]}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                choices = chunk.get("choices")
                if choices and (choices[0].get("delta") or {}).get("content"):
                    clock.text()
                    deltas += 1
                    if deltas == call.stale_after and call.stale_action == "close":
                        response.close()  # the connection goes with it: what a client that stops reading does
                        return _record(clock, deltas, 0, "stale", stale=True)
                elif chunk.get("usage") and not choices:
                    tokens = chunk["usage"]["completion_tokens"]
                elif "error" in chunk:
                    error = error or str(chunk["error"])[:300]
        stale = call.stale_after is not None and deltas >= call.stale_after
        outcome = "failed" if error else "stale" if stale else "completed"
        return _record(clock, deltas, tokens, outcome, error, stale=stale, late=outcome == "completed" and call.late())


# -- NNRP: vllm_nnrp_plugin.client.aio.connection ------------------------------------------------------------


def _takes(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


class Nnrp:
    """One connection and one session (of ``priority_class``, where the client can ask for one) for every call of
    the process."""

    def __init__(self, uri: str, body: dict[str, Any], priority_class: str | None, in_flight: int) -> None:
        self.uri, self.priority_class, self.in_flight = uri, priority_class, in_flight
        self.envelope = _envelope(body, CHAT_COMPLETIONS_CREATE)
        if priority_class:
            self.envelope["nnrp"] = {"priority_class": priority_class}
        self.features: set[str] = set()  # what of the client's scheduling API the calls used

    async def __aenter__(self) -> Nnrp:
        self.conn = await connect(self.uri)
        options: dict[str, Any] = {"max_in_flight_operations": self.in_flight}
        if self.priority_class and _takes(self.conn.open_session, "priority_class"):
            options["priority_class"] = self.priority_class
            self.features.add("session_priority_class")
        self.session = await self.conn.open_session(**options)
        self.submit_class = bool(self.priority_class) and _takes(self.session.submit, "priority_class")
        if self.submit_class:
            self.features.add("submit_priority_class")
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(END_TIMEOUT_S):
                await self.conn.close()

    async def call(self, call: Call) -> dict[str, Any]:
        clock, deltas, tokens, terminal = Clock(), 0, 0, None
        envelope = self.envelope
        if call.deadline_ms is not None:
            envelope = {**envelope, "nnrp": {**envelope.get("nnrp", {}), "timeout_ms": call.deadline_ms}}
        call.submitted_unix_ms = time.time() * 1000
        op = self.session.submit(envelope, **({"priority_class": self.priority_class} if self.submit_class else {}))
        if call.deadline_ms is not None and hasattr(op, "deadline"):
            op.deadline(int(call.submitted_unix_ms + call.deadline_ms))
            self.features.add("deadline")
        async for event in op:  # a task cancelled in here sends FRAME_CANCEL (the background role's stop)
            kind = event.get("type")
            if kind == "response.output_text.delta" and event.get("delta"):
                clock.text()
                deltas += 1
                if deltas == call.stale_after:
                    return await self._end_stale(op, call, clock, deltas)
            elif kind == "response.usage":
                tokens = event["usage"]["output_tokens"]
            terminal = event
        kind = (terminal or {}).get("type")
        if kind == "response.completed":
            return _record(clock, deltas, tokens, "completed", late=call.late(), terminal=None)
        expired = call.deadline_ms is not None and (
            (terminal or {}).get("reason") in ("deadline_expired", "expired")
            or ((terminal or {}).get("error") or {}).get("code") == "request_timeout"
        )
        if expired:
            return _record(clock, deltas, 0, "expired", terminal=terminal)
        return _record(clock, deltas, 0, "failed", f"terminal: {terminal}"[:300], terminal=terminal)

    async def _end_stale(self, op: Any, call: Call, clock: Clock, deltas: int) -> dict[str, Any]:
        supersede = call.stale_action == "supersede" and hasattr(op, "supersede")
        if supersede and not op.done:  # supersede raises once the terminal came
            op.supersede()
            self.features.add("supersede")
        else:
            op.cancel()  # nothing once the terminal came
        try:
            async with asyncio.timeout(END_TIMEOUT_S):
                terminal = await op.result()
        except TimeoutError:
            return _record(clock, deltas, 0, "failed", f"no terminal within {END_TIMEOUT_S} s", stale=True)
        if terminal.get("type") == "response.completed":  # it ended before the supersede / cancel arrived
            return _record(clock, deltas, 0, "stale", stale=True, terminal=terminal)
        ok = terminal.get("type") == "response.cancelled"
        return _record(
            clock,
            deltas,
            0,
            "stale" if ok else "failed",
            None if ok else f"ended by {terminal}"[:300],
            stale=True,
            terminal=terminal,
        )


# -- roles ------------------------------------------------------------------------------------------------


async def _until(unix_s: float) -> None:
    await asyncio.sleep(max(0.0, unix_s - time.time()))


async def _guarded(client: Any, call: Call) -> dict[str, Any]:
    clock = Clock()
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            return await client.call(call)
    except Exception as exc:  # the call's failure
        return _record(clock, 0, 0, "failed", f"{type(exc).__name__}: {exc}"[:300], stale=call.stale_after is not None)


async def background(client: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    done: list[dict[str, Any]] = []

    async def lane() -> None:
        while True:
            done.append(await _guarded(client, Call()))

    await _until(a.start_at)
    lanes = [asyncio.create_task(lane()) for _ in range(a.streams)]
    while time.time() < a.stop_at and not (a.stop_file and os.path.exists(a.stop_file)):
        await asyncio.sleep(0.05)
    for task in lanes:
        task.cancel()  # NNRP: FRAME_CANCEL; HTTP: the response is closed
    await asyncio.gather(*lanes, return_exceptions=True)
    return done


async def paced(client: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    await _until(a.start_at)
    tasks, i = [], 0
    while (at := a.start_at + i / a.rate) < a.stop_at:
        await _until(at)
        tasks.append(asyncio.create_task(_guarded(client, Call(deadline_ms=a.deadline_ms))))
        i += 1
    out = list(await asyncio.gather(*tasks))
    if a.stop_file:
        open(a.stop_file, "w").close()  # the background role of the scenario stops
    return out


async def agent(client: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    stale = set(random.Random(a.seed).sample(range(a.calls), round(a.calls * a.stale_fraction)))
    queue = iter(range(a.calls))
    out: list[dict[str, Any]] = []

    async def worker() -> None:
        for i in queue:
            call = Call(a.stale_after if i in stale else None, a.stale_action)
            out.append({**await _guarded(client, call), "index": i})

    await _until(a.start_at)
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    return sorted(out, key=lambda r: r["index"])


ROLES = {"background": background, "interactive": paced, "deadline": paced, "agent": agent}


async def _main(a: argparse.Namespace) -> None:
    body = orjson.loads(a.body)
    width = a.streams if a.role == "background" else a.concurrency if a.role == "agent" else 64
    if a.protocol == "http":
        client: Any = Http(a.target, body, warm=min(width, 32))
    else:
        client = Nnrp(a.target, body, a.priority_class, in_flight=width)
    async with client:
        requests = await ROLES[a.role](client, a)
    features = sorted(getattr(client, "features", ()))
    sys.stdout.buffer.write(orjson.dumps({"requests": requests, "features": features}) + b"\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.value_client", description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("protocol", choices=["http", "nnrp"])
    p.add_argument("target", help="HTTP base URL or NNRP URI")
    p.add_argument("body", help="the chat request body (JSON)")
    p.add_argument("--start-at", type=float, required=True, help="wall-clock start (unix s)")
    p.add_argument("--stop-at", type=float, default=0.0, help="wall-clock end of background / paced roles (unix s)")
    p.add_argument(
        "--stop-file",
        help="background: also stops once this file exists; interactive / deadline: made once all their calls ended",
    )
    p.add_argument("--streams", type=int, default=16, help="background: streams kept in flight")
    p.add_argument("--rate", type=float, default=2.0, help="interactive / deadline: calls per second")
    p.add_argument("--calls", type=int, default=100, help="agent: calls")
    p.add_argument("--concurrency", type=int, default=8, help="agent: calls at a time")
    p.add_argument("--stale-fraction", type=float, default=0.3, help="agent: share of calls that go stale")
    p.add_argument("--stale-after", type=int, default=8, help="agent: text deltas before a stale call goes stale")
    p.add_argument("--stale-action", choices=["supersede", "cancel", "close", "read"], default="read")
    p.add_argument("--seed", type=int, default=0, help="agent: which calls go stale")
    p.add_argument("--deadline-ms", type=int, help="deadline: each call's deadline after its submit, ms")
    p.add_argument(
        "--class",
        dest="priority_class",
        choices=["interactive", "balanced", "background"],
        help="NNRP priority class of the calls (none: the session default)",
    )
    a = p.parse_args(argv)
    if a.protocol == "http" and a.stale_action in ("supersede", "cancel"):
        p.error("supersede and cancel are NNRP's")
    if a.protocol == "nnrp" and a.stale_action in ("close",):
        p.error("close is HTTP's")
    asyncio.run(_main(a))


if __name__ == "__main__":
    main()

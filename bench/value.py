"""Value: what priorities, SUPERSEDE and deadlines buy on one real ``vllm serve`` whose requests queue.

    python -m bench value --name value

The server serves the tiny model of :mod:`bench.tiny_model` (``--load-format dummy``) with
``--scheduling-policy priority`` and ``--max-num-seqs`` :data:`MAX_NUM_SEQS` (4): on a 2-CPU machine the
tiny model generates about 1,000 tokens/s over a batch of 4 (a step of ~4 ms), so 16 background streams of 256
tokens keep 12 requests waiting at every moment, and what the scheduler does with its waiting queue decides
what an interactive call waits (vLLM's priority policy orders the waiting queue; it preempts a running request
only when KV blocks run out, which they do not here). NNRP listens on TCP with
``nnrp.max_in_flight_per_session`` 64 (the default is ``max_num_seqs``, which would refuse the background
session's 16 streams). Every client runs in its own process
(:mod:`bench.value_client`, one event loop each; HTTP: aiohttp, NNRP: the package's asyncio client), the
processes of one run meeting at a wall-clock start. Scenarios (ids ``value.<scenario>.<metric>.<run>``):

1. ``priority``: ``background`` streams (``BACKGROUND_TOKENS`` tokens, ``ignore_eos``) kept in flight while
   interactive calls (``INTERACTIVE_TOKENS`` tokens) come at ``rate`` per second for ``seconds`` s (after a
   ``WARM_S`` s head start of the background). ``nnrp``: the background on one session of class
   ``background``, the interactive calls on one of class ``interactive`` (vLLM ``priority`` 10 and -10 on the
   plugin's side); ``http``: the same workload over HTTP/SSE without a priority. Rows: ``interactive_ttft``
   (submit -> first text delta, ms), ``interactive_ttft_ratio.nnrp_over_http`` (target p95 <= 0.5),
   ``background_tokens_per_s`` (what the background still got) and ``failed``.
2. ``stale``: an agent: ``agent_calls`` calls of ``AGENT_TOKENS`` tokens, ``agent_concurrency`` at a time, on
   the otherwise idle server; a seeded 30 % go stale after ``STALE_AFTER`` text deltas. ``nnrp_supersede``:
   SUPERSEDE (FRAME_CANCEL where the client has no ``Operation.supersede``; the row's parameters say which);
   ``http_close``: the client closes the stream (and its connection); ``http_read``: the client reads the stale
   call to its end. Engine tokens for the stale calls: vLLM's ``vllm:generation_tokens_total`` (``/metrics``)
   after the run minus before (the server idle both times: nothing running or waiting, the counter still) minus
   the usage's output tokens of the calls that did not go stale. vLLM counts a token when its API server takes
   the engine's output (``OutputProcessor``; the outputs of a request it already aborted are dropped uncounted),
   so an ended stale call costs at least the ``STALE_AFTER`` tokens read, and tokens the engine computed in the
   step during which the abort arrived are not seen. Rows: ``stale_tokens`` (one sample per run),
   ``stale_tokens_ratio.nnrp_supersede_over_http_close`` (target <= 0.5), ``…_over_http_read``, ``failed``.
3. ``deadline``: calls of ``INTERACTIVE_TOKENS`` tokens at ``rate`` per second with the ``priority`` background
   kept running over HTTP (no priority, the same in both runs). ``http`` first: nothing tells vLLM's HTTP server
   about a deadline, so its calls run as without one and the client reads each to its end; the deadline is
   ``DEADLINE_FACTOR`` × that run's median submit -> result, and its results after it are late. Then ``nnrp``
   with that deadline after each submit (envelope ``nnrp.timeout_ms``, and an NNRP DEADLINE at the same
   wall-clock instant where the client has ``Operation.deadline``: the server ends expired work). A late result
   is a completed result received after its deadline. Rows: ``late_pct`` (target nnrp <= 0.1 %), ``expired``
   (calls the server ended for their deadline, by terminal), ``completed_latency`` (ms), ``failed``.

``failed``: calls that ended otherwise than asked (an error, no terminal, a cancel answered by something else);
the note has the first error.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import orjson

from bench import tiny_model
from bench.e2e import START_TIMEOUT_S, chat_body
from bench.load import PROMPT, _ratio, _report_log
from bench.procs import run_clients
from bench.results import Result, Target, percentile
from compat.launcher import free_port, serve_with_nnrp

MAX_NUM_SEQS = 4
SERVER_ARGS = ("--scheduling-policy", "priority", "--max-num-seqs", str(MAX_NUM_SEQS))
NNRP_CONFIG = {"nnrp": {"max_in_flight_per_session": 64}}
BACKGROUND_TOKENS = 256
INTERACTIVE_TOKENS = 16
AGENT_TOKENS = 128
STALE_AFTER = 8
STALE_FRACTION = 0.3
DEADLINE_FACTOR = 1.1
#: the background's head start before the interactive / deadline calls (the queue fills)
WARM_S = 3.0
#: from starting the client processes to their common start (imports, connections)
SETUP_S = 5.0
TTFT_TARGET = Target("p95", "<=", 0.5)
STALE_TARGET = Target("p50", "<=", 0.5)
LATE_TARGET = Target("max", "<=", 0.1)
NO_FAILURE = Target("max", "<=", 0)
#: metric names of vLLM's /metrics
GENERATED = "vllm:generation_tokens_total"
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def _clients(server: Any, roles: Sequence[tuple[str, str, dict[str, Any], list[str], float]]) -> list[dict[str, Any]]:
    """Run one :mod:`bench.value_client` process per (role, protocol, body, options, start offset in s), all
    starting :data:`SETUP_S` s from now plus their offset; their outputs in that order."""
    start = time.time() + SETUP_S
    argument_lists = [
        [
            role,
            protocol,
            server.nnrp if protocol == "nnrp" else server.http,
            orjson.dumps(body).decode(),
            "--start-at",
            f"{start + offset:.3f}",
            *options,
        ]
        for role, protocol, body, options, offset in roles
    ]
    return run_clients("bench.value_client", argument_lists, timeout_s=600)


def wait_idle(server: Any, timeout_s: float = 60.0) -> float:
    """Wait until vLLM runs and queues nothing and its generated-token counter stood still for a second; return
    that counter. Raises ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        busy = sum(server.metric(name) for name in BUSY)
        now = server.metric(GENERATED)
        if not busy and now == last:
            return now
        last = None if busy else now
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve still busy after {timeout_s} s")


def _failed(id: str, requests: Sequence[dict[str, Any]], parameters: dict[str, Any]) -> Result:
    """Calls that ended otherwise than asked (module docstring); the note has the first error."""
    bad = [r for r in requests if r["outcome"] == "failed"]
    note = f"{len(bad)} of {len(requests)}; first error: {bad[0]['error']}" if bad else None
    return Result.of(id, "requests", [len(bad)], targets=(NO_FAILURE,), parameters=parameters, note=note)


def _features(outputs: Sequence[dict[str, Any]]) -> str:
    """The NNRP client features the runs used (:mod:`bench.value_client`), comma-separated, or ``none``."""
    return ",".join(sorted({f for out in outputs for f in out.get("features", ())})) or "none"


def _loaded(
    server: Any,
    workdir: str,
    protocol: str,
    *,
    background: int,
    rate: float,
    seconds: float,
    role: str,
    options: Sequence[str] = (),
    bg_protocol: str | None = None,
) -> tuple[dict, dict, float]:
    """``background`` streams of :data:`BACKGROUND_TOKENS` tokens over ``bg_protocol`` (default ``protocol``;
    NNRP: class background) and, :data:`WARM_S` s later, ``role`` calls of :data:`INTERACTIVE_TOKENS` tokens
    at ``rate`` per second for ``seconds`` s over ``protocol`` with ``options``; the background stops when the
    last of those calls ended. Returns the background's and the calls' client outputs and the wall time from the
    background's start to the end (s)."""
    bg_protocol = bg_protocol or protocol
    stop = f"{workdir}/stop-{free_port()}"
    wait_idle(server)
    start = time.time() + SETUP_S
    bg_out, out = _clients(
        server,
        [
            (
                "background",
                bg_protocol,
                chat_body(PROMPT, BACKGROUND_TOKENS),
                [
                    "--streams",
                    str(background),
                    "--stop-file",
                    stop,
                    "--stop-at",
                    f"{start + WARM_S + seconds + 300:.3f}",
                    *(["--class", "background"] if bg_protocol == "nnrp" else []),
                ],
                0.0,
            ),
            (
                role,
                protocol,
                chat_body(PROMPT, INTERACTIVE_TOKENS),
                ["--rate", str(rate), "--stop-file", stop, "--stop-at", f"{start + WARM_S + seconds:.3f}", *options],
                WARM_S,
            ),
        ],
    )
    return bg_out, out, time.time() - start


def priority_rows(server: Any, workdir: str, *, background: int, rate: float, seconds: float) -> list[Result]:
    """Scenario 1 (module docstring)."""
    rows: list[Result] = []
    made: dict[str, Result] = {}
    for protocol in ("http", "nnrp"):
        started = time.perf_counter()
        options = ["--class", "interactive"] if protocol == "nnrp" else []
        bg_out, out, wall = _loaded(
            server,
            workdir,
            protocol,
            background=background,
            rate=rate,
            seconds=seconds,
            role="interactive",
            options=options,
        )
        calls, streams = out["requests"], bg_out["requests"]
        params = {
            "background_streams": background,
            "background_max_tokens": BACKGROUND_TOKENS,
            "interactive_per_s": rate,
            "interactive_seconds": seconds,
            "interactive_max_tokens": INTERACTIVE_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
            **({"nnrp_client": _features([bg_out, out])} if protocol == "nnrp" else {"priority": "none"}),
        }
        ttft = [r["ttft_ms"] for r in calls if r["outcome"] == "completed" and r["ttft_ms"]]
        done = [r for r in streams if r["outcome"] == "completed"]
        made[protocol] = Result.of(
            f"value.priority.interactive_ttft.{protocol}",
            "ms",
            ttft or [0.0],
            parameters=params,
            note=f"{len(ttft)} of {len(calls)} interactive calls completed",
        )
        rows += [
            made[protocol],
            Result.of(
                f"value.priority.background_tokens_per_s.{protocol}",
                "tokens/s",
                [sum(r["tokens"] for r in done) / max(wall, 1.0)],
                parameters=params,
                note=f"{len(done)} background streams completed: their tokens / the background's wall time",
            ),
            _failed(f"value.priority.failed.{protocol}", [*calls, *streams], params),
        ]
        _progress(f"value.priority.{protocol}", started)
    rows.append(
        _ratio(
            "value.priority.interactive_ttft_ratio.nnrp_over_http",
            made["nnrp"],
            made["http"],
            TTFT_TARGET,
            made["nnrp"].parameters,
        )
    )
    return rows


#: scenario 2's runs: (run name, protocol, the stale calls' action)
STALE_RUNS = (("nnrp_supersede", "nnrp", "supersede"), ("http_close", "http", "close"), ("http_read", "http", "read"))


def stale_rows(server: Any, *, calls: int, concurrency: int, seed: int = 1) -> list[Result]:
    """Scenario 2 (module docstring)."""
    body = chat_body(PROMPT, AGENT_TOKENS)
    made: dict[str, Result] = {}
    rows: list[Result] = []
    for run, protocol, action in STALE_RUNS:
        started = time.perf_counter()
        before = wait_idle(server)
        (out,) = _clients(
            server,
            [
                (
                    "agent",
                    protocol,
                    body,
                    [
                        "--calls",
                        str(calls),
                        "--concurrency",
                        str(concurrency),
                        "--stale-fraction",
                        str(STALE_FRACTION),
                        "--stale-after",
                        str(STALE_AFTER),
                        "--stale-action",
                        action,
                        "--seed",
                        str(seed),
                    ],
                    0.0,
                )
            ],
        )
        generated = wait_idle(server) - before
        requests = out["requests"]
        fresh = sum(r["tokens"] for r in requests if not r["stale"])
        stale = [r for r in requests if r["stale"]]
        stale_tokens = generated - fresh
        params = {
            "calls": calls,
            "concurrency": concurrency,
            "stale_fraction": STALE_FRACTION,
            "stale_after_deltas": STALE_AFTER,
            "max_tokens": AGENT_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
            "stale_action": action,
        }
        if protocol == "nnrp":
            params["nnrp_client"] = _features([out])
            if action == "supersede" and "supersede" not in params["nnrp_client"]:
                params["stale_action"] = "cancel (this client has no Operation.supersede)"
        made[run] = Result.of(
            f"value.stale.stale_tokens.{run}",
            "tokens",
            [stale_tokens],
            parameters=params,
            note=f"{len(stale)} stale calls, {stale_tokens / max(1, len(stale)):.1f} engine tokens each "
            f"({STALE_AFTER} text deltas read); engine generated {generated:.0f}, non-stale calls' usage {fresh}",
        )
        rows += [made[run], _failed(f"value.stale.failed.{run}", requests, params)]
        _progress(f"value.stale.{run}", started)
    for against, target in (("http_close", STALE_TARGET), ("http_read", None)):
        rows.append(
            _ratio(
                f"value.stale.stale_tokens_ratio.nnrp_supersede_over_{against}",
                made["nnrp_supersede"],
                made[against],
                target,
                made["nnrp_supersede"].parameters,
            )
        )
    return rows


def deadline_rows(server: Any, workdir: str, *, background: int, rate: float, seconds: float) -> list[Result]:
    """Scenario 3 (module docstring): the HTTP run first (its calls read to the end, as with no deadline: vLLM's
    HTTP server is told of none), whose median sets the deadline, then the NNRP run with it."""
    load = {"background": background, "rate": rate, "seconds": seconds, "bg_protocol": "http"}
    params = {
        "background_streams": background,
        "background_protocol": "http",
        "per_s": rate,
        "seconds": seconds,
        "max_tokens": INTERACTIVE_TOKENS,
        "max_num_seqs": MAX_NUM_SEQS,
    }
    rows: list[Result] = []
    deadline_ms = 0
    for protocol in ("http", "nnrp"):
        started = time.perf_counter()
        options = ["--deadline-ms", str(deadline_ms)] if protocol == "nnrp" else []
        _, out, _ = _loaded(server, workdir, protocol, role="deadline", options=options, **load)
        calls = out["requests"]
        completed = [r for r in calls if r["outcome"] == "completed"]
        if protocol == "http":
            deadline_ms = max(1, round(percentile([r["total_ms"] for r in completed] or [0.0], 0.5) * DEADLINE_FACTOR))
            params = {**params, "deadline_ms": deadline_ms, "deadline": f"{DEADLINE_FACTOR} x the HTTP run's median"}
            for r in completed:  # the client read it to the end: late when it came after the deadline
                r["late"] = r["total_ms"] > deadline_ms
        late = [r for r in completed if r["late"]]
        expired = [r for r in calls if r["outcome"] == "expired"]
        kinds = Counter(
            "deadline_expired drop" if "deadline_expired" in r["terminal"] else "request_timeout error" for r in expired
        )
        run_params = {**params, "nnrp_client": _features([out])} if protocol == "nnrp" else params
        rows += [
            Result.of(
                f"value.deadline.late_pct.{protocol}",
                "%",
                [100 * len(late) / max(1, len(calls))],
                targets=(LATE_TARGET,) if protocol == "nnrp" else (),
                parameters=run_params,
                note=f"{len(late)} late of {len(calls)} calls ({len(completed)} completed)",
            ),
            Result.of(
                f"value.deadline.expired.{protocol}",
                "requests",
                [len(expired)],
                parameters=run_params,
                note="ended by the server for their deadline: "
                + (", ".join(f"{k} x {n}" for k, n in kinds.items()) or "none"),
            ),
            Result.of(
                f"value.deadline.completed_latency.{protocol}",
                "ms",
                [r["total_ms"] for r in completed] or [0.0],
                parameters=run_params,
                note="submit -> result",
            ),
            _failed(f"value.deadline.failed.{protocol}", calls, run_params),
        ]
        _progress(f"value.deadline.{protocol}", started)
    return rows


def _progress(what: str, started: float) -> None:
    print(f"bench value: {what} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def measure(
    server: Any, workdir: str, *, background: int, rate: float, seconds: float, agent_calls: int, agent_concurrency: int
) -> list[Result]:
    """The three scenarios on a ready ``server`` (``http``, ``nnrp``: its NNRP URI, ``metric``), after a warm-up
    call per protocol."""
    _clients(
        server,
        [
            (
                "agent",
                protocol,
                chat_body(PROMPT, 16),
                ["--calls", "4", "--concurrency", "4", "--stale-fraction", "0"],
                0.0,
            )
            for protocol in ("http", "nnrp")
        ],
    )
    return [
        *priority_rows(server, workdir, background=background, rate=rate, seconds=seconds),
        *stale_rows(server, calls=agent_calls, concurrency=agent_concurrency),
        *deadline_rows(server, workdir, background=background, rate=rate, seconds=seconds),
    ]


def run(
    *,
    model: str | None = None,
    background: int = 16,
    rate: float = 2.0,
    seconds: float = 20.0,
    agent_calls: int = 100,
    agent_concurrency: int = 8,
) -> list[Result]:
    """Serve the tiny model made from ``model`` (default ``$VLLM_NNRP_TEST_MODEL``) with
    :data:`SERVER_ARGS` and measure (module docstring). Raises ``SystemExit`` without a model,
    ``compat.launcher.ServeError`` when ``vllm serve`` does not start, ``RuntimeError`` when a client fails."""
    model = model or os.environ.get("VLLM_NNRP_TEST_MODEL")
    if not model:
        raise SystemExit("value benchmark: give --model or set VLLM_NNRP_TEST_MODEL")
    with tempfile.TemporaryDirectory() as workdir:
        tiny = str(tiny_model.build(model))
        uri = f"tcp://127.0.0.1:{free_port()}"
        server = serve_with_nnrp(
            tiny,
            workdir,
            listen=(uri,),
            log=f"{workdir}/vllm-{free_port()}.log",
            extra_args=(
                "--load-format",
                "dummy",
                *SERVER_ARGS,
                "--additional-config",
                orjson.dumps(NNRP_CONFIG).decode(),
            ),
        )
        server.nnrp = uri
        try:
            server.wait_ready(START_TIMEOUT_S)
            return measure(
                server,
                workdir,
                background=background,
                rate=rate,
                seconds=seconds,
                agent_calls=agent_calls,
                agent_concurrency=agent_concurrency,
            )
        finally:
            served = pathlib.Path(server.log).stat().st_size
            server.stop()
            _report_log(server, served)

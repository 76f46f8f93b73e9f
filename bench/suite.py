"""Run the benchmarks side by side and write ``<out>/<name>.json`` + ``<out>/<name>.md``.

    python -m bench [all|mapper|latency|cancel|framework|e2e|load|parser|value|carriers|rust …] [--quick] \
        [--out docs/benchmarks] [--name NAME] [--model DIR] \
        [--load-transport tcp|ipc] [--load-rounds N] [--load-tls] [--load-tools] [--load-responses] \
        [--load-stream-interval N] [--rust-frontend PATH]

(from the checkout's root: the benchmarks are not part of the installed package).

``--quick`` runs each with tiny sizes (the smoke the tests run: it must run, not meet a number). The
framework benchmark needs vLLM's environment (FastAPI, uvicorn, uvloop); the e2e and load benchmarks need vLLM
installed in this interpreter and a model directory (``--model`` or
``VLLM_NNRP_TEST_MODEL``; load serves a tiny model made from it, :mod:`bench.tiny_model`). ``--load-tls``: load
over TLS (vLLM's HTTPS and NNRP on ``nnrps://``, one self-signed certificate; ids ``load.tls.…``, :mod:`bench.load`).
``--load-stream-interval 0`` skips load's second server (``--stream-interval``; default 8). ``--load-tools``: load on
an agent server (a hermes tool-call parser, a tool in every request; ids ``load.tools.…``); ``--load-responses``:
the levels as Responses streams (``load[.tools].responses.…``). ``parser``: vLLM's hermes
parser per token against the stream's length (:mod:`bench.parser_cost`; vLLM's environment and a model directory).
``value``: priorities, SUPERSEDE and deadlines on a ``vllm serve`` whose requests queue (:mod:`bench.value`; the
same needs as load). ``carriers``: the load levels, cancels and threads over every NNRP carrier of one server
(tcp, nnrps, ws, wss, quic; :mod:`bench.carriers`; the same needs as load). ``rust``: the load levels over
HTTP/SSE from vLLM's Rust frontend instead of its Python API server (:mod:`bench.rust_frontend`; vLLM 0.32's
environment and ``--rust-frontend PATH`` of its ``vllm-rs`` binary; with ``--load-tools`` the agent server; ``all``
runs it only when the path is given).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable

from bench import cancel_latency, event_latency, mapper
from bench.results import Result, document, write


def _full_load(
    model=None,
    load_transport="tcp",
    load_rounds=2,
    load_tls=False,
    load_stream_interval=8,
    load_tools=False,
    load_responses=False,
    **_,
):
    return _load().run(
        model=model,
        transport=load_transport,
        rounds=load_rounds,
        tls=load_tls,
        stream_interval=load_stream_interval or None,
        tools=load_tools,
        responses=load_responses,
    )


def _quick_load(
    model=None, load_transport="tcp", load_rounds=1, load_tls=False, load_tools=False, load_responses=False, **_
):
    return _load().run(
        model=model,
        levels=(4,),
        rounds=load_rounds,
        max_tokens=16,
        shared={4: 2},
        burst_clients=8,
        burst_load_streams=4,
        cancel_streams=8,
        cancel_per_session=4,
        cancel_sample=4,
        idle_sessions=8,
        idle_seconds=2,
        thread_sessions=8,
        stream_interval=None,
        transport=load_transport,
        tls=load_tls,
        tools=load_tools,
        responses=load_responses,
    )


FULL: dict[str, Callable[..., list[Result]]] = {
    "mapper": lambda **_: mapper.run(),
    "latency": lambda **_: event_latency.run(),
    "cancel": lambda **_: cancel_latency.run(),
    "framework": lambda **_: _framework().run(),
    "e2e": lambda model=None, **_: _e2e().run(model=model),
    "load": _full_load,
    "parser": lambda model=None, **_: _parser_cost().run(model=model),
    "value": lambda model=None, **_: _value().run(model=model),
    "carriers": lambda model=None, load_rounds=2, **_: _carriers().run(model=model, rounds=load_rounds),
    "rust": lambda model=None, load_rounds=2, load_tools=False, rust_frontend=None, **_: _rust().run(
        frontend=rust_frontend,
        model=model,
        rounds=load_rounds,
        tools=load_tools,
    ),
}
QUICK: dict[str, Callable[..., list[Result]]] = {
    "mapper": lambda **_: mapper.run(repetitions=3, rounds=5),
    "latency": lambda **_: event_latency.run(
        light_events=50, heavy_streams=8, rate=2000, heavy_seconds=0.3, layouts=(("heavy", 1, 2, None),), warmup=5
    ),
    "cancel": lambda **_: cancel_latency.run(operations=5),
    "framework": lambda **_: _framework().run(levels=(4,), rounds=2, tokens=16),
    "e2e": lambda model=None, **_: _e2e().run(
        model=model, levels=(1, 2), per_worker=1, rounds=1, max_tokens=4, baseline=False
    ),
    "load": _quick_load,
    "parser": lambda model=None, **_: _parser_cost().run(model=model, lengths=(16, 32), repetitions=1),
    "value": lambda model=None, **_: _value().run(
        model=model, background=8, rate=4.0, seconds=2.0, agent_calls=10, agent_concurrency=4
    ),
    "carriers": lambda model=None, load_rounds=1, **_: _carriers().run(
        model=model,
        levels=(4,),
        rounds=load_rounds,
        max_tokens=16,
        cancel_streams=8,
        cancel_per_session=4,
        cancel_sample=4,
        thread_sessions=8,
    ),
    "rust": lambda model=None, load_rounds=1, load_tools=False, rust_frontend=None, **_: _rust().run(
        frontend=rust_frontend,
        model=model,
        levels=(4,),
        rounds=load_rounds,
        max_tokens=16,
        tools=load_tools,
    ),
}


def _framework():
    from bench import framework  # its server needs vLLM's environment (FastAPI, uvicorn, uvloop)

    return framework


def _e2e():
    from bench import e2e  # needs vLLM's environment (httpx, a vllm executable)

    return e2e


def _load():
    from bench import load  # needs vLLM's environment (aiohttp, a vllm executable)

    return load


def _parser_cost():
    from bench import parser_cost  # needs vLLM's environment (its parsers and tokenizer)

    return parser_cost


def _carriers():
    from bench import carriers  # needs vLLM's environment (aiohttp, a vllm executable)

    return carriers


def _rust():
    from bench import rust_frontend  # needs vLLM 0.32's environment (aiohttp, a vllm executable)

    return rust_frontend


def _value():
    from bench import value  # needs vLLM's environment (aiohttp, a vllm executable)

    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("which", nargs="*", default=["all"], choices=["all", *FULL], help="benchmarks to run (default all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, numbers mean nothing")
    p.add_argument(
        "--out", default="docs/benchmarks", help="directory for the JSON and markdown (default docs/benchmarks)"
    )
    p.add_argument("--name", default="results", help="file name without extension (default results)")
    p.add_argument("--model", help="model directory for e2e and load (default $VLLM_NNRP_TEST_MODEL)")
    p.add_argument(
        "--load-transport", choices=["tcp", "ipc"], default="tcp", help="NNRP transport of load (default tcp)"
    )
    p.add_argument(
        "--load-rounds",
        type=int,
        help="windows per protocol and level in load, alternating A/B/B/A (default 2; --quick: 1)",
    )
    p.add_argument(
        "--load-tls",
        action="store_true",
        help="load over TLS: vLLM's HTTPS against NNRP on nnrps:// "
        "(one self-signed certificate; ids load.tls.*; --load-transport does not apply)",
    )
    p.add_argument(
        "--load-tools",
        action="store_true",
        help="load on an agent server: hermes tool-call parser, one function tool in every request (ids load.tools.*)",
    )
    p.add_argument(
        "--load-responses",
        action="store_true",
        help="load's levels as Responses streams "
        "(/v1/responses against responses.create; ids load[.tools].responses.*)",
    )
    p.add_argument(
        "--load-stream-interval",
        type=int,
        default=8,
        metavar="N",
        help="load's second server serves with --stream-interval N (default 8; 0: no second server; --quick: none)",
    )
    p.add_argument(
        "--rust-frontend",
        metavar="PATH",
        help="the vllm-rs binary of vLLM's Rust frontend, for rust "
        "(from PyPI's CUDA wheel of vLLM 0.32: bench/rust_frontend.py)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.load_tls and args.load_transport != "tcp":
        p.error("--load-tls serves NNRP on nnrps:// (TLS over TCP); --load-transport ipc does not apply")
    if "rust" in args.which and not args.rust_frontend:
        p.error("rust needs --rust-frontend PATH (the vllm-rs binary)")
    everything = [name for name in FULL if name != "rust" or args.rust_frontend]
    which = everything if "all" in args.which else list(dict.fromkeys(args.which))
    table = QUICK if args.quick else FULL
    rows: list[Result] = []
    for name in which:
        print(f"bench: running {name} …", file=sys.stderr, flush=True)
        options = {} if args.load_rounds is None else {"load_rounds": args.load_rounds}
        rows += table[name](
            model=args.model,
            load_transport=args.load_transport,
            load_tls=args.load_tls,
            load_tools=args.load_tools,
            load_responses=args.load_responses,
            load_stream_interval=args.load_stream_interval,
            rust_frontend=args.rust_frontend,
            **options,
        )
    extra = {}
    if {"e2e", "load", "parser", "value", "carriers", "rust"} & set(which):
        import vllm

        extra["vllm"] = vllm.__version__
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = document(rows, command=command.strip(), extra_versions=extra)
    json_path, md_path = write(doc, pathlib.Path(args.out), args.name)
    sys.stdout.write(md_path.read_text())
    print(f"bench: wrote {json_path} and {md_path}", file=sys.stderr)
    return 0

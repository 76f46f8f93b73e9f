"""``python -m bench.profile_load``: where the API server's CPU goes under :mod:`bench.load`'s streams.

Serves :mod:`bench.load`'s server (the tiny model with ``--load-format dummy``; ``--tools``: the agent server,
hermes tool-call parser, one tool in every request; ``--responses``: Responses streams, ``/v1/responses`` and
``responses.create``), runs one warm-up window, then ``--windows`` windows of
``--streams`` streams over ``--protocol`` (``nnrp``: one session per stream over ``--carrier``, default ``tcp``;
``http``: vLLM's HTTP/SSE)
while ``py-spy record`` (``pip install py-spy``; it reads the process from outside, so the server runs as in
production) samples the API server at ``--rate`` Hz. Prints one JSON object: the API server's µs per token of
the windows, and the busy samples (the loop's wait in ``epoll`` left out) split by whose code they are in
(:data:`PLACES`), in per cent; ``--raw PATH`` keeps py-spy's raw stacks.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time

import orjson

from bench import load, tiny_model
from bench.e2e import START_TIMEOUT_S
from compat.launcher import free_port, serve_with_nnrp

#: innermost frames that are a socket write (NNRP's connection; uvicorn's, for vLLM's HTTP/SSE; aioquic's datagram
#: sends, for QUIC): the kernel's loopback TCP or UDP (the receiving client's side included) runs inside them
SOCKET_WRITES = (
    "StreamConnection.send (",
    "WebSocketConnection._write_raw (",
    "RequestResponseCycle.send (uvicorn/",
    "QuicConnectionProtocol.transmit (aioquic/",
)
SOCKET_PLACE = "socket writes (the kernel's loopback TCP or UDP)"
#: (place, markers): any other busy sample belongs to the first place any of whose markers is in any frame below
#: the event loop (so a parser's own metrics and regular expressions count as the parser, the engine client's
#: statistics as its output path, the plugin only what runs in its own code)
PLACES = (
    ("vLLM's tool-call/reasoning parser", ("vllm/tool_parsers/", "vllm/parser/", "vllm/reasoning/")),
    ("vLLM's engine client (output processing, detokenising, stats)", ("vllm/v1/",)),
    ("vLLM's OpenAI serving (request set-up, chunks, pydantic)", ("vllm/entrypoints/", "pydantic")),
    ("aioquic (QUIC packets: frames, encryption, acknowledgements, loss recovery)", ("aioquic/",)),
    ("wsproto (WebSocket frames in)", ("wsproto/",)),
    ("the plugin", ("vllm_nnrp_plugin/",)),
    (
        "HTTP server (uvicorn, Starlette, FastAPI middleware)",
        ("uvicorn/", "starlette/", "fastapi", "prometheus_fastapi"),
    ),
    ("event loop and other", ("",)),
)
#: the address of each NNRP carrier the profile can load (the TLS ones with a self-signed certificate)
CARRIER_ADDRESS = {
    "tcp": "tcp://127.0.0.1:{port}",
    "nnrps": "nnrps://127.0.0.1:{port}",
    "ws": "ws://127.0.0.1:{port}/nnrp",
    "wss": "wss://127.0.0.1:{port}/nnrp",
    "quic": "quic://127.0.0.1:{port}",
}
#: the frame that runs the API server's event loop (vLLM's ``uvloop.run``): the stack above it is the process's
ROOT = "asyncio/runners.py"
#: innermost frames of an idle loop or of a waiting thread: not busy
IDLE = ("select (selectors.py", "wait (threading.py", "_worker (concurrent/futures")


def places(raw: str) -> dict[str, float]:
    """Busy samples of py-spy's raw output (``frame;frame;… count`` lines) by :data:`PLACES`, in per cent."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if any(idle in frame for frame in frames[-2:] for idle in IDLE):
            continue
        root = next((i for i, frame in enumerate(frames) if ROOT in frame), -1)
        frames = frames[root + 1 :] or frames[-1:]  # what the loop runs (``vllm serve``'s own frames are above it)
        if any(marker in frames[-1] for marker in SOCKET_WRITES):
            counts[SOCKET_PLACE] += int(n)
            continue
        place = next(place for place, markers in PLACES if any(m in f for m in markers for f in frames))
        counts[place] += int(n)
    total = sum(counts.values()) or 1
    return {place: round(100 * n / total, 1) for place, n in counts.most_common()}


def run(
    *,
    model: str,
    streams: int,
    windows: int,
    protocol: str,
    tools: bool,
    rate: int,
    raw: str | None,
    carrier: str = "tcp",
    responses: bool = False,
) -> dict:
    api = "responses" if responses else "chat"
    body = {**load.request_body(api, 256), **(load.agent_fields(api) if tools else {})}
    with tempfile.TemporaryDirectory() as workdir:
        cert, key = load.self_signed(workdir)
        nnrp = {carrier: CARRIER_ADDRESS[carrier].format(port=free_port())}
        config = {"nnrp": {**load.NNRP_CONFIG["nnrp"], "tls_cert_file": cert, "tls_key_file": key}}
        server = serve_with_nnrp(
            str(tiny_model.build(model)),
            workdir,
            listen=tuple(nnrp.values()),
            extra_args=(
                "--load-format",
                "dummy",
                "--max-num-seqs",
                str(max(256, streams)),
                "--additional-config",
                orjson.dumps(config).decode(),
                *(load.AGENT_SERVER_ARGS if tools else ()),
            ),
        )
        server.nnrp, server.ca_file = nnrp, cert
        try:
            server.wait_ready(START_TIMEOUT_S)
            engine = load.engine_pids(server.pid)
            load.window(server, engine, "stream", protocol, streams, body, transport=carrier, workdir=workdir, api=api)
            out = raw or f"{workdir}/py-spy.txt"
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(server.pid),
                    "--rate",
                    str(rate),
                    "--format",
                    "raw",
                    "--nonblocking",
                    "-o",
                    out,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1)  # attached
            measured = [
                load.window(
                    server, engine, "stream", protocol, streams, body, transport=carrier, workdir=workdir, api=api
                )
                for _ in range(windows)
            ]
            spy.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
            spy.wait(60)
            with open(out, encoding="utf-8") as f:
                split = places(f.read())
        finally:
            server.stop()
    return {
        "protocol": protocol,
        "carrier": carrier if protocol == "nnrp" else "tcp",
        "tools": tools,
        "api": api,
        "streams": streams,
        "api_server_cpu_us_per_token": [round(w.api_cpu_s * 1e6 / max(1, w.tokens), 1) for w in measured],
        "busy_samples_percent": split,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.profile_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", choices=["nnrp", "http"], default="nnrp")
    p.add_argument("--carrier", choices=sorted(CARRIER_ADDRESS), default="tcp", help="NNRP's carrier (default tcp)")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--tools", action="store_true", help="the agent server (hermes parser, a tool in every request)")
    p.add_argument("--responses", action="store_true", help="Responses streams instead of chat completions")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second (default 200)")
    p.add_argument("--raw", help="keep py-spy's raw stacks here")
    p.add_argument("--model", default=os.environ.get("VLLM_NNRP_TEST_MODEL"), help="default $VLLM_NNRP_TEST_MODEL")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not args.model:
        p.error("give --model or set VLLM_NNRP_TEST_MODEL")
    result = run(
        model=args.model,
        streams=args.streams,
        windows=args.windows,
        protocol=args.protocol,
        tools=args.tools,
        rate=args.rate,
        raw=args.raw,
        carrier=args.carrier,
        responses=args.responses,
    )
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

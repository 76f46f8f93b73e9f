"""Record a vLLM line's HTTP outputs into ``compat/fixtures/vllm/<version>/``: the same requests, the same servers.

    compat/record-fixtures.sh 0.29.0        # builds/reuses the line's env and the model, then runs this module

Replays every ``<case>.request.json`` of a reference folder (default ``compat/fixtures/vllm/0.32.0``) against real
``vllm serve`` processes of the installed vLLM, without the plugin, started by :mod:`compat.launcher` with the
flags the recorded anchors had (the launcher's base flags; the generate server also ``--enable-auto-tool-choice
--tool-call-parser hermes --chat-template compat/tool_chat_template_hermes.jinja``; the pooling server
:data:`compat.launcher.POOLING_ARGS`), one request at a time, and stores each response body byte for byte as it
arrived (also a body the server cut short: what came before the connection closed): ``<case>.sse`` for a
streamed request (``"stream": true``), else ``<case>.json``. The endpoint follows
the case name: ``responses-*`` ``POST /v1/responses``, ``models-*`` ``GET /v1/models``, ``embeddings-*`` ``POST
/v1/embeddings`` (pooling server), every other case ``POST /v1/chat/completions``. ``version.json`` is ``GET
/version``. Standard library only (runs in the line's vLLM environment).
"""

from __future__ import annotations

import argparse
import http.client
import json
import pathlib
import shutil
import sys
import tempfile
import urllib.error
import urllib.request

from compat.launcher import POOLING_ARGS, VLLMServer

HERE = pathlib.Path(__file__).resolve().parent
REFERENCE = HERE / "fixtures" / "vllm" / "0.32.0"
TOOL_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--chat-template",
    str(HERE / "tool_chat_template_hermes.jinja"),
)
ENDPOINTS = {"responses": "/v1/responses", "models": "/v1/models", "embeddings": "/v1/embeddings"}


def endpoint(case: str) -> str:
    """The HTTP path a recorded case was sent to (chat completions unless its name says otherwise)."""
    return ENDPOINTS.get(case.split("-", 1)[0], "/v1/chat/completions")


def fetch(base: str, path: str, body: bytes | None) -> bytes:
    """The response body, also for an error status (vLLM's error bodies are fixtures too) and one cut short (the
    bytes that arrived: vLLM 0.18.1 breaks some Responses streams off before their first event)."""
    request = urllib.request.Request(
        base + path, data=body, headers={"Content-Type": "application/json"} if body is not None else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.read()
    except http.client.IncompleteRead as exc:
        return exc.partial
    except urllib.error.HTTPError as exc:
        return exc.read()


def record(server: VLLMServer, cases: list[pathlib.Path], out: pathlib.Path) -> None:
    for request_file in cases:
        case = request_file.name.removesuffix(".request.json")
        path = endpoint(case)
        body = request_file.read_bytes()
        streamed = json.loads(body).get("stream") is True
        answer = fetch(server.http, path, None if path == "/v1/models" else body)
        shutil.copyfile(request_file, out / request_file.name)
        (out / f"{case}.{'sse' if streamed else 'json'}").write_bytes(answer)
        print(f"recorded {case} ({path}, {len(answer)} bytes)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compat.record_fixtures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (compat/build-model.sh)")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="fixture folder to write")
    parser.add_argument("--reference", type=pathlib.Path, default=REFERENCE, help="folder whose requests to replay")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    requests = sorted(args.reference.glob("*.request.json"))
    pooling = [r for r in requests if endpoint(r.name) == ENDPOINTS["embeddings"]]
    generate = [r for r in requests if r not in pooling]
    workdir = tempfile.mkdtemp(prefix="vllm-nnrp-record-")
    with VLLMServer(args.model, workdir, extra_args=TOOL_ARGS) as server:
        server.wait_ready()
        (args.out / "version.json").write_bytes(fetch(server.http, "/version", None))
        record(server, generate, args.out)
    if pooling:
        with VLLMServer(args.model, workdir, extra_args=POOLING_ARGS) as server:
            server.wait_ready()
            record(server, pooling, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``vllm-nnrp``: command-line client for a ``vllm serve`` running the NNRP plugin.

``vllm-nnrp chat --endpoint tcp://127.0.0.1:9400 [--model M] [--no-stream] [--json] "Say hello."``
streams the answer to stdout as it arrives and prints usage at the end; ``--json`` prints the raw profile
events, one JSON object per line. Exit status: 0 on ``response.completed``, 1 on ``response.error`` (its
code is printed to stderr), 2 on a drop or a transport problem, 3 on timeout.

``vllm-nnrp capabilities --endpoint URI [--conformance]`` prints the server's capability document (fetched over
NNRP with the operation ``nnrp.capabilities``), or with ``--conformance`` the conformance manifest derived from
it; exit 2 when it cannot be fetched.

``vllm-nnrp conformance --endpoint URI [--suite DIR] [--recipes DIR] [--out DIR]`` runs the conformance suite
against the server (:mod:`vllm_nnrp_plugin.conformance.runner`); exit 0 only when every selected case passed.

Also runnable as ``python -m vllm_nnrp_plugin.cli``. (The benchmarks are not part of the package: ``python -m
bench`` from a checkout.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import orjson

from vllm_nnrp_plugin.nnrp_binding.endpoints import DEFAULT_LISTEN
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, SCHEMA_VERSION
from vllm_nnrp_plugin.profile import events as ev


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-nnrp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser("chat", help="send one chat message and stream the answer")
    chat.add_argument("message", help="the user message")
    chat.add_argument("--endpoint", default=DEFAULT_LISTEN, help=f"tcp://HOST:PORT or unix:///PATH (default {DEFAULT_LISTEN})")
    chat.add_argument("--model", help="served model name (default: the server's first model)")
    chat.add_argument("--max-tokens", type=int, help="max_tokens of the request")
    chat.add_argument("--temperature", type=float, help="sampling temperature")
    chat.add_argument("--no-stream", action="store_true", help="ask for one non-streaming answer")
    chat.add_argument("--json", action="store_true", help="print the raw profile events as JSON lines")
    chat.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the terminal (default 300)")
    caps = commands.add_parser("capabilities", help="print the server's capability document")
    caps.add_argument("--endpoint", default=DEFAULT_LISTEN, help=f"tcp://HOST:PORT or unix:///PATH (default {DEFAULT_LISTEN})")
    caps.add_argument("--conformance", action="store_true", help="print the derived conformance manifest instead")
    caps.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    from vllm_nnrp_plugin.conformance.runner import add_arguments

    add_arguments(commands.add_parser("conformance", help="run the conformance suite against the server"))
    args = parser.parse_args(argv)
    if args.command == "capabilities":
        return asyncio.run(_capabilities(args))
    if args.command == "conformance":
        from vllm_nnrp_plugin.conformance.runner import run

        return run(args)
    return asyncio.run(_chat(args))


async def _connect(endpoint: str) -> Any:
    """A connected :class:`ProfileClient`, or None after saying why on stderr."""
    from vllm_nnrp_plugin.client import ClientError, ProfileClient

    try:
        return await ProfileClient.connect(endpoint)
    except ClientError as exc:  # an unusable address, or nnrp-py's transport failure
        print(f"vllm-nnrp: cannot connect to {endpoint}: {exc}", file=sys.stderr)
        return None


async def _capabilities(args: argparse.Namespace) -> int:
    from vllm_nnrp_plugin.client import ClientError
    from vllm_nnrp_plugin.profile.capabilities import conformance_manifest

    client = await _connect(args.endpoint)
    if client is None:
        return 2
    try:
        document = client.capabilities(timeout_s=args.timeout)
    except ClientError as exc:  # ClientTimeout, a refused fetch, the transport failed
        print(f"vllm-nnrp: cannot fetch capabilities from {args.endpoint}: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    if args.conformance:
        document = conformance_manifest(document)
    _out(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def chat_envelope(args: argparse.Namespace) -> dict[str, Any]:
    """The ``chat.completions.create`` envelope for the command-line arguments."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": args.message}], "stream": not args.no_stream}
    if not args.no_stream:
        body["stream_options"] = {"include_usage": True}
    for key, value in (("model", args.model), ("max_tokens", args.max_tokens), ("temperature", args.temperature)):
        if value is not None:
            body[key] = value
    return {"schema_version": SCHEMA_VERSION, "operation": CHAT_COMPLETIONS_CREATE, "body": body}


async def _chat(args: argparse.Namespace) -> int:
    from vllm_nnrp_plugin.client import ClientError, ClientTimeout

    client = await _connect(args.endpoint)
    if client is None:
        return 2
    try:
        printer = _Printer(as_json=args.json)
        try:
            operation = client.submit(chat_envelope(args))
            for event in client.events(operation, timeout_s=args.timeout):
                status = printer.show(event)
                if status is not None:
                    return status
        except ClientTimeout as exc:
            print(f"vllm-nnrp: {exc}", file=sys.stderr)
            return 3
        except ClientError as exc:  # the transport failed mid-operation
            print(f"vllm-nnrp: {exc}", file=sys.stderr)
            return 2
        return 2
    finally:
        client.close()


class _Printer:
    def __init__(self, *, as_json: bool) -> None:
        self._json = as_json
        self._usage_shown = False
        self._text_shown = False

    def show(self, event: Any) -> int | None:
        """Print one event; return the exit status once the terminal arrived."""
        data = event.event
        kind = data["type"] if data is not None else None
        if self._json and data is not None:
            _out(orjson.dumps(data).decode() + "\n")
        elif kind == ev.OUTPUT_TEXT_DELTA:
            self._text_shown = True
            _out(data["delta"])
        elif kind == ev.USAGE:
            self._print_usage(data["usage"])
        elif kind == ev.COMPLETED:
            body = data["body"]
            if not self._text_shown and body.get("choices"):
                _out(body["choices"][0]["message"].get("content") or "")
            if not self._usage_shown and body.get("usage"):
                self._print_usage(ev.usage(body["usage"])["usage"])
            elif not self._usage_shown:
                _out("\n")
        if not event.terminal:
            return None
        if kind == ev.COMPLETED:
            return 0
        if kind == ev.ERROR:
            error = data["error"]
            print(f"vllm-nnrp: error {error['code']}: {error['message']}", file=sys.stderr)
            return 1
        print(f"vllm-nnrp: operation dropped (NNRP drop reason {event.drop_reason}): {data}", file=sys.stderr)
        return 2

    def _print_usage(self, usage: dict[str, Any]) -> None:
        self._usage_shown = True
        _out(
            f"\n[usage] input {usage['input_tokens']} · output {usage['output_tokens']} · "
            f"total {usage['total_tokens']} tokens\n"
        )


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())

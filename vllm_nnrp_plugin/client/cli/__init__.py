"""``vllm-nnrp``: command-line client for a ``vllm serve`` running the NNRP plugin.

``vllm-nnrp chat --endpoint tcp://127.0.0.1:9400 [--model M] [--no-stream] [--json] "Say hello."``
streams the answer to stdout as it arrives, then the tool calls and usage; ``--json`` prints the raw profile
events, one JSON object per line. ``vllm-nnrp respond [--model M] [--instructions I] [--max-output-tokens N]
[--no-stream] [--json] PROMPT`` does the same with ``responses.create``.

``vllm-nnrp models [--json]`` prints the served models (``models.list``): one line per model with its id and
``max_model_len`` (tokens), or the raw ``list`` body. ``vllm-nnrp embed [--model M] [--encoding-format
float|base64] [--dimensions N] [--json] TEXT [TEXT …]`` prints, per input, its index, dimension count and first
values (``embeddings.create``; ``base64`` vectors are decoded as little-endian float32, vLLM's default
``embed_dtype``), then usage; or the raw body.

Exit status of these four: 0 on ``response.completed``, 1 on ``response.error`` (its code is printed to stderr;
``unsupported_operation`` when the server does not serve the operation), 2 on a drop or a transport problem,
3 on timeout.

``--timeout S`` means what an HTTP client's timeout means: the longest wait to connect, to open the session, and
for each next event of the answer (the first one included) — a stream that keeps producing runs as long as it
produces; one silent for longer is cancelled (the server aborts the vLLM request), exit 3. ``--max-time S`` (like
curl's) bounds the whole operation instead: it is sent as the envelope's ``nnrp.timeout_ms`` and the server ends
the operation with ``request_timeout`` (exit 3).

Every operation command and ``capabilities`` speak the project's asyncio client
(:mod:`vllm_nnrp_plugin.client.aio.connection`) to ``--endpoint`` (``tcp://HOST:PORT``, ``nnrps://HOST:PORT``,
``unix:///PATH``, ``ws://HOST:PORT[/PATH]``, ``wss://HOST:PORT[/PATH]`` or ``quic://HOST:PORT``) with ``--api-key``
(default: ``$VLLM_API_KEY``, else ``$OPENAI_API_KEY``; sent only when set: what a ``vllm serve --api-key``
requires, on every carrier) and, for the TLS carriers ``nnrps://``, ``wss://`` and ``quic://``, ``--tls-ca FILE``
(PEM CA or server certificates; default: the system's trust store). A refused key exits 2 saying so. ``--priority
interactive|balanced|background`` opens the session with that NNRP priority class (SESSION_OPEN
``priority_class``) and, for the operation commands, puts it in the envelope as ``nnrp.priority_class``; without
it the session is balanced and the envelope has no ``nnrp`` member.

``vllm-nnrp capabilities --endpoint URI [--conformance]`` prints the server's capability document (fetched over
NNRP with the operation ``nnrp.capabilities``), or with ``--conformance`` the conformance manifest derived from
it; exit 2 when it cannot be fetched.

``vllm-nnrp conformance --endpoint URI [--suite DIR] [--recipes DIR] [--no-suite-recipes] [--out DIR]`` runs the
conformance suite against the server (:mod:`vllm_nnrp_plugin.client.conformance.runner`); exit 0 only when every
selected case passed.

Also runnable as ``python -m vllm_nnrp_plugin.client.cli``. (The benchmarks are not part of the package: ``python -m
bench`` from a checkout.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import struct
import sys
from collections.abc import Callable
from typing import Any

import orjson

from vllm_nnrp_plugin.client.cli.operation import show_operation
from vllm_nnrp_plugin.client.cli.say import reason, say
from vllm_nnrp_plugin.contract.endpoints import DEFAULT_LISTEN
from vllm_nnrp_plugin.core.controls import PRIORITY_CLASSES
from vllm_nnrp_plugin.profile import (
    CHAT_COMPLETIONS_CREATE,
    EMBEDDINGS_CREATE,
    MODELS_LIST,
    RESPONSES_CREATE,
    SCHEMA_VERSION,
)
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events as ev

#: where the key comes from when ``--api-key`` is not given, in order (vLLM's server variable, the SDK's)
API_KEY_ENVS = ("VLLM_API_KEY", "OPENAI_API_KEY")
#: values of each embedding ``vllm-nnrp embed`` prints
SHOWN_VALUES = 4
#: what ``--json`` prints, per command
EVENTS, BODY = "the raw profile events as JSON lines", "the raw body as JSON"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "capabilities":
        return asyncio.run(_capabilities(args))
    if args.command == "conformance":
        from vllm_nnrp_plugin.client.conformance.runner import run

        return run(args)
    envelope, printer = COMMANDS[args.command](args)
    return asyncio.run(_run(args, envelope, printer))


def build_parser() -> argparse.ArgumentParser:
    """The ``vllm-nnrp`` argument parser (one subcommand each)."""
    parser = argparse.ArgumentParser(prog="vllm-nnrp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    chat = _operation_parser(commands, "chat", "send one chat message and stream the answer", timeout=300.0, raw=EVENTS)
    chat.add_argument("message", help="the user message")
    chat.add_argument("--model", help="served model name (default: the server's first model)")
    chat.add_argument("--max-tokens", type=int, help="max_tokens of the request")
    chat.add_argument("--temperature", type=float, help="sampling temperature")
    chat.add_argument("--no-stream", action="store_true", help="ask for one non-streaming answer")
    respond = _operation_parser(
        commands, "respond", "send one prompt to responses.create and stream the answer", timeout=300.0, raw=EVENTS
    )
    respond.add_argument("prompt", help="the input")
    respond.add_argument("--model", help="served model name (default: the server's first model)")
    respond.add_argument("--instructions", help="instructions of the request (a system message)")
    respond.add_argument("--max-output-tokens", type=int, help="max_output_tokens of the request")
    respond.add_argument("--no-stream", action="store_true", help="ask for one non-streaming answer")
    _operation_parser(commands, "models", "list the served models (models.list)", timeout=30.0, raw=BODY)
    embed = _operation_parser(commands, "embed", "embed texts (embeddings.create)", timeout=60.0, raw=BODY)
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="the inputs, one embedding each")
    embed.add_argument("--model", help="served model name (default: the server's first model)")
    embed.add_argument("--encoding-format", choices=("float", "base64"), help="encoding_format of the request")
    embed.add_argument("--dimensions", type=int, help="dimensions of the request (models that support it)")
    caps = commands.add_parser("capabilities", help="print the server's capability document")
    _endpoint_option(caps)
    caps.add_argument("--conformance", action="store_true", help="print the derived conformance manifest instead")
    caps.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    from vllm_nnrp_plugin.client.conformance.runner import add_arguments

    add_arguments(commands.add_parser("conformance", help="run the conformance suite against the server"))
    return parser


def _endpoint_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        default=DEFAULT_LISTEN,
        help=f"tcp://HOST:PORT, nnrps://HOST:PORT, unix:///PATH, ws(s)://HOST:PORT[/PATH] or quic://HOST:PORT "
        f"(default {DEFAULT_LISTEN}); several, comma-separated: the replicas of a fleet",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"the server's API key (vllm serve --api-key; default: ${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]})",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="PEM CA or server certificate(s) to trust for nnrps://, "
        "wss:// and quic:// (default: the system's trust store)",
    )
    parser.add_argument(
        "--priority",
        choices=tuple(PRIORITY_CLASSES),
        help="NNRP priority class of the session "
        "and the operation (envelope nnrp.priority_class; default: a balanced session)",
    )


def api_key_of(args: argparse.Namespace, environ: Any = None) -> str | None:
    """``--api-key``, else the first of :data:`API_KEY_ENVS` set in the environment, else None."""
    if args.api_key:
        return args.api_key
    environ = os.environ if environ is None else environ
    return next((environ[name] for name in API_KEY_ENVS if environ.get(name)), None)


def _operation_parser(commands: Any, name: str, help_text: str, *, timeout: float, raw: str) -> argparse.ArgumentParser:
    """A subcommand that runs one profile operation: ``--endpoint``, ``--json`` (prints ``raw``), ``--timeout``."""
    parser = commands.add_parser(name, help=help_text)
    _endpoint_option(parser)
    parser.add_argument("--json", action="store_true", help=f"print {raw}")
    parser.add_argument(
        "--timeout",
        type=float,
        default=timeout,
        help="seconds to wait to connect, to open the "
        f"session, and for each next event of the answer (default {timeout:g})",
    )
    parser.add_argument(
        "--max-time",
        type=float,
        help="seconds the whole operation may take (envelope nnrp.timeout_ms; default: no bound while events come)",
    )
    return parser


async def _session(args: argparse.Namespace) -> tuple[Any, Any] | None:
    """A connection and an open session to ``args.endpoint``, or None after saying why on stderr."""
    from vllm_nnrp_plugin.client.aio.connection import connect
    from vllm_nnrp_plugin.client.errors import AuthenticationFailed, ClientError

    try:
        conn = await asyncio.wait_for(
            connect(args.endpoint, api_key=api_key_of(args), tls_ca_file=args.tls_ca), args.timeout
        )
    except (ClientError, ValueError, TimeoutError) as exc:  # an unusable address or key, no server, TLS refused
        why = reason(exc)
        if not why.startswith("cannot connect to"):  # the connection's own errors already say it
            why = f"cannot connect to {args.endpoint}: {why}"
        hint = (
            (
                "; pass --tls-ca FILE (the server's certificate, or the CA that signed it), and check that the "
                "certificate names the host or IP address you connect to"
            )
            if "CERTIFICATE_VERIFY_FAILED" in why
            else ""
        )
        say(f"vllm-nnrp: {why}{hint}")
        return None
    try:
        session = await asyncio.wait_for(conn.open_session(priority_class=args.priority or "balanced"), args.timeout)
    except AuthenticationFailed:
        await conn.close()
        what = "refused the key given" if api_key_of(args) else "requires an API key and none was given"
        say(f"vllm-nnrp: {args.endpoint} {what}: use --api-key or ${API_KEY_ENVS[0]} (vLLM's --api-key)")
        return None
    except (ClientError, TimeoutError) as exc:
        await conn.close()
        say(f"vllm-nnrp: {args.endpoint} did not open a session: {reason(exc)}")
        return None
    return conn, session


async def _capabilities(args: argparse.Namespace) -> int:
    from vllm_nnrp_plugin.profile.capabilities import CAPABILITIES_OPERATION, conformance_manifest

    opened = await _session(args)
    if opened is None:
        return 2
    conn, session = opened
    try:
        op = session.submit({"schema_version": SCHEMA_VERSION, "operation": CAPABILITIES_OPERATION, "body": {}})
        terminal = await asyncio.wait_for(op.result(), args.timeout)
    except Exception as exc:  # noqa: BLE001 - ClientError, a timeout: said plainly, exit 2
        say(f"vllm-nnrp: cannot fetch capabilities from {args.endpoint}: {reason(exc)}")
        return 2
    finally:
        await conn.close()
    if terminal.get("type") != ev.COMPLETED:
        say(f"vllm-nnrp: cannot fetch capabilities from {args.endpoint}: {terminal}")
        return 2
    document = terminal["body"]
    if args.conformance:
        document = conformance_manifest(document)
    _out(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def _envelope(operation: str, body: dict[str, Any], args: argparse.Namespace, *fields: str) -> dict[str, Any]:
    """The envelope of ``operation``: ``body`` plus each request field of ``fields`` (named as the argument)
    that was given on the command line; ``nnrp.priority_class`` when ``--priority`` was."""
    body.update({name: getattr(args, name) for name in fields if getattr(args, name) is not None})
    envelope = {"schema_version": SCHEMA_VERSION, "operation": operation, "body": body}
    nnrp: dict[str, Any] = {}
    if args.priority:
        nnrp["priority_class"] = args.priority
    if getattr(args, "max_time", None):
        nnrp["timeout_ms"] = max(1, int(args.max_time * 1000))
    if nnrp:
        envelope["nnrp"] = nnrp
    return envelope


def chat_envelope(args: argparse.Namespace) -> dict[str, Any]:
    """The ``chat.completions.create`` envelope for the command-line arguments."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": args.message}], "stream": not args.no_stream}
    if not args.no_stream:
        body["stream_options"] = {"include_usage": True}
    return _envelope(CHAT_COMPLETIONS_CREATE, body, args, "model", "max_tokens", "temperature")


def respond_envelope(args: argparse.Namespace) -> dict[str, Any]:
    """The ``responses.create`` envelope for the command-line arguments (OpenAI's Responses request: ``input``,
    ``instructions``, ``max_output_tokens``, ``stream``)."""
    body: dict[str, Any] = {"input": args.prompt, "stream": not args.no_stream}
    return _envelope(RESPONSES_CREATE, body, args, "model", "instructions", "max_output_tokens")


def models_envelope(args: argparse.Namespace) -> dict[str, Any]:
    """The ``models.list`` envelope (an empty body)."""
    return _envelope(MODELS_LIST, {}, args)


def embed_envelope(args: argparse.Namespace) -> dict[str, Any]:
    """The ``embeddings.create`` envelope: every text in one request (``input`` a list, in order)."""
    return _envelope(EMBEDDINGS_CREATE, {"input": list(args.texts)}, args, "model", "encoding_format", "dimensions")


async def _run(args: argparse.Namespace, envelope: dict[str, Any], printer: Any) -> int:
    """Submit ``envelope`` and show its events with ``printer`` until the terminal; the exit status."""
    from vllm_nnrp_plugin.client.cli.fleet import is_fleet_endpoint, run_on_fleet

    if is_fleet_endpoint(args.endpoint):  # several addresses: the fleet's replicas (:mod:`.fleet`)
        return await run_on_fleet(args, envelope, printer, api_key_of(args))
    opened = await _session(args)
    if opened is None:
        return 2
    conn, session = opened
    try:
        return await show_operation(args, printer, lambda: session.submit(envelope, read_timeout_s=args.timeout))
    finally:
        await conn.close()


def terminal_status(event: Any) -> int:
    """The exit status of a terminal event (0 completed, 1 ``response.error``, 3 its ``request_timeout`` (the
    ``--max-time`` bound), 2 a drop); says why on stderr."""
    data = event.event
    kind = data["type"] if data is not None else None
    if kind == ev.COMPLETED:
        return 0
    if kind == ev.ERROR:
        error = data["error"]
        say(f"vllm-nnrp: error {error['code']}: {error['message']}")
        return 3 if error["code"] == E.REQUEST_TIMEOUT else 1
    say(f"vllm-nnrp: operation dropped (NNRP drop reason {event.drop_reason}): {data}")
    return 2


def answer_of(body: dict[str, Any]) -> tuple[str, list[tuple[str, str, str]], dict[str, Any] | None]:
    """``(text, [(call_id, name, arguments)], profile usage or None)`` of a completed body: a ``chat.completion``
    (its first choice's ``message``; OpenAI's ``prompt_tokens``/``completion_tokens`` usage) or a Responses
    ``response`` object (its ``output`` items: ``message`` with ``output_text`` parts, ``function_call``;
    ``input_tokens``/``output_tokens`` usage)."""
    text, calls = "", []
    if "choices" in body:
        message = body["choices"][0]["message"] if body["choices"] else {}
        text = message.get("content") or ""
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
        usage = ev.usage(body["usage"])["usage"] if body.get("usage") else None
        return text, calls, usage
    for item in body.get("output") or ():
        if item.get("type") == "message":
            text += "".join(
                part.get("text", "") for part in item.get("content") or () if part.get("type") == "output_text"
            )
        elif item.get("type") == "function_call":
            calls.append((item["call_id"], item["name"], item["arguments"]))
    usage = body.get("usage")
    if usage:
        usage = {key: usage.get(key) or 0 for key in ("input_tokens", "output_tokens", "total_tokens")}
    return text, calls, usage or None


class AnswerPrinter:
    """Prints a ``chat.completions.create`` or ``responses.create`` operation: text deltas as they arrive,
    each completed tool call as ``[tool call CALL_ID] NAME(ARGUMENTS)``, usage; for a non-streamed answer the
    same from the completed body (:func:`answer_of`). With ``as_json`` the raw events, one per line."""

    def __init__(self, *, as_json: bool) -> None:
        self._json = as_json
        self._usage_shown = False
        self._text_shown = False
        self._calls_shown = False

    def show(self, event: Any) -> int | None:
        """Print one event; return the exit status once the terminal arrived."""
        data = event.event
        kind = data["type"] if data is not None else None
        if self._json and data is not None:
            _out(orjson.dumps(data).decode() + "\n")
        elif kind == ev.OUTPUT_TEXT_DELTA:
            self._text_shown = True
            _out(data["delta"])
        elif kind == ev.TOOL_CALL_COMPLETED:
            self._print_call(data["call_id"], data["name"], data["arguments"])
        elif kind == ev.TOOL_CALL_ERROR:
            self._calls_shown = True
            say(f"vllm-nnrp: tool call {data['call_id']} failed: {data['error']['code']}")
        elif kind == ev.USAGE:
            self._print_usage(data["usage"])
        elif kind == ev.COMPLETED:
            self._print_body(data["body"])
        return terminal_status(event) if event.terminal else None

    def _print_body(self, body: dict[str, Any]) -> None:
        text, calls, usage = answer_of(body)
        if not self._text_shown:
            _out(text)
        if not self._calls_shown:
            for call in calls:
                self._print_call(*call)
        if not self._usage_shown and usage is not None:
            self._print_usage(usage)
        elif not self._usage_shown:
            _out("\n")

    def _print_call(self, call_id: str, name: str, arguments: str) -> None:
        self._calls_shown = True
        _out(f"\n[tool call {call_id}] {name}({arguments})")

    def _print_usage(self, usage: dict[str, Any]) -> None:
        self._usage_shown = True
        _out(
            f"\n[usage] input {usage['input_tokens']} · output {usage['output_tokens']} · "
            f"total {usage['total_tokens']} tokens\n"
        )


class BodyPrinter:
    """Prints the body of an operation answered with one body (``models.list``, ``embeddings.create``) with
    ``render``, or as indented JSON with ``as_json``."""

    def __init__(self, render: Callable[[dict[str, Any]], str], *, as_json: bool) -> None:
        self._render = render
        self._json = as_json

    def show(self, event: Any) -> int | None:
        if not event.terminal:
            return None
        status = terminal_status(event)
        if status == 0:
            body = event.event["body"]
            _out(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n" if self._json else self._render(body))
        return status


def render_models(body: dict[str, Any]) -> str:
    """One line per model of an OpenAI ``list`` of ``model`` objects: its id and vLLM's ``max_model_len``
    (tokens; ``-`` when absent)."""
    rows = [(model["id"], str(model.get("max_model_len", "-"))) for model in body.get("data") or ()]
    width = max((len(model_id) for model_id, _ in rows), default=0)
    return "".join(f"{model_id:<{width}}  max_model_len {length}\n" for model_id, length in rows)


def embedding_values(embedding: list[float] | str) -> list[float]:
    """The vector of one ``embedding``: a list of floats (``encoding_format: "float"``), or the base64 string of
    little-endian float32 values (``"base64"``; OpenAI's encoding and vLLM's default ``embed_dtype``/native
    endianness on little-endian hosts). Raises ValueError for a string that is not that."""
    if isinstance(embedding, list):
        return embedding
    raw = base64.b64decode(embedding, validate=True)
    if len(raw) % 4:
        raise ValueError(f"a base64 embedding of {len(raw)} bytes is not float32 values")
    return [value for (value,) in struct.iter_unpack("<f", raw)]


def render_embeddings(body: dict[str, Any]) -> str:
    """Per embedding of an OpenAI ``list`` of ``embedding`` objects: ``[INDEX] N dimensions: v0, v1, … ``
    (the first :data:`SHOWN_VALUES` values), then ``[usage] input N · total N tokens``."""
    lines = []
    for item in body.get("data") or ():
        try:
            values = embedding_values(item["embedding"])
        except ValueError as exc:
            lines.append(f"[{item['index']}] undecodable embedding: {exc}")
            continue
        shown = ", ".join(f"{value:.4f}" for value in values[:SHOWN_VALUES])
        more = ", …" if len(values) > SHOWN_VALUES else ""
        lines.append(f"[{item['index']}] {len(values)} dimensions: {shown}{more}")
    usage = body.get("usage")
    if usage:
        lines.append(f"[usage] input {usage.get('prompt_tokens', 0)} · total {usage.get('total_tokens', 0)} tokens")
    return "".join(line + "\n" for line in lines)


#: command -> (envelope, printer) for the command-line arguments
COMMANDS: dict[str, Callable[[argparse.Namespace], tuple[dict[str, Any], Any]]] = {
    "chat": lambda args: (chat_envelope(args), AnswerPrinter(as_json=args.json)),
    "respond": lambda args: (respond_envelope(args), AnswerPrinter(as_json=args.json)),
    "models": lambda args: (models_envelope(args), BodyPrinter(render_models, as_json=args.json)),
    "embed": lambda args: (embed_envelope(args), BodyPrinter(render_embeddings, as_json=args.json)),
}


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()

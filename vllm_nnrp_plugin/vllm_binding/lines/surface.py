"""What a binding of vLLM lines declares (:class:`Binding`), what it is checked against (:class:`Surface`, read from
the installed vLLM by :func:`~vllm_nnrp_plugin.vllm_binding.families.read_surface`), and the probes the lines share.

The modules beside this one declare one binding each (``v0_18`` … ``v0_34``): everything this package knows about
those lines in one place.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

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


def family_of(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.27.1`` or ``0.32.0+cpu``."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


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
    """A named binding (the adapter of one or more vLLM lines) for the lines of its tested ``anchors`` (one version
    per line, oldest first; the line of ``0.27.1`` is the family (0, 27)).

    ``attach_paths``: the ways the NNRP service can be attached on these lines, in priority order; ``probes``:
    the features of the installed vLLM the binding needs (checked before the model loads). What the lanes may do on
    these lines (``None``: the lane may run, once its start-up self-check passes on the installed vLLM,
    :mod:`..self_check`; else why it cannot): ``chat_parser_lane_off`` for the chat engine lane with a tool-call
    or reasoning parser, ``responses_lane_off`` for the Responses lane, ``responses_parser_lane_off`` for the
    Responses lane with a parser. ``json_schema_stream_fails``: the line's Responses stream breaks off before its
    first event when the request's text format is a JSON schema
    (:func:`~vllm_nnrp_plugin.vllm_binding.families.responses_stream_fails`).
    """

    name: str
    anchors: tuple[str, ...]
    attach_paths: tuple[str, ...]
    probes: tuple[Probe, ...]
    chat_parser_lane_off: str | None = None
    responses_lane_off: str | None = None
    responses_parser_lane_off: str | None = None
    json_schema_stream_fails: bool = False

    @property
    def families(self) -> tuple[tuple[int, int], ...]:
        """(major, minor) of each anchor: the lines this binding serves."""
        return tuple(family_of(anchor) for anchor in self.anchors)

    def anchor_for(self, family: tuple[int, int]) -> str:
        """The tested anchor of ``family``, one of :attr:`families`."""
        return self.anchors[self.families.index(tuple(family))]


#: the probes the lines' bindings pick from
CHAT = Probe(f"{CHAT_PROTOCOL_MODULE}.ChatCompletionRequest", lambda s: s.chat_protocol)
NOT_RELOCATED = Probe(
    f"the {API_SERVER_MODULE}.build_app layout (not the relocated {RELOCATED_LAUNCHERS_MODULE})",
    lambda s: not s.relocated_launchers,
)
BUILD_APP_018 = Probe(
    "build_app(args, supported_tasks) without model_config (0.18 shape)",
    lambda s: "args" in s.build_app_params and "model_config" not in s.build_app_params,
)
BUILD_APP_022 = Probe(
    "build_app(args, supported_tasks, model_config) (0.22+ shape)",
    lambda s: "model_config" in s.build_app_params,
)
RELOCATED = Probe(f"the relocated {RELOCATED_APP_MODULE}.build_app layout (0.29+)", lambda s: s.relocated_launchers)
ENDPOINT_PLUGINS = Probe("vllm.plugins.load_endpoint_plugins", lambda s: s.endpoint_plugins)
NO_ENDPOINT_PLUGINS = Probe(
    "no vllm.plugins.load_endpoint_plugins (the 0.18/0.22 lines have none)", lambda s: not s.endpoint_plugins
)
#: the probes of the relocated layout (0.29+: ``vllm/entrypoints/launchers/app.py``, the endpoint-plugin hook)
RELOCATED_LAYOUT = (ENDPOINT_PLUGINS, BUILD_APP_022, CHAT, RELOCATED)

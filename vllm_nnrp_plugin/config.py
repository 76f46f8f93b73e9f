"""Plugin settings: the ``nnrp`` block of vLLM's ``--additional-config`` plus environment overrides.

``--additional-config '{"nnrp": {"enabled": true, "listen": ["tcp://127.0.0.1:9400"]}}'`` (or the same
mapping under ``additional-config:`` in a ``vllm serve --config`` YAML file, which vLLM turns into the same JSON).
vLLM keeps it as ``VllmConfig.additional_config`` (a dict, ``vllm/config/vllm.py``), read in the API server as
``app.state.vllm_config.additional_config``; the ``nnrp`` key namespaces ours, as vLLM adds keys of its own.

| key | type | default | meaning |
|---|---|---|---|
| ``enabled`` | bool | on when ``VLLM_PLUGINS`` names ``nnrp`` | start the listener |
| ``listen`` | list of URIs | ``["tcp://127.0.0.1:9400"]`` | ``tcp://HOST:PORT``, ``unix:///PATH`` |
| ``max_envelope_bytes`` | int, bytes | 33554432 (32 MiB) | larger envelopes get ``envelope_too_large``; sized to take what vLLM's HTTP server takes (uvicorn sets no request-body limit: https://www.uvicorn.org/settings/, so a long-context prompt or base64 images reach vLLM, which answers them itself); memory is bounded by ``max_buffered_bytes`` and the read back-pressure, not by this |
| ``max_sessions`` | int | 256 | open sessions per API-server process; more are refused at open |
| ``max_in_flight_per_session`` | int or null | null: vLLM's ``--max-num-seqs`` | operations one session may have running (its credit); more get ``too_many_requests`` |
| ``max_in_flight`` | int or null | null: no limit (operations wait in vLLM's queue, as HTTP requests do) | operations one API-server process may have running; more get ``too_many_requests`` |
| ``max_queued_events`` | int | 1024 | events one session may have waiting to be sent; beyond it the operation that overflows ends with ``client_too_slow`` |
| ``allow_untested_vllm`` | bool | false | on a vLLM line newer than the newest this release was tested on, start with the newest line's binding instead of refusing; every engine lane still has to pass its start-up self-check (logged as a warning naming the line and the lanes kept) |
| ``allow_unauthenticated`` | bool | false | serve NNRP without a key although ``vllm serve`` requires one (``--api-key`` / ``VLLM_API_KEY``); logged as a warning |
| ``handshake_timeout_ms`` | int, ms | 10000 | a new connection's TLS handshake must complete within it; then, until its first session is open, its client may stay silent no longer (bytes waiting unread are not silence; a trickling handshake ends at 3 × it: :func:`.nnrp_binding.bounds.handshake_recheck`); else it is closed |
| ``drain_timeout_ms`` | int, ms | 30000 | on vLLM's shutdown (SIGTERM), how long operations already running may go on finishing while the server takes no new connection, session or operation (:mod:`vllm_nnrp_plugin.contract.draining`); then the rest end with ``server_shutdown``; 0: end them at once |
| ``max_connections`` | int | 2048 | open NNRP connections per API-server process; a new one beyond it is closed at once |
| ``max_buffered_bytes`` | int, bytes | 268435456 | bytes of incomplete packets over every connection; the connection whose read goes over it ends (one packet may be at most ``max(2 × max_envelope_bytes, max_envelope_bytes + 1 MiB)``, 64 MiB by default: the native peers' packet limit, advertised in SERVER_HELLO_ACK ``max_body_bytes``) |
| ``allow_non_loopback`` | bool | false | allow a ``tcp://`` / ``ws://`` address, or a ``metrics_listen`` host, that other hosts can reach without TLS (logged as a warning) |
| ``tls_cert_file`` | path | none | PEM certificate for ``nnrps://``, ``wss://`` and ``quic://`` |
| ``tls_key_file`` | path | none | PEM private key for the same |
| ``ipc_socket_group`` | group name | none | unix socket files are owner-only (0600); with a group, 0660 and owned by that group |
| ``fault_injection_backend_error_model`` | str or null | null | **test only**: requests for this model id end
  with ``backend_error`` without reaching vLLM (the conformance suite's ``backend-error`` case) |
| ``metrics_listen`` | ``HOST:PORT`` or null | null | also serve the NNRP metrics on their own ``/metrics`` server there (no authentication, no TLS; a host other than loopback needs ``allow_non_loopback``); by default they are only in vLLM's ``/metrics`` |
| ``ws_allowed_origins`` | list of origins or null | null: no browser origin when no API key is required, any when one is | the ``Origin`` values a ``ws://`` / ``wss://`` Upgrade may carry (``"https://app.example.com"``, or ``"*"`` for any); an Upgrade with another ``Origin`` gets HTTP 403; one without ``Origin`` (not a browser) is never refused for it |
| ``priorities`` | mapping of NNRP priority class to int | ``{"interactive": -10, "balanced": 0, "background": 10}`` | the vLLM request ``priority`` of each NNRP priority class on a server that schedules by priority (``--scheduling-policy priority``; lower runs first; an HTTP request's default is 0); a class left out keeps its default; a request body's own ``priority`` wins |
| ``operations`` | list of operation names or null | null: every operation the server's vLLM serving objects offer | serve only these ``openai-compatible/1`` operations over NNRP (e.g. ``["chat.completions.create"]``: a Level-1-only deployment; any other operation gets ``unsupported_operation``) |

``accept_timeout_ms`` and ``idle_poll_ms`` (settings of a QUIC runtime this package no longer has) are accepted
and ignored with a warning naming them (:data:`OBSOLETE_KEYS`), so a configuration written for an earlier version
still starts.

Environment: ``VLLM_NNRP_LISTEN`` (comma-separated URIs) overrides ``listen``. Unknown keys, wrong types and
listen URIs outside the forms of :mod:`vllm_nnrp_plugin.contract.endpoints` are errors
(:class:`ConfigError`), never ignored; so are a non-loopback address without TLS, or a non-loopback
``metrics_listen``, unless ``allow_non_loopback`` is true, a ``quic://`` address without aioquic installed (the
``[quic]`` extra), a ``ws_allowed_origins`` entry that is not an origin, a TLS address without ``tls_cert_file`` /
``tls_key_file``, unreadable certificate or key files, an
unknown ``ipc_socket_group`` and an ``operations`` entry that is not an operation of the profile
(:data:`vllm_nnrp_plugin.profile.LEVELS`). Whether the vLLM server serves the listed operations is known only
once it runs: :class:`vllm_nnrp_plugin.vllm_binding.backend.VLLMBackend` refuses to start otherwise.
"""

from __future__ import annotations

import grp
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs

from vllm_nnrp_plugin.contract.endpoints import (
    DEFAULT_LISTEN,
    QUIC_INSTALL,
    EndpointError,
    is_loopback,
    is_loopback_host,
    parse_endpoint,
    quic_available,
)
from vllm_nnrp_plugin.core.controls import PRIORITY_CLASSES
from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.profile import LEVELS

logger = logging.getLogger(__name__)

#: keys of earlier versions that no longer mean anything, and why: accepted, ignored, named in a warning
OBSOLETE_KEYS = {
    "accept_timeout_ms": "QUIC no longer runs on nnrp-py's native runtime (every carrier is served on vLLM's loop)",
    "idle_poll_ms": "QUIC no longer runs on nnrp-py's native runtime (no session is polled)",
}

#: every operation of the ``openai-compatible/1`` profile, by level
PROFILE_OPERATIONS = tuple(name for names in LEVELS.values() for name in names)

CONFIG_KEY = "nnrp"
LISTEN_ENV = "VLLM_NNRP_LISTEN"
PLUGIN_NAME = "nnrp"


class ConfigError(NNRPStartupError, ValueError):
    """The ``nnrp`` settings are invalid; the message says which key and how to fix it."""


def _not_negative(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"nnrp.{attribute.name} must be 0 or more, got {value!r}")


def _positive(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ValueError(f"nnrp.{attribute.name} must be > 0, got {value}")


def _host_port(_inst: object, attribute: attrs.Attribute, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"nnrp.{attribute.name} must be HOST:PORT, got {value!r}")


def _profile_operations(_inst: object, attribute: attrs.Attribute, value: tuple[str, ...] | None) -> None:
    unknown = [name for name in value or () if name not in PROFILE_OPERATIONS]
    if unknown:
        raise ValueError(
            f"nnrp.{attribute.name} names {', '.join(map(repr, unknown))}, not an openai-compatible/1 operation. "
            f"Fix: list some of {', '.join(PROFILE_OPERATIONS)}, or drop the key to serve every operation the "
            "server offers."
        )


#: a browser ``Origin``: scheme, host and an optional port, nothing else (RFC 6454 §7), or ``*`` for any
_ORIGIN = re.compile(r"\*|https?://[^/?#\s]+")


def _origins(_inst: object, attribute: attrs.Attribute, value: tuple[str, ...] | None) -> None:
    bad = [origin for origin in value or () if not _ORIGIN.fullmatch(origin)]
    if bad:
        raise ValueError(
            f"nnrp.{attribute.name} names {', '.join(map(repr, bad))}, not an origin. Fix: list origins as browsers "
            'send them, scheme://host[:port] without a path (e.g. "https://app.example.com"), or "*" for any.'
        )


#: vLLM ``priority`` of each NNRP priority class by default: balanced as an HTTP request's default (0)
DEFAULT_PRIORITIES = {"interactive": -10, "balanced": 0, "background": 10}


def _priority_classes(_inst: object, attribute: attrs.Attribute, value: dict[str, int]) -> None:
    unknown = [name for name in value if name not in PRIORITY_CLASSES]
    if unknown:
        raise ValueError(
            f"nnrp.{attribute.name} names {', '.join(map(repr, unknown))}, not an NNRP priority class. Fix: use "
            f"{', '.join(PRIORITY_CLASSES)}."
        )


@attrs.frozen
class NNRPConfig:
    """Validated settings (see the module table for units and defaults)."""

    enabled: bool | None = None
    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    max_envelope_bytes: int = attrs.field(default=32 << 20, validator=_positive)
    max_sessions: int = attrs.field(default=256, validator=_positive)
    max_in_flight_per_session: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    max_in_flight: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    max_queued_events: int = attrs.field(default=1024, validator=_positive)
    allow_untested_vllm: bool = False
    allow_unauthenticated: bool = False
    handshake_timeout_ms: int = attrs.field(default=10_000, validator=_positive)
    drain_timeout_ms: int = attrs.field(default=30_000, validator=_not_negative)
    max_connections: int = attrs.field(default=2048, validator=_positive)
    max_buffered_bytes: int = attrs.field(default=256 << 20, validator=_positive)
    allow_non_loopback: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    ipc_socket_group: str | None = None
    fault_injection_backend_error_model: str | None = None
    metrics_listen: str | None = attrs.field(default=None, validator=attrs.validators.optional(_host_port))
    ws_allowed_origins: tuple[str, ...] | None = attrs.field(default=None, validator=_origins)
    operations: tuple[str, ...] | None = attrs.field(default=None, validator=_profile_operations)
    priorities: dict[str, int] = attrs.field(factory=dict, validator=_priority_classes)

    def vllm_priorities(self) -> tuple[int, ...]:
        """vLLM ``priority`` by NNRP priority class value (0 interactive, 1 balanced, 2 background)."""
        chosen = {**DEFAULT_PRIORITIES, **self.priorities}
        return tuple(chosen[name] for name in PRIORITY_CLASSES)


_converter = cattrs.Converter(forbid_extra_keys=True)


def _strict_int(value: Any, _type: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _strict_bool(value: Any, _type: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _strings(value: Any, _type: type) -> tuple[str, ...]:
    """``listen`` (URIs) and ``operations`` (names): a non-empty list of non-empty strings, or one string."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"expected a non-empty list of strings, got {value!r}")
    return tuple(value)


def _strict_str(value: Any, _type: type) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"expected a non-empty string, got {value!r}")
    return value


_converter.register_structure_hook(int, _strict_int)
_converter.register_structure_hook(str, _strict_str)
_converter.register_structure_hook(bool, _strict_bool)
_converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _strings)


def plugins_named(environ: Mapping[str, str]) -> bool:
    """True when ``VLLM_PLUGINS`` names ``nnrp`` (vLLM splits on ``,`` without stripping)."""
    value = environ.get("VLLM_PLUGINS")
    return value is not None and PLUGIN_NAME in value.split(",")


def load_config(additional_config: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ) -> NNRPConfig:
    """Read ``additional_config["nnrp"]`` and the environment; when enabled, check every listen URI.
    Raises :class:`ConfigError`.

    ``enabled`` is resolved: an explicit ``nnrp.enabled`` wins, else ``VLLM_PLUGINS`` naming ``nnrp`` enables.
    """
    block = (additional_config or {}).get(CONFIG_KEY, {})
    if not isinstance(block, Mapping):
        raise ConfigError(f"additional-config key {CONFIG_KEY!r} must be a mapping, got {block!r}")
    block = dict(block)
    for key in OBSOLETE_KEYS.keys() & block.keys():
        del block[key]
        logger.warning(
            "nnrp.%s has no effect and is ignored: %s. Fix: remove it from --additional-config.",
            key,
            OBSOLETE_KEYS[key],
        )
    try:
        config = _converter.structure(block, NNRPConfig)
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        raise ConfigError(f"invalid nnrp settings in --additional-config: {_describe(exc)}") from None
    changes: dict[str, Any] = {}
    if config.enabled is None:
        changes["enabled"] = plugins_named(environ)
    env_listen = environ.get(LISTEN_ENV)
    if env_listen is not None:
        uris = tuple(u.strip() for u in env_listen.split(",") if u.strip())
        if not uris:
            raise ConfigError(f"{LISTEN_ENV} is set but names no address")
        changes["listen"] = uris
    config = attrs.evolve(config, **changes)
    if config.enabled:
        _check_exposure(config)
    return config


def _check_exposure(config: NNRPConfig) -> None:
    """Every listen URI parses; plain TCP/WebSocket stays on loopback unless ``allow_non_loopback``; TLS
    carriers have readable certificate and key files; the IPC group exists: never open a door on the network
    by accident."""
    needs_tls = False
    for uri in config.listen:
        try:
            carrier = parse_endpoint(uri)
        except EndpointError as exc:
            raise ConfigError(f"bad NNRP listen address {exc}") from None
        needs_tls = needs_tls or carrier.tls
        if not carrier.tls and not is_loopback(carrier) and not config.allow_non_loopback:
            raise ConfigError(
                f"NNRP listen address {uri} is reachable from other hosts without TLS. Fix: listen on 127.0.0.1 "
                "or a unix socket, use nnrps:// / wss:// / quic:// with nnrp.tls_cert_file and nnrp.tls_key_file, "
                'or set "allow_non_loopback": true if this network is trusted.'
            )
        if carrier.transport == "quic" and not quic_available():
            raise ConfigError(
                f"NNRP listen address {uri} is QUIC, and aioquic (which serves it) is not installed in this "
                f"environment. Fix: {QUIC_INSTALL} into vLLM's environment, or drop the quic:// address."
            )
    if config.metrics_listen is not None and not config.allow_non_loopback:
        host = config.metrics_listen.rpartition(":")[0]
        if not is_loopback_host(host):
            raise ConfigError(
                f"nnrp.metrics_listen {config.metrics_listen} is reachable from other hosts, and the metrics server "
                "has neither authentication nor TLS. Fix: listen on 127.0.0.1 (scrape through vLLM's own /metrics, "
                'which carries the same series, or a local agent), or set "allow_non_loopback": true if this '
                "network is trusted."
            )
    if needs_tls:
        for key in ("tls_cert_file", "tls_key_file"):
            path = getattr(config, key)
            if path is None:
                raise ConfigError(
                    f"an nnrps:// / wss:// / quic:// listen address needs nnrp.{key} (a PEM file). Fix: set "
                    "nnrp.tls_cert_file and nnrp.tls_key_file, or use tcp:// on loopback."
                )
            if not os.access(path, os.R_OK):
                raise ConfigError(f"nnrp.{key} {path!r} is not a readable file. Fix: point it at a PEM file.")
    if config.ipc_socket_group is not None:
        try:
            grp.getgrnam(config.ipc_socket_group)
        except KeyError:
            raise ConfigError(
                f"nnrp.ipc_socket_group {config.ipc_socket_group!r} is not a group on this host. Fix: name an "
                "existing group, or drop the key for an owner-only socket."
            ) from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="nnrp", format_exception=lambda e, _t: str(e)))
    return str(exc)

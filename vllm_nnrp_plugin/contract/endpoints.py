"""Listen/connect addresses (the server's and the client's), one URI per carrier (named as nnrp-py names its
carriers: ``tcp``, ``ipc``, ``websocket``, ``quic``):

| URI | carrier | TLS |
|---|---|---|
| ``tcp://HOST:PORT`` | TCP | no |
| ``nnrps://HOST:PORT`` | TCP | yes (NNRP's secure scheme) |
| ``unix:///ABS/PATH.sock`` | IPC | n/a (owner-only socket file) |
| ``ws://HOST:PORT/PATH`` | WebSocket | no |
| ``wss://HOST:PORT/PATH`` | WebSocket | yes |
| ``quic://HOST:PORT`` | QUIC | always |

Every carrier is served by the project's own wire core on vLLM's event loop
(:mod:`vllm_nnrp_plugin.nnrp_binding.listener`). :func:`is_loopback` tells the exposure rule (config.py) which
addresses stay on this host.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import urllib.parse

import attrs

from vllm_nnrp_plugin.errors import NNRPStartupError

DEFAULT_PORT = 9400
DEFAULT_LISTEN = f"tcp://127.0.0.1:{DEFAULT_PORT}"

# URI scheme -> (nnrp-py carrier, provider-route scheme, TLS)
_NETWORK_SCHEMES = {
    "tcp": ("tcp", "tcp", False),
    "nnrps": ("tcp", "tcp", True),
    "ws": ("websocket", "ws", False),
    "wss": ("websocket", "wss", True),
    "quic": ("quic", "quic", True),
}
#: the ALPN protocol id of NNRP/1 (NagareWorks/nnrp-doc ``docs/en/design/v1-preview1.md`` §5.1; nnrp-rs
#: ``crates/nnrp-core/src/header.rs``) on ``nnrps`` and ``quic``: the server selects it when a client offers it
#: and serves a client that offers none (nnrp-py's native clients) without ALPN; the client offers it
ALPN = "nnrp/1"
#: the path of a WebSocket address that names none: the Upgrade's target (nnrp-rs' and nnrp-py's route)
WEBSOCKET_PATH = "/nnrp"
#: the ALPN protocol id of ``wss``: WebSocket runs over HTTP/1.1 (RFC 6455 §4.1; nnrp-rs' rustls server selects none)
ALPN_WEBSOCKET = "http/1.1"

_FORMS = "tcp://HOST:PORT, nnrps://HOST:PORT, unix:///ABSOLUTE/PATH.sock, ws(s)://HOST:PORT/PATH or quic://HOST:PORT"


#: the command that installs what ``quic://`` needs (aioquic is an extra: its pyOpenSSL pins ``cryptography``
#: below the version some vLLM lines resolve, so a plain install leaves it out)
QUIC_INSTALL = 'pip install "vllm-nnrp-plugin[quic]"'


def quic_available() -> bool:
    """True when aioquic, which serves and connects ``quic://`` addresses, is installed (the ``[quic]`` extra)."""
    return importlib.util.find_spec("aioquic") is not None


class EndpointError(NNRPStartupError, ValueError):
    """A listen or connect URI this package cannot use; the message names the accepted forms."""


@attrs.frozen
class Carrier:
    """``transport``: nnrp-py carrier name (``tcp``, ``ipc``, ``websocket``, ``quic``); ``provider_uri``: its
    provider route; ``endpoint``: the ``nnrp://`` / ``nnrps://`` application endpoint; ``uri``: the URI as
    configured; ``tls``: the carrier needs a certificate; ``host``: the host (``None`` for IPC)."""

    transport: str
    provider_uri: str
    endpoint: str
    uri: str
    tls: bool = False
    host: str | None = None

    @property
    def label(self) -> str:
        """The carrier's name in metrics, logs and operation records: ``tcp``, ``tls`` (``nnrps``), ``ipc``,
        ``websocket`` (``ws`` and ``wss``) or ``quic``."""
        return "tls" if self.tls and self.transport == "tcp" else self.transport


def parse_endpoint(uri: str) -> Carrier:
    """Parse one URI (forms in the module table). Raises :class:`EndpointError`."""
    parts = urllib.parse.urlsplit(uri.strip())
    if parts.scheme == "unix":
        path = parts.path
        if parts.netloc or not path.startswith("/"):
            raise EndpointError(f"{uri!r}: a unix socket needs an absolute path, e.g. unix:///tmp/vllm-nnrp.sock")
        return Carrier("ipc", f"unix://{path}", "nnrp://localhost", uri)
    if parts.scheme not in _NETWORK_SCHEMES:
        raise EndpointError(f"{uri!r}: unsupported scheme {parts.scheme!r}; use {_FORMS}")
    transport, provider_scheme, tls = _NETWORK_SCHEMES[parts.scheme]
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise EndpointError(f"{uri!r}: a network address needs a host and a port, e.g. tcp://127.0.0.1:{DEFAULT_PORT}")
    host = parts.hostname
    authority = f"[{host}]" if ":" in host else host
    netloc = f"{authority}:{port}"
    path = ""
    if transport == "websocket":
        path = parts.path or WEBSOCKET_PATH
    elif parts.path not in ("", "/"):
        raise EndpointError(f"{uri!r}: only WebSocket addresses take a path")
    endpoint = f"{'nnrps' if tls and transport != 'quic' else 'nnrp'}://{authority}"
    return Carrier(transport, f"{provider_scheme}://{netloc}{path}", endpoint, uri, tls, host)


def is_loopback(carrier: Carrier) -> bool:
    """True for IPC and for network addresses that only this host can reach (127.0.0.0/8, ::1, localhost)."""
    return carrier.host is None or is_loopback_host(carrier.host)


def is_loopback_host(host: str) -> bool:
    """True for a host only this machine can reach: ``localhost``, 127.0.0.0/8, ``::1`` (bracketed or not)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything

"""Listen/connect addresses: ``tcp://HOST:PORT`` and ``unix:///ABS/PATH.sock`` (the IPC carrier).

One URI selects one nnrp-py carrier. Each carrier gets its own listener (nnrp-sdk.md addendum 4: one
listener serving several carriers loses sessions at accept deadlines).
"""

from __future__ import annotations

import urllib.parse

import attrs

DEFAULT_PORT = 9400
DEFAULT_LISTEN = f"tcp://127.0.0.1:{DEFAULT_PORT}"


class EndpointError(ValueError):
    """A listen or connect URI this package cannot use; the message names the accepted forms."""


@attrs.frozen
class Carrier:
    """``transport``: nnrp-py carrier name (``tcp`` or ``ipc``); ``provider_uri``: its provider route;
    ``endpoint``: the ``nnrp://`` application endpoint; ``uri``: the URI as configured."""

    transport: str
    provider_uri: str
    endpoint: str
    uri: str


def parse_endpoint(uri: str) -> Carrier:
    """Parse one URI. Raises :class:`EndpointError` for anything but ``tcp://host:port`` / ``unix:///path``."""
    parts = urllib.parse.urlsplit(uri.strip())
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise EndpointError(f"{uri!r}: a TCP address needs a host and a port, e.g. tcp://127.0.0.1:{DEFAULT_PORT}")
        host = parts.hostname
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return Carrier("tcp", f"tcp://{netloc}", f"nnrp://{netloc.rsplit(':', 1)[0]}", uri)
    if parts.scheme == "unix":
        path = parts.path
        if parts.netloc or not path.startswith("/"):
            raise EndpointError(f"{uri!r}: a unix socket needs an absolute path, e.g. unix:///tmp/vllm-nnrp.sock")
        return Carrier("ipc", f"unix://{path}", "nnrp://localhost", uri)
    raise EndpointError(
        f"{uri!r}: unsupported scheme {parts.scheme!r}; use tcp://HOST:PORT or unix:///ABSOLUTE/PATH.sock"
    )

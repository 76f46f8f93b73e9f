"""Every error the client side raises, in one hierarchy: ``except ClientError`` catches the failures of each
client — :class:`~vllm_nnrp_plugin.client.native.profile_client.ProfileClient` (nnrp-py's native client) and
:func:`~vllm_nnrp_plugin.client.aio.connection.connect` (the asyncio client) with its sessions and operations. (The
``openai`` transports, :mod:`vllm_nnrp_plugin.client.openai`, answer the SDK with ``httpx`` errors instead, as its
HTTP transport would.)

::

    ClientError
    ├── ClientAddressError     an endpoint URI the client cannot use (also a ValueError)
    ├── ClientConnectionError  asyncio client: no connection, or it is gone (also a ConnectionError)
    ├── SessionOpenError       asyncio client: the server refused the session
    │   └── AuthenticationFailed   … because it requires vLLM's API key and none valid came
    ├── ClientTransportError   ProfileClient: nnrp-py failed a native call (also nnrp-py's NativeRuntimeError)
    ├── ClientTimeout          ProfileClient: no terminal in time (also a TimeoutError)
    └── ClientResponseError    the server answered, but not as asked

nnrp-py's own exceptions never leave the clients.
"""

from __future__ import annotations

from typing import Any

from nnrp.native import NativeRuntimeError

__all__ = [
    "AuthenticationFailed",
    "ClientAddressError",
    "ClientConnectionError",
    "ClientError",
    "ClientResponseError",
    "ClientTimeout",
    "ClientTransportError",
    "SessionOpenError",
]


class ClientError(Exception):
    """An NNRP client call failed; the base of every error the client side raises."""


class ClientAddressError(ClientError, ValueError):
    """The endpoint URI cannot be used: for :class:`~vllm_nnrp_plugin.client.native.profile_client.ProfileClient` not
    one of the forms of :mod:`vllm_nnrp_plugin.contract.endpoints`, or a TLS URI without ``trusted_cert_der``;
    for :func:`~vllm_nnrp_plugin.client.aio.connection.connect` none of ``tcp://HOST:PORT``, ``nnrps://HOST:PORT``,
    ``unix:///ABSOLUTE/PATH``, ``ws://HOST:PORT[/PATH]``, ``wss://HOST:PORT[/PATH]``, ``quic://HOST:PORT``
    (:data:`vllm_nnrp_plugin.client.aio.connection.FORMS`; there also a :class:`ClientConnectionError`)."""


class ClientConnectionError(ClientError, ConnectionError):
    """The asyncio client has no connection, or it is gone (cannot connect, lost, closed by the server, or ended
    on a protocol violation): every pending open, operation and close fails with it."""


class _ConnectAddressError(ClientConnectionError, ClientAddressError):
    """An endpoint URI :func:`~vllm_nnrp_plugin.client.aio.connection.connect` cannot use: an address error, and a
    connection error as everything else ``connect`` raises."""


class SessionOpenError(ClientError):
    """The server refused the session: ``session_error_code`` (NNRP u32, 0 when this client refused a
    malformed SESSION_OPEN_ACK) and the server's ``diagnostic``."""

    def __init__(self, session_error_code: int, diagnostic: str) -> None:
        super().__init__(f"session refused ({session_error_code:#010x}): {diagnostic}")
        self.session_error_code = session_error_code
        self.diagnostic = diagnostic


class AuthenticationFailed(SessionOpenError):
    """The server requires vLLM's API key and refused the session (``session_error_code`` ``auth_failed``,
    0x00010001): none was given, or one the server does not hold."""


class ClientTransportError(ClientError, NativeRuntimeError):
    """nnrp-py failed a native call (``nnrp.native.NativeRuntimeError`` and its kinds, or
    ``NativeArtifactError`` when no native transport loads); the original is the ``__cause__``, its
    ``status`` (``nnrp.native.NativeStatus``, None for an artifact error) is kept. Also a
    ``NativeRuntimeError``, so code written against nnrp-py's own errors still catches it."""

    def __init__(self, message: str, status: Any = None) -> None:
        RuntimeError.__init__(self, message)
        self.status = status


class ClientTimeout(ClientError, TimeoutError):
    """No terminal arrived in time (the server is gone, or the operation is slower than the timeout)."""


class ClientResponseError(ClientError):
    """The server answered, but not with what was asked for: an event or terminal that does not decode (not JSON,
    or a RESULT_PUSH body outside the profile's typed-body mapping), or a capability fetch ending in anything but
    ``response.completed``."""

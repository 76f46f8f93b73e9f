"""The client side: everything that talks to the plugin's NNRP listener from outside ``vllm serve``. The server side
(:mod:`vllm_nnrp_plugin.service` and what it runs) never imports from here.

* :mod:`.aio` — :func:`connect`: the project's asyncio client on its sans-IO wire core
  (:mod:`vllm_nnrp_plugin.nnrp_wire.client`): :class:`Connection`, :class:`Session`, :class:`Operation`
  (:mod:`.aio.connection`); over TCP, TLS, unix sockets, and the carriers of :mod:`.aio.websocket` (``ws://``,
  ``wss://``) and :mod:`.aio.quic` (``quic://``), on every one of which it sends vLLM's API key;
* :mod:`.native` — :class:`ProfileClient` (:mod:`.native.profile_client`): one session over nnrp-py's native
  client (every carrier, WebSocket and QUIC included), the oracle of nnrp-py's own client; used by :mod:`.cli`
  and :mod:`.conformance`;
* :mod:`.openai` — the official ``openai`` SDK over NNRP: :class:`NNRPTransport` and :class:`AsyncNNRPTransport`
  (``httpx`` / ``httpx2`` transports on :mod:`.aio`), with their SSE renderers and error mapping;
* :mod:`.fleet` — a fleet of replicas: :mod:`.fleet.policy` which replica a call goes to (sans-IO, plain data)
  and :class:`FleetPool` (:mod:`.fleet.pool`), its asyncio shell, which the ``openai`` transports and the CLI use
  for several addresses;
* :mod:`.errors` — :class:`ClientError`, the one base of every error both clients raise, and its subclasses;
  :mod:`.events` — :class:`ClientEvent`, what both clients hand their callers for one event;
* :mod:`.cli` — the ``vllm-nnrp`` command; :mod:`.conformance` — the conformance driver
  (``python -m vllm_nnrp_plugin.client.conformance``).

The names of ``__all__`` are importable from here (``from vllm_nnrp_plugin.client import ProfileClient``). Each
is loaded with its module on first use, so using one client does not import the others (nnrp-py's native client,
which :class:`ProfileClient` needs, is slow to import) and ``vllm-nnrp --help`` stays quick.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the module (under this package) each exported name is defined in
_EXPORTS = {
    "AuthenticationFailed": "errors",
    "ClientAddressError": "errors",
    "ClientConnectionError": "errors",
    "ClientError": "errors",
    "ClientResponseError": "errors",
    "ClientTimeout": "errors",
    "ClientTransportError": "errors",
    "SessionOpenError": "errors",
    "ClientEvent": "events",
    "ProfileClient": "native.profile_client",
    "Connection": "aio.connection",
    "Operation": "aio.connection",
    "Session": "aio.connection",
    "connect": "aio.connection",
    "FleetPool": "fleet.pool",
    "AsyncNNRPTransport": "openai.transport",
    "NNRPTransport": "openai.transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return value

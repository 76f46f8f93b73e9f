"""An asyncio NNRP client on the project's own wire core (:mod:`vllm_nnrp_plugin.nnrp_wire.client`): one
:class:`~.connection.Connection` (an ``asyncio.Protocol``) per connection, sessions multiplexed on it, each
operation an async iterator of its profile events. No threads, no polling."""

from vllm_nnrp_plugin.nnrp_client.connection import (
    ClientConnectionError,
    ClientError,
    ClientResponseError,
    Connection,
    Operation,
    Session,
    SessionOpenError,
    connect,
)

__all__ = [
    "ClientConnectionError",
    "ClientError",
    "ClientResponseError",
    "Connection",
    "Operation",
    "Session",
    "SessionOpenError",
    "connect",
]

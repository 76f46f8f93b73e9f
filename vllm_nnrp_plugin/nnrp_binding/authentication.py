"""Which NNRP connections must present vLLM's API key, and the check of a presented one.

The rule follows vLLM's HTTP API (``vllm/entrypoints/openai/api_server.py`` ``build_app``: the keys are
``args.api_key`` — ``--api-key``, which takes one or more keys — or else ``VLLM_API_KEY``; a request is
served when its ``Authorization: Bearer <key>`` matches one of them):

* with keys, every network carrier (``tcp``, TLS, WebSocket, QUIC) requires one of them
  (:class:`APIKeys`, handed to the wire core as its ``authenticate``);
* unix sockets never do: the socket file is owner-only (0600) or group-shared (0660), so the operating system
  has already decided who may connect (:mod:`.exposure`);
* ``nnrp.allow_unauthenticated`` serves NNRP without a key although HTTP requires one: the operator's explicit
  choice, logged as a warning at start-up.

The check is vLLM's: SHA-256 of the presented key compared with each configured key's digest by
``secrets.compare_digest``, every digest compared whatever the outcome (no early exit), so the time it takes
does not depend on how much of a key matched. Keys are held only as digests; none is ever logged.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

from vllm_nnrp_plugin.contract.auth_block import bearer_key

#: carriers the operating system authenticates (:mod:`.exposure`: socket file permissions)
KEY_FREE_TRANSPORTS = frozenset({"ipc"})


class APIKeys:
    """vLLM's API keys as SHA-256 digests. Call it with an authentication block
    (:mod:`vllm_nnrp_plugin.contract.auth_block`): True when it holds one of the keys; raises
    :class:`~vllm_nnrp_plugin.contract.auth_block.AuthBlockError` (a ``ValueError``) when the block is malformed."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(hashlib.sha256(key.encode("utf-8")).digest() for key in keys if key)
        if not self._digests:
            raise ValueError("APIKeys needs at least one non-empty key")

    def __call__(self, block: bytes) -> bool:
        presented = hashlib.sha256(bearer_key(block).encode("utf-8")).digest()
        match = False
        for digest in self._digests:
            match |= secrets.compare_digest(presented, digest)
        return match

    def __repr__(self) -> str:  # never the digests either
        return f"APIKeys({len(self._digests)} keys)"


def authenticator_for(transport: str, keys: APIKeys | None) -> APIKeys | None:
    """What the wire core of a connection on ``transport`` checks keys with: ``keys`` on a network carrier,
    ``None`` (no key required) on a unix socket or when the server requires none."""
    return None if transport in KEY_FREE_TRANSPORTS else keys

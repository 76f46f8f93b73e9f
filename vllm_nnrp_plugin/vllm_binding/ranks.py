"""The NNRP address of each API-server process when vLLM runs several.

``vllm serve --api-server-count N`` (which data-parallel deployments turn on by themselves) starts N API-server
processes, ranks ``0 … N-1``, each with its own app, engine client and NNRP listener. Every rank serves NNRP on
its own addresses, derived from the configured ``listen`` URIs (the rank and count are vLLM's
``ParallelConfig._api_process_rank`` / ``_api_process_count``, ``vllm/config/parallel.py``; defaults 0 and 1):

| configured | rank 0 | rank r > 0 |
|---|---|---|
| ``tcp://HOST:PORT`` | ``tcp://HOST:PORT`` | ``tcp://HOST:PORT+r`` |
| ``nnrps://`` ``ws://`` ``wss://`` ``quic://`` | as configured | same scheme and path, ``PORT+r`` |
| ``unix:///DIR/NAME.sock`` | ``unix:///DIR/NAME.sock`` | ``unix:///DIR/NAME-r.sock`` |

So with one API server nothing changes, and a client picks a rank by address. An operation lives entirely in
the process that accepted it, so its cancellation aborts the request on that process's own engine client.
"""

from __future__ import annotations

import pathlib
import urllib.parse
from collections.abc import Sequence

from vllm_nnrp_plugin.errors import NNRPStartupError

MAX_PORT = 65535


class RankAddressError(NNRPStartupError, ValueError):
    """A derived address does not exist (a TCP port beyond 65535); the message names the fix."""


def rank_listen(listen: Sequence[str], rank: int, count: int) -> tuple[str, ...]:
    """The listen URIs of API-server ``rank`` of ``count`` (URIs already validated by ``load_config``).

    Raises :class:`RankAddressError` when ``PORT + rank`` exceeds 65535.
    """
    if count <= 1 or rank == 0:
        return tuple(listen)
    return tuple(_for_rank(uri, rank, count) for uri in listen)


def _for_rank(uri: str, rank: int, count: int) -> str:
    parts = urllib.parse.urlsplit(uri.strip())
    if parts.scheme == "unix":
        path = pathlib.PurePosixPath(parts.path)
        return f"unix://{path.with_name(f'{path.stem}-{rank}{path.suffix}')}"
    assert parts.port is not None and parts.hostname is not None  # load_config refused a TCP URI without them
    port = parts.port + rank
    if port > MAX_PORT:
        raise RankAddressError(
            f"{uri!r}: API server {rank} of {count} would listen on port {port} (> {MAX_PORT}); rank r listens on "
            f"PORT + r. Fix: configure a port <= {MAX_PORT - count + 1} in nnrp.listen or VLLM_NNRP_LISTEN."
        )
    host = parts.hostname
    netloc = f"{f'[{host}]' if ':' in host else host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

"""Exposure rules of an NNRP listen address: who can reach it and with which credentials.

* TLS carriers get the configured PEM certificate and unencrypted PEM key: ``nnrps`` and ``wss`` as an
  ``ssl.SSLContext`` (:func:`server_ssl_context`), ``quic`` as aioquic's configuration
  (:func:`.quic.server_configuration`);
* a plain (non-TLS) address other hosts can reach is logged as a warning (``vllm_nnrp_plugin.config`` refuses
  it unless ``allow_non_loopback``);
* a unix socket file is made owner-only (0600), or 0660 owned by ``ipc_socket_group``, right after the bind
  (:func:`restrict_socket`); a stale socket file from a crashed run is removed first;
* a taken TCP port is reported plainly, before anything is bound.

:func:`before_bind` and :func:`after_bind` are the two steps the listener runs around each bind. Every
problem raises :class:`ListenError` naming the address, the cause and the fix.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import ssl
import urllib.parse

import attrs

from vllm_nnrp_plugin.contract.endpoints import ALPN, Carrier, is_loopback
from vllm_nnrp_plugin.errors import NNRPStartupError

logger = logging.getLogger(__name__)


class ListenError(NNRPStartupError):
    """An address could not be bound; the message names the address, the cause and the fix."""


@attrs.frozen
class Exposure:
    """``tls_cert_file`` / ``tls_key_file``: PEM paths for TLS carriers; ``ipc_socket_group``: group of unix
    socket files (``None``: owner-only); ``ws_allowed_origins``: ``nnrp.ws_allowed_origins``, the browser
    origins WebSocket addresses accept (:func:`.websocket.allowed_origins`)."""

    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    ipc_socket_group: str | None = None
    ws_allowed_origins: tuple[str, ...] | None = None


def before_bind(carrier: Carrier) -> None:
    """Clear the way for ``carrier`` (stale socket file, taken TCP port) and warn when a plain address is
    reachable from other hosts. Raises :class:`ListenError`."""
    if carrier.transport == "ipc":
        _remove_stale_socket(carrier.provider_uri)
    elif carrier.transport != "quic":
        _check_tcp_free(carrier)
    if not carrier.tls and not is_loopback(carrier):
        logger.warning(
            "NNRP listens on %s without TLS: any host that reaches it can use the model (nnrp.allow_non_loopback)",
            carrier.uri,
        )


def after_bind(carrier: Carrier, exposure: Exposure) -> None:
    """Restrict a freshly bound unix socket file (:func:`restrict_socket`); nothing for other carriers."""
    if carrier.transport == "ipc":
        restrict_socket(urllib.parse.urlsplit(carrier.provider_uri).path, exposure.ipc_socket_group)


def _check_tcp_free(carrier: Carrier) -> None:
    """A taken TCP port, said plainly before any address of the listener is bound."""
    parts = urllib.parse.urlsplit(carrier.provider_uri)
    if not parts.port:
        return
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((parts.hostname, parts.port))
        except OSError as exc:
            raise ListenError(
                f"cannot listen for NNRP on {carrier.uri}: {exc.strerror}. Fix: stop whatever holds that "
                "address, or choose another one with nnrp.listen / VLLM_NNRP_LISTEN."
            ) from None


def server_ssl_context(exposure: Exposure) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or later) with the PEM certificate chain and key, offering ALPN
    ``nnrp/1``. Raises :class:`ListenError`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    assert exposure.tls_cert_file is not None  # load_config refuses a TLS address without a certificate
    try:
        context.load_cert_chain(exposure.tls_cert_file, exposure.tls_key_file)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ListenError(
            f"cannot load the NNRP TLS certificate/key ({exposure.tls_cert_file}, {exposure.tls_key_file}): {exc}. "
            "Fix: nnrp.tls_cert_file must be a PEM certificate and nnrp.tls_key_file an unencrypted PEM key."
        ) from None
    context.set_alpn_protocols([ALPN])
    return context


def restrict_socket(path: str, group: str | None) -> None:
    """Owner-only (0600) socket file, or 0660 owned by ``group``. Raises :class:`ListenError`."""
    try:
        if group is None:
            os.chmod(path, 0o600)
        else:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
            os.chmod(path, 0o660)
    except (OSError, KeyError) as exc:
        raise ListenError(
            f"cannot restrict the NNRP socket file {path} (group {group}): {exc}. Fix: nnrp.ipc_socket_group must "
            "be a group this user belongs to."
        ) from None


def _remove_stale_socket(provider_uri: str) -> None:
    """A socket file left by a crashed run blocks the bind; remove it if nobody answers on it."""
    path = urllib.parse.urlsplit(provider_uri).path
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        logger.info("removing stale NNRP socket file %s", path)
        os.unlink(path)
    except OSError:
        pass  # not a socket we can judge: let the bind report it
    finally:
        probe.close()

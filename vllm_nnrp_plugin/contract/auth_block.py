"""The authentication block this deployment puts into NNRP: what a client sends and what the server accepts.

NNRP carries authentication material as an opaque block whose encoding is the deployment's to define
(NagareWorks/nnrp-doc ``docs/en/design/v1-preview1.md`` §6.2 item 8 and §6.2.1 ``auth_bytes``: "Logical length
of ``auth_block``"; §6.3 item 7 and §6.3.1 ``auth_status``: "Authentication-result enum"). This deployment
follows vLLM's HTTP API, so a client that can reach vLLM over HTTPS can reach it over NNRP with the same key:

* **The block** is the UTF-8 bytes of the value of the HTTP ``Authorization`` header that vLLM checks:
  ``Bearer <key>`` — a scheme, one space (0x20), the key. The scheme is compared case-insensitively, the key
  byte for byte (vLLM's ``AuthenticationMiddleware.verify_token``, ``vllm/entrypoints/serve/utils/server_utils.py``
  on 0.26; ``vllm/entrypoints/openai/api_server.py`` before). At most :data:`MAX_AUTH_BYTES` bytes.
* **Where it travels**: in CLIENT_HELLO, at the end of the body, after the control extension block
  (``auth_bytes`` long; the body is ``control_extension_block || auth_block``, as nnrp-py's
  ``nnrp.client.transport.build_client_hello_packet`` lays it out); or in SESSION_OPEN, after the resume token
  and before the session extension block (the metadata's field order: ``resume_token || auth_block ||
  session_extension``). A key in the hello authenticates every session of the connection.
* **SERVER_HELLO_ACK ``auth_status``** (u8): :data:`AUTH_STATUS_NOT_REQUIRED` 0, the server requires no key
  (a block sent anyway is ignored, as vLLM ignores an ``Authorization`` header when it has no ``--api-key``);
  :data:`AUTH_STATUS_ACCEPTED` 1; :data:`AUTH_STATUS_REJECTED` 2, a well-formed block with a key the server does
  not hold; :data:`AUTH_STATUS_MISSING` 3, a key is required and none came. After 2 or 3 every SESSION_OPEN
  without a valid block of its own is rejected with ``session_error_code`` ``auth_failed`` (0x00010001).

Plain functions over bytes; shared by the server (:mod:`vllm_nnrp_plugin.nnrp_binding.authentication`) and the
clients (:mod:`vllm_nnrp_plugin.client`).
"""

from __future__ import annotations

__all__ = [
    "AUTH_STATUS_ACCEPTED",
    "AUTH_STATUS_MISSING",
    "AUTH_STATUS_NOT_REQUIRED",
    "AUTH_STATUS_REJECTED",
    "AuthBlockError",
    "MAX_AUTH_BYTES",
    "bearer_block",
    "bearer_key",
    "block_of_authorization",
]

#: longest authentication block accepted (bytes); a longer one is a protocol error, not a failed key
MAX_AUTH_BYTES = 4096

AUTH_STATUS_NOT_REQUIRED = 0
AUTH_STATUS_ACCEPTED = 1
AUTH_STATUS_REJECTED = 2
AUTH_STATUS_MISSING = 3

_SCHEME = "bearer"


class AuthBlockError(ValueError):
    """An authentication block (or a key meant for one) that is not ``Bearer <key>`` in UTF-8 within
    :data:`MAX_AUTH_BYTES` bytes. The message never contains the key."""


def bearer_block(api_key: str) -> bytes:
    """The block for ``api_key``: ``b"Bearer " + key`` in UTF-8. Raises :class:`AuthBlockError` for an empty
    key, one with a control character (an HTTP header could not carry it either) or one too long."""
    if not api_key:
        raise AuthBlockError("the API key is empty")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in api_key):
        raise AuthBlockError("the API key contains a control character")
    block = b"Bearer " + api_key.encode("utf-8")
    if len(block) > MAX_AUTH_BYTES:
        raise AuthBlockError(f"the API key is longer than an NNRP authentication block allows ({MAX_AUTH_BYTES} bytes)")
    return block


def bearer_key(block: bytes) -> str:
    """The key inside ``block`` (what follows ``Bearer `` — the scheme matched case-insensitively, split at the
    first space as vLLM splits the header). Raises :class:`AuthBlockError` when the block is too long, not
    UTF-8, or not of the bearer scheme."""
    if len(block) > MAX_AUTH_BYTES:
        raise AuthBlockError(f"authentication block of {len(block)} bytes (at most {MAX_AUTH_BYTES})")
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        raise AuthBlockError("authentication block is not UTF-8") from None
    scheme, space, key = text.partition(" ")
    if not space or scheme.lower() != _SCHEME:
        raise AuthBlockError("authentication block is not 'Bearer <key>'")
    return key


def block_of_authorization(header_value: str | None) -> bytes:
    """The block for an HTTP ``Authorization`` header value as the ``openai`` SDK builds it (``Bearer <key>``),
    ``b""`` for none or an empty key (the SDK's ``api_key=""``). Raises :class:`AuthBlockError` for any
    other scheme or an unusable key."""
    if not header_value:
        return b""
    scheme, _, key = header_value.partition(" ")
    if scheme.lower() != _SCHEME:
        raise AuthBlockError("the Authorization header is not 'Bearer <key>'")
    return bearer_block(key) if key else b""

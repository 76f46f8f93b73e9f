"""Typed profile errors: every failure becomes one terminal ``response.error`` with a stable ``code``.

The event shape is ``{"type": "response.error", "error": {"type", "code", "message"}}`` with three non-empty
strings (profile-contract.md §3). Frozen by the conformance suite: ``missing_messages``,
``unsupported_operation``, ``backend_error``; the other codes are this adapter's and are equally stable.
``status`` is the informational RESULT_PUSH status code (HTTP-like); clients read the JSON, not the status.
"""

from __future__ import annotations

import attrs

# envelope / frame problems (the request never reached vLLM)
ENVELOPE_TOO_LARGE = "envelope_too_large"
INVALID_FRAME = "invalid_frame"
INVALID_JSON = "invalid_json"
INVALID_ENVELOPE = "invalid_envelope"
UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
UNSUPPORTED_OPERATION = "unsupported_operation"
MISSING_MESSAGES = "missing_messages"
# vLLM's answer
INVALID_REQUEST = "invalid_request"
MODEL_NOT_FOUND = "model_not_found"
BACKEND_ERROR = "backend_error"
TOOL_CALL_INCOMPLETE = "tool_call_incomplete"  # only in response.tool_call.error, never a terminal
# the operation's time ran out (envelope nnrp.timeout_ms or an NNRP DEADLINE control)
REQUEST_TIMEOUT = "request_timeout"
# the listener is stopping (in-flight operations end with this)
SERVER_SHUTDOWN = "server_shutdown"

INVALID_REQUEST_ERROR = "invalid_request_error"
SERVER_ERROR = "server_error"


@attrs.frozen(auto_exc=True)
class ProfileError(Exception):
    """A failure that ends one operation with ``response.error``.

    ``code``: one of the module constants; ``message``: human-readable, never empty;
    ``type``: OpenAI error type (``invalid_request_error`` or ``server_error``);
    ``status``: RESULT_PUSH status code (400, 404, 413, 500 …).
    """

    code: str
    message: str
    type: str = INVALID_REQUEST_ERROR
    status: int = 400

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def backend_error(message: str, status: int = 500) -> ProfileError:
    """The engine failed (vLLM 5xx, engine death, a mid-stream error object)."""
    return ProfileError(BACKEND_ERROR, message or "backend error", SERVER_ERROR, status)

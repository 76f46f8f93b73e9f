"""Typed profile errors: every failure becomes one terminal ``response.error`` with a stable ``code``.

The event shape is ``{"type": "response.error", "error": {"type", "code", "message"}}`` with three non-empty
strings (the profile's "Events" section, error body). Frozen by the conformance suite: ``missing_messages``,
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
# only in response.tool_call.error, never a terminal: a call that did not end as one complete JSON value with a name
TOOL_CALL_INCOMPLETE = "tool_call_incomplete"  # the token budget or a stop string/token ended it
TOOL_CALL_INVALID = "tool_call_invalid"  # anything else (end of sequence inside it, no name, a new call on its index)
# the operation's time ran out (envelope nnrp.timeout_ms or an NNRP DEADLINE control)
REQUEST_TIMEOUT = "request_timeout"
# the listener is stopping (in-flight operations end with this)
SERVER_SHUTDOWN = "server_shutdown"
# limits (nnrp.max_in_flight_per_session, nnrp.max_in_flight): the operation never reached vLLM
TOO_MANY_REQUESTS = "too_many_requests"
# the session's outbox is full (nnrp.max_queued_events): the client reads slower than vLLM generates
CLIENT_TOO_SLOW = "client_too_slow"

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


def too_many_requests(message: str) -> ProfileError:
    """A limit on in-flight operations refused the submit before it reached vLLM (429)."""
    return ProfileError(TOO_MANY_REQUESTS, message, SERVER_ERROR, 429)


def client_too_slow(message: str) -> ProfileError:
    """The session's outbox hit its bound; the operation is stopped and its vLLM request aborted (429)."""
    return ProfileError(CLIENT_TOO_SLOW, message, SERVER_ERROR, 429)


def server_shutdown() -> ProfileError:
    """The listener is stopping (``vllm serve`` got SIGTERM/SIGINT) while the operation ran (503)."""
    return ProfileError(SERVER_SHUTDOWN, "the NNRP listener is shutting down", SERVER_ERROR, 503)


def backend_error(message: str, status: int = 500) -> ProfileError:
    """The engine failed (vLLM 5xx, engine death, a mid-stream error object). ``message`` goes to the client:
    vLLM's own error text (what its HTTP server answers too), never a raw Python exception's (:func:`failure`)."""
    return ProfileError(BACKEND_ERROR, message or "backend error", SERVER_ERROR, status)


def failure(exc: BaseException) -> ProfileError:
    """``backend_error`` (500) for an exception that no layer turned into a profile error (an engine failure vLLM
    did not wrap, or a bug): the message names only the exception's type. Its text — which may carry file paths,
    addresses, internals or the request's own content — stays in the server log, which the caller writes."""
    return backend_error(
        f"the server failed while serving this operation ({type(exc).__name__}); the server log has the details"
    )

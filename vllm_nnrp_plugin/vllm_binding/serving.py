"""What every operation's binding does the same way with vLLM's serving objects
(``vllm/entrypoints/openai/engine/serving.py`` and the objects derived from it): validate the body as vLLM's
request model, call the serving object with a synthetic HTTP request that carries the trace context, and map
vLLM's ``ErrorResponse`` (or a raised exception, through the serving object's ``create_error_response``) to
the profile's errors.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_nnrp_plugin.profile import errors as E


def validate(request_cls: Any, body: dict[str, Any], operation: str) -> Any:
    """``body`` as vLLM's pydantic request model ``request_cls``; raises :class:`ProfileError`
    ``invalid_request`` (400) naming every invalid field."""
    try:
        return request_cls.model_validate(body)
    except ValueError as exc:  # pydantic.ValidationError
        raise E.ProfileError(E.INVALID_REQUEST, validation_message(exc, operation)) from None


def error_from_response(response: Any) -> E.ProfileError:
    """Map vLLM's ``ErrorResponse`` (``.error.message/.type/.param/.code``, code = HTTP status):
    404 on ``model`` -> ``model_not_found``; other 4xx -> ``invalid_request``; else ``backend_error``."""
    error = response.error
    status = int(error.code) if isinstance(error.code, int) else 500
    message = str(error.message) or error.type
    if status == 404 and (error.param == "model" or error.type == "NotFoundError"):
        return E.ProfileError(E.MODEL_NOT_FOUND, message, E.INVALID_REQUEST_ERROR, 404)
    if 400 <= status < 500:
        return E.ProfileError(E.INVALID_REQUEST, message, E.INVALID_REQUEST_ERROR, status)
    return E.backend_error(message, status)


def trace_request(traceparent: str | None, path: str) -> Any:
    """None without a trace context, else a synthetic HTTP request for ``path`` carrying only ``traceparent``
    (vLLM reads a W3C ``traceparent`` only from ``raw_request.headers``, with ``extract_trace_headers``,
    ``vllm/tracing/utils.py``); its ``receive`` never reports a disconnect (the NNRP side handles cancellation)."""
    if traceparent is None:
        return None
    from starlette.requests import Request

    async def _never() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    scope = {
        "type": "http", "method": "POST", "path": path, "query_string": b"",
        "headers": [(b"traceparent", traceparent.encode("latin-1"))], "state": {},
    }  # fmt: skip
    return Request(scope, receive=_never)


def validation_message(exc: ValueError, operation: str) -> str:
    """``invalid <operation> body: <field>: <problem>; …`` from a pydantic ``ValidationError``."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors():
        location = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{location}: {err.get('msg')}")
    return f"invalid {operation} body: " + "; ".join(parts)

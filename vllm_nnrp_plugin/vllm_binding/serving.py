"""What every operation's binding does the same way with vLLM's serving objects
(``vllm/entrypoints/openai/engine/serving.py`` and the objects derived from it): validate the body as vLLM's
request model, call the serving object with a synthetic HTTP request that carries the trace context, and map
vLLM's ``ErrorResponse`` (or a raised exception, through the serving object's ``create_error_response``) to
the profile's errors.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.profile import errors as E

_FIELD = re.compile(r"\w+")  # a field name or a list index


def validate(parse: Any, body: dict[str, Any], operation: str) -> Any:
    """``body`` parsed by ``parse`` (vLLM's pydantic request model's ``model_validate``, or a ``TypeAdapter``'s
    ``validate_python`` for a union model); raises :class:`ProfileError` ``invalid_request`` (400) naming every
    invalid field."""
    try:
        return parse(body)
    except ValueError as exc:  # pydantic.ValidationError
        raise E.ProfileError(E.INVALID_REQUEST, validation_message(exc, operation)) from None


def with_controls(
    body: dict[str, Any],
    controls: RuntimeControls | None,
    priorities: tuple[int, ...] | None,
    max_tokens_fields: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``body`` as the operation's runtime controls (:mod:`vllm_nnrp_plugin.core.controls`) dispatch it (a new dict when
    something changes; ``body`` itself is never changed), recording the ``priority`` vLLM runs it with:

    * ``priorities`` (vLLM ``priority`` by NNRP class value; ``None`` when the server does not schedule by priority,
      ``--scheduling-policy``): the request's ``priority`` is that of the operation's class — fixed from here on:
      no vLLM line 0.18–0.32 changes a request's priority once the engine has it (``Request.priority`` is set once,
      ``vllm/v1/request.py``; the engine client has no call for it) — unless ``body`` sets
      one itself (which wins; vLLM orders its waiting queue by it, lower first:
      ``vllm/v1/core/sched/request_queue.py``);
    * a token budget caps every field of ``max_tokens_fields`` ``body`` sets (a higher value comes down to the
      budget) or, when it sets none, the first of them is set to the budget (tokens).
    """
    if controls is None:
        return body
    changed: dict[str, Any] = {}
    if priorities is not None:
        own = body.get("priority")
        if own is None:
            changed["priority"] = controls.vllm_priority = priorities[controls.priority_class]
        elif type(own) is int:
            controls.vllm_priority = own
    budget = controls.token_budget
    if budget is not None and max_tokens_fields:
        present = [name for name in max_tokens_fields if body.get(name) is not None]
        for name in present:
            if type(body[name]) is int and body[name] > budget:
                changed[name] = budget
        if not present:
            changed[max_tokens_fields[0]] = budget
    return {**body, **changed} if changed else body


def error_from_response(response: Any) -> E.ProfileError:
    """Map vLLM's ``ErrorResponse`` (``.error.message/.type/.param/.code``, code = HTTP status):
    :func:`error_from_body` of its ``error``."""
    error = response.error
    return error_from_body({"message": error.message, "type": error.type, "param": error.param, "code": error.code})


def error_from_body(error: dict[str, Any]) -> E.ProfileError:
    """Map the ``error`` object of vLLM's error body (``{message, type, param, code}``, code = HTTP status):
    404 on ``model`` -> ``model_not_found``; other 4xx -> ``invalid_request``; else ``backend_error``."""
    code = error.get("code")
    status = int(code) if isinstance(code, int) else 500
    message = str(error.get("message") or error.get("type"))
    if status == 404 and (error.get("param") == "model" or error.get("type") == "NotFoundError"):
        return E.ProfileError(E.MODEL_NOT_FOUND, message, E.INVALID_REQUEST_ERROR, 404)
    if 400 <= status < 500:
        return E.ProfileError(E.INVALID_REQUEST, message, E.INVALID_REQUEST_ERROR, status)
    return E.backend_error(message, status)


def trace_request(traceparent: str | None, path: str, request_id: str | None = None) -> Any:
    """None without a trace context or ``request_id``, else a synthetic HTTP request for ``path`` carrying only
    ``traceparent`` (vLLM reads a W3C ``traceparent`` only from ``raw_request.headers``, with
    ``extract_trace_headers``, ``vllm/tracing/utils.py``) and ``X-Request-Id: request_id`` (the id vLLM's pooling
    serving objects build their engine request ids from, ``_base_request_id``); its ``receive`` never reports a
    disconnect (the NNRP side handles cancellation)."""
    if traceparent is None and request_id is None:
        return None
    from starlette.requests import Request

    async def _never() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    headers = [(b"traceparent", traceparent.encode("latin-1"))] if traceparent is not None else []
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode("latin-1")))
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": headers, "state": {}}
    return Request(scope, receive=_never)


async def call_serving(serving: Any, method: str, request: Any, traceparent: str | None, path: str) -> Any:
    """``await serving.<method>(request, raw_request=<trace_request(traceparent, path)>)`` — what vLLM's HTTP route
    for ``path`` does —, with what it raises (some invalid requests, engine death) turned into its
    ``ErrorResponse`` by ``serving.create_error_response``, as that route's exception handler does."""
    try:
        return await getattr(serving, method)(request, raw_request=trace_request(traceparent, path))
    except Exception as exc:
        return serving.create_error_response(exc)


def validation_message(exc: ValueError, operation: str) -> str:
    """``invalid <operation> body: <field>: <problem>; …`` from a pydantic ``ValidationError``, each problem once.
    Location parts that are not field names or indexes (the union members and validators pydantic names for a
    union request model such as vLLM's ``EmbeddingRequest``: ``list[int]``, ``function-wrap[…]``) are left out."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts: dict[str, None] = {}
    for err in errors():
        location = ".".join(str(p) for p in err.get("loc", ()) if _FIELD.fullmatch(str(p))) or "body"
        parts[f"{location}: {err.get('msg')}"] = None
    return f"invalid {operation} body: " + "; ".join(parts)

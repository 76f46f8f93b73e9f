"""One ``openai`` SDK request over NNRP: which operation it is, what to submit, and how that operation's events
become the ``httpx`` answer vLLM's HTTP server would give (used by :mod:`vllm_nnrp_plugin.client.openai.transport`,
which does the I/O).

Routes (vLLM's paths, ``vllm/entrypoints/openai/*/api_router.py``, ``vllm/entrypoints/pooling/embed/``):

* ``POST …/chat/completions`` → ``chat.completions.create``; streamed as ``chat.completion.chunk`` events
  (:class:`vllm_nnrp_plugin.client.openai.sse.ChatChunkStream`);
* ``POST …/responses`` → ``responses.create``; streamed as Responses events
  (:class:`vllm_nnrp_plugin.client.openai.responses_sse.ResponsesEventStream`);
* ``POST …/embeddings`` → ``embeddings.create`` (non-streaming);
* ``GET …/models`` → ``models.list`` (vLLM's own model list); a server that does not serve it refuses with
  ``unsupported_operation`` and the call is resubmitted as ``nnrp.capabilities``, whose document's ``models``
  make the list (:func:`vllm_nnrp_plugin.client.openai.sse.model_list`);
* anything else → FastAPI's 404 / 405 (:func:`vllm_nnrp_plugin.client.openai.sse.route_reply`).

A request header ``X-NNRP-Priority-Class: interactive|balanced|background`` (the SDK's ``extra_headers``) becomes
the envelope's ``nnrp.priority_class`` (the server schedules that operation in that class); another value is a 400
``invalid_request`` answer, like an invalid JSON body, without a submit.

Timeouts mean what they mean over HTTP (httpx's ``Timeout``: https://www.python-httpx.org/advanced/timeouts/):
the request's ``connect`` and ``pool`` timeouts bound the connect and the wait for a free session, and its ``read``
timeout (what the SDK's ``timeout`` sets, 600 s by default) bounds the **silence** between two events of the
operation (before the first one included: a non-streamed answer is one event), not the whole operation; a stream
that keeps producing runs as long as it produces. When the silence is over, the operation is cancelled
(FRAME_CANCEL: the server aborts the vLLM request) and the call fails with ``ReadTimeout`` (the SDK's
``APITimeoutError``). A bound on the whole operation is only there when asked: the header
``X-NNRP-Timeout-Ms: N`` (positive integer, ms from the submit) or the transport's ``operation_timeout_s``
becomes the envelope's ``nnrp.timeout_ms`` (the server ends the operation with ``request_timeout`` →
``ReadTimeout``); another header value is a 400 ``invalid_request`` without a submit.

A non-streamed answer is the ``response.completed`` body as JSON (200); a terminal ``response.error`` is its HTTP
status and vLLM's error body (:func:`vllm_nnrp_plugin.client.openai.sse.error_reply`), except ``request_timeout``
(``httpx.ReadTimeout``); a drop or an NNRP failure is ``httpx.ReadError``.

Responses and errors are made by the library of the request: ``httpx`` for an ``httpx`` client's request,
``httpx2`` for an ``httpx2`` one's (the SDK's own HTTP library since openai 3; its clients insist on their own
``Response`` and byte-stream classes). Neither is imported here.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import orjson

from vllm_nnrp_plugin.client.errors import ClientError
from vllm_nnrp_plugin.client.events import ClientEvent
from vllm_nnrp_plugin.client.openai import sse
from vllm_nnrp_plugin.client.openai.responses_sse import ResponsesEventStream
from vllm_nnrp_plugin.contract.auth_block import bearer_key, block_of_authorization
from vllm_nnrp_plugin.core.controls import PRIORITY_CLASSES
from vllm_nnrp_plugin.profile import (
    CHAT_COMPLETIONS_CREATE,
    EMBEDDINGS_CREATE,
    MODELS_LIST,
    RESPONSES_CREATE,
    SCHEMA_VERSION,
    events,
)
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import CAPABILITIES_OPERATION
from vllm_nnrp_plugin.profile.chat_stream import usage_asked

#: the operation of each POST path
_POST_OPERATIONS = {
    sse.CHAT_PATH: CHAT_COMPLETIONS_CREATE,
    sse.RESPONSES_PATH: RESPONSES_CREATE,
    sse.EMBEDDINGS_PATH: EMBEDDINGS_CREATE,
}
#: :meth:`Call.answer`'s "submit :attr:`Call.envelope` again" (``models.list`` refused: fetch the capabilities)
RESUBMIT: Any = object()
#: the request header naming the operation's priority class (``nnrp.priority_class``)
PRIORITY_HEADER = "x-nnrp-priority-class"
#: the request header asking for a bound on the whole operation (ms; ``nnrp.timeout_ms``)
TIMEOUT_HEADER = "x-nnrp-timeout-ms"
Item = ClientEvent | ClientError  # one event of the operation, or the failure that ended it


def library(request: Any) -> ModuleType:
    """The HTTP library whose ``Request`` ``request`` is: the ``httpx`` or ``httpx2`` module (by the class's
    top-level package, which is imported already since the request exists)."""
    return sys.modules[type(request).__module__.partition(".")[0]]


def _json(status: int, body: Any, request: Any) -> Any:
    return library(request).Response(
        status, headers={"content-type": "application/json"}, content=orjson.dumps(body), request=request
    )


def _envelope(operation: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "operation": operation, "body": body}


class Call:
    """One SDK request (an ``httpx`` or ``httpx2`` request, :attr:`lib` its library): what to submit
    (:meth:`plan`), and how its events become bytes or an error of that library. :attr:`ended`: the operation's
    terminal was read, or the caller gave it up."""

    def __init__(self, request: Any, *, operation_timeout_s: float | None = None) -> None:
        self.request = request
        self.lib = library(request)
        self.operation: str | None = None
        self.envelope: dict[str, Any] | None = None
        self.stream: sse.ChatChunkStream | ResponsesEventStream | None = None
        timeouts = request.extensions.get("timeout") or {}
        #: the longest silence between two events of the operation, the first one included (the request's read
        #: timeout, s; None: no bound)
        self.timeout_s: float | None = timeouts.get("read")
        #: the bound on the whole operation the transport asks for (s; None: none), unless the header names one
        self.operation_timeout_s = operation_timeout_s
        #: the longest wait for a free session (the request's pool timeout, s; None: no bound)
        self.pool_timeout_s: float | None = timeouts.get("pool")
        #: the longest wait for a connection (the request's connect timeout, s; None: no bound)
        self.connect_timeout_s: float | None = timeouts.get("connect")
        self.ended = False

    def respond(self, first: Item, stream: Callable[[Item], Any]) -> Any:
        """:meth:`answer`, or for a stream the 200 response whose body ``stream(first)`` makes, or None."""
        response = self.answer(first)
        if response is None and self.stream is not None:
            response = self.lib.Response(
                200, headers={"content-type": "text/event-stream"}, stream=stream(first), request=self.request
            )
        return response

    def plan(self) -> Any:
        """Set :attr:`envelope` (what to submit) and return None, or return the immediate answer."""
        priority = self.request.headers.get(PRIORITY_HEADER)
        if priority is not None and priority not in PRIORITY_CLASSES:
            return _json(
                400,
                {
                    "error": {
                        "message": f"{PRIORITY_HEADER}: {priority!r} is not one of {', '.join(PRIORITY_CLASSES)}",
                        "type": "BadRequestError",
                        "param": None,
                        "code": E.INVALID_REQUEST,
                    }
                },
                self.request,
            )
        total_ms = self._operation_timeout_ms()
        if isinstance(total_ms, str):
            return _json(
                400,
                {"error": {"message": total_ms, "type": "BadRequestError", "param": None, "code": E.INVALID_REQUEST}},
                self.request,
            )
        answer = self._plan()
        if answer is not None or self.envelope is None:  # answered at once: nothing to submit
            return answer
        if priority is not None:
            self.envelope["nnrp"] = {**self.envelope.get("nnrp", {}), "priority_class": priority}
        if total_ms is not None:
            self.envelope["nnrp"] = {**self.envelope.get("nnrp", {}), "timeout_ms": total_ms}
        return None

    def _operation_timeout_ms(self) -> int | str | None:
        """The whole operation's bound asked for (ms): the ``X-NNRP-Timeout-Ms`` header, else the transport's
        ``operation_timeout_s``, else None; a message (str) for a header that is not a positive integer."""
        header = self.request.headers.get(TIMEOUT_HEADER)
        if header is not None:
            try:
                value = int(header)
            except ValueError:
                value = 0
            if not 0 < value < 1 << 31:
                return f"{TIMEOUT_HEADER}: {header!r} is not a positive integer of milliseconds"
            return value
        if self.operation_timeout_s is not None:
            return max(1, int(self.operation_timeout_s * 1000))
        return None

    def _plan(self) -> Any:
        path, method = self.request.url.path, self.request.method
        if path.endswith(sse.MODELS_PATH) and method == "GET":
            self.operation, self.envelope = MODELS_LIST, _envelope(MODELS_LIST, {})
            return None
        self.operation = next((op for p, op in _POST_OPERATIONS.items() if path.endswith(p)), None)
        if self.operation is None or method != "POST":
            return _json(*sse.route_reply(path, method), self.request)
        try:
            body = orjson.loads(self.request.content)
        except orjson.JSONDecodeError as exc:
            return _json(
                400,
                {
                    "error": {
                        "message": f"invalid JSON body: {exc}",
                        "type": "BadRequestError",
                        "param": None,
                        "code": E.INVALID_JSON,
                    }
                },
                self.request,
            )
        self.envelope = _envelope(self.operation, body)
        if "x-request-id" in self.request.headers:
            self.envelope["request_id"] = self.request.headers["x-request-id"]
        if isinstance(body, dict) and body.get("stream") and self.operation != EMBEDDINGS_CREATE:
            self.stream = self._stream_of(body)
        return None

    def _stream_of(self, body: dict[str, Any]) -> sse.ChatChunkStream | ResponsesEventStream:
        if self.operation == RESPONSES_CREATE:
            return ResponsesEventStream(
                response_id=f"resp_nnrp-{uuid.uuid4().hex}", created_at=int(time.time()), request=body
            )
        return sse.ChatChunkStream(
            completion_id=f"chatcmpl-nnrp-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.get("model"),
            include_usage=usage_asked(body),
        )

    def unauthorized(self) -> Any:
        """vLLM's answer to a request without a valid API key (``AuthenticationMiddleware``: 401,
        ``{"error": "Unauthorized"}``), which the SDK raises as ``AuthenticationError``."""
        self.ended = True
        return _json(401, {"error": "Unauthorized"}, self.request)

    def api_key(self) -> str | None:
        """The key of the request's ``Authorization: Bearer <key>`` header (what the SDK's ``api_key`` set), or
        None. Raises :class:`~vllm_nnrp_plugin.contract.auth_block.AuthBlockError` for another scheme or an unusable
        key."""
        block = block_of_authorization(self.request.headers.get("authorization"))
        return bearer_key(block) if block else None

    def failure(self, exc: ClientError | None) -> Exception:
        """``ReadError`` for an NNRP failure, ``ReadTimeout`` (``exc`` None) when the operation stayed silent
        for the read timeout (of :attr:`lib`)."""
        self.ended = True
        if exc is None:
            return self.lib.ReadTimeout(
                f"no event from the NNRP server for {self.timeout_s:g} s (the read timeout)", request=self.request
            )
        return self.lib.ReadError(f"NNRP: {exc}", request=self.request)

    def refused(self, item: Item) -> bool:
        """``item`` is a ``too_many_requests`` refusal as the first event: the server refused the submit at
        admission, so it never reached vLLM (docs/operating.md *Limits and backpressure*) and resubmitting is
        safe."""
        if isinstance(item, ClientError) or not item.terminal or not item.event:
            return False
        error = item.event.get("error") or {}
        return item.event.get("type") == events.ERROR and error.get("code") == E.TOO_MANY_REQUESTS

    def _event(self, item: Item) -> dict[str, Any]:
        """The profile event of ``item``; raises an ``httpx`` transport error for a failure, a drop or a
        ``request_timeout``."""
        if isinstance(item, ClientError):
            raise self.failure(item)
        event = item.event or {}
        if item.terminal:
            self.ended = True
        if item.frame == "result_drop":
            raise self.lib.ReadError(
                f"NNRP operation dropped (reason {item.drop_reason}): {event}", request=self.request
            )
        if event.get("type") == events.ERROR and (event.get("error") or {}).get("code") == E.REQUEST_TIMEOUT:
            raise self.lib.ReadTimeout(event["error"].get("message") or E.REQUEST_TIMEOUT, request=self.request)
        return event

    def answer(self, item: Item) -> Any:
        """The response once ``item`` decides it, or None (a non-streamed call's partial; a stream, which then
        starts with ``item``), or :data:`RESUBMIT` with the next :attr:`envelope`. Raises an ``httpx`` transport
        error."""
        event = self._event(item)
        assert not isinstance(item, ClientError)  # _event raised it
        if not item.terminal:
            return None
        if event.get("type") == events.ERROR:
            if self.operation == MODELS_LIST and event["error"].get("code") == E.UNSUPPORTED_OPERATION:
                self.operation, self.envelope = CAPABILITIES_OPERATION, _envelope(CAPABILITIES_OPERATION, {})
                self.ended = False
                return RESUBMIT
            return _json(*sse.error_reply(event, item.status), self.request)
        body = event.get("body") or {}
        if self.operation == CAPABILITIES_OPERATION:
            return _json(200, sse.model_list(body, int(time.time())), self.request)
        return None if self.stream is not None else _json(200, body, self.request)

    def render(self, item: Item) -> bytes:
        """The SSE bytes of one streamed item. Raises an ``httpx`` transport error for a failure or a drop."""
        assert self.stream is not None
        event = self._event(item)
        assert not isinstance(item, ClientError)  # _event raised it
        if not item.terminal:
            return self.stream.feed(event)
        if event.get("type") == events.ERROR:
            return self.stream.fail(event, item.status)
        return self.stream.finish(event.get("body") or {})

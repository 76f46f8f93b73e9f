"""One session's rules (:class:`vllm_nnrp_plugin.nnrp_binding.session_policy.SessionPolicy`) driven the way a
connection drives them (:mod:`vllm_nnrp_plugin.nnrp_binding.connection`), with plain data: a submit carrying a
real typed body, and runtime controls (DEADLINE, TRACE_CONTEXT)."""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Callable

from vllm_nnrp_plugin.contract import wire_mapping
from vllm_nnrp_plugin.core.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding.server_operation import ServerOperation, SessionLink, envelope_of
from vllm_nnrp_plugin.nnrp_binding.session_policy import SessionPolicy


class Handler:
    """Records what the session's policy tells the service, in order: ``(callback name, operation, *args)``."""

    def __init__(self) -> None:
        self.posted: list[tuple] = []

    def __getattr__(self, name: str):
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda *args: self.posted.append((name, *args))


class Session:
    """A session of one connection: ``handle(control)`` applies one of this module's controls as the connection
    does; ``link.items`` holds what its operations queued (nothing sends it)."""

    def __init__(self, handler: Handler, limits: SessionLimits) -> None:
        self.link = SessionLink(limits.max_queued_events, lambda: None)
        self.policy = SessionPolicy(handler, limits, self.link, send_credit=lambda window: None)

    def handle(self, control: Callable[[Session], None]) -> None:
        control(self)


def pump(max_in_flight: int = 16, max_queued_events: int = 1024) -> tuple[Session, Handler, asyncio.AbstractEventLoop]:
    """A session and the handler it reports to (directly: everything runs on one loop, as in the server)."""
    handler = Handler()
    return Session(handler, SessionLimits(max_in_flight, max_queued_events)), handler, asyncio.new_event_loop()


def submit(operation_id: int, payload: bytes = b"{}") -> Callable[[Session], None]:
    """A SUBMIT of ``operation_id`` (its frame id too) with ``payload`` as the typed body's envelope."""

    def apply(session: Session) -> None:
        sop = ServerOperation(
            session.link,
            session_id=1,
            operation_id=operation_id,
            frame_id=operation_id,
            envelope=envelope_of(wire_mapping.STRUCTURED_EVENT, 1, wire_mapping.typed_body(payload)),
            transport="tcp",
            connection_id=1,
            now_ns=time.monotonic_ns(),
            now_unix_ns=time.time_ns(),
        )
        session.policy.submit(sop)

    return apply


def deadline(operation_id: int, unix_ms: int) -> Callable[[Session], None]:
    return lambda session: session.policy.deadline(operation_id, unix_ms)


def trace_context(frame_id: int, trace_id: int, span_id: int, flags: int = 1, body_bytes: int = 0):
    """A TRACE_CONTEXT on ``frame_id`` (0: session scope), its fields under the wire core's names."""
    value = types.SimpleNamespace(
        trace_id=trace_id, span_id=span_id, parent_span_id=0, stage_code=0, flags=flags, body_bytes=body_bytes
    )
    return lambda session: session.policy.trace_context(frame_id, session.policy.by_frame(frame_id), value)

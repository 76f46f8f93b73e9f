"""Plain stand-ins for the nnrp-py objects a session pump reads (no native session is touched): a submit
carrying a real typed body, and runtime controls (DEADLINE, TRACE_CONTEXT, cancels)."""

from __future__ import annotations

import asyncio
import types

from nnrp.core import MessageType

from vllm_nnrp_plugin import wire_mapping
from vllm_nnrp_plugin.limits import SessionLimits
from vllm_nnrp_plugin.nnrp_binding.cadence import PollCadence
from vllm_nnrp_plugin.nnrp_binding.sender import Sender
from vllm_nnrp_plugin.nnrp_binding.session import SessionPump


class Handler:
    """Records what the pump posts to the loop, in order: ``(callback name, operation, *args)``."""

    def __init__(self) -> None:
        self.posted: list[tuple] = []

    def __getattr__(self, name: str):
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda *args: self.posted.append((name, *args))


def pump(max_in_flight: int = 16, max_queued_events: int = 1024) -> tuple[SessionPump, Handler, asyncio.AbstractEventLoop]:
    """A pump on a fake session; ``loop.run_until_complete(asyncio.sleep(0))`` delivers what it posted."""
    loop, handler = asyncio.new_event_loop(), Handler()
    session = types.SimpleNamespace(active_transport_name="tcp")
    # a sender that is never started: what the pump queues stays in ``pump.link.items`` for the test to read
    return SessionPump(session, handler, loop, cadence=PollCadence(100), sender=Sender(),
                       limits=SessionLimits(max_in_flight, max_queued_events)), handler, loop  # fmt: skip


def submit(operation_id: int, payload: bytes = b"{}") -> types.SimpleNamespace:
    metadata = types.SimpleNamespace(payload_kind_bitmap=wire_mapping.STRUCTURED_EVENT, payload_frame_count=1)
    native = types.SimpleNamespace(
        operation_id=operation_id, frame_id=operation_id,
        submit=types.SimpleNamespace(header=types.SimpleNamespace(session_id=1),
                                     metadata=types.SimpleNamespace(value=metadata),
                                     tail=types.SimpleNamespace(body=wire_mapping.typed_body(payload))),
    )  # fmt: skip
    return types.SimpleNamespace(as_submit=lambda: native, as_runtime=lambda: None)


def runtime(kind: MessageType, value: object, frame_id: int = 0) -> types.SimpleNamespace:
    control = types.SimpleNamespace(header=types.SimpleNamespace(message_type=kind, frame_id=frame_id),
                                    metadata=types.SimpleNamespace(value=value))  # fmt: skip
    return types.SimpleNamespace(as_submit=lambda: None, as_runtime=lambda: control)


def deadline(operation_id: int, unix_ms: int) -> types.SimpleNamespace:
    value = types.SimpleNamespace(operation_id=operation_id, deadline_unix_ms=unix_ms)
    return runtime(MessageType.DEADLINE, value)


def trace_context(frame_id: int, trace_id: int, span_id: int, flags: int = 1, body_bytes: int = 0):
    value = types.SimpleNamespace(trace_id=trace_id, span_id=span_id, parent_span_id=0, stage_code=0, flags=flags,
                                  body_bytes=body_bytes)  # fmt: skip
    return runtime(MessageType.TRACE_CONTEXT, value, frame_id)

"""What both clients hand their callers for one event of an operation: :class:`ClientEvent` (plain data)."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["ClientEvent", "operation_event"]


@attrs.frozen
class ClientEvent:
    """One event of an operation.

    ``frame``: ``partial_result``, ``result_push`` or ``result_drop``; ``event``: the profile event (for a
    drop, the ``response.cancelled`` carried as diagnostic bytes, or ``None``); ``drop_reason``: the NNRP
    drop reason code for a drop; ``status``: RESULT_PUSH status code.
    """

    frame: str
    event: dict[str, Any] | None
    drop_reason: int | None = None
    status: int | None = None

    @property
    def terminal(self) -> bool:
        return self.frame != "partial_result"


def operation_event(op: Any, event: dict[str, Any], *, terminal: bool) -> ClientEvent:
    """``event`` of the asyncio client's operation ``op`` (:class:`vllm_nnrp_plugin.client.aio.connection.Operation`)
    as a :class:`ClientEvent`: a partial result, or (``terminal``) the RESULT_PUSH with its status code or the
    drop with its reason code."""
    if not terminal:
        return ClientEvent("partial_result", event)
    if op.drop_reason_code is not None:
        return ClientEvent("result_drop", event, drop_reason=op.drop_reason_code)
    return ClientEvent("result_push", event, status=op.status_code)

"""An operation's own priority class in its envelope, ``{"nnrp": {"priority_class": "<name>"}}`` (the names of
:data:`vllm_nnrp_plugin.core.controls.PRIORITY_CLASSES`: NNRP ``priority_class`` 0, 1, 2, u8 in SESSION_OPEN, u16 in
PRIORITY_UPDATE; nnrp-rs ``crates/nnrp-core/src/enums.rs`` ``PriorityClass``)."""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.core.controls import priority_class_of


def with_priority_class(envelope: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of ``envelope`` whose ``nnrp.priority_class`` is ``name`` (other ``nnrp`` keys kept; the caller's
    dicts are not changed). Raises ``ValueError`` for an unknown name or an ``nnrp`` member that is not an
    object."""
    priority_class_of(name)
    nnrp = envelope.get("nnrp", {})
    if not isinstance(nnrp, dict):
        raise ValueError(f"envelope member 'nnrp' must be an object, got {type(nnrp).__name__}")
    return {**envelope, "nnrp": {**nnrp, "priority_class": name}}

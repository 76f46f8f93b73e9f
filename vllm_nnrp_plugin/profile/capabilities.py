"""The capability document: what this server really serves (the profile's "Capability documents" section).

Two shapes from one source:

* the **runtime capability document** (the profile's shape, fetched by clients):
  ``{profile, schema_version, compatibility_levels: [1], operations: [{name, streaming, non_streaming,
  tool_calls, cancellation}], models: [{id, owned_by}], extensions: [{name, critical, description}]}``;
* the **conformance capabilities manifest** (the suite's ``api-profile-capabilities`` schema, which forbids
  ``models``): ``{adapter, profile, schema_version, compatibility_levels, operations, extensions}``.

The operations listed are the only ones accepted; any other gets ``unsupported_operation``.

**Fetching it over NNRP** (the profile leaves the transport of the document open): submit an ordinary envelope with
the reserved operation ``nnrp.capabilities`` and an empty body, ``{"schema_version": "openai-compatible/1",
"operation": "nnrp.capabilities", "body": {}}``; the terminal is ``response.completed`` whose ``body`` is the
runtime document. It is not a profile operation and is never listed in ``operations``.
"""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, PROFILE, SCHEMA_VERSION

ADAPTER = "vllm-nnrp-plugin"
CAPABILITIES_OPERATION = "nnrp.capabilities"
DIAGNOSTICS_EXTENSION = {
    "name": "vllm.diagnostics",
    "critical": False,
    "description": "Opt-in per operation with the envelope hint nnrp.diagnostics: true: the terminal event gets a "
    "'diagnostics' object (schema vllm.diagnostics/1: ids, timing, usage, cancellation, trace context) derived "
    "from the operation's observation record; never needed to use the profile.",
}


def runtime_document(*, models: list[str], owned_by: str, tool_calls: bool) -> dict[str, Any]:
    """The runtime document for ``models`` (vLLM's served model names, in order). ``tool_calls`` is true only
    when vLLM has a tool-call parser configured (``--enable-auto-tool-choice --tool-call-parser``)."""
    return {
        "profile": PROFILE,
        "schema_version": SCHEMA_VERSION,
        "compatibility_levels": [1],
        "operations": [
            {
                "name": CHAT_COMPLETIONS_CREATE,
                "streaming": True,
                "non_streaming": True,
                "tool_calls": tool_calls,
                "cancellation": True,
            }
        ],
        "models": [{"id": model, "owned_by": owned_by} for model in models],
        "extensions": [dict(DIAGNOSTICS_EXTENSION)],
    }


def operation_names(document: dict[str, Any]) -> frozenset[str]:
    """The operations a document advertises (the envelope decoder accepts exactly these)."""
    return frozenset(op["name"] for op in document["operations"])


def conformance_manifest(document: dict[str, Any], adapter: str = ADAPTER) -> dict[str, Any]:
    """The suite's capabilities manifest derived from a runtime document (drops ``models``)."""
    return {
        "adapter": adapter,
        "profile": document["profile"],
        "schema_version": document["schema_version"],
        "compatibility_levels": list(document["compatibility_levels"]),
        "operations": [dict(op) for op in document["operations"]],
        "extensions": [dict(ext) for ext in document.get("extensions", ())],
    }

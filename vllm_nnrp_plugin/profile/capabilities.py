"""The capability document: what this server really serves (the profile's "Capability documents" section).

Two shapes from one source:

* the **runtime capability document** (the profile's shape, fetched by clients):
  ``{profile, schema_version, compatibility_levels: [1, …], operations: [{name, streaming, non_streaming,
  tool_calls, cancellation, …options}], models: [{id, owned_by}], extensions: [{name, critical, description}]}``
  (the non-critical extensions ``vllm.diagnostics`` and ``vllm.openai_chunk``), plus the server's ``limits``
  (:func:`with_limits`);
* the **conformance capabilities manifest** (the suite's ``api-profile-capabilities`` schema, which forbids
  ``models``): ``{adapter, profile, schema_version, compatibility_levels, operations, extensions}``.

The operations listed are the only ones accepted; any other gets ``unsupported_operation``. A level is claimed
only when every operation of it is listed.

**Fetching it over NNRP** (the profile leaves the transport of the document open): submit an ordinary envelope with
the reserved operation ``nnrp.capabilities`` and an empty body, ``{"schema_version": "openai-compatible/1",
"operation": "nnrp.capabilities", "body": {}}``; the terminal is ``response.completed`` whose ``body`` is the
runtime document. It is not a profile operation and is never listed in ``operations``.
"""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE, LEVELS, PROFILE, SCHEMA_VERSION

ADAPTER = "vllm-nnrp-plugin"
CAPABILITIES_OPERATION = "nnrp.capabilities"
_MANIFEST_KEYS = ("name", "streaming", "non_streaming", "tool_calls", "cancellation")
DIAGNOSTICS_EXTENSION = {
    "name": "vllm.diagnostics",
    "critical": False,
    "description": "Opt-in per operation with the envelope hint nnrp.diagnostics: true: the terminal event gets a "
    "'diagnostics' object (schema vllm.diagnostics/1: ids, timing, usage, cancellation, trace context) derived "
    "from the operation's observation record; never needed to use the profile.",
}
OPENAI_CHUNK_EXTENSION = {
    "name": "vllm.openai_chunk",
    "critical": False,
    "description": "response.output_text.delta may carry 'openai_chunk' (the profile's optional replay field): the "
    "chat.completion.chunk or Responses event vLLM streamed for it, only when that object carries token logprobs "
    "(the request asked with logprobs) or reasoning (vLLM runs a reasoning parser); such an object without text "
    "rides on a delta with an empty 'delta'. Other streams carry none; never needed to use the profile.",
}


def operation(
    name: str,
    *,
    streaming: bool,
    non_streaming: bool,
    tool_calls: bool = False,
    cancellation: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """One entry of the document's ``operations``: ``{name, streaming, non_streaming, tool_calls, cancellation}``
    plus operation-specific ``options`` (e.g. ``encoding_formats`` of ``embeddings.create``), which only the
    runtime document carries (:func:`conformance_manifest` drops them: the suite's schema forbids them)."""
    return {
        "name": name,
        "streaming": streaming,
        "non_streaming": non_streaming,
        "tool_calls": tool_calls,
        "cancellation": cancellation,
        **options,
    }


def chat_operation(*, tool_calls: bool) -> dict[str, Any]:
    """``chat.completions.create``; ``tool_calls`` is true only when vLLM has a tool-call parser configured
    (``--enable-auto-tool-choice --tool-call-parser``)."""
    return operation(CHAT_COMPLETIONS_CREATE, streaming=True, non_streaming=True, tool_calls=tool_calls)


def compatibility_levels(operations: list[dict[str, Any]]) -> list[int]:
    """The levels whose every operation is served (:data:`~vllm_nnrp_plugin.profile.LEVELS`), ascending: a
    server that serves ``models.list`` but not ``embeddings.create`` does not claim level 3."""
    served = {op["name"] for op in operations}
    return [level for level, names in sorted(LEVELS.items()) if served.issuperset(names)]


def runtime_document(*, models: list[str], owned_by: str, operations: list[dict[str, Any]]) -> dict[str, Any]:
    """The runtime document for ``models`` (vLLM's served model names, in order) serving ``operations``
    (entries of :func:`operation`, in the order given); ``vllm.openai_chunk`` is declared when an operation
    streams (the only place it occurs). Raises ValueError when ``operations`` make up no whole
    compatibility level (the suite's manifest needs at least one)."""
    levels = compatibility_levels(operations)
    if not levels:
        names = ", ".join(op["name"] for op in operations) or "none"
        raise ValueError(f"the operations served ({names}) make up no whole openai-compatible/1 level")
    return {
        "profile": PROFILE,
        "schema_version": SCHEMA_VERSION,
        "compatibility_levels": levels,
        "operations": [dict(op) for op in operations],
        "models": [{"id": model, "owned_by": owned_by} for model in models],
        "extensions": [dict(DIAGNOSTICS_EXTENSION)]
        + ([dict(OPENAI_CHUNK_EXTENSION)] if any(op["streaming"] for op in operations) else []),
    }


def with_limits(
    document: dict[str, Any], *, max_in_flight: int | None, max_in_flight_per_session: int, max_sessions: int
) -> dict[str, Any]:
    """``document`` with the server's admission limits as ``limits: {max_in_flight, max_in_flight_per_session,
    max_sessions}`` (operations per API-server process, per session, open sessions per process: the
    ``nnrp.*`` settings of the same names). The profile's document names no limits; this top-level key is
    the server's own addition, which clients that do not know it ignore and :func:`conformance_manifest`
    leaves out (the suite's manifest schema allows no other keys). Clients size their fan-out by it
    (:mod:`vllm_nnrp_plugin.client.aio.pool`)."""
    limits = {
        "max_in_flight": max_in_flight,
        "max_in_flight_per_session": max_in_flight_per_session,
        "max_sessions": max_sessions,
    }
    return {**document, "limits": limits}


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
        "operations": [{key: op[key] for key in _MANIFEST_KEYS if key in op} for op in document["operations"]],
        "extensions": [dict(ext) for ext in document.get("extensions", ())],
    }

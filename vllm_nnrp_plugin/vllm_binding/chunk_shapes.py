"""One shape for vLLM's chat output on every supported line, before the profile mapper sees it.

The 0.18, 0.22 and 0.26 lines emit the same model output in slightly different JSON (recorded from real vLLM
in ``compat/fixtures/vllm/<anchor>/``; vllm-integration.md §8, fixtures README "Differences"). This module
rewrites every stream chunk and every non-streaming body into the *normal form* below, so the profile events
are identical across anchors for the same model output. Each rule is a no-op on the lines that already have
the normal form, so the functions are safe on any supported line.

Stream chunks (``chat.completion.chunk`` dicts), normal form = the 0.26 shape, minus the build-specific fields:

* ``system_fingerprint`` is removed: ``vllm-<version>-<hash>`` from 0.22 on (absent on 0.18); it names the
  build, so it can never be identical across anchors.
* ``prompt_text: null`` (0.22+, first chunk) is removed.
* ``delta.content: null`` (0.26, beside tool-call deltas) is removed, and so is ``delta.content: ""`` outside the
  first (``role``) delta (0.18, the finish delta of a choice stopped by end of sequence); ``delta.tool_calls: []``
  (0.22, on every text delta while a tool parser is enabled) is removed.
* Tool-call deltas: the first delta of a call carries ``id``, ``type``, ``index`` and ``function.name`` only;
  the first ``arguments`` fragment, which 0.18/0.22 put in that same delta, moves to a chunk of its own right
  after it. ``function.name: null`` on later fragments (0.18/0.22, ``tool_choice: "required"``) is removed, and
  so are empty ``arguments: ""`` fragments (0.18/0.22 finish chunk of a named tool choice).

Non-streaming bodies (``chat.completion`` dicts) lose ``system_fingerprint``; the null fields only newer lines
send (``prompt_text`` and ``choices[i].routed_experts`` from 0.22, ``ec_transfer_params`` and ``metrics`` on
0.26); and ``message.tool_calls: []`` (0.18/0.22 when there are no calls; 0.26 omits the key).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

Chunk = dict[str, Any]

#: top-level fields of a non-streaming body that only newer lines send, always null in these outputs
_NEWER_NULL_FIELDS = frozenset({"prompt_text", "ec_transfer_params", "metrics"})


async def normalised_chunks(chunks: AsyncGenerator[Chunk, None]) -> AsyncIterator[Chunk]:
    """The chunks of ``chunks`` in normal form, in order (one input chunk gives one or two). Closing this
    generator closes ``chunks`` (so vLLM's stream is closed, not left to garbage collection)."""
    try:
        async for chunk in chunks:
            for out in normalise_chunk(chunk):
                yield out
    finally:
        await chunks.aclose()


def normalise_chunk(chunk: Chunk) -> list[Chunk]:
    """One chunk in normal form: usually ``[chunk]``; two chunks when a tool-call name delta also carried the
    first argument fragment. Error chunks (``{"error": …}``) pass unchanged. Does not modify ``chunk``."""
    if "error" in chunk or not isinstance(chunk.get("choices"), list):
        return [chunk]
    head = {k: v for k, v in chunk.items() if k != "system_fingerprint" and not (k == "prompt_text" and v is None)}
    first, fragments = [], []
    for choice in chunk["choices"]:
        choice = copy.deepcopy(choice)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            moved = _normalise_delta(delta)
            if moved:
                fragments.append({**choice, "delta": {"tool_calls": moved}})
                choice["finish_reason"] = None  # the choice ends with its last fragment
        first.append(choice)
    out = [{**head, "choices": first}]
    if fragments:
        out.append({**head, "choices": fragments})
    return out


def normalise_body(body: Chunk) -> Chunk:
    """A non-streaming ``chat.completion`` body in normal form (a new dict; ``body`` is not modified)."""
    body = {k: v for k, v in body.items() if k != "system_fingerprint" and not (k in _NEWER_NULL_FIELDS and v is None)}
    choices = []
    for choice in body.get("choices") or ():
        choice = {k: v for k, v in choice.items() if not (k == "routed_experts" and v is None)}
        message = choice.get("message")
        if isinstance(message, dict) and message.get("tool_calls") == []:
            choice["message"] = {k: v for k, v in message.items() if k != "tool_calls"}
        choices.append(choice)
    if "choices" in body:
        body["choices"] = choices
    return body


def _normalise_delta(delta: Chunk) -> list[Chunk]:
    """Rewrite ``delta`` in place; return the argument fragments split off its name deltas."""
    if "content" in delta and (delta["content"] is None or (delta["content"] == "" and "role" not in delta)):
        del delta["content"]
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return []
    kept, moved = [], []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict):
            if "name" in function and function["name"] is None:
                del function["name"]
            arguments = function.get("arguments")
            if function.get("name") and arguments:
                del function["arguments"]
                moved.append({"index": call.get("index", 0), "function": {"arguments": arguments}})
            elif arguments == "" and not function.get("name") and not call.get("id"):
                continue  # an empty fragment says nothing
        kept.append(call)
    if kept:
        delta["tool_calls"] = kept
    else:
        del delta["tool_calls"]
    return moved

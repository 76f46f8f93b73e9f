"""Map a stream of OpenAI ``chat.completion.chunk`` objects to profile events (profile-contract.md §3).

``choices[i].delta.content`` -> ``response.output_text.delta {index: i, delta}``; a chunk with
``choices: []`` and ``usage`` (sent when ``stream_options.include_usage``) -> ``response.usage``; an
``{"error": {...}}`` chunk -> :class:`ProfileError` ``backend_error``. :meth:`ChatStreamMapper.completed_body`
assembles the ``chat.completion`` object the terminal ``response.completed`` carries. Tool-call deltas are
folded into that body (``message.tool_calls``); their streaming events are a later capability.
"""

from __future__ import annotations

from typing import Any

from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile import events


class ChatStreamMapper:
    """Feed chunks in arrival order with :meth:`feed`; read the final body with :meth:`completed_body`."""

    __slots__ = ("_head", "_choices", "_usage", "_fingerprint")

    def __init__(self) -> None:
        self._head: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._fingerprint: str | None = None

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chunk, in order (often one, sometimes none).

        Raises :class:`ProfileError` ``backend_error`` for an error chunk (vLLM's mid-stream
        ``data: {"error": {...}}``).
        """
        if "error" in chunk:
            raise _stream_error(chunk["error"])
        if self._head is None:
            self._head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("system_fingerprint"):
            self._fingerprint = chunk["system_fingerprint"]
        out: list[dict[str, Any]] = []
        choices = chunk.get("choices") or ()
        for choice in choices:
            index = choice.get("index", 0)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice()
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                state.text.append(content)
                out.append(events.output_text_delta(index, content))
            for call in delta.get("tool_calls") or ():
                state.add_tool_call_delta(call)
            if choice.get("finish_reason") is not None:
                state.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage and not choices:
            self._usage = usage
            out.append(events.usage(usage))
        return out

    def completed_body(self) -> dict[str, Any]:
        """The ``chat.completion`` object assembled from the stream (OpenAI usage names kept)."""
        head = self._head or {}
        body: dict[str, Any] = {
            "id": head.get("id"),
            "object": "chat.completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [self._choices[i].as_choice(i) for i in sorted(self._choices)],
        }
        if self._usage is not None:
            body["usage"] = self._usage
        if self._fingerprint is not None:
            body["system_fingerprint"] = self._fingerprint
        return body


class _Choice:
    __slots__ = ("text", "finish_reason", "tool_calls")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def add_tool_call_delta(self, call: dict[str, Any]) -> None:
        index = call.get("index", len(self.tool_calls))
        acc = self.tool_calls.get(index)
        if acc is None:
            acc = self.tool_calls[index] = {"id": None, "type": "function", "name": "", "arguments": []}
        if call.get("id"):
            acc["id"] = call["id"]
        function = call.get("function") or {}
        if function.get("name"):
            acc["name"] = function["name"]
        if function.get("arguments"):
            acc["arguments"].append(function["arguments"])

    def as_choice(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) if self.text else None}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": c["type"],
                    "function": {"name": c["name"], "arguments": "".join(c["arguments"])},
                }
                for _, c in sorted(self.tool_calls.items())
            ]
        return {"index": index, "message": message, "logprobs": None, "finish_reason": self.finish_reason}


def _stream_error(error: object) -> E.ProfileError:
    """A mid-stream error object is always ``backend_error``: generation had already started."""
    if not isinstance(error, dict):
        return E.backend_error(str(error))
    status = error.get("code")
    return E.backend_error(str(error.get("message") or "backend error in stream"),
                           status if isinstance(status, int) else 500)

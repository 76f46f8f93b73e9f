"""One shape for vLLM's chat output on every supported line, before the profile mapper sees it.

The supported lines (0.18, 0.22, 0.26 to 0.32) emit the same model output in slightly different JSON (recorded
from real vLLM in ``compat/fixtures/vllm/<anchor>/``, one folder per anchor with the requests that produced them).
This module rewrites every stream chunk and every non-streaming body into the *normal form* below, so the profile events
are identical across anchors for the same model output. Each rule is a no-op on the lines that already have
the normal form, so the functions are safe on any supported line.

Stream chunks (``chat.completion.chunk`` dicts), normal form = the 0.26 shape (0.27 to 0.32 stream the same shapes),
minus the build-specific fields:

* ``system_fingerprint`` is removed: ``vllm-<version>-<hash>`` from 0.22 on (absent on 0.18); it names the
  build, so it can never be identical across anchors.
* ``prompt_text: null`` (0.22+, first chunk) is removed.
* ``delta.content: null`` (0.26, beside tool-call deltas) is removed, and so is ``delta.content: ""`` outside the
  first (``role``) delta (0.18, the finish delta of a choice stopped by end of sequence); ``delta.tool_calls: []``
  (0.22, on every text delta while a tool parser is enabled) is removed.
* Tool-call deltas: the first delta of a call carries ``id``, ``type``, ``index`` and ``function.name`` only;
  the first ``arguments`` fragment, which 0.18/0.22 put in that same delta, moves to the next chunk together
  with every entry that followed it (vLLM's order of fragments is kept exactly). ``function.name: null`` on
  later fragments (0.18/0.22, ``tool_choice: "required"``) is removed, and so are empty ``arguments: ""``
  fragments (0.18/0.22 finish chunk of a named tool choice).
* Finish reasons tell the truth: vLLM's stream generator
  (``vllm/entrypoints/openai/chat_completion/serving.py``, ``chat_completion_stream_generator``) reports
  ``finish_reason: "tool_calls"`` for every choice that streamed a tool call, even when the token budget ended
  it, where its non-streaming answer says ``"length"``. Given the request's :class:`TokenBudget`, a
  ``"tool_calls"`` finish chunk waits for vLLM's usage (the usage chunk at the end, or usage on that chunk) and
  becomes ``"length"`` when the completion tokens reached the budget (:class:`VLLMStream`). A ``"tool_calls"``
  left on a choice that completed no call becomes ``"stop"`` in the profile mapper, which knows which calls
  completed (:mod:`vllm_nnrp_plugin.profile.chat_stream`).

Parsing: :func:`vllm_chunks` (and its I/O-free core :class:`VLLMStream`) turns the ``data: <json>`` strings
vLLM's generator yields into normal-form chunks; it is the one way vLLM's stream output reaches the profile
mapper, in production and in the tests and benchmarks that replay recordings. Most chunks of a stream only
carry the next piece of text, and vLLM writes them all alike (its pydantic models dump their fields in a fixed
order): once a stream had one such chunk, a later ``data:`` line that is byte for byte the same around its
``content`` string is that chunk with other text, and it is handed over as a
:class:`~vllm_nnrp_plugin.profile.chat_stream.TextDelta` without building its dict (:class:`_TextLane`).

Non-streaming bodies (``chat.completion`` dicts) lose ``system_fingerprint``; the null fields only newer lines
send (``prompt_text`` and ``choices[i].routed_experts`` from 0.22, ``ec_transfer_params`` and ``metrics`` on
0.26); ``usage.completion_tokens_details: null`` (from 0.28, beside the ``prompt_tokens_details: null`` every line
sends); and ``message.tool_calls: []`` (0.18/0.22 when there are no calls; 0.26 omits the key).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import attrs
import orjson

from vllm_nnrp_plugin.profile.chat_stream import TextDelta

Chunk = dict[str, Any]
#: what :class:`VLLMStream` hands on: a normal-form chunk dict, or a text-only chunk as a :class:`TextDelta`
Item = Chunk | TextDelta

#: top-level fields of a non-streaming body that only newer lines send, always null in these outputs
_NEWER_NULL_FIELDS = frozenset({"prompt_text", "ec_transfer_params", "metrics"})
_DATA = "data: "
_DONE = "[DONE]"


@attrs.frozen
class TokenBudget:
    """The output-token budget vLLM gives one request (``get_max_tokens`` in
    ``vllm/entrypoints/serve/utils/api_utils.py``): ``max_tokens`` is the request's ``max_completion_tokens`` /
    ``max_tokens`` or vLLM's default, capped by ``--override-generation-config``'s maximum; ``max_model_len``
    the context length. Both in tokens; ``None`` when unknown."""

    max_tokens: int | None = None
    max_model_len: int | None = None

    def spent(self, prompt_tokens: int | None, completion_tokens: int, choices: int = 1) -> bool:
        """True when ``completion_tokens`` (summed over ``choices`` choices) reached every choice's budget."""
        limits = [] if self.max_tokens is None else [self.max_tokens]
        if self.max_model_len is not None and isinstance(prompt_tokens, int):
            limits.append(self.max_model_len - prompt_tokens)
        return bool(limits) and completion_tokens >= choices * min(limits)


class VLLMStream:
    """vLLM's chat stream -> normal-form chunks, without I/O: :meth:`feed` each string vLLM's generator yields
    (``data: <json>`` lines; ``data: [DONE]`` sets :attr:`done`), then :meth:`end` if the strings stop without
    ``[DONE]``. ``budget``: the request's :class:`TokenBudget`; without one, finish reasons pass as vLLM sent
    them. With several choices and only vLLM's summed final usage, a budget counts as spent only when every
    choice spent it (ask for ``stream_options.continuous_usage_stats`` to get each choice's count).
    Raises ``orjson.JSONDecodeError`` for a ``data:`` line that is not JSON."""

    __slots__ = ("_budget", "_held", "_choices", "_lane", "_middle", "done")

    def __init__(self, budget: TokenBudget | None = None) -> None:
        self._budget = budget
        self._held: list[Chunk] = []  # "tool_calls" finish chunks waiting for vLLM's usage
        self._choices: set[int] = set()
        self._lane: _TextLane | None = None  # the byte shape of this stream's text-only chunks, once seen
        self._middle: Chunk | None = None  # the stream's first middle chunk, once seen
        self.done = False

    @property
    def text_lane(self) -> _TextLane | None:
        """The byte shape of this stream's text-only chunks (its ``index`` and ``template``), once a string fed in
        was one."""
        return self._lane

    @property
    def middle_chunk(self) -> Chunk | None:
        """The first middle chunk of the stream in normal form, once a string fed in was one: one choice, no
        ``role`` in its delta, null ``logprobs`` and ``finish_reason``, no ``usage`` — the shape vLLM's generator
        gives every chunk between the first and the finish chunk of a request of one choice."""
        return self._middle

    def feed_chunk(self, chunk: Chunk) -> list[Item]:
        """Normal-form chunks for one chunk dict, as :meth:`feed` gives them for the ``data:`` line of its JSON
        (``chunk``, which nobody else may hold, is rewritten in place)."""
        return [out for normal in _normalise_parsed(chunk) for out in self._truthful(normal)]

    def feed(self, item: str) -> list[Item]:
        """Normal-form chunks for one string of vLLM's stream, in order."""
        if self.done:
            return []
        lane = self._lane
        if lane is not None:
            text = lane.text(item)
            if text is not None:
                return [TextDelta(lane.index, text, lane.template)]
        # vLLM's generator yields one "data: <json>\n\n" per chunk: that shape is parsed without splitting
        if item.startswith(_DATA) and item.endswith("\n\n") and item.count("\n") == 2:
            return self._line(item[len(_DATA) : -2].rstrip("\r"))
        out: list[Item] = []
        # SSE lines end at "\n"; not str.splitlines(), which also breaks at U+0085, U+2028 and U+2029,
        # characters JSON text carries unescaped (model_dump_json leaves them as they are)
        for line in item.split("\n"):
            if not self.done and line.startswith(_DATA):
                out.extend(self._line(line[len(_DATA) :].rstrip("\r")))
        return out

    def _line(self, data: str) -> list[Item]:
        """The chunks of one ``data:`` line's payload."""
        if data == _DONE:
            self.done = True
            return self.end()
        chunks = _normalise_parsed(orjson.loads(data))
        if self._middle is None and _is_middle(chunks[0]):
            self._middle = chunks[0]
        if len(chunks) == 1:
            if self._lane is None:
                self._lane = _TextLane.learn(data, chunks[0])
            return self._truthful(chunks[0])
        return [out for chunk in chunks for out in self._truthful(chunk)]

    def end(self) -> list[Item]:
        """The chunks still held back (the stream ended without the usage they waited for)."""
        held, self._held = self._held, []
        return held  # type: ignore[return-value]  # handed over, not shared: a list of chunks is one of items

    def _truthful(self, chunk: Chunk) -> list[Item]:
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return [*self.end(), chunk]  # an error chunk
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            usage = None
        tool_calls_finish = False
        for choice in choices:
            if isinstance(choice, dict):
                self._choices.add(choice.get("index", 0))
                tool_calls_finish = tool_calls_finish or choice.get("finish_reason") == "tool_calls"
        if not choices:
            if usage is not None:
                for held in self._held:
                    self._settle(held, usage, len(self._choices))
            return [*self.end(), chunk]
        if self._budget is None or not tool_calls_finish:
            return [chunk]
        if usage is not None:  # continuous usage stats: this choice's own count
            self._settle(chunk, usage, 1)
            return [chunk]
        self._held.append(chunk)
        return []

    def _settle(self, chunk: Chunk, usage: Chunk, choices: int) -> None:
        completion = usage.get("completion_tokens")
        if isinstance(completion, int) and self._budget is not None:
            if self._budget.spent(usage.get("prompt_tokens"), completion, choices):
                for choice in chunk["choices"]:
                    if isinstance(choice, dict) and choice.get("finish_reason") == "tool_calls":
                        choice["finish_reason"] = "length"


def _is_middle(chunk: Chunk) -> bool:
    """True for a normal-form chunk of :attr:`VLLMStream.middle_chunk`'s shape."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or chunk.get("usage") is not None:
        return False
    (choice,) = choices
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return (
        isinstance(delta, dict)
        and "role" not in delta
        and choice.get("logprobs") is None
        and choice.get("finish_reason") is None
    )


class _TextLane:
    """The byte shape of one stream's text-only chunks, as vLLM's generator yields them (``data: <json>\\n\\n``):
    ``head`` (up to and including ``"delta":{"content":``) and ``tail`` (everything after the content string)
    of a chunk whose normal form is ``template`` (one choice, index ``index``, delta ``{"content": <non-empty
    text>}``, no logprobs, finish reason or usage). A string that starts with ``head``, ends with ``tail`` and
    has one JSON string between them is one ``data:`` line (a JSON string holds no raw line break) that parses
    to ``template`` with that string as its content: everything else in it is the same bytes."""

    __slots__ = ("head", "tail", "index", "template", "_start", "_end")

    _MARK = '"delta":{"content":'  # no JSON string holds it: inside one, every '"' is escaped

    def __init__(self, head: str, tail: str, index: int, template: Chunk) -> None:
        self.head, self.tail, self.index, self.template = head, tail, index, template
        self._start, self._end = len(head), len(tail)

    @classmethod
    def learn(cls, data: str, chunk: Chunk) -> _TextLane | None:
        """The lane of ``chunk`` (the normal form of payload ``data``), or ``None`` when it is not text-only."""
        choices = chunk.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or chunk.get("usage") is not None:
            return None
        (choice,) = choices
        if (
            not isinstance(choice, dict)
            or choice.get("logprobs") is not None
            or choice.get("finish_reason") is not None
        ):
            return None
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        if not isinstance(content, str) or not content or len(delta) != 1:  # type: ignore[arg-type]  # a str content came from a dict delta
            return None
        start = data.find(cls._MARK)
        if start < 0:
            return None
        start += len(cls._MARK)
        end = _string_end(data, start)
        if end is None or orjson.loads(data[start:end]) != content:
            return None
        return cls(_DATA + data[:start], data[end:] + "\n\n", choice.get("index", 0), chunk)

    def text(self, item: str) -> str | None:
        """The content of ``item`` (a string vLLM's generator yielded) when it is a chunk of this lane with
        non-empty text, else ``None``."""
        if len(item) <= self._start + self._end or not (item.startswith(self.head) and item.endswith(self.tail)):
            return None
        try:
            text = orjson.loads(item[self._start : len(item) - self._end])
        except orjson.JSONDecodeError:
            return None
        return text if text.__class__ is str and text else None


def _string_end(data: str, start: int) -> int | None:
    """The index after the JSON string that starts at ``data[start]`` (``None``: no string starts there)."""
    if data[start : start + 1] != '"':
        return None
    at = start + 1
    while (at := data.find('"', at)) >= 0:
        escapes = at - 1
        while data[escapes] == "\\":
            escapes -= 1
        if (at - 1 - escapes) % 2 == 0:  # not escaped
            return at + 1
        at += 1
    return None


async def vllm_chunks(stream: AsyncGenerator[str, None], budget: TokenBudget | None = None) -> AsyncIterator[Item]:
    """The normal-form chunks (dicts; text-only ones as :class:`TextDelta`) of vLLM's chat stream ``stream`` (the
    strings ``create_chat_completion``'s generator yields), in order, through :class:`VLLMStream`; stops at
    ``[DONE]``. Closing this generator, or reaching its end, closes ``stream`` (vLLM's generator is never left to
    garbage collection)."""
    parser = VLLMStream(budget)
    try:
        async for item in stream:
            for chunk in parser.feed(item):
                yield chunk
            if parser.done:
                return
        for chunk in parser.end():
            yield chunk
    finally:
        await stream.aclose()


def normalise_chunk(chunk: Chunk) -> list[Chunk]:
    """One chunk in normal form: usually ``[chunk]``; more chunks when a tool-call name delta also carried an
    argument fragment (the fragment and every entry after it go to the next chunk, so vLLM's order is kept).
    Error chunks (``{"error": …}``) pass unchanged. Does not modify ``chunk``."""
    return _normalise_parsed(copy.deepcopy(chunk))


def _normalise_parsed(chunk: Chunk) -> list[Chunk]:
    """:func:`normalise_chunk` on a chunk nobody else holds (fresh from the JSON parser): rewritten in place."""
    choices = chunk.get("choices")
    if "error" in chunk or not isinstance(choices, list):
        return [chunk]
    chunk.pop("system_fingerprint", None)
    if "prompt_text" in chunk and chunk["prompt_text"] is None:
        del chunk["prompt_text"]
    per_choice: list[list[Any]] | None = None  # the pieces of each choice, once one of them splits
    for position, choice in enumerate(choices):
        delta = choice.get("delta") if isinstance(choice, dict) else None
        later = _normalise_delta(delta) if isinstance(delta, dict) else None
        if later:
            ending = {k: choice.pop(k) for k in ("finish_reason", "stop_reason") if k in choice}
            choice["finish_reason"] = None
            bare = {k: v for k, v in choice.items() if k != "delta"}
            pieces = [choice, *({**bare, "delta": {"tool_calls": calls}} for calls in later)]
            pieces[-1].update(ending)  # the choice ends with its last piece
            if per_choice is None:
                per_choice = [[c] for c in choices[:position]]
            per_choice.append(pieces)
        elif per_choice is not None:
            per_choice.append([choice])
    if per_choice is None:
        return [chunk]
    head = {k: v for k, v in chunk.items() if k != "choices"}
    return [{**head, "choices": [p[k] for p in per_choice if k < len(p)]} for k in range(max(map(len, per_choice)))]


def normalise_body(body: Chunk) -> Chunk:
    """A non-streaming ``chat.completion`` body in normal form (a new dict; ``body`` is not modified)."""
    body = {k: v for k, v in body.items() if k != "system_fingerprint" and not (k in _NEWER_NULL_FIELDS and v is None)}
    usage = body.get("usage")
    if isinstance(usage, dict) and "completion_tokens_details" in usage and usage["completion_tokens_details"] is None:
        body["usage"] = {k: v for k, v in usage.items() if k != "completion_tokens_details"}
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


def _normalise_delta(delta: Chunk) -> list[list[Chunk]]:
    """Rewrite ``delta`` in place; return the groups of tool-call entries split off after each name delta
    that carried an argument fragment (each group starts with that fragment)."""
    if "content" in delta and (delta["content"] is None or (delta["content"] == "" and "role" not in delta)):
        del delta["content"]
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return []
    groups: list[list[Chunk]] = [[]]
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            if "name" in function and function["name"] is None:
                del function["name"]
            arguments = function.get("arguments")
            if function.get("name") and arguments:
                del function["arguments"]
                groups[-1].append(call)
                groups.append([{"index": call.get("index", 0), "function": {"arguments": arguments}}])
                continue
            if arguments == "" and not function.get("name") and not call.get("id"):
                continue  # an empty fragment says nothing
        groups[-1].append(call)
    first, later = groups[0], [g for g in groups[1:] if g]
    if first:
        delta["tool_calls"] = first
    else:
        del delta["tool_calls"]
    return later

"""One of vLLM's stream generators driven from the engine lane's task, fed the engine outputs the lane hands it.

The engine lanes (:mod:`.engine_lane` for chat, :mod:`.responses_lane` for Responses) read the engine's outputs
themselves and give vLLM's generator only those they cannot prove equal to what they build. vLLM's generator
(``OpenAIServingChat.chat_completion_stream_generator``, ``OpenAIServingResponses._process_simple_streaming_events``)
reads its outputs from a :class:`Feed` instead of the engine's generator; :class:`Pump` steps it in the lane's task
and gets control back when it waits for the next output (the feed suspends it with :data:`WANTS_OUTPUT`); any other
wait inside it goes to the event loop as usual. :class:`HandOverParser` stands in for the parser object vLLM's
generator holds, so that the lane can call that parser once per output and still hand vLLM's generator the result.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from typing import Any

#: what vLLM's generator suspends with when it waits for the next engine output (never seen by the event loop)
WANTS_OUTPUT = object()


class HandOverParser:
    """The parser object vLLM's generator holds: vLLM's own ``parser`` behind it. Its ``parse_delta`` hands over
    ``pending`` (the delta the lane already parsed for this output) or raises ``error`` (what the lane's parse
    raised), else drops the first ``skip`` token ids (those of outputs the lane took, prepended only for vLLM's
    counts) and asks ``parser``. ``tool_call_seen``: vLLM's generator got a delta with tool calls (chat: its
    ``tools_streamed`` is set). Every other attribute is ``parser``'s."""

    __slots__ = ("parser", "pending", "error", "skip", "tool_call_seen")

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.pending: Any = None
        self.error: BaseException | None = None
        self.skip = 0
        self.tool_call_seen = False

    def parse_delta(
        self,
        delta_text: str,
        delta_token_ids: list[int],
        request: Any,
        prompt_token_ids: list[int] | None = None,
        **kwargs: Any,
    ) -> Any:
        error = self.error
        if error is not None:
            self.error = None
            raise error
        delta = self.pending
        if delta is not None:
            self.pending = None
        else:
            if self.skip:
                delta_token_ids, self.skip = delta_token_ids[self.skip :], 0
            delta = self.parser.parse_delta(delta_text, delta_token_ids, request, prompt_token_ids, **kwargs)
        if delta is not None and delta.tool_calls:
            self.tool_call_seen = True
        return delta

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


class Feed:
    """The async iterator vLLM's generator reads engine outputs from: it hands over the ``output`` the lane put in
    (or raises its ``error``, or ends once ``ended``), else suspends vLLM's generator with :data:`WANTS_OUTPUT`,
    which only :class:`Pump` sees."""

    __slots__ = ("output", "error", "ended")

    def __init__(self) -> None:
        self.output: Any = None
        self.error: BaseException | None = None
        self.ended = False

    def __aiter__(self) -> Feed:
        return self

    def __anext__(self) -> Feed:
        return self

    def __await__(self) -> Generator[Any, None, Any]:
        while True:
            output = self.output
            if output is not None:
                self.output = None
                return output
            error = self.error
            if error is not None:
                self.error = None
                raise error
            if self.ended:
                raise StopAsyncIteration
            yield WANTS_OUTPUT


class Pump:
    """Steps vLLM's generator ``items`` in the caller's task: :meth:`yielded` runs it until it waits for the next
    output (or ends) and returns what it yielded meanwhile."""

    __slots__ = ("generator", "_step", "_ended")

    def __init__(self, items: AsyncGenerator[Any, None]) -> None:
        self.generator = items
        self._step: Any = None  # the step of vLLM's generator that waits for an output
        self._ended = False

    async def yielded(self) -> list[Any]:
        """What vLLM's generator yields until it waits for the next output or ends."""
        out: list[Any] = []
        while not self._ended:
            step, self._step = self._step or self.generator.__anext__(), None
            try:
                yielded = await _Step(step)
            except StopAsyncIteration:
                self._ended = True
                break
            if yielded is WANTS_OUTPUT:
                self._step = step
                break
            out.append(yielded)
        return out

    async def close(self, feed: Feed) -> None:
        """End vLLM's generator: where it waits for an output, with ``GeneratorExit`` (its ``finally`` blocks run, as
        ``aclose`` runs them), then ``aclose`` it."""
        if self._step is not None:
            feed.output, feed.error = None, GeneratorExit()
            try:
                await self.yielded()
            except GeneratorExit:
                pass
        await self.generator.aclose()


class _Step:
    """Awaits one step of vLLM's generator (an ``asend`` of ``__anext__``): its value when it yields,
    :data:`WANTS_OUTPUT` when it suspends at the feed (the step can be resumed later), ``StopAsyncIteration`` when
    it ended. Every other suspension inside it is passed to the event loop and resumed (or thrown into) as the loop
    says, as ``await`` would."""

    __slots__ = ("_step",)

    def __init__(self, step: Any) -> None:
        self._step = step

    def __await__(self) -> Generator[Any, Any, Any]:
        step = self._step
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                suspended = step.send(sent) if thrown is None else step.throw(thrown)
            except StopIteration as done:
                return done.value
            if suspended is WANTS_OUTPUT:
                return WANTS_OUTPUT
            sent, thrown = None, None
            try:
                sent = yield suspended
            except BaseException as exc:  # a cancel: thrown into vLLM's generator where it waits
                thrown = exc

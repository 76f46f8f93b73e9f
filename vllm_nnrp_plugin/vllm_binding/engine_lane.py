"""vLLM's text-only engine outputs reach the profile mapper without vLLM's chunk strings (the engine lane).

vLLM's chat stream generator, ``OpenAIServingChat.chat_completion_stream_generator(request, result_generator,
request_id, model_name, …)`` (``vllm/entrypoints/openai/chat_completion/serving.py``; the same four leading
parameters on 0.18–0.32), reads the engine's ``RequestOutput`` objects from ``result_generator`` and turns each into
a ``chat.completion.chunk``: it builds ``DeltaMessage``, ``ChatCompletionResponseStreamChoice`` and
``ChatCompletionStreamResponse`` (pydantic models), dumps them as JSON and yields ``data: <json>\\n\\n``, which
:class:`~vllm_nnrp_plugin.vllm_binding.chunk_shapes.VLLMStream` parses back. For most outputs of a plain chat
stream all of that carries one piece of text. The engine lane takes those outputs straight from the engine
(HTTP/SSE clients of the same server are not affected):

* :func:`lane_serving` gives a view of vLLM's serving object (same state, same methods) whose stream generator,
  for a request that :func:`request_fits`, returns an :class:`EngineStream` instead of vLLM's generator. vLLM still
  validates and renders the request, derives its sampling parameters, starts it in the engine and formats every
  chunk that is not only text: the first chunk (``role``), an ``echo``, the finish chunk, the usage chunk and
  error chunks come from vLLM's own generator, which reads its outputs from a :class:`_Feed` the lane fills.
* :meth:`EngineStream.items` reads ``result_generator`` itself. Once vLLM's own strings showed the stream's
  text-only chunk shape (``VLLMStream.text_lane``), an output of one choice with new text and no finish reason is
  handed on as a :class:`~vllm_nnrp_plugin.profile.chat_stream.TextDelta` of that shape — the text-only chunk vLLM
  would have built for it, which gives the mapper the same events and state — and never reaches vLLM's generator.
  Every other output goes to vLLM's generator, with the token ids of the outputs the lane took in front of its
  own, so that vLLM's token counts (usage, ``previous_num_tokens``) are what they would have been.

Only a configuration in which every middle output becomes a text-only chunk uses the lane (:func:`serving_fits`,
:func:`request_fits`): no tool or reasoning parser, no harmony (``gpt_oss``) model, no output logging, no forced
usage (``--enable-force-include-usage`` streams usage on every chunk), and a request of one choice without
``tools``, ``logprobs``, ``return_token_ids``, beam search or ``continuous_usage_stats``. Everything else takes
vLLM's generator whole, as before.

vLLM's generator is driven without a task of its own: :class:`_Pump` steps it in the lane's task and gets control
back when it waits for the next output (the feed suspends it with :data:`_WANTS_OUTPUT`); any other wait inside it
goes to the event loop as usual.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Generator
from typing import Any

from vllm_nnrp_plugin.profile.chat_stream import TextDelta
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import Item, TokenBudget, VLLMStream

#: what vLLM's generator suspends with when it waits for the next engine output (never seen by the event loop)
_WANTS_OUTPUT = object()
#: the leading parameters the lane relies on, the same on 0.18–0.32
_STREAM_GENERATOR_PARAMETERS = ("self", "request", "result_generator", "request_id", "model_name")


def serving_fits(serving: Any) -> str | None:
    """Why the chat serving object ``serving`` (``OpenAIServingChat``) cannot use the engine lane, or ``None`` when it
    can: its attributes ``parser_cls`` (0.22+), ``tool_parser`` / ``reasoning_parser_cls`` (0.18, 0.22),
    ``use_harmony`` (0.18, 0.22), ``enable_log_outputs``, ``enable_force_include_usage``, and the signature of
    ``chat_completion_stream_generator``."""
    if any(getattr(serving, name, None) is not None for name in ("parser_cls", "tool_parser", "reasoning_parser_cls")):
        return "a tool-call or reasoning parser is configured"
    if getattr(serving, "use_harmony", False):
        return "the model uses the harmony format"
    if getattr(serving, "enable_log_outputs", False):
        return "vLLM logs every output (--enable-log-outputs)"
    if getattr(serving, "enable_force_include_usage", False):
        return "vLLM streams usage on every chunk (--enable-force-include-usage)"
    generator = getattr(type(serving), "chat_completion_stream_generator", None)
    if generator is None:
        return "the serving object has no chat_completion_stream_generator"
    names = tuple(inspect.signature(generator).parameters)[: len(_STREAM_GENERATOR_PARAMETERS)]
    if names != _STREAM_GENERATOR_PARAMETERS:
        return f"chat_completion_stream_generator's parameters begin {names}"
    return None


def request_fits(request: Any) -> bool:
    """True when every middle output of vLLM's ``ChatCompletionRequest`` ``request`` becomes a text-only chunk:
    one choice (``n``), no ``tools``, ``logprobs``, ``return_token_ids`` (0.22+), ``use_beam_search`` or
    ``stream_options.continuous_usage_stats``."""
    options = request.stream_options
    return (
        (request.n or 1) == 1
        and not request.tools
        and not request.logprobs
        and not getattr(request, "return_token_ids", False)
        and not getattr(request, "use_beam_search", False)
        and not (options is not None and options.continuous_usage_stats)
    )


def lane_serving(serving: Any) -> Any:
    """A view of ``serving`` (its class's subclass sharing its ``__dict__``: the same state, the same methods) whose
    ``chat_completion_stream_generator`` returns an :class:`EngineStream` for a request that :func:`request_fits`,
    vLLM's own generator otherwise. ``serving`` itself is not changed: vLLM's HTTP routes keep using it."""
    base = type(serving)
    vllm_generator = base.chat_completion_stream_generator

    def chat_completion_stream_generator(self: Any, request: Any, result_generator: Any, *args: Any,
                                         **kwargs: Any) -> Any:
        if not request_fits(request):
            return vllm_generator(self, request, result_generator, *args, **kwargs)
        feed = _Feed()
        return EngineStream(vllm_generator(self, request, feed, *args, **kwargs), result_generator, feed)

    view_cls = type(base.__name__, (base,), {"chat_completion_stream_generator": chat_completion_stream_generator,
                                             "__module__": __name__})
    view = object.__new__(view_cls)
    view.__dict__ = serving.__dict__
    return view


class EngineStream:
    """One chat stream on the engine lane: ``strings`` (vLLM's stream generator, reading ``feed``), ``outputs``
    (the engine's ``RequestOutput`` generator, ``result_generator``) and the :class:`_Feed` between them. Read it
    with :meth:`items`."""

    __slots__ = ("_pump", "_outputs", "_feed")

    def __init__(self, strings: AsyncGenerator[str, None], outputs: AsyncIterator[Any], feed: _Feed) -> None:
        self._pump = _Pump(strings)
        self._outputs = outputs
        self._feed = feed

    async def items(self, budget: TokenBudget | None = None) -> AsyncIterator[Item]:
        """The stream's normal-form chunks, as :func:`~vllm_nnrp_plugin.vllm_binding.chunk_shapes.vllm_chunks` gives
        them for vLLM's strings (``budget``: the request's token budget), in order. An exception the engine's
        generator raises reaches vLLM's generator, which reports it as its error chunk. Closing this generator, or
        reaching its end, closes vLLM's generator and the engine's."""
        parser = VLLMStream(budget)
        feed, pump = self._feed, self._pump
        next_output = self._outputs.__anext__
        lane = None  # the stream's text-only shape, once vLLM's own strings showed it
        taken: list[int] = []  # token ids of the outputs the lane took since vLLM's generator saw one
        try:
            while True:
                try:
                    output = await next_output()
                except StopAsyncIteration:  # after the finished output (``AsyncLLM.generate``), so ``taken`` is empty
                    feed.ended = True
                    break
                except Exception as exc:  # the engine failed: vLLM's generator reports it
                    feed.error = exc
                    break
                if lane is not None:
                    completion = _text_only(output)
                    if completion is not None:
                        taken.extend(completion.token_ids)
                        yield TextDelta(lane.index, completion.text, lane.template)
                        continue
                    if taken and len(output.outputs) == 1:
                        output, taken = _with_token_ids(output, taken), []
                feed.output = output
                for string in await pump.strings():
                    for item in parser.feed(string):
                        yield item
                if parser.done:
                    return
                lane = parser.text_lane
            for string in await pump.strings():
                for item in parser.feed(string):
                    yield item
            for item in parser.end():
                yield item
        finally:
            try:
                await pump.close(feed)
            finally:
                aclose = getattr(self._outputs, "aclose", None)
                if aclose is not None:
                    await aclose()


def _text_only(output: Any) -> Any:
    """The one ``CompletionOutput`` of ``RequestOutput`` ``output`` when new text is all it carries (index 0, no
    finish reason, non-empty text), else ``None``."""
    outputs = output.outputs
    if len(outputs) != 1:
        return None
    completion = outputs[0]
    if completion.finish_reason is not None or completion.index != 0 or not completion.text:
        return None
    return completion


def _with_token_ids(output: Any, taken: list[int]) -> Any:
    """A shallow copy of ``RequestOutput`` ``output`` (one choice) whose ``CompletionOutput.token_ids`` are ``taken``
    followed by its own; the engine's objects are not changed."""
    (completion,) = output.outputs
    completion = copy.copy(completion)
    completion.token_ids = [*taken, *completion.token_ids]
    output = copy.copy(output)
    output.outputs = [completion]
    return output


class _Feed:
    """The async iterator vLLM's generator reads ``RequestOutput`` objects from: it hands over the ``output`` the lane
    put in (or raises its ``error``, or ends once ``ended``), else suspends vLLM's generator with
    :data:`_WANTS_OUTPUT`, which only :class:`_Pump` sees."""

    __slots__ = ("output", "error", "ended")

    def __init__(self) -> None:
        self.output: Any = None
        self.error: BaseException | None = None
        self.ended = False

    def __aiter__(self) -> _Feed:
        return self

    def __anext__(self) -> _Feed:
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
            yield _WANTS_OUTPUT


class _Pump:
    """Steps vLLM's generator ``strings`` in the caller's task: :meth:`strings` runs it until it waits for the next
    output (or ends) and returns what it yielded meanwhile."""

    __slots__ = ("_strings", "_step", "_ended")

    def __init__(self, strings: AsyncGenerator[str, None]) -> None:
        self._strings = strings
        self._step: Any = None  # the step of vLLM's generator that waits for an output
        self._ended = False

    async def strings(self) -> list[str]:
        """The strings vLLM's generator yields until it waits for the next output or ends."""
        out: list[str] = []
        while not self._ended:
            step, self._step = self._step or self._strings.__anext__(), None
            try:
                yielded = await _Step(step)
            except StopAsyncIteration:
                self._ended = True
                break
            if yielded is _WANTS_OUTPUT:
                self._step = step
                break
            out.append(yielded)
        return out

    async def close(self, feed: _Feed) -> None:
        """End vLLM's generator: where it waits for an output, with ``GeneratorExit`` (its ``finally`` blocks run, as
        ``aclose`` runs them), then ``aclose`` it."""
        if self._step is not None:
            feed.output, feed.error = None, GeneratorExit()
            try:
                await self.strings()
            except GeneratorExit:
                pass
        await self._strings.aclose()


class _Step:
    """Awaits one step of vLLM's generator (an ``asend`` of ``__anext__``): its value when it yields a string,
    :data:`_WANTS_OUTPUT` when it suspends at the feed (the step can be resumed later), ``StopAsyncIteration`` when
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
            if suspended is _WANTS_OUTPUT:
                return _WANTS_OUTPUT
            sent, thrown = None, None
            try:
                sent = yield suspended
            except BaseException as exc:  # a cancel: thrown into vLLM's generator where it waits
                thrown = exc

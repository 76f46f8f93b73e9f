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
  error chunks come from vLLM's own generator, which reads its outputs from a :class:`Feed` the lane fills.
* :meth:`EngineStream.items` reads ``result_generator`` itself. Once vLLM's own strings showed the stream's
  text-only chunk shape (``VLLMStream.text_lane``), an output of one choice with new text and no finish reason is
  handed on as a :class:`~vllm_nnrp_plugin.profile.chat_stream.TextDelta` of that shape — the text-only chunk vLLM
  would have built for it, which gives the mapper the same events and state — and never reaches vLLM's generator.
  Every other output goes to vLLM's generator, with the token ids of the outputs the lane took in front of its
  own, so that vLLM's token counts (usage, ``previous_num_tokens``) are what they would have been.

A server with a tool-call or reasoning parser (``--tool-call-parser``, ``--reasoning-parser``) takes the lane too
on the lines where vLLM's generator drives one stateful parser object per choice
(:func:`~vllm_nnrp_plugin.vllm_binding.families.stream_parser_off`; 0.26–0.34). vLLM's generator still creates
that parser (the view's ``parser_cls`` hands it a :class:`HandOverParser` wrapping the object vLLM's own class makes
for the request), and the lane calls the same object's ``parse_delta`` with the arguments vLLM's generator would
pass, once per output, in order, so vLLM's parser still decides what is content, reasoning and tool-call text:

* a middle output whose ``DeltaMessage`` is ``None`` (a control token, text the parser holds back) gives nothing,
  as in vLLM's generator; one that is only ``content`` is a :class:`TextDelta`; any other is the chunk vLLM would
  have built for it (the stream's middle-chunk shape, learnt from vLLM's own first middle chunk, with the
  ``DeltaMessage`` dumped as ``model_dump_json(exclude_unset=True)`` dumps it and vLLM's
  ``maybe_filter_parallel_tool_calls`` rule applied), in normal form;
* the first output whose delta carries a tool call goes to vLLM's generator with that delta (the wrapper hands it
  over instead of parsing again), so that vLLM's own ``tools_streamed`` decides the finish reason; the finish
  output always goes to vLLM's generator, which parses it (``finished=True``), checks for unstreamed arguments and
  names the finish reason as its line does; the wrapper removes the token ids of the outputs the lane took (they
  are in front of the output only for vLLM's token counts) before they reach the parser;
* a ``parse_delta`` that raises is raised inside vLLM's generator, which reports it as its error chunk.

Only a configuration in which the lane can give exactly vLLM's chunks uses it (:func:`serving_fits`,
:func:`request_fits`): no harmony (``gpt_oss``) model, no output logging, no forced usage
(``--enable-force-include-usage`` streams usage on every chunk), a parser only where vLLM's generator drives one
parser object, and a request of one choice without ``logprobs``, ``return_token_ids``, beam search or
``continuous_usage_stats`` (and without ``tools`` on a server without a parser). Everything else takes vLLM's
generator whole, as before.

vLLM's generator is driven without a task of its own, fed from the lane (:mod:`.driven_generator`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.profile.chat_stream import TextDelta
from vllm_nnrp_plugin.vllm_binding.chunk_shapes import Chunk, Item, TokenBudget, VLLMStream
from vllm_nnrp_plugin.vllm_binding.driven_generator import Feed, HandOverParser, Pump
from vllm_nnrp_plugin.vllm_binding.engine_tap import view_maker
from vllm_nnrp_plugin.vllm_binding.families import Binding, stream_parser_off

#: the leading parameters the lane relies on, the same on 0.18–0.32
_STREAM_GENERATOR_PARAMETERS = ("self", "request", "result_generator", "request_id", "model_name")
#: the ``DeltaMessage`` fields set on a delta that is only text (``tool_calls``: an empty list some parsers set)
_CONTENT = frozenset({"content"})
_CONTENT_AND_CALLS = frozenset({"content", "tool_calls"})


def serving_fits(serving: Any, binding: Binding) -> str | None:
    """Why the chat serving object ``serving`` (``OpenAIServingChat``) of ``binding``'s lines cannot use the engine
    lane, or ``None`` when it may (its start-up self-check decides: :mod:`.self_check`): its attributes
    ``use_harmony`` (0.18, 0.22), ``enable_log_outputs``, ``enable_force_include_usage``, the signature of
    ``chat_completion_stream_generator``, and, when it has a parser (``parser_cls`` 0.22+, ``tool_parser`` /
    ``reasoning_parser_cls`` 0.18 and 0.22), whether the lane can drive it
    (:func:`~vllm_nnrp_plugin.vllm_binding.families.stream_parser_off`)."""
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
    if has_parser(serving):
        off = stream_parser_off(serving, binding)
        if off is not None:
            return f"a tool-call or reasoning parser is configured and {off}"
    return None


def has_parser(serving: Any) -> bool:
    """True when vLLM's chat serving object runs a tool-call or reasoning parser: ``parser_cls`` (0.22+),
    ``tool_parser`` / ``reasoning_parser_cls`` (0.18, 0.22)."""
    names = ("parser_cls", "tool_parser", "reasoning_parser_cls")
    return any(getattr(serving, name, None) is not None for name in names)


def request_fits(request: Any, parser: bool = False) -> bool:
    """True when the lane gives exactly vLLM's chunks for vLLM's ``ChatCompletionRequest`` ``request``: one choice
    (``n``), no ``logprobs``, ``return_token_ids`` (0.22+), ``use_beam_search`` or
    ``stream_options.continuous_usage_stats``, and no ``tools`` unless the server has a parser the lane drives
    (``parser``)."""
    options = request.stream_options
    return (
        (request.n or 1) == 1
        and (parser or not request.tools)
        and not request.logprobs
        and not getattr(request, "return_token_ids", False)
        and not getattr(request, "use_beam_search", False)
        and not (options is not None and options.continuous_usage_stats)
    )


def lane_serving(serving: Any) -> Callable[[RuntimeControls | None], Any]:
    """``make(controls)``: a view of ``serving`` for one request (:func:`~.engine_tap.view_maker`: the same state, the
    same methods, the engine client tapped for ``controls``) whose ``chat_completion_stream_generator`` returns an
    :class:`EngineStream` for a request that :func:`request_fits`, vLLM's own generator otherwise. With a parser
    (:func:`has_parser`) the view's ``parser_cls`` records the parser vLLM's generator creates for the request.
    ``serving`` itself is not changed: vLLM's HTTP routes keep using it."""
    vllm_generator = type(serving).chat_completion_stream_generator
    parser = has_parser(serving)

    def chat_completion_stream_generator(
        self: Any, request: Any, result_generator: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not request_fits(request, parser):
            return vllm_generator(self, request, result_generator, *args, **kwargs)
        feed = Feed()
        turn = None
        if parser:
            turn = self._lane_turn = _ParserTurn(request)
        report = getattr(self._nnrp_engine, "report_lane", None)  # the start-up self-check's engine (.self_check)
        return EngineStream(vllm_generator(self, request, feed, *args, **kwargs), result_generator, feed, turn, report)

    namespace: dict[str, Any] = {"chat_completion_stream_generator": chat_completion_stream_generator}
    if parser:
        namespace.update(__slots__=("_lane_turn",), parser_cls=property(_recording_parser_cls))
    return view_maker(serving, namespace)


def _recording_parser_cls(view: Any) -> Any:
    """The view's ``parser_cls``: vLLM's own, or — once the request's stream generator was created (its
    :class:`_ParserTurn`) — a :class:`_RecordingParserCls` of it."""
    cls = view.__dict__.get("parser_cls")
    turn = getattr(view, "_lane_turn", None)
    return cls if cls is None or turn is None else _RecordingParserCls(cls, turn)


class _RecordingParserCls:
    """vLLM's parser class as the stream generator of one request sees it: calling it makes vLLM's parser object and
    returns it wrapped in a :class:`HandOverParser` recorded on ``turn``; every attribute is the class's own."""

    __slots__ = ("_cls", "_turn")

    def __init__(self, cls: Any, turn: _ParserTurn) -> None:
        self._cls, self._turn = cls, turn

    def __call__(self, *args: Any, **kwargs: Any) -> HandOverParser:
        parser = HandOverParser(self._cls(*args, **kwargs))
        self._turn.parsers.append(parser)
        return parser

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)


class _ParserTurn:
    """One lane request on a parser server: vLLM's ``ChatCompletionRequest`` and the :class:`HandOverParser` objects
    vLLM's generator created for it (one per choice; the lane drives a request of one choice)."""

    __slots__ = ("request", "parsers")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.parsers: list[HandOverParser] = []


class _Middle:
    """How a parser stream's middle outputs become items: ``head`` and ``rest`` (the chunk and choice fields of vLLM's
    first middle chunk of this stream, without ``choices`` and ``delta``) and the :class:`HandOverParser`."""

    __slots__ = ("head", "rest", "parser", "parallel", "_text_template")

    def __init__(self, head: Chunk, rest: Chunk, parser: HandOverParser, parallel: bool) -> None:
        self.head, self.rest, self.parser, self.parallel = head, rest, parser, parallel
        self._text_template: Chunk | None = None

    @classmethod
    def learn(cls, chunk: Chunk | None, turn: _ParserTurn) -> _Middle | None:
        """The shape of ``chunk`` (the stream's first middle chunk, :attr:`VLLMStream.middle_chunk`), once vLLM's
        generator made exactly one parser for ``turn``."""
        if chunk is None or len(turn.parsers) != 1:
            return None
        (choice,) = chunk["choices"]
        head = {k: v for k, v in chunk.items() if k != "choices"}
        rest = {k: v for k, v in choice.items() if k != "delta"}
        return cls(head, rest, turn.parsers[0], turn.request.parallel_tool_calls is not False)

    def items(self, delta: Any, stream: VLLMStream) -> list[Item]:
        """The normal-form items of the chunk vLLM's generator builds for a middle output whose ``DeltaMessage`` is
        ``delta``: ``ChatCompletionResponseStreamChoice(delta=delta, …)`` through
        ``maybe_filter_parallel_tool_calls`` (``vllm/entrypoints/serve/utils/tool_calls_utils.py``: only the calls
        of index 0 when the request says ``parallel_tool_calls: false``), dumped with ``exclude_unset``."""
        content = delta.content
        if content.__class__ is str and content:
            fields = delta.model_fields_set
            if fields == _CONTENT or (fields == _CONTENT_AND_CALLS and not delta.tool_calls):
                template = self._text_template
                if template is None:
                    template = self._text_template = self._chunk({"content": content})
                return [TextDelta(self.rest.get("index", 0), content, template)]
        dumped = delta.model_dump(mode="json", exclude_unset=True)
        calls = dumped.get("tool_calls")
        if calls and not self.parallel:
            dumped["tool_calls"] = [call for call in calls if call.get("index") == 0]
        return stream.feed_chunk(self._chunk(dumped))

    def _chunk(self, delta: Chunk) -> Chunk:
        return {**self.head, "choices": [{**self.rest, "delta": delta}]}


class EngineStream:
    """One chat stream on the engine lane: ``strings`` (vLLM's stream generator, reading ``feed``), ``outputs``
    (the engine's ``RequestOutput`` generator, ``result_generator``) and the :class:`Feed` between them; ``turn``:
    the request's :class:`_ParserTurn` on a parser server; ``report``, when given, is told how many outputs the lane
    took itself when the stream ends. Read it with :meth:`items`."""

    __slots__ = ("_pump", "_outputs", "_feed", "_turn", "_report")

    def __init__(
        self,
        strings: AsyncGenerator[str, None],
        outputs: AsyncIterator[Any],
        feed: Feed,
        turn: _ParserTurn | None = None,
        report: Callable[[int], None] | None = None,
    ) -> None:
        self._pump = Pump(strings)
        self._outputs = outputs
        self._feed = feed
        self._turn = turn
        self._report = report

    async def items(self, budget: TokenBudget | None = None) -> AsyncIterator[Item]:
        """The stream's normal-form chunks, as :func:`~vllm_nnrp_plugin.vllm_binding.chunk_shapes.vllm_chunks` gives
        them for vLLM's strings (``budget``: the request's token budget), in order. An exception the engine's
        generator raises reaches vLLM's generator, which reports it as its error chunk. Closing this generator, or
        reaching its end, closes vLLM's generator and the engine's."""
        parser = VLLMStream(budget)
        feed, pump, turn = self._feed, self._pump, self._turn
        next_output = self._outputs.__anext__
        lane = None  # the stream's text-only shape, once vLLM's own strings showed it (no parser)
        middle = None  # the stream's middle-chunk shape and parser, once vLLM's own strings showed it (parser)
        taken: list[int] = []  # token ids of the outputs the lane took since vLLM's generator saw one
        took = 0  # outputs the lane took
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
                    completion = _middle(output)
                    if completion is not None and completion.text:
                        taken.extend(completion.token_ids)
                        took += 1
                        yield TextDelta(lane.index, completion.text, lane.template)
                        continue
                elif middle is not None:
                    completion = _middle(output)
                    if completion is not None and len(completion.token_ids):
                        ids = completion.token_ids
                        ids = ids if ids.__class__ is list else list(ids)
                        wrapper = middle.parser
                        try:
                            delta = wrapper.parser.parse_delta(
                                completion.text,
                                ids,
                                turn.request,  # type: ignore[union-attr]  # a parser middle comes with its turn
                                output.prompt_token_ids,
                                finished=False,
                            )
                        except Exception as exc:  # vLLM's generator reports it, as when its own parse raises
                            wrapper.error = exc
                        else:
                            if delta is None or wrapper.tool_call_seen or not delta.tool_calls:
                                taken.extend(ids)
                                took += 1
                                if delta is not None:
                                    for item in middle.items(delta, parser):
                                        yield item
                                continue
                            wrapper.pending = delta  # the first tool call: vLLM's generator streams it
                if taken and len(output.outputs) == 1:
                    if middle is not None and middle.parser.pending is None and middle.parser.error is None:
                        middle.parser.skip = len(taken)
                    output, taken = _with_token_ids(output, taken), []
                feed.output = output
                for string in await pump.yielded():
                    for item in parser.feed(string):
                        yield item
                if parser.done:
                    return
                if turn is None:
                    lane = parser.text_lane
                elif middle is None:
                    middle = _Middle.learn(parser.middle_chunk, turn)
            for string in await pump.yielded():
                for item in parser.feed(string):
                    yield item
            for item in parser.end():
                yield item
        finally:
            if self._report is not None:
                self._report(took)
            try:
                await pump.close(feed)
            finally:
                aclose = getattr(self._outputs, "aclose", None)
                if aclose is not None:
                    await aclose()


def _middle(output: Any) -> Any:
    """The one ``CompletionOutput`` of ``RequestOutput`` ``output`` when it is a middle output of a request of one
    choice (index 0, no finish reason), else ``None``. The text lane takes it when it has text; the parser lane when
    it has token ids (vLLM's generator parses every such output)."""
    outputs = output.outputs
    if len(outputs) != 1:
        return None
    completion = outputs[0]
    if completion.finish_reason is not None or completion.index != 0:
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

"""vLLM's Responses engine outputs reach the profile mapper without vLLM's per-token event objects (the Responses lane).

vLLM's simple (non-harmony) Responses stream, ``OpenAIServingResponses._process_simple_streaming_events(request,
sampling_params, result_generator, context, …, _increment_sequence_number_and_return)``
(``vllm/entrypoints/openai/responses/serving.py``), reads the request's ``SimpleContext`` from ``result_generator``
once per engine output (``_generate_with_builtin_tools`` has already appended the output to it: the text, token
ids and counts the final Response is made from), has the request's parser make a ``DeltaMessage`` of the output
(``ctx.response_parser.parse_delta(…, finished=…)``; without a parser ``DeltaMessage(content=output.text)``) and
drives a ``SimpleStreamingEventProcessor`` (``…/responses/streaming_events.py``): a state — ``CONTENT``,
``REASONING`` or ``TOOL_CALL`` — whose change closes one output item and opens the next, and per delta an event
object (openai's ``ResponseTextDeltaEvent``, ``ResponseReasoningTextDeltaEvent``, …) numbered by
``_increment_sequence_number_and_return``. :func:`responses_lane_serving` gives a per-request view of vLLM's serving
object (HTTP/SSE clients of the same server are not affected) whose processor, for a request that
:func:`request_fits`, is :func:`_lane`: it reads the contexts itself and, for a middle output (no finish reason),
calls the request's parser object with the arguments vLLM's processor would pass. When the delta

* is only content and the processor's state is ``CONTENT`` — vLLM would emit one ``response.output_text.delta`` of
  the open item and change nothing but ``state.accumulated_text`` —, the lane appends the text to that state and
  hands on the event as the dict the profile mapper reads (``type``, ``output_index``, ``delta``, as
  :mod:`.responses` reduces vLLM's own), numbered by vLLM's counter;
* is only reasoning and the state is ``REASONING``: the same for ``response.reasoning_text.delta``, whole (the dict
  ``model_dump`` gives of it, sequence number included: the mapper passes reasoning events on as they are);
* is ``None``, or content that is empty: nothing, as in vLLM's processor.

Every other output — those before vLLM's processor began, one that opens or closes an item, tool-call deltas, the
finish output — goes to vLLM's processor, driven in the lane's task (:mod:`.driven_generator`), and its events pass
as they are; the delta the lane parsed reaches it through a
:class:`~vllm_nnrp_plugin.vllm_binding.driven_generator.HandOverParser` put in place of the context's parser for
this request, so vLLM's parser is asked once per output, in order; a parse that raised is raised inside vLLM's
processor. The processor's state is vLLM's own object, read from its generator's frame (``ag_frame.f_locals``, the
``processor`` local) once it has begun; where it cannot be read the lane hands every output over.

Which lines and servers: :func:`~vllm_nnrp_plugin.vllm_binding.families.responses_lane_off`; which requests:
:func:`request_fits`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.vllm_binding.driven_generator import Feed, HandOverParser, Pump
from vllm_nnrp_plugin.vllm_binding.engine_tap import view_maker

#: the event types the lane hands on (openai's ``ResponseTextDeltaEvent``, ``ResponseReasoningTextDeltaEvent``)
TEXT_DELTA = "response.output_text.delta"
REASONING_DELTA = "response.reasoning_text.delta"


def request_fits(request: Any) -> bool:
    """True when the lane gives exactly vLLM's events for vLLM's ``ResponsesRequest`` ``request``: it does not ask
    for output logprobs (``include: ["message.output_text.logprobs"]``, ``is_include_output_logprobs``), which vLLM
    computes per text delta."""
    return not request.is_include_output_logprobs()


def responses_lane_serving(serving: Any) -> Callable[[RuntimeControls | None], Any]:
    """``make(controls)``: a view of ``serving`` (``OpenAIServingResponses``) for one request
    (:func:`~.engine_tap.view_maker`: the same state, the same methods, the engine client tapped for ``controls``)
    whose ``_process_simple_streaming_events`` is the lane for a request that :func:`request_fits`, vLLM's own
    otherwise. ``serving`` itself is not changed: vLLM's HTTP routes keep using it."""
    vllm_processor = type(serving)._process_simple_streaming_events

    def _process_simple_streaming_events(
        self: Any,
        request: Any,
        sampling_params: Any,
        result_generator: Any,
        context: Any,
        model_name: Any,
        tokenizer: Any,
        request_metadata: Any,
        created_time: Any,
        _increment_sequence_number_and_return: Any,
    ) -> Any:
        rest = (model_name, tokenizer, request_metadata, created_time, _increment_sequence_number_and_return)
        if not request_fits(request):
            return vllm_processor(self, request, sampling_params, result_generator, context, *rest)
        parser = getattr(context, "response_parser", None)
        if parser is not None:
            parser = context.response_parser = HandOverParser(parser)
        feed = Feed()
        events = vllm_processor(self, request, sampling_params, feed, context, *rest)
        report = getattr(self._nnrp_engine, "report_lane", None)  # the start-up self-check's engine (.self_check)
        return _lane(events, result_generator, feed, parser, request, _increment_sequence_number_and_return, report)

    return view_maker(serving, {"_process_simple_streaming_events": _process_simple_streaming_events})


class _Numbered:
    """What the lane asks vLLM's ``_increment_sequence_number_and_return`` for a sequence number with (it sets the
    attribute of any event that has one)."""

    __slots__ = ("sequence_number",)

    def __init__(self) -> None:
        self.sequence_number = -1


async def _lane(
    events: AsyncGenerator[Any, None],
    contexts: AsyncIterator[Any],
    feed: Feed,
    parser: HandOverParser | None,
    request: Any,
    number: Callable[[Any], Any],
    report: Callable[[int], None] | None = None,
) -> AsyncIterator[Any]:
    """The Responses events of one stream (module docstring): vLLM's processor ``events`` reading ``feed``, the
    contexts ``contexts`` (vLLM's ``result_generator``), the request's ``parser`` (``None``: the server has none)
    and vLLM's ``number`` (``_increment_sequence_number_and_return``). Closing this generator, or reaching its end,
    closes vLLM's processor and ``contexts``; ``report``, when given, is told how many outputs the lane took
    itself."""
    pump = Pump(events)
    next_context = contexts.__anext__
    parse = None if parser is None else parser.parser.parse_delta
    state = content = reasoning = None  # vLLM's processor state and its CONTENT / REASONING, once it began
    taken = 0
    try:
        while True:
            try:
                ctx = await next_context()
            except StopAsyncIteration:
                feed.ended = True
                break
            except Exception as exc:  # the engine failed: vLLM's processor raises it
                feed.error = exc
                break
            if state is not None:
                last = ctx.last_output
                outputs = None if last is None else last.outputs
                output = outputs[0] if outputs else None
                if output is not None and output.finish_reason is None:
                    delta = None
                    if parse is None:
                        text, thought, other = output.text, None, False
                    else:
                        ids = output.token_ids
                        try:
                            delta = parse(
                                output.text,
                                ids if ids.__class__ is list else list(ids),
                                request,
                                last.prompt_token_ids,
                                finished=False,
                            )
                        except Exception as exc:  # vLLM's processor raises it, as when its own parse raises
                            parser.error = exc  # type: ignore[union-attr]  # parse is set with the parser
                            text = thought = None
                            other = True
                        else:
                            if delta is None:
                                continue
                            text, thought = delta.content, delta.reasoning
                            other = bool(delta.tool_calls) or (text is not None and thought is not None)
                    if not other:
                        if thought is None:
                            if not text:
                                continue
                            if state.current_state is content:
                                state.accumulated_text += text
                                item: Any = {"type": TEXT_DELTA, "output_index": state.output_index, "delta": text}
                                number(item)
                                taken += 1
                                yield item
                                continue
                        elif state.current_state is reasoning:
                            state.accumulated_text += thought
                            taken += 1
                            yield {
                                "content_index": state.content_index,
                                "delta": thought,
                                "item_id": state.current_item_id,
                                "output_index": state.output_index,
                                "sequence_number": number(_Numbered()).sequence_number,
                                "type": REASONING_DELTA,
                            }
                            continue
                    if delta is not None:
                        parser.pending = delta  # type: ignore[union-attr]  # a delta comes from the parser
            feed.output = ctx
            for event in await pump.yielded():
                yield event
            if state is None:
                state = _processor_state(pump.generator)
                if state is not None:
                    kind = type(state.current_state)
                    content, reasoning = kind.CONTENT, kind.REASONING
        for event in await pump.yielded():
            yield event
    finally:
        if report is not None:
            report(taken)
        try:
            await pump.close(feed)
        finally:
            aclose = getattr(contexts, "aclose", None)
            if aclose is not None:
                await aclose()


def _processor_state(events: AsyncGenerator[Any, None]) -> Any:
    """The ``SimpleStreamingState`` of the ``processor`` vLLM's processor generator ``events`` made, or ``None``
    when its frame has no such local (the generator ended, or the line names it otherwise)."""
    frame = events.ag_frame  # type: ignore[attr-defined]  # vLLM's is a native async generator: it has a frame
    processor = None if frame is None else frame.f_locals.get("processor")
    state = getattr(processor, "state", None)
    return state if hasattr(state, "accumulated_text") else None

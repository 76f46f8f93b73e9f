"""The lanes' start-up self-check (:mod:`vllm_nnrp_plugin.vllm_binding.self_check`): the lane is kept only when its
events equal vLLM's own path on the same outputs and it took outputs itself; a changed vLLM (a renamed parser
keyword, a processor attribute the lane reads, chunk rules the lane does not know, a feed that leaks out of vLLM's
frame) switches it off with a reason instead of failing a stream.

vLLM's serving objects are the stand-ins of tests/unit/test_engine_lane_parser.py (chat, 0.26–0.32's calling shape,
replaying recorded deltas) and tests/unit/test_responses_lane.py (Responses, 0.26's processor and state rules); on
the real installed vLLM the check runs at every start-up (tests/e2e/test_engine_lane_e2e.py and
tests/e2e/test_responses_lane_e2e.py read its start-up log line)."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.test_chunk_shapes import profile
from tests.unit.test_engine_lane_parser import CASES, ParserServing, script_of, string_items
from tests.unit.test_engine_lane_parser import tool_request as chat_request
from tests.unit.test_responses_lane import RECORDINGS, ScriptedParser, Serving, request
from tests.unit.test_responses_lane import script_of as responses_script
from vllm_nnrp_plugin.vllm_binding import self_check
from vllm_nnrp_plugin.vllm_binding.engine_lane import lane_serving
from vllm_nnrp_plugin.vllm_binding.responses import _event_dicts
from vllm_nnrp_plugin.vllm_binding.responses_lane import responses_lane_serving
from vllm_nnrp_plugin.vllm_binding.self_check import Case, canonical, lane_difference

CHAT = [Case(f"{anchor}/{case}", {}, "") for anchor, case in CASES]


class _Reporter:
    """The engine client the lane's view is given: it only counts what the lane reports (``report_lane``)."""

    def __init__(self):
        self.taken = 0

    def report_lane(self, taken):
        self.taken += taken


def chat_runner(make_serving):
    """A self-check runner over the chat stand-in ``make_serving(outputs, deltas)`` for the cases of :data:`CHAT`."""

    async def run(case, lane):
        anchor, name = case.name.split("/")
        serving = make_serving(*script_of(anchor, name))
        reporter = _Reporter()
        if lane:
            stream = await lane_serving(serving)(None, reporter).create_chat_completion(chat_request())
            items = [item async for item in stream.items()]
        else:
            items = await string_items(serving, chat_request())
        events, body = profile(items)
        return [*events, body], reporter.taken

    return run


def responses_runner(make_serving):
    """A self-check runner over the Responses stand-in ``make_serving(texts, parser)`` for recorded streams."""

    async def run(case, lane):
        texts, deltas = responses_script(case.name)
        serving = make_serving(texts, ScriptedParser(deltas))
        reporter = _Reporter()
        target = responses_lane_serving(serving)(None, reporter) if lane else serving
        events = [event async for event in _event_dicts(target.responses_stream_generator(request()))]
        return events, reporter.taken

    return run


RESPONSES = [Case(path, {}, "") for path in RECORDINGS]


def test_the_chat_lane_passes_on_vllms_behaviour():
    assert asyncio.run(lane_difference(chat_runner(ParserServing), CHAT)) is None


def test_a_changed_parser_signature_switches_the_chat_lane_off_with_the_difference():
    """vLLM makes ``parse_delta``'s arguments keyword-only (its own generator passes them by name, so HTTP still
    works): the lane's call raises inside vLLM's generator, which ends the lane's stream with an error where vLLM's
    own stream completes; the reason names the error."""

    class KeywordOnly(ParserServing):
        def __init__(self, outputs, deltas):
            super().__init__(outputs, deltas)
            replay = self.parser_cls

            class KeywordOnlyParser(replay):
                def parse_delta(self, *, delta_text, delta_token_ids, request, prompt_token_ids=None, finished):
                    return replay.parse_delta(
                        self, delta_text, delta_token_ids, request, prompt_token_ids, finished=finished
                    )

            self.parser_cls = KeywordOnlyParser

    reason = asyncio.run(lane_difference(chat_runner(KeywordOnly), CHAT[:1]))
    assert reason is not None and reason.startswith(CHAT[0].name + ": the lane raised ProfileError"), reason
    assert "parse_delta() takes 1 positional argument" in reason


def test_chunk_rules_the_lane_does_not_know_switch_the_chat_lane_off():
    """vLLM starts to drop tool calls from middle chunks (as 0.34 does where a request does not keep them): the
    lane, which builds those chunks itself, would differ."""

    class Dropping(ParserServing):
        @staticmethod
        def _dumped(res, delta, tools_streamed, request):
            if delta is not None and delta.tool_calls:
                delta = delta.model_copy(update={"tool_calls": []})
            return ParserServing._dumped(res, delta, tools_streamed, request)

        def __init__(self, outputs, deltas):
            super().__init__(outputs, deltas)
            for output in outputs:
                output.strings = None  # every chunk built by the rule above, not replayed

    cases = [case for case in CHAT if "tool-required" in case.name][:1]
    reason = asyncio.run(lane_difference(chat_runner(Dropping), cases))
    assert reason is not None and "event" in reason, reason


def test_a_generator_that_does_not_drive_parser_cls_leaves_the_lane_nothing_and_off():
    """vLLM's generator makes its parser some other way than through ``self.parser_cls``: the lane never gets the
    parser object, hands every output to vLLM's generator (the events stay vLLM's) and is switched off."""

    class OwnParser(ParserServing):
        async def chat_completion_stream_generator(self, request, result_generator, *args):
            own = object.__new__(ParserServing)
            own.__dict__ = self.__dict__  # the serving object's own parser_cls, not the one the view records
            async for string in ParserServing.chat_completion_stream_generator(own, request, result_generator, *args):
                yield string

    reason = asyncio.run(lane_difference(chat_runner(OwnParser), CHAT[:2]))
    assert reason == "the lane took no engine output itself (it hands every one to vLLM's own code on this vLLM)"


def test_the_responses_lane_passes_on_vllms_behaviour():
    assert asyncio.run(lane_difference(responses_runner(Serving), RESPONSES)) is None


def test_a_processor_moved_out_of_reach_switches_the_responses_lane_off():
    """vLLM moves its ``SimpleStreamingEventProcessor`` into a helper generator: the lane cannot read the state it
    would change, takes no output (every stream stays vLLM's), and is switched off."""

    class Moved(Serving):
        async def _process_simple_streaming_events(self, *args):
            async for event in Serving._process_simple_streaming_events(self, *args):
                yield event

    assert (
        asyncio.run(lane_difference(responses_runner(Moved), RESPONSES[:2]))
        == "the lane took no engine output itself (it hands every one to vLLM's own code on this vLLM)"
    )


def test_a_lane_that_hangs_or_raises_is_a_failed_check_not_a_failed_start():
    async def hangs(case, lane):
        if lane:
            await asyncio.Event().wait()
        return [], 0

    async def raises(case, lane):
        if lane:
            raise KeyError("processor")
        return [{"type": "x"}], 0

    cases = [Case("chat text", {}, "")]
    assert (
        asyncio.run(lane_difference(hangs, cases, timeout_s=0.05)) == "chat text: the lane did not finish within 0.05 s"
    )
    assert asyncio.run(lane_difference(raises, cases)) == "chat text: the lane raised KeyError: 'processor'"


def test_a_case_vllm_itself_cannot_run_is_skipped_and_all_skipped_is_a_failure():
    async def vllm_fails(case, lane):
        if not lane:
            raise ValueError("not served")
        return [], 1

    assert (
        asyncio.run(lane_difference(vllm_fails, [Case("a", {}, "")]))
        == "vLLM's own path ran none of the self-check's requests"
    )


def test_ids_and_timestamps_are_canonical_and_everything_else_compared():
    one = [
        {"id": "chatcmpl-1", "created": 5, "choices": [{"delta": {"tool_calls": [{"id": "call-a"}]}}]},
        {"id": "chatcmpl-1", "item_id": "call-a"},
    ]
    two = [
        {"id": "chatcmpl-9", "created": 7, "choices": [{"delta": {"tool_calls": [{"id": "call-b"}]}}]},
        {"id": "chatcmpl-9", "item_id": "call-b"},
    ]
    assert canonical(one) == canonical(two)
    three = [two[0], {"id": "chatcmpl-9", "item_id": "chatcmpl-9"}]  # a different id structure
    assert canonical(one) != canonical(three)
    assert self_check.first_difference([1, 2], [1, 3]) == "event 1 is 3 on the lane, 2 on vLLM's path"
    assert self_check.first_difference([1, 2], [1]) == "1 events on the lane, 2 on vLLM's path"


def test_the_cases_cover_text_tools_and_reasoning():
    names = [case.name for case in self_check.chat_cases("m", tool_parser=True)]
    assert names == ["chat text", "chat tool-call", "chat reasoning", "chat tool_choice auto", "chat tool_choice none"]
    assert [c.name for c in self_check.responses_cases("m", tool_parser=False)] == [
        "Responses text",
        "Responses tool-call",
        "Responses reasoning",
    ]


class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_pieces_are_one_output_per_token():
    assert self_check.pieces_of("Hi!", _Tokenizer()) == [("H", [72]), ("i", [105]), ("!", [33])]


@pytest.mark.parametrize("where", ["renderer", "get_tokenizer", "engine"])
def test_the_tokenizer_is_found_where_each_line_keeps_it(where):
    tokenizer = _Tokenizer()

    class Renderer:
        def get_tokenizer(self):
            return tokenizer

    class Engine:
        async def get_tokenizer(self):
            return tokenizer

    class Serving:
        pass

    serving = Serving()
    if where == "renderer":
        serving.renderer = type("R", (), {"tokenizer": tokenizer})()
    elif where == "get_tokenizer":
        serving.renderer = Renderer()
    else:
        serving.engine_client = Engine()
    assert asyncio.run(self_check.tokenizer_of(serving)) is tokenizer
    with pytest.raises(LookupError):
        asyncio.run(self_check.tokenizer_of(Serving()))

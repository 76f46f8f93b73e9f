"""The line bindings (:mod:`vllm_nnrp_plugin.vllm_binding.lines`): one module per binding, every anchor tested in an
environment of its own, and what a binding declares about its lanes is what the lane checks answer."""

from __future__ import annotations

import pathlib
import types

import pytest

from vllm_nnrp_plugin.vllm_binding import families
from vllm_nnrp_plugin.vllm_binding.lines import BINDINGS, v0_18, v0_22, v0_26, v0_34

COMPAT = pathlib.Path(__file__).resolve().parents[2] / "compat"


def test_every_line_has_one_binding_and_every_anchor_an_environment():
    lines = [family for binding in BINDINGS for family in binding.families]
    assert lines == sorted(lines) and len(lines) == len(set(lines))
    for binding in BINDINGS:
        for anchor in binding.anchors:
            assert (COMPAT / f"vllm-{anchor}" / "env.sh").is_file(), anchor
    assert families.binding_for((0, 33)) is families.binding_for((0, 34)) is v0_34.BINDING


class _Parser:
    def parse_delta(self, delta_text, delta_token_ids, request, prompt_token_ids=None, *, finished):
        return None


def test_the_chat_lane_takes_a_lines_parser_only_where_its_binding_allows_it():
    serving = types.SimpleNamespace(parser_cls=_Parser)
    assert families.stream_parser_off(serving, v0_26.BINDING) is None
    assert families.stream_parser_off(serving, v0_34.BINDING) is None
    assert families.stream_parser_off(serving, v0_22.BINDING) == v0_22.BINDING.chat_parser_lane_off
    assert "previous_texts" in families.stream_parser_off(serving, v0_18.BINDING)


class _Responses:
    parser = None

    async def _process_simple_streaming_events(
        self,
        request,
        sampling_params,
        result_generator,
        context,
        model_name,
        tokenizer,
        request_metadata,
        created_time,
        _increment_sequence_number_and_return,
    ):
        yield None


@pytest.mark.parametrize("binding", BINDINGS, ids=lambda b: b.name)
def test_the_responses_lane_takes_a_line_only_where_its_binding_allows_it(binding):
    plain, with_parser = _Responses(), _Responses()
    with_parser.parser = object()
    assert families.responses_lane_off(plain, binding) == binding.responses_lane_off
    expected = binding.responses_lane_off or binding.responses_parser_lane_off
    assert families.responses_lane_off(with_parser, binding) == expected
    assert (binding is v0_18.BINDING) == (binding.responses_lane_off is not None)
    assert (binding is v0_22.BINDING) == (binding.responses_parser_lane_off is not None)


def test_a_harmony_model_or_another_processor_shape_keeps_vllms_path():
    harmony = _Responses()
    harmony.use_harmony = True
    assert families.responses_lane_off(harmony, v0_34.BINDING) == "the model uses the harmony format"

    class Other:
        parser = None

        async def _process_simple_streaming_events(self, request, result_generator):
            yield None

    assert "parameters are" in families.responses_lane_off(Other(), v0_34.BINDING)

"""``vllm-nnrp``'s envelopes and printing, on plain data (the loopback tests run the command against a server:
``tests/test_cli_loopback.py``)."""

import base64
import json
import struct

import pytest

from tests.support import recorded_json
from vllm_nnrp_plugin.client import ClientEvent, cli
from vllm_nnrp_plugin.profile import events as ev


def envelope_for(*argv):
    args = cli.build_parser().parse_args(argv)
    return cli.COMMANDS[args.command](args)[0]


def test_chat_and_respond_envelopes_carry_only_what_was_given():
    assert envelope_for("chat", "hi") == {
        "schema_version": "openai-compatible/1",
        "operation": "chat.completions.create",
        "body": {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    }
    body = envelope_for("chat", "--no-stream", "--model", "m", "--max-tokens", "5", "--temperature", "0", "hi")["body"]
    assert body == {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "model": "m",
        "max_tokens": 5,
        "temperature": 0.0,
    }
    respond = envelope_for("respond", "Say hello.")
    assert respond["operation"] == "responses.create" and respond["body"] == {"input": "Say hello.", "stream": True}
    body = envelope_for(
        "respond", "--no-stream", "--model", "m", "--instructions", "Be brief.", "--max-output-tokens", "16", "x"
    )["body"]
    assert body == {"input": "x", "stream": False, "model": "m", "instructions": "Be brief.", "max_output_tokens": 16}


def test_models_and_embed_envelopes():
    assert envelope_for("models") == {"schema_version": "openai-compatible/1", "operation": "models.list", "body": {}}
    embed = envelope_for("embed", "a", "b c")
    assert embed["operation"] == "embeddings.create" and embed["body"] == {"input": ["a", "b c"]}
    body = envelope_for("embed", "--model", "m", "--encoding-format", "base64", "--dimensions", "8", "a")["body"]
    assert body == {"input": ["a"], "model": "m", "encoding_format": "base64", "dimensions": 8}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["embed", "--encoding-format", "int8", "a"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["embed"])  # at least one TEXT


def partial(event):
    return ClientEvent("partial_result", event)


def completed(body):
    return ClientEvent("result_push", ev.completed(body), status=0)


def show_all(printer, events):
    statuses = [printer.show(event) for event in events]
    assert statuses[:-1] == [None] * (len(statuses) - 1)
    return statuses[-1]


RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "model": "example-model",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Hello", "annotations": []},
                {"type": "output_text", "text": " there.", "annotations": []},
            ],
        },
        {
            "type": "function_call",
            "id": "fc_2",
            "call_id": "call_2",
            "name": "lookup",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
    ],
    "usage": {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 19,
    },
}


def test_a_streamed_response_prints_text_tool_calls_and_usage_once(capsys):
    # vLLM makes the completed Response's call ids anew: the calls the events showed are not printed again
    events = [
        partial(ev.output_text_delta(0, "Hello")),
        partial(ev.output_text_delta(0, " there.")),
        partial(ev.tool_call_started(1, "fc_1", "call_1", "lookup")),
        partial(ev.tool_call_delta(1, "fc_1", "call_1", '{"city": ')),
        partial(ev.tool_call_delta(1, "fc_1", "call_1", '"Paris"}')),
        partial(ev.tool_call_completed(1, "fc_1", "call_1", "lookup", '{"city": "Paris"}')),
        partial(ev.usage({"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19})),
        completed(RESPONSE),
    ]
    assert show_all(cli.AnswerPrinter(as_json=False), events) == 0
    assert capsys.readouterr().out == (
        'Hello there.\n[tool call call_1] lookup({"city": "Paris"})\n[usage] input 12 · output 7 · total 19 tokens\n'
    )


def test_a_non_streamed_response_prints_the_bodys_text_calls_and_usage(capsys):
    assert show_all(cli.AnswerPrinter(as_json=False), [completed(RESPONSE)]) == 0
    assert capsys.readouterr().out == (
        'Hello there.\n[tool call call_2] lookup({"city": "Paris"})\n[usage] input 12 · output 7 · total 19 tokens\n'
    )


def test_a_non_streamed_chat_completion_prints_its_message_and_tool_calls(capsys):
    text = recorded_json("c-nonstream-text")
    assert show_all(cli.AnswerPrinter(as_json=False), [completed(text)]) == 0
    usage = text["usage"]
    assert capsys.readouterr().out == (
        f"{text['choices'][0]['message']['content']}\n[usage] input {usage['prompt_tokens']} · "
        f"output {usage['completion_tokens']} · total {usage['total_tokens']} tokens\n"
    )
    tool = recorded_json("f-nonstream-tool-required")
    (call,) = tool["choices"][0]["message"]["tool_calls"]
    assert show_all(cli.AnswerPrinter(as_json=False), [completed(tool)]) == 0
    assert (
        f"[tool call {call['id']}] {call['function']['name']}({call['function']['arguments']})"
        in capsys.readouterr().out
    )


def test_errors_drops_and_failed_tool_calls_go_to_stderr(capsys):
    from vllm_nnrp_plugin.profile import errors as E

    err = E.ProfileError(E.UNSUPPORTED_OPERATION, "operation 'responses.create' is not served")
    assert cli.AnswerPrinter(as_json=False).show(ClientEvent("result_push", ev.error(err), status=1)) == 1
    assert "vllm-nnrp: error unsupported_operation: operation 'responses.create'" in capsys.readouterr().err
    printer = cli.AnswerPrinter(as_json=False)
    assert printer.show(partial(ev.tool_call_error(0, "fc_1", "call_1", E.backend_error("engine died")))) is None
    assert "tool call call_1 failed: backend_error" in capsys.readouterr().err
    assert printer.show(ClientEvent("result_drop", ev.cancelled("client_cancelled"), drop_reason=1)) == 2
    assert "NNRP drop reason 1" in capsys.readouterr().err


def test_json_prints_every_event_as_one_line(capsys):
    events = [partial(ev.output_text_delta(0, "Hi")), completed(RESPONSE)]
    assert show_all(cli.AnswerPrinter(as_json=True), events) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [event.event for event in events]


MODELS = {
    "object": "list",
    "data": [
        {
            "id": "example-model",
            "object": "model",
            "created": 1796123190,
            "owned_by": "vllm",
            "root": "/m",
            "parent": None,
            "max_model_len": 2048,
            "permission": [],
        },
        {
            "id": "lora-a",
            "object": "model",
            "created": 1796123190,
            "owned_by": "vllm",
            "root": "/a",
            "parent": "example-model",
        },
    ],
}


def test_models_prints_one_line_per_model_or_the_raw_body(capsys):
    assert cli.BodyPrinter(cli.render_models, as_json=False).show(completed(MODELS)) == 0
    assert capsys.readouterr().out == "example-model  max_model_len 2048\nlora-a         max_model_len -\n"
    assert cli.BodyPrinter(cli.render_models, as_json=True).show(completed(MODELS)) == 0
    assert json.loads(capsys.readouterr().out) == MODELS


VECTOR = [0.5, -0.25, 0.125, 1.0, -2.0, 0.0]


def embeddings(encode):
    return {
        "object": "list",
        "id": "embd-1",
        "model": "example-model",
        "created": 1796123190,
        "data": [
            {"object": "embedding", "index": 0, "embedding": encode(VECTOR)},
            {"object": "embedding", "index": 1, "embedding": encode(VECTOR[:3])},
        ],
        "usage": {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0, "prompt_tokens_details": None},
    }


def as_base64(values):
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


@pytest.mark.parametrize("encode", [list, as_base64], ids=["float", "base64"])
def test_embed_prints_index_dimensions_and_first_values_then_usage(capsys, encode):
    assert cli.BodyPrinter(cli.render_embeddings, as_json=False).show(completed(embeddings(encode))) == 0
    assert capsys.readouterr().out == (
        "[0] 6 dimensions: 0.5000, -0.2500, 0.1250, 1.0000, …\n"
        "[1] 3 dimensions: 0.5000, -0.2500, 0.1250\n"
        "[usage] input 5 · total 5 tokens\n"
    )


def test_an_undecodable_base64_embedding_is_said_not_raised():
    assert cli.embedding_values(as_base64(VECTOR)) == VECTOR
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": base64.b64encode(b"12345").decode()}],
    }
    assert (
        cli.render_embeddings(body)
        == "[0] undecodable embedding: a base64 embedding of 5 bytes is not float32 values\n"
    )
    with pytest.raises(ValueError):
        cli.embedding_values("not base64!")

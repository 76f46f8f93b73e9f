"""Responses event -> profile event mapping on streams recorded from real vLLM's ``/v1/responses``
(compat/fixtures/vllm/<version>/responses-*), and the adapter serving ``responses.create`` with it."""

from __future__ import annotations

import asyncio
import functools
import json

import orjson
import pytest

from tests.support import FIXTURES, error_response
from vllm_nnrp_plugin.core.adapter import STREAM_MAPPERS, AdapterLimits, Call, run_operation
from vllm_nnrp_plugin.core.controls import RuntimeControls
from vllm_nnrp_plugin.observability.observation import Observation
from vllm_nnrp_plugin.profile import RESPONSES_CREATE
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.profile.capabilities import chat_operation, operation, runtime_document
from vllm_nnrp_plugin.profile.responses_stream import ResponsesStreamMapper
from vllm_nnrp_plugin.vllm_binding.families import family_of, responses_stream_fails
from vllm_nnrp_plugin.vllm_binding.serving import error_from_response

VERSIONS = sorted(p.parent.name for p in FIXTURES.parent.glob("*/responses-a-stream-text.sse"))


def recorded_events(case: str, version: str = "0.26.0") -> list[dict]:
    """The ``data:`` objects of a recorded ``/v1/responses`` SSE stream (``event: <type>\\ndata: <json>``)."""
    text = (FIXTURES.parent / version / f"{case}.sse").read_text()
    return [orjson.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


def recorded(case: str, version: str = "0.26.0") -> dict:
    return orjson.loads((FIXTURES.parent / version / f"{case}.json").read_bytes())


def run(items: list[dict]) -> tuple[list[dict], dict]:
    mapper = ResponsesStreamMapper()
    events = [event for item in items for event in mapper.feed(item)]
    events += mapper.finish()
    return events, mapper.completed_body()


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def profile_usage(response: dict) -> dict:
    usage = response["usage"]
    return {
        "input_tokens": usage["input_tokens"],
        "output_tokens": usage["output_tokens"],
        "total_tokens": usage["total_tokens"],
    }


@pytest.mark.parametrize("version", VERSIONS)
def test_text_stream_is_ordered_deltas_then_usage_and_the_final_response(version):
    events, body = run(recorded_events("responses-a-stream-text", version))
    *deltas, usage = events
    assert deltas and all(e["type"] == "response.output_text.delta" and e["index"] == 0 and e["delta"] for e in deltas)
    text = "".join(e["delta"] for e in deltas)
    reference = recorded("responses-c-nonstream-text", version)  # the same greedy request, stream: false
    assert text == output_text(body) == output_text(reference)
    assert usage == {"type": "response.usage", "usage": profile_usage(reference)}
    assert body["object"] == "response" and body["status"] == reference["status"]
    assert body["id"].startswith("resp_") and body["usage"] == reference["usage"]


@pytest.mark.parametrize("version", VERSIONS)
def test_length_cut_stream_completes_with_the_incomplete_response(version):
    events, body = run(recorded_events("responses-k-stream-length", version))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == output_text(body)
    assert events[-1]["usage"]["output_tokens"] == 5


def test_from_0_34_a_cut_stream_ends_with_response_incomplete_and_completes_with_that_response():
    """vLLM 0.33+ ends a Response cut by ``max_output_tokens`` with ``response.incomplete`` (recorded on 0.34.0 with
    the olmo3 reasoning parser, where the whole answer is reasoning): the operation completes with that Response,
    as it does with 0.32's ``response.completed`` of status ``incomplete``."""
    items = recorded_events("responses-r-stream-reasoning-cut", "0.34.0")
    assert items[-1]["type"] == "response.incomplete"
    events, body = run(items)
    assert body == items[-1]["response"] and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    *reasoning, usage = events
    assert reasoning and all(e["type"] == "response.output_text.delta" and "openai_chunk" in e for e in reasoning)
    assert usage == {"type": "response.usage", "usage": profile_usage(body)} and usage["usage"]["output_tokens"] == 32


@pytest.mark.parametrize("version", VERSIONS)
def test_function_call_stream_is_started_deltas_completed_with_vllms_ids(version):
    items = recorded_events("responses-d-stream-tool-required", version)
    events, body = run(items)
    added = next(i["item"] for i in items if i["type"] == "response.output_item.added")
    ids, arguments, usage = one_lookup_call(events)
    assert ids == {"index": 0, "item_id": added["id"], "call_id": added["call_id"]}
    assert json.loads(arguments) == {"city": "Paris"}
    assert usage["type"] == "response.usage"
    (call,) = body["output"]  # vLLM's final Response: on 0.32 the streamed ids, before it new ones
    assert ((call["id"], call["call_id"]) == (ids["item_id"], ids["call_id"])) is (version >= "0.32")
    assert (
        call["type"] == "function_call"
        and call["name"] == "lookup"
        and json.loads(call["arguments"]) == json.loads(arguments)
    )
    reference = recorded("responses-f-nonstream-tool-required", version)
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in reference["output"]] == [
        ("function_call", "lookup", {"city": "Paris"})
    ]


def one_lookup_call(events: list[dict]) -> tuple[dict, str, dict]:
    """(ids, arguments, the event after) of a stream that is exactly one ``lookup`` call in the profile's order
    (started, deltas of the same ids, completed with their concatenation) and one more event."""
    started, *deltas, completed, after = events
    ids = {"index": started["index"], "item_id": started["item_id"], "call_id": started["call_id"]}
    assert started == {"type": "response.tool_call.started", **ids, "name": "lookup"}
    assert deltas and all(e["type"] == "response.tool_call.delta" and e.items() >= ids.items() for e in deltas)
    arguments = "".join(e["arguments_delta"] for e in deltas)
    assert completed == {"type": "response.tool_call.completed", **ids, "name": "lookup", "arguments": arguments}
    return ids, arguments, after


def _with_done_arguments(items: list[dict], arguments: str, status: str) -> list[dict]:
    """The recorded function-call stream, with the call ending on ``arguments`` and the Response ``status``."""
    out = []
    for item in json.loads(json.dumps(items)):
        if item["type"] == "response.output_item.done":
            item["item"]["arguments"] = arguments
        if item["type"] == "response.completed":
            item["response"]["status"] = status
        out.append(item)
    return out


@pytest.mark.parametrize("status, code", [("incomplete", "tool_call_incomplete"), ("completed", "tool_call_invalid")])
def test_arguments_that_are_not_json_end_the_call_with_an_error(status, code):
    items = _with_done_arguments(recorded_events("responses-d-stream-tool-required"), '{"city": "Par', status)
    events, _ = run(items)
    terminals = [e for e in events if e["type"] in ("response.tool_call.completed", "response.tool_call.error")]
    assert [(e["type"], e["error"]["code"]) for e in terminals] == [("response.tool_call.error", code)]
    assert events[-1]["type"] == "response.usage"  # the call ended before usage, as the call's own order requires


@pytest.mark.parametrize("cut", range(0, 14))
def test_a_stream_failing_anywhere_ends_every_started_call_exactly_once(cut):
    items = recorded_events("responses-d-stream-tool-required")[:cut]
    mapper = ResponsesStreamMapper()
    events = [e for item in items for e in mapper.feed(item)]
    with pytest.raises(E.ProfileError) as failed:
        mapper.feed({"type": "error", "code": 500, "message": "engine died", "param": None, "sequence_number": cut})
    assert failed.value.code == "backend_error" and failed.value.message == "engine died"
    events += mapper.fail_open_calls(failed.value)
    per_call: dict[str, list[str]] = {}
    for e in events:
        per_call.setdefault(e["call_id"], []).append(e["type"].rsplit(".", 1)[1])
    for kinds in per_call.values():
        assert kinds[0] == "started" and kinds.count("started") == 1
        assert kinds[-1] in ("completed", "error") and kinds.count("completed") + kinds.count("error") == 1
    assert mapper.fail_open_calls(failed.value) == []


def test_vllms_generic_streaming_error_body_is_a_backend_error():
    mapper = ResponsesStreamMapper()
    with pytest.raises(E.ProfileError) as failed:
        mapper.feed({"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}})
    assert (failed.value.code, failed.value.message) == ("backend_error", "Internal server error")


def test_a_stream_ending_without_response_completed_is_a_backend_error():
    mapper = ResponsesStreamMapper()
    for item in recorded_events("responses-a-stream-text")[:-1]:
        mapper.feed(item)
    with pytest.raises(E.ProfileError) as failed:
        mapper.finish()
    assert failed.value.code == "backend_error"


@pytest.mark.parametrize(
    "case, code",
    [
        ("responses-g-unknown-model-nonstream", "model_not_found"),
        ("responses-i-no-input-nonstream", "invalid_request"),
        ("responses-j-bad-type-nonstream", "invalid_request"),
    ],
)
def test_vllms_recorded_error_bodies_map_to_typed_errors(case, code):
    assert error_from_response(error_response(case)).code == code


def recorded_request(case: str, version: str) -> dict:
    return orjson.loads((FIXTURES.parent / version / f"{case}.request.json").read_bytes())


@pytest.mark.parametrize(
    "version", sorted(p.parent.name for p in FIXTURES.parent.glob("*/responses-d-stream-tool-required.sse"))
)
def test_a_streamed_required_call_is_refused_exactly_on_the_lines_whose_recorded_stream_is_empty(version):
    """0.18.1's /v1/responses answers the streamed required call with 200 and not one event (recorded), so the
    binding refuses it there; every other line streams it, and it passes there."""
    events = recorded_events("responses-d-stream-tool-required", version)
    request = recorded_request("responses-d-stream-tool-required", version)
    assert responses_stream_fails(family_of(version), request, tool_parser=True) is (events == [])
    assert (events == []) is (version < "0.22")


def test_on_0_18_the_refused_stream_is_one_a_non_streaming_call_answers():
    """What the refusal tells the client to do works there: the same request with stream: false is answered with
    the call (recorded on 0.18.1), and the rule lets it through, as it does a stream with tool_choice auto. Let
    through, the recorded stream would end in a backend_error with no event at all."""
    streamed = recorded_request("responses-d-stream-tool-required", "0.18.1")
    plain = recorded_request("responses-f-nonstream-tool-required", "0.18.1")
    assert {**streamed, "stream": False} == plain
    with pytest.raises(E.ProfileError) as failed:
        run(recorded_events("responses-d-stream-tool-required", "0.18.1"))
    assert failed.value.code == "backend_error"
    assert not responses_stream_fails((0, 18), plain, tool_parser=True)
    reference = recorded("responses-f-nonstream-tool-required", "0.18.1")
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in reference["output"]] == [
        ("function_call", "lookup", {"city": "Paris"})
    ]
    assert not responses_stream_fails(
        (0, 18), recorded_request("responses-l-stream-tool-parameterless", "0.18.1"), tool_parser=True
    )


@pytest.mark.parametrize(
    "change, fails",
    [
        ({}, True),
        ({"tool_choice": {"type": "function", "name": "lookup"}}, True),
        ({"tool_choice": "auto"}, False),
        ({"tool_choice": "none"}, False),
        ({"tools": []}, False),
        ({"tool_choice": "auto", "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}}, True),
        ({"tool_choice": "auto", "text": {"format": {"type": "text"}}}, False),
    ],
)
def test_on_0_18_a_stream_fails_when_its_text_format_is_a_json_schema(change, fails):
    body = {**recorded_request("responses-d-stream-tool-required", "0.18.1"), **change}
    assert responses_stream_fails((0, 18), body, tool_parser=True) is fails
    forced = "text" not in change  # the schema vLLM's tool parser sets: none without a parser
    assert responses_stream_fails((0, 18), body, tool_parser=False) is (fails and not forced)
    assert not responses_stream_fails((0, 22), body, tool_parser=True)


# -- the adapter serving responses.create with the registered mapper ---------------------------------------


class ListSink:
    def __init__(self) -> None:
        self.observation = Observation(
            connection_id=1,
            session_id=1,
            operation_id=1,
            frame_id=1,
            transport="tcp",
            submitted_ns=0,
            submitted_unix_ns=0,
        )
        self.events: list[dict] = []

    def partial(self, event):
        self.events.append(event)

    def complete(self, body):
        self.events.append({"type": "response.completed", "body": body})

    def fail(self, err):
        self.events.append({"type": "response.error", "error": {"code": err.code}})

    @functools.cached_property
    def controls(self):
        return RuntimeControls()

    def limit_time(self, timeout_ms):
        pass

    def abort_with(self, abort):
        pass

    def dispatch(self):
        return None

    def expired(self):
        return False


class RecordedResponses:
    """A backend serving ``responses.create`` from recorded vLLM events (``items``) or a body."""

    def __init__(self, items=None, body=None) -> None:
        self.items, self.body, self.aborted = items, body, []

    async def create(self, op, body, request_id, traceparent=None, controls=None):
        if self.body is not None:
            return Call(body=self.body)

        async def stream():
            for item in self.items:
                await asyncio.sleep(0)
                yield item

        return Call(stream=stream())

    def engine_request_id(self, op, request_id):
        return f"resp_{request_id}_0"

    async def abort(self, op, request_id):
        self.aborted.append(request_id)


DOCUMENT = runtime_document(
    models=["example-model"],
    owned_by="recorded",
    operations=[
        chat_operation(tool_calls=True),
        operation(RESPONSES_CREATE, streaming=True, non_streaming=True, tool_calls=True),
    ],
)


def serve(backend, body) -> ListSink:
    sink = ListSink()
    payload = orjson.dumps({"schema_version": "openai-compatible/1", "operation": RESPONSES_CREATE, "body": body})
    asyncio.run(run_operation(sink, payload, backend, AdapterLimits(1 << 20), DOCUMENT))
    return sink


def test_the_adapter_streams_a_response_through_the_registered_mapper():
    assert isinstance(STREAM_MAPPERS[RESPONSES_CREATE]({}), ResponsesStreamMapper)
    items = recorded_events("responses-d-stream-tool-required")
    backend = RecordedResponses(items)
    sink = serve(backend, {"model": "example-model", "input": "x", "stream": True})
    kinds = [e["type"] for e in sink.events]
    assert kinds[0] == "response.tool_call.started" and kinds[-3:] == [
        "response.tool_call.completed",
        "response.usage",
        "response.completed",
    ]
    assert sink.events[-1]["body"] == items[-1]["response"]
    assert sink.observation.request_id.startswith("resp_nnrp-") and sink.observation.request_id.endswith("_0")
    assert (sink.observation.input_tokens, sink.observation.output_tokens) == (241, 36)
    assert backend.aborted == []


def test_the_adapter_aborts_a_response_whose_stream_failed():
    items = recorded_events("responses-d-stream-tool-required")[:5] + [{"type": "error", "code": 500, "message": "x"}]
    backend = RecordedResponses(items)
    sink = serve(backend, {"model": "example-model", "input": "x", "stream": True})
    assert [e["type"] for e in sink.events][-2:] == ["response.tool_call.error", "response.error"]
    assert len(backend.aborted) == 1


def test_the_adapter_returns_the_non_streaming_response_object():
    reference = recorded("responses-c-nonstream-text")
    sink = serve(RecordedResponses(body=reference), {"model": "example-model", "input": "x"})
    assert sink.events == [{"type": "response.completed", "body": reference}]
    assert (sink.observation.input_tokens, sink.observation.output_tokens) == (35, 32)


# -- the project's responses.create recipes (recipes/responses) -----------------------------------------------


@pytest.mark.parametrize("tool_calls", [True, False])
def test_responses_recipes_validate_and_are_planned_only_for_a_level_2_server(tool_calls):
    from vllm_nnrp_plugin.client.conformance.plan import build_plan
    from vllm_nnrp_plugin.client.conformance.suite import Suite, locate_suite
    from vllm_nnrp_plugin.profile.capabilities import conformance_manifest

    try:
        suite = Suite(locate_suite())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    recipes = suite.recipes(FIXTURES.parents[3] / "recipes" / "responses" / "manifest.json")
    assert all(r["operation"] == RESPONSES_CREATE and "api.level2" in r["required_capabilities"] for r in recipes)
    level1 = runtime_document(models=["example-model"], owned_by="vllm", operations=[chat_operation(tool_calls=True)])
    level2 = runtime_document(
        models=["example-model"],
        owned_by="vllm",
        operations=[
            chat_operation(tool_calls=tool_calls),
            operation(RESPONSES_CREATE, streaming=True, non_streaming=True, tool_calls=tool_calls),
        ],
    )
    planned = {}
    for name, document in (("level1", level1), ("level2", level2)):
        plan = build_plan(recipes, conformance_manifest(document), results_path="r.json", evidence_dir="e")
        suite.validate(plan, "execution-plan")
        planned[name] = {case["id"] for case in plan["cases"]}
    assert planned["level1"] == set()
    tool_case = "vllm-nnrp.responses.tool-call-required"
    assert planned["level2"] == {r["id"] for r in recipes} - (set() if tool_calls else {tool_case})


@pytest.mark.parametrize("version", VERSIONS)
def test_the_binding_hands_text_deltas_over_reduced_and_the_events_are_the_same(version):
    """``vllm_binding.responses._event_dicts``: a text delta event object becomes only the fields the mapper reads;
    every other event is dumped whole. The profile events and body are those of vLLM's full dicts."""
    from vllm_nnrp_plugin.vllm_binding.responses import _event_dicts

    full = recorded_events("responses-a-stream-text", version)

    class Event:  # vLLM's event object: attributes, and model_dump giving its data: dict
        def __init__(self, data):
            self.__dict__.update(data)
            self._data = data

        def model_dump(self, mode, by_alias):
            assert (mode, by_alias) == ("json", True)
            return self._data

    async def vllm_events():
        for data in full:
            yield Event(data)

    async def drain():
        return [item async for item in _event_dicts(vllm_events())]

    handed = asyncio.run(drain())
    deltas = [item for item in handed if item["type"] == "response.output_text.delta"]
    assert deltas and all(set(item) == {"type", "output_index", "delta"} for item in deltas)
    assert [item for item in handed if item not in deltas] == [
        d for d in full if d["type"] != "response.output_text.delta"
    ]
    assert run(handed) == run(full)

"""Routing an ``openai`` SDK request to a profile operation and turning its terminal into vLLM's HTTP answer
(vllm_nnrp_plugin.client.openai.calls), with plain ``httpx`` requests and profile events; the bodies are vLLM 0.26.0's
recorded ones (compat/fixtures)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.support import recorded_json
from vllm_nnrp_plugin.client import ClientEvent
from vllm_nnrp_plugin.client.openai.calls import RESUBMIT, Call
from vllm_nnrp_plugin.client.openai.responses_sse import ResponsesEventStream
from vllm_nnrp_plugin.client.openai.sse import ChatChunkStream, error_status

URL = "http://nnrp.invalid/v1"


def call(method: str, path: str, body: dict | None = None, headers: dict | None = None, **extensions) -> Call:
    request = httpx.Request(
        method,
        URL + path,
        content=orjson.dumps(body) if body is not None else b"",
        headers=headers,
        extensions=extensions,
    )
    return Call(request)


def completed(body: dict) -> ClientEvent:
    return ClientEvent("result_push", {"type": "response.completed", "body": body}, status=200)


def refused(code: str, status: int = 400) -> ClientEvent:
    return ClientEvent(
        "result_push", {"type": "response.error", "error": {"code": code, "message": "no"}}, status=status
    )


@pytest.mark.parametrize(
    "path, body, operation, stream",
    [
        (
            "/chat/completions",
            {"model": "m", "messages": [], "stream": True},
            "chat.completions.create",
            ChatChunkStream,
        ),
        ("/responses", {"model": "m", "input": "x"}, "responses.create", None),
        ("/responses", {"model": "m", "input": "x", "stream": True}, "responses.create", ResponsesEventStream),
        ("/embeddings", {"model": "m", "input": "x"}, "embeddings.create", None),
    ],
)
def test_posts_become_one_submit_of_their_operation_with_the_body_as_is(path, body, operation, stream):
    planned = call("POST", path, body, timeout={"read": 2.5})
    assert planned.plan() is None
    # the read timeout bounds the silence between events on the client, not the whole operation on the server
    assert planned.envelope == {"schema_version": "openai-compatible/1", "operation": operation, "body": body}
    assert planned.timeout_s == 2.5
    assert type(planned.stream) is stream if stream else planned.stream is None


def test_a_non_streamed_answer_is_the_completed_body_as_json():
    planned = call("POST", "/embeddings", {"model": "m", "input": ["a", "b"]})
    planned.plan()
    answer = planned.answer(completed(recorded_json("embeddings-a-float")))
    assert answer.status_code == 200 and orjson.loads(answer.content) == recorded_json("embeddings-a-float")


def test_models_list_where_served_is_vllms_list_else_the_capability_document_is_fetched():
    planned = call("GET", "/models")
    planned.plan()
    assert planned.envelope["operation"] == "models.list"
    assert orjson.loads(planned.answer(completed(recorded_json("models-a-list"))).content) == recorded_json(
        "models-a-list"
    )
    planned = call("GET", "/models")
    planned.plan()
    assert planned.answer(refused("unsupported_operation")) is RESUBMIT
    assert planned.envelope["operation"] == "nnrp.capabilities" and not planned.ended
    listed = orjson.loads(planned.answer(completed({"models": [{"id": "m", "owned_by": "vllm"}]})).content)
    assert [(m["id"], m["object"], m["owned_by"]) for m in listed["data"]] == [("m", "model", "vllm")]


def test_an_operation_the_server_does_not_serve_is_404_with_vllms_error_shape():
    planned = call("POST", "/embeddings", {"model": "m", "input": "x"})
    planned.plan()
    answer = planned.answer(refused("unsupported_operation"))
    assert answer.status_code == 404
    assert orjson.loads(answer.content) == {
        "error": {"message": "no", "type": "NotFoundError", "param": None, "code": "unsupported_operation"}
    }
    assert error_status({"error": {"code": "unsupported_operation"}}, 400) == 404


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/responses", 405),
        ("GET", "/embeddings", 405),
        ("POST", "/models", 405),
        ("POST", "/completions", 404),
        ("GET", "/responses/resp_1", 404),
    ],
)
def test_other_routes_get_fastapis_answer_without_a_submit(method, path, status):
    planned = call(method, path, {})
    assert planned.plan().status_code == status and planned.envelope is None


def test_a_bound_on_the_whole_operation_comes_from_the_header_or_the_transport():
    planned = call(
        "POST",
        "/chat/completions",
        {"model": "m", "messages": []},
        timeout={"read": 2.5},
        headers={"X-NNRP-Timeout-Ms": "1500"},
    )
    assert planned.plan() is None and planned.envelope["nnrp"] == {"timeout_ms": 1500}
    assert planned.timeout_s == 2.5
    for bad in ("soon", "0", "-5", "1.5"):
        refused = call("POST", "/chat/completions", {"model": "m"}, headers={"X-NNRP-Timeout-Ms": bad}).plan()
        assert refused.status_code == 400 and b"x-nnrp-timeout-ms" in refused.content
    request = httpx.Request("POST", URL + "/chat/completions", content=b'{"messages": []}')
    bounded = Call(request, operation_timeout_s=0.25)
    assert bounded.plan() is None and bounded.envelope["nnrp"] == {"timeout_ms": 250} and bounded.timeout_s is None

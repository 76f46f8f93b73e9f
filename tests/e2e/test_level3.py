"""Level 3 inside real ``vllm serve`` on CPU over the real NNRP client: ``models.list`` on a generate and a
pooling server, ``embeddings.create`` on a pooling server (``--convert embed``), each against vLLM's own HTTP
answer on the same server; the capability documents; operations a server does not serve; bad bodies; and the
refusal of a server whose operations make up no whole level."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest

from tests.e2e.conftest import SERVED_NAME, VLLMServer, attach_options, model_dir
from tests.e2e.test_level1 import connect
from tests.e2e.test_vllm_serve import wait_idle

pytestmark = pytest.mark.vllm

TWO_INPUTS = {"model": SERVED_NAME, "input": ["The quick brown fox", "jumps over the lazy dog"]}
TOLERANCE = 1e-3  # absolute, per component: the same engine computes both, batching may round differently


def call(client, operation, body, timeout_s=120, **nnrp):
    """The events of one ``operation`` (the last is the terminal)."""
    env = {"schema_version": "openai-compatible/1", "operation": operation, "body": body}
    if nnrp:
        env["nnrp"] = nnrp
    return [e.event for e in client.events(client.submit(env), timeout_s=timeout_s)]


def completed(client, operation, body, **nnrp):
    (terminal,) = call(client, operation, body, **nnrp)
    assert terminal["type"] == "response.completed", terminal
    return terminal


def error_code(client, operation, body):
    (terminal,) = call(client, operation, body)
    assert terminal["type"] == "response.error", terminal
    return terminal["error"]["code"]


@pytest.fixture
def pooling_client(vllm_pooling_server):
    client = connect(vllm_pooling_server.nnrp["tcp"])
    yield client
    client.close()


def vectors(body):
    """``data[i].embedding`` as lists of floats (``base64``: little-endian float32, vLLM's default)."""
    out = []
    for item in body["data"]:
        value = item["embedding"]
        if isinstance(value, str):
            raw = base64.b64decode(value)
            value = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        out.append(value)
    return out


def without_random_fields(model_list):
    """vLLM's ``ModelList`` minus what it draws anew per call (``created``, permission ids)."""
    cards = []
    for card in model_list["data"]:
        card = {k: v for k, v in card.items() if k != "created"}
        card["permission"] = [{k: v for k, v in p.items() if k not in ("id", "created")} for p in card["permission"]]
        cards.append(card)
    return {**model_list, "data": cards}


# -- the pooling server with NNRP enabled really serves NNRP -------------------------------------------------


def test_a_pooling_server_with_nnrp_enabled_has_a_listener(vllm_pooling_server, pooling_client):
    log = vllm_pooling_server.output()
    assert "Skipping endpoint plugin nnrp" not in log
    (line,) = [line for line in log.splitlines() if "NNRP listening on" in line]
    assert vllm_pooling_server.nnrp["tcp"] in line
    assert pooling_client.capabilities()["compatibility_levels"] == [3]


def test_capability_documents_list_what_each_server_serves(pooling_client, plain_client):
    pooling = pooling_client.capabilities()
    assert pooling["compatibility_levels"] == [3]
    assert pooling["operations"] == [
        {"name": "models.list", "streaming": False, "non_streaming": True, "tool_calls": False, "cancellation": False},
        {
            "name": "embeddings.create",
            "streaming": False,
            "non_streaming": True,
            "tool_calls": False,
            "cancellation": True,
            "encoding_formats": ["float", "base64"],
            "dimensions": False,
        },  # not Matryoshka
    ]
    generate = plain_client.capabilities()
    assert generate["compatibility_levels"] == [1, 2]  # models.list without embeddings is not level 3
    assert [op["name"] for op in generate["operations"]] == [
        "chat.completions.create",
        "responses.create",
        "models.list",
    ]


# -- embeddings.create ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embeddings_are_vllms_http_embeddings(vllm_pooling_server, pooling_client, encoding_format):
    body = {**TWO_INPUTS, "encoding_format": encoding_format}
    nnrp = completed(pooling_client, "embeddings.create", body)["body"]
    http = httpx.post(f"{vllm_pooling_server.http}/v1/embeddings", json=body, timeout=60).json()
    assert nnrp["object"] == http["object"] == "list" and nnrp["model"] == http["model"] == SERVED_NAME
    assert nnrp["usage"] == http["usage"] and nnrp["usage"]["prompt_tokens"] > 0
    assert [(d["index"], d["object"]) for d in nnrp["data"]] == [(0, "embedding"), (1, "embedding")]
    assert all(isinstance(d["embedding"], str if encoding_format == "base64" else list) for d in nnrp["data"])
    ours, theirs = vectors(nnrp), vectors(http)
    assert [len(v) for v in ours] == [len(v) for v in theirs] and len(ours[0]) > 100
    assert max(abs(a - b) for v, w in zip(ours, theirs, strict=True) for a, b in zip(v, w, strict=True)) < TOLERANCE
    assert ours[0] != ours[1]  # two inputs, two different vectors


def test_an_embedding_is_known_to_the_engine_by_vllms_embd_id(pooling_client):
    terminal = completed(pooling_client, "embeddings.create", TWO_INPUTS, diagnostics=True)
    diagnostics = terminal["diagnostics"]
    assert diagnostics["request_id"].startswith("embd-nnrp-")
    assert terminal["body"]["id"] == diagnostics["request_id"]  # vLLM's response id is the engine id's prefix
    assert diagnostics["usage"]["input_tokens"] == terminal["body"]["usage"]["prompt_tokens"]


def test_a_cancelled_embedding_leaves_no_vllm_request_running(vllm_pooling_server, pooling_client):
    long_input = " ".join(["the sea is wide and deep"] * 300)  # ~1800 tokens each
    op = pooling_client.submit(
        {
            "schema_version": "openai-compatible/1",
            "operation": "embeddings.create",
            "body": {"model": SERVED_NAME, "input": [long_input] * 16},
        }
    )
    pooling_client.cancel(op)
    (terminal,) = list(pooling_client.events(op, timeout_s=60))
    assert terminal.frame == "result_drop"
    assert wait_idle(vllm_pooling_server, timeout_s=60)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"model": SERVED_NAME, "input": 42}, "invalid_request"),  # vLLM's request model refuses it
        ({"model": SERVED_NAME, "input": []}, "invalid_request"),  # vLLM: "You must pass at least one prompt"
        ({**TWO_INPUTS, "dimensions": 8}, "invalid_request"),  # not a Matryoshka model
        ({**TWO_INPUTS, "encoding_format": "bytes"}, "invalid_request"),  # binary: not in a JSON body
        ({"model": "no-such-model", "input": "hello"}, "model_not_found"),
    ],
)
def test_bad_embeddings_bodies_get_typed_errors_and_the_session_keeps_serving(pooling_client, body, code):
    assert error_code(pooling_client, "embeddings.create", body) == code
    assert len(completed(pooling_client, "embeddings.create", TWO_INPUTS)["body"]["data"]) == 2


# -- models.list ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["vllm_server", "vllm_pooling_server"])
def test_models_list_is_vllms_v1_models(request, server):
    server = request.getfixturevalue(server)
    client = connect(server.nnrp["tcp"])
    try:
        nnrp = completed(client, "models.list", {})["body"]
        assert error_code(client, "models.list", {"limit": 5}) == "invalid_request"
    finally:
        client.close()
    http = httpx.get(f"{server.http}/v1/models", timeout=30).json()
    assert without_random_fields(nnrp) == without_random_fields(http)
    assert [card["id"] for card in nnrp["data"]] == [SERVED_NAME] and nnrp["data"][0]["max_model_len"] == 2048


# -- operations a server does not serve ----------------------------------------------------------------------


def test_each_server_refuses_the_operations_it_does_not_serve(pooling_client, plain_client):
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert error_code(pooling_client, "chat.completions.create", chat) == "unsupported_operation"
    assert error_code(plain_client, "embeddings.create", TWO_INPUTS) == "unsupported_operation"


# -- a server whose operations make up no whole level --------------------------------------------------------


def test_a_server_that_serves_no_whole_level_stops_at_start_up(tmp_path, vllm_version):
    """A classification server (``--convert classify``) offers only ``models.list`` of the profile: with NNRP
    enabled ``vllm serve`` exits at start-up with the plugin's message instead of running without a listener."""
    env, args = attach_options(vllm_version[1])
    server = VLLMServer(model_dir(), tmp_path, env=env, extra_args=(*args, "--convert", "classify"))
    try:
        status = server.wait_exit(300)
    finally:
        server.stop()
    assert status != 0
    assert "NNRP cannot serve this vLLM server" in server.output()
    assert "(models.list) make up no whole openai-compatible/1 level" in server.output()

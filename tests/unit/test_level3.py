"""Level 3 bindings over a scripted ``app.state`` fed with bodies recorded from real vLLM
(``compat/fixtures/vllm/<version>/models-*.json``, ``embeddings-*.json``): ``models.list``, ``embeddings.create``
(vLLM's own request model and error mapping, so those tests need vLLM and are skipped without it), the engine
ids an unfinished embedding aborts, the capability document of a pooling server, the refusal of a server that
serves no whole level, and the endpoint plugin's eligibility on every server."""

from __future__ import annotations

import asyncio
import types

import orjson
import pytest

from tests.support import FIXTURES
from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.profile import errors as E
from vllm_nnrp_plugin.vllm_binding.backend import VLLMBackend
from vllm_nnrp_plugin.vllm_binding.endpoint import NNRPEndpointPlugin
from vllm_nnrp_plugin.vllm_binding.families import binding_for
from vllm_nnrp_plugin.vllm_binding.models import ModelsBinding

VERSIONS = ("0.22.1", "0.26.0", "0.27.1", "0.32.0")


def recorded(case: str, version: str = "0.26.0") -> dict:
    return orjson.loads((FIXTURES.parent / version / f"{case}.json").read_bytes())


def request_of(case: str, version: str = "0.26.0") -> dict:
    return orjson.loads((FIXTURES.parent / version / f"{case}.request.json").read_bytes())


def run(coro):
    return asyncio.run(coro)


class ScriptedModels:
    """``OpenAIServingModels`` answering ``show_available_models()`` with a recorded ``/v1/models`` body."""

    def __init__(self, version: str = "0.26.0") -> None:
        self.model_list = recorded("models-a-list", version)
        self.base_model_paths = [types.SimpleNamespace(name=card["id"]) for card in self.model_list["data"]]

    async def show_available_models(self):
        return types.SimpleNamespace(model_dump=lambda mode=None: self.model_list)


class Engine:
    def __init__(self) -> None:
        self.aborted: list = []

    async def abort(self, request_ids) -> None:
        self.aborted.append(request_ids)


# -- models.list (no vLLM needed) ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_models_list_answers_with_vllms_model_list(version):
    models = ScriptedModels(version)
    call = run(ModelsBinding(models).create(request_of("models-a-list", version), "nnrp-1"))
    assert call.stream is None and call.body == models.model_list
    assert call.body["object"] == "list" and call.body["data"][0]["max_model_len"] == 2048


def test_models_list_refuses_a_body_with_parameters_and_has_nothing_to_abort():
    binding = ModelsBinding(ScriptedModels())
    with pytest.raises(E.ProfileError) as info:
        run(binding.create({"limit": 5, "after": "x"}, "nnrp-1"))
    assert info.value.code == E.INVALID_REQUEST and "(got after, limit)" in info.value.message
    assert binding.engine_request_ids("nnrp-1") == []
    assert binding.operation() == {
        "name": "models.list",
        "streaming": False,
        "non_streaming": True,
        "tool_calls": False,
        "cancellation": False,
    }


def test_a_server_with_only_models_list_is_refused_at_start_up():
    """A classify/score server: ``openai_serving_models`` but neither chat nor embeddings."""
    state = types.SimpleNamespace(
        engine_client=Engine(),
        openai_serving_models=ScriptedModels(),
        openai_serving_chat=None,
        serving_embedding=None,
        serving_classification=object(),
    )
    with pytest.raises(NNRPStartupError, match=r"the operations served \(models.list\) make up no whole"):
        VLLMBackend(state, vllm_version="0.26.0", binding=binding_for((0, 26)))


def test_the_endpoint_plugin_requires_no_task():
    """vLLM loads an endpoint plugin whose ``required_tasks`` is None on every server
    (``vllm/plugins/__init__.py``, ``load_endpoint_plugins``); the backend decides what it serves."""
    assert NNRPEndpointPlugin.required_tasks is None


def test_vllm_loads_the_endpoint_plugin_on_a_pooling_server(monkeypatch):
    plugins = pytest.importorskip("vllm.plugins")
    if not hasattr(plugins, "load_endpoint_plugins"):
        pytest.skip("this vLLM line has no endpoint plugins (attach path: --middleware)")
    monkeypatch.setenv("VLLM_PLUGINS", "nnrp")
    loaded = plugins.load_endpoint_plugins(("embed", "token_embed"))
    assert [type(p) for p in loaded] == [NNRPEndpointPlugin]


# -- embeddings.create (vLLM's request model and error mapping) ----------------------------------------------


class ScriptedServingEmbedding:
    """``ServingEmbedding``: ``await serving(request, raw_request)`` answers with a recorded ``/v1/embeddings``
    body as vLLM's JSON ``Response``, or raises what vLLM raises for the recorded error (its message)."""

    def __init__(self, answer=None, raises=None, block: bool = False) -> None:
        self.model_config = types.SimpleNamespace(is_matryoshka=False, matryoshka_dimensions=None)
        self.answer, self.raises, self.block, self.calls = answer, raises, block, []
        self.blocked = asyncio.Event()  # set once a ``block`` call waits (vLLM runs the request)

    async def __call__(self, request, raw_request=None):
        self.calls.append((request, raw_request))
        if self.block:
            self.blocked.set()
            await asyncio.Event().wait()
        if self.raises is not None:
            raise self.raises
        from starlette.responses import JSONResponse

        return JSONResponse(self.answer)


@pytest.fixture
def vllm_embed():
    return pytest.importorskip("vllm.entrypoints.pooling.embed.protocol")


def pooling_state(serving):
    return types.SimpleNamespace(
        engine_client=Engine(),
        openai_serving_models=ScriptedModels(),
        openai_serving_chat=None,
        serving_embedding=serving,
    )


@pytest.mark.parametrize("case", ["embeddings-a-float", "embeddings-b-base64"])
@pytest.mark.parametrize("version", VERSIONS)
def test_embeddings_answer_with_vllms_body_under_the_embd_engine_id(vllm_embed, version, case):
    serving = ScriptedServingEmbedding(answer=recorded(case, version))
    state = pooling_state(serving)
    backend = VLLMBackend(state, vllm_version="0.26.0", binding=binding_for((0, 26)))
    traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    call = run(backend.create("embeddings.create", request_of(case, version), "nnrp-7", traceparent))
    assert call.body == recorded(case, version) and len(call.body["data"]) == 2
    assert call.body["usage"]["prompt_tokens"] == call.body["usage"]["total_tokens"] > 0
    ((request, raw_request),) = serving.calls
    assert request.input == request_of(case, version)["input"] and request.encoding_format == case.split("-")[-1]
    assert raw_request.headers["x-request-id"] == "nnrp-7" and raw_request.headers["traceparent"].startswith("00-aaaa")
    assert backend.engine_request_id("embeddings.create", "nnrp-7") == "embd-nnrp-7"
    run(backend.abort("embeddings.create", "nnrp-7"))  # finished: nothing left to abort
    assert state.engine_client.aborted == []


def test_an_unfinished_embedding_aborts_every_inputs_engine_request(vllm_embed):
    serving = ScriptedServingEmbedding(block=True)
    state = pooling_state(serving)
    backend = VLLMBackend(state, vllm_version="0.26.0", binding=binding_for((0, 26)))

    async def cancelled():
        task = asyncio.ensure_future(backend.create("embeddings.create", request_of("embeddings-a-float"), "nnrp-9"))
        await serving.blocked.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await backend.abort("embeddings.create", "nnrp-9")

    run(cancelled())
    assert state.engine_client.aborted == [["embd-nnrp-9-0", "embd-nnrp-9-1"]]


def test_the_capability_document_of_a_pooling_server_claims_level_3(vllm_embed):
    document = VLLMBackend(
        pooling_state(ScriptedServingEmbedding()), vllm_version="0.26.0", binding=binding_for((0, 26))
    ).capabilities()
    assert document["compatibility_levels"] == [3]
    assert document["models"] == [{"id": "example-model", "owned_by": "vllm"}]
    assert [op["name"] for op in document["operations"]] == ["models.list", "embeddings.create"]
    embeddings = document["operations"][1]
    assert embeddings["encoding_formats"] == ["float", "base64"] and embeddings["dimensions"] is False


@pytest.mark.parametrize(
    ("case", "exception", "code"),
    [
        ("embeddings-f-empty-input", ValueError, E.INVALID_REQUEST),
        ("embeddings-e-dimensions", ValueError, E.INVALID_REQUEST),
        ("embeddings-c-unknown-model", "VLLMNotFoundError", E.MODEL_NOT_FOUND),
    ],
)
def test_vllms_errors_map_to_the_profiles_codes_with_vllms_message(vllm_embed, case, exception, code):
    if isinstance(exception, str):
        exception = getattr(pytest.importorskip("vllm.exceptions"), exception)
    message = recorded(case)["error"]["message"]
    backend = VLLMBackend(
        pooling_state(ScriptedServingEmbedding(raises=exception(message))),
        vllm_version="0.26.0",
        binding=binding_for((0, 26)),
    )
    with pytest.raises(E.ProfileError) as info:
        run(backend.create("embeddings.create", request_of(case), "nnrp-3"))
    assert (info.value.code, info.value.message) == (code, message)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "example-model", "input": 42}, "invalid embeddings.create body: input"),
        ({"model": "example-model", "input": "x", "encoding_format": "bytes"}, "binary response"),
        ({"input": "x", "encoding_format": "bytes_only"}, "binary response"),
    ],
)
def test_bodies_vllm_cannot_answer_in_json_are_refused_before_vllm_is_called(vllm_embed, body, says):
    serving = ScriptedServingEmbedding(answer=recorded("embeddings-a-float"))
    state = pooling_state(serving)
    backend = VLLMBackend(state, vllm_version="0.26.0", binding=binding_for((0, 26)))
    with pytest.raises(E.ProfileError) as info:
        run(backend.create("embeddings.create", body, "nnrp-4"))
    assert info.value.code == E.INVALID_REQUEST and says in info.value.message
    assert serving.calls == []
    run(backend.abort("embeddings.create", "nnrp-4"))
    assert state.engine_client.aborted == []  # no engine request was started


# -- the project's Level 3 recipes ---------------------------------------------------------------------------

LEVEL3_RECIPES = FIXTURES.parents[3] / "recipes" / "level3" / "manifest.json"
MODELS_ENTRY = {"name": "models.list", "streaming": False, "non_streaming": True, "cancellation": False}
EMBEDDINGS_ENTRY = {
    "name": "embeddings.create",
    "streaming": False,
    "non_streaming": True,
    "encoding_formats": ["float", "base64"],
    "dimensions": False,
}


def level3_plan(operations):
    pytest.importorskip("jsonschema")
    from vllm_nnrp_plugin.client.conformance.plan import build_plan
    from vllm_nnrp_plugin.client.conformance.suite import Suite, locate_suite
    from vllm_nnrp_plugin.profile.capabilities import conformance_manifest, operation, runtime_document

    try:
        suite = Suite(locate_suite())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    recipes = suite.recipes(LEVEL3_RECIPES)
    document = runtime_document(
        models=["example-model"], owned_by="vllm", operations=[operation(**op) for op in operations]
    )
    plan = build_plan(recipes, conformance_manifest(document), results_path="r.json", evidence_dir="e")
    suite.validate(plan, "execution-plan")
    return recipes, {case["id"].removeprefix("vllm-nnrp.level3.") for case in plan["cases"]}


def test_level3_recipes_are_planned_where_their_operations_are_served():
    chat = {"name": "chat.completions.create", "streaming": True, "non_streaming": True}
    recipes, pooling = level3_plan([MODELS_ENTRY, EMBEDDINGS_ENTRY])
    assert pooling == {r["id"].removeprefix("vllm-nnrp.level3.") for r in recipes} - {
        "embeddings-unsupported-on-generate-server"
    }
    _, generate = level3_plan([chat, MODELS_ENTRY])
    assert generate == {"models-list", "models-list-invalid-body", "embeddings-unsupported-on-generate-server"}


@pytest.mark.parametrize("version", VERSIONS)
def test_recorded_vllm_bodies_pass_the_success_recipes(version):
    from vllm_nnrp_plugin.client.conformance.plan import substitute
    from vllm_nnrp_plugin.client.conformance.rules import case_problems

    recipes, _ = level3_plan([MODELS_ENTRY, EMBEDDINGS_ENTRY])
    bodies = {
        "embeddings-two-inputs": "embeddings-a-float",
        "embeddings-base64": "embeddings-b-base64",
        "models-list": "models-a-list",
    }
    for recipe in recipes:
        name = recipe["id"].removeprefix("vllm-nnrp.level3.")
        if name in bodies:
            expect = substitute(recipe["expect"], recipe.get("parameters", {}))
            event = {"type": "response.completed", "body": recorded(bodies[name], version)}
            assert case_problems(expect, "success", [event]) == [], name

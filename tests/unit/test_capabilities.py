"""The capability document and the conformance manifest derived from it (the profile's "Capability documents")."""

import json

import pytest

from vllm_nnrp_plugin.client.conformance.suite import locate_suite
from vllm_nnrp_plugin.config import load_config
from vllm_nnrp_plugin.profile.capabilities import (
    chat_operation,
    conformance_manifest,
    operation,
    operation_names,
    runtime_document,
)


def test_runtime_document_has_the_profile_shape():
    document = runtime_document(
        models=["example-model", "alias"], owned_by="vllm", operations=[chat_operation(tool_calls=False)]
    )
    assert document["profile"] == "openai-compatible" and document["compatibility_levels"] == [1]
    assert document["operations"] == [
        {
            "name": "chat.completions.create",
            "streaming": True,
            "non_streaming": True,
            "tool_calls": False,
            "cancellation": True,
        }
    ]
    assert document["models"] == [{"id": "example-model", "owned_by": "vllm"}, {"id": "alias", "owned_by": "vllm"}]
    assert [(e["name"], e["critical"]) for e in document["extensions"]] == [
        ("vllm.diagnostics", False),
        ("vllm.openai_chunk", False),
    ]
    assert all(e["description"] for e in document["extensions"])
    assert operation_names(document) == {"chat.completions.create"}


def test_openai_chunk_is_declared_where_an_operation_streams_and_reaches_the_conformance_manifest():
    streaming = runtime_document(models=["m"], owned_by="vllm", operations=[chat_operation(tool_calls=False)])
    assert {"name": "vllm.openai_chunk", "critical": False} == {
        k: v for k, v in conformance_manifest(streaming)["extensions"][1].items() if k != "description"
    }
    pooling = runtime_document(
        models=["m"],
        owned_by="vllm",
        operations=[
            operation("models.list", streaming=False, non_streaming=True),
            operation("embeddings.create", streaming=False, non_streaming=True),
        ],
    )
    assert [e["name"] for e in pooling["extensions"]] == ["vllm.diagnostics"]


@pytest.mark.parametrize("tool_calls", [True, False])
def test_conformance_manifest_validates_against_the_suite_schema(tool_calls):
    jsonschema = pytest.importorskip("jsonschema")
    try:
        suite = locate_suite()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    schema = json.loads((suite / "schemas" / "api-profile-capabilities.schema.json").read_text())
    document = runtime_document(
        models=["example-model"], owned_by="vllm", operations=[chat_operation(tool_calls=tool_calls)]
    )
    manifest = conformance_manifest(document)
    jsonschema.validate(manifest, schema)
    assert manifest["adapter"] == "vllm-nnrp-plugin" and "models" not in manifest
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema)  # the runtime document is a different shape (it has models)


MODELS = operation("models.list", streaming=False, non_streaming=True, cancellation=False)
EMBEDDINGS = operation("embeddings.create", streaming=False, non_streaming=True, encoding_formats=["float"])
RESPONSES = operation("responses.create", streaming=True, non_streaming=True)


@pytest.mark.parametrize(
    ("operations", "levels"),
    [
        ([chat_operation(tool_calls=True), MODELS], [1]),  # models.list alone is not level 3
        ([chat_operation(tool_calls=True), RESPONSES, MODELS], [1, 2]),
        ([MODELS, EMBEDDINGS], [3]),  # a pooling server: no chat
        ([RESPONSES], [2]),
    ],
)
def test_a_level_is_claimed_only_when_all_its_operations_are_served(operations, levels):
    document = runtime_document(models=["m"], owned_by="vllm", operations=operations)
    assert document["compatibility_levels"] == levels
    assert operation_names(document) == {op["name"] for op in operations}


def test_operations_that_make_up_no_level_are_refused():
    with pytest.raises(ValueError, match="models.list"):
        runtime_document(models=["m"], owned_by="vllm", operations=[MODELS])


def test_the_manifest_drops_operation_options_the_suite_schema_forbids():
    document = runtime_document(models=["m"], owned_by="vllm", operations=[MODELS, EMBEDDINGS])
    assert document["operations"][1]["encoding_formats"] == ["float"]
    manifest = conformance_manifest(document)
    assert manifest["operations"][1] == {
        "name": "embeddings.create",
        "streaming": False,
        "non_streaming": True,
        "tool_calls": False,
        "cancellation": True,
    }
    assert manifest["compatibility_levels"] == [3]


def test_fault_injection_is_off_unless_configured():
    assert load_config({}).fault_injection_backend_error_model is None
    configured = load_config({"nnrp": {"fault_injection_backend_error_model": "backend-error"}})
    assert configured.fault_injection_backend_error_model == "backend-error"

"""The capability document and the conformance manifest derived from it (the profile's "Capability documents")."""

import json

import pytest

from vllm_nnrp_plugin.conformance.suite import locate_suite
from vllm_nnrp_plugin.config import load_config
from vllm_nnrp_plugin.profile.capabilities import conformance_manifest, operation_names, runtime_document


def test_runtime_document_has_the_profile_shape():
    document = runtime_document(models=["example-model", "alias"], owned_by="vllm", tool_calls=False)
    assert document["profile"] == "openai-compatible" and document["compatibility_levels"] == [1]
    assert document["operations"] == [
        {"name": "chat.completions.create", "streaming": True, "non_streaming": True, "tool_calls": False,
         "cancellation": True}
    ]  # fmt: skip
    assert document["models"] == [{"id": "example-model", "owned_by": "vllm"}, {"id": "alias", "owned_by": "vllm"}]
    assert document["extensions"] == [
        {"name": "vllm.diagnostics", "critical": False, "description": document["extensions"][0]["description"]}
    ]
    assert operation_names(document) == {"chat.completions.create"}


@pytest.mark.parametrize("tool_calls", [True, False])
def test_conformance_manifest_validates_against_the_suite_schema(tool_calls):
    jsonschema = pytest.importorskip("jsonschema")
    try:
        suite = locate_suite()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    schema = json.loads((suite / "schemas" / "api-profile-capabilities.schema.json").read_text())
    document = runtime_document(models=["example-model"], owned_by="vllm", tool_calls=tool_calls)
    manifest = conformance_manifest(document)
    jsonschema.validate(manifest, schema)
    assert manifest["adapter"] == "vllm-nnrp-plugin" and "models" not in manifest
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema)  # the runtime document is a different shape (it has models)


def test_fault_injection_is_off_unless_configured():
    assert load_config({}).fault_injection_backend_error_model is None
    configured = load_config({"nnrp": {"fault_injection_backend_error_model": "backend-error"}})
    assert configured.fault_injection_backend_error_model == "backend-error"

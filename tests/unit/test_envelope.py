import orjson
import pytest

from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE
from vllm_nnrp_plugin.profile.envelope import decode_envelope
from vllm_nnrp_plugin.profile.errors import ProfileError
from tests.support import envelope

OPERATIONS = frozenset({CHAT_COMPLETIONS_CREATE})


def decode(doc, max_bytes=1 << 20):
    payload = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return decode_envelope(payload, operations=OPERATIONS, max_bytes=max_bytes)


def code_of(doc, **kw):
    with pytest.raises(ProfileError) as info:
        decode(doc, **kw)
    err = info.value
    assert err.message and err.type and err.code  # non-empty strings, as the profile requires
    return err.code


def test_valid_envelope_keeps_nnrp_hints_out_of_body():
    env = decode(envelope({"messages": [{"role": "user", "content": "hi"}]}, request_id="r1", nnrp={"timeout_ms": 5}))
    assert env.operation == "chat.completions.create"
    assert env.body == {"messages": [{"role": "user", "content": "hi"}]}
    assert env.request_id == "r1"
    assert env.nnrp == {"timeout_ms": 5}


@pytest.mark.parametrize(
    "doc, code",
    [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        ([1, 2], "invalid_envelope"),
        ({"operation": "chat.completions.create", "body": {}}, "invalid_envelope"),
        ({**envelope({"messages": []}), "schema_version": "openai-compatible/2"}, "unsupported_schema_version"),
        ({**envelope({"messages": []}), "operation": "responses.create"}, "unsupported_operation"),
        ({**envelope({"messages": []}), "operation": 7}, "invalid_envelope"),
        ({**envelope({}), "body": "text"}, "invalid_envelope"),
        ({**envelope({}), "body": [1]}, "invalid_envelope"),
        (envelope({"model": "m"}), "missing_messages"),
        (envelope({"messages": []}, request_id=5), "invalid_envelope"),
        (envelope({"messages": []}, nnrp=[1]), "invalid_envelope"),
    ],
)
def test_bad_envelopes_get_typed_errors(doc, code):
    assert code_of(doc) == code


def test_oversized_envelope_is_refused_before_parsing():
    doc = envelope({"messages": [{"role": "user", "content": "x" * 200}]})
    with pytest.raises(ProfileError) as info:
        decode(doc, max_bytes=100)
    assert info.value.code == "envelope_too_large" and info.value.status == 413

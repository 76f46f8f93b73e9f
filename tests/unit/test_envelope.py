import orjson
import pytest

from tests.support import envelope
from vllm_nnrp_plugin.profile import CHAT_COMPLETIONS_CREATE
from vllm_nnrp_plugin.profile.envelope import decode_envelope
from vllm_nnrp_plugin.profile.errors import ProfileError

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


# -- deep nesting and client values in messages --------------------------------------------------------------


def nested(depth: int) -> bytes:
    """A JSON array ``depth`` levels deep (``[[[…]]]``, 2 bytes a level)."""
    return b"[" * depth + b"]" * depth


def with_field(field: str, value: bytes) -> bytes:
    """A valid chat envelope whose ``field`` (``schema_version``, ``operation``, ``request_id``, ``body``,
    ``nnrp``, ``nnrp.timeout_ms`` or ``body.<key>``) holds the raw JSON ``value``."""
    parts = {
        "schema_version": b'"openai-compatible/1"',
        "operation": b'"chat.completions.create"',
        "body": b'{"messages":[]}',
        "nnrp": b"{}",
    }
    if field.startswith("body."):
        parts["body"] = b'{"messages":[],"' + field[5:].encode() + b'":' + value + b"}"
    elif field == "nnrp.timeout_ms":
        parts["nnrp"] = b'{"timeout_ms":' + value + b"}"
    else:
        parts[field] = value
    return b"{" + b",".join(b'"' + k.encode() + b'":' + v for k, v in parts.items()) + b"}"


FIELDS = (
    "schema_version",
    "operation",
    "request_id",
    "body",
    "nnrp",
    "nnrp.timeout_ms",
    "body.model",
    "body.messages",
    "body.tools",
)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("depth", [255, 1000, 1024, 1025, 100_000])
def test_deep_nesting_anywhere_is_an_invalid_envelope_at_once(field, depth):
    # 1000 levels is the ~2 KB envelope that once raised RecursionError formatting its message; past 1024 orjson
    # itself refuses to parse
    with pytest.raises(ProfileError) as info:
        decode(with_field(field, nested(depth)), max_bytes=1 << 20)
    assert info.value.code == "invalid_envelope" and "deeper than 254 levels" in info.value.message


def test_nesting_up_to_the_limit_is_fine():
    # the envelope is level 1 and body level 2, so the field's own arrays are levels 3 … depth + 2
    assert decode(with_field("body.tools", nested(252))).body["tools"] is not None
    assert code_of(with_field("body.tools", nested(253))) == "invalid_envelope"
    assert code_of(with_field("schema_version", nested(254))) == "invalid_envelope"
    many = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]} for _ in range(500)]}
    assert len(decode(envelope(many)).body["messages"]) == 500  # wide is not deep


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("schema_version", b'"x\\n' + b"y" * 100_000 + b'"', "schema_version string 'x\\x0ayyy"),
        ("schema_version", b"[[1, 2]]", "schema_version array of 1 items"),
        ("schema_version", b"{}", "schema_version object of 0 keys"),
        ("schema_version", b"5.5", "schema_version number 5.5"),
        ("operation", b'"' + b"o" * 1_000_000 + b'"', "operation string 'ooo"),
        ("nnrp.timeout_ms", b'"\\u001b[2J"', "got string '\\x1b[2J'"),
        ("nnrp.timeout_ms", b"[[[]]]", "got array of 1 items"),
        ("nnrp.timeout_ms", b"true", "got boolean true"),
    ],
)
def test_messages_describe_client_values_short_and_escaped(field, value, says):
    with pytest.raises(ProfileError) as info:
        decode(with_field(field, value), max_bytes=1 << 21)
    assert says in info.value.message
    assert len(info.value.message) < 300 and info.value.message.isprintable()

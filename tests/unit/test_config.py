import logging
import types

import pytest

from vllm_nnrp_plugin.config import ConfigError, load_config
from vllm_nnrp_plugin.contract.endpoints import EndpointError, parse_endpoint
from vllm_nnrp_plugin.errors import NNRPStartupError
from vllm_nnrp_plugin.profile import capabilities
from vllm_nnrp_plugin.vllm_binding import backend as backend_module
from vllm_nnrp_plugin.vllm_binding.families import binding_for


def test_installed_but_not_enabled_by_default():
    assert load_config({}, {}).enabled is False
    assert load_config(None, {"VLLM_PLUGINS": "other"}).enabled is False


def test_vllm_plugins_naming_nnrp_enables_unless_config_says_no():
    assert load_config({}, {"VLLM_PLUGINS": "a,nnrp"}).enabled is True
    assert load_config({}, {"VLLM_PLUGINS": "a, nnrp"}).enabled is False  # vLLM does not strip spaces
    assert load_config({"nnrp": {"enabled": False}}, {"VLLM_PLUGINS": "nnrp"}).enabled is False
    assert load_config({"nnrp": {"enabled": True}}, {}).enabled is True


def test_env_listen_overrides_config():
    config = load_config(
        {"nnrp": {"listen": ["tcp://127.0.0.1:1"]}}, {"VLLM_NNRP_LISTEN": "tcp://127.0.0.1:2, unix:///tmp/x.sock"}
    )
    assert config.listen == ("tcp://127.0.0.1:2", "unix:///tmp/x.sock")
    assert load_config({}, {}).listen == ("tcp://127.0.0.1:9400",)


@pytest.mark.parametrize(
    "block, fragment",
    [
        ({"enabeld": True}, "enabeld"),
        ({"enabled": "yes"}, "nnrp.enabled"),
        ({"max_envelope_bytes": "5"}, "nnrp.max_envelope_bytes"),
        ({"max_envelope_bytes": 0}, "max_envelope_bytes must be > 0"),
        ({"listen": []}, "nnrp.listen"),
        (7, "must be a mapping"),
        ({"metrics_listen": "9401"}, "metrics_listen must be HOST:PORT"),
        ({"metrics_listen": 9401}, "nnrp.metrics_listen"),
    ],
)
def test_misconfiguration_is_an_error_that_names_the_key(block, fragment):
    with pytest.raises(ConfigError) as info:
        load_config({"nnrp": block}, {})
    assert fragment in str(info.value)


def test_empty_env_listen_is_an_error():
    with pytest.raises(ConfigError):
        load_config({}, {"VLLM_NNRP_LISTEN": " , "})


@pytest.mark.parametrize(
    "uri, transport, provider",
    [
        ("tcp://127.0.0.1:9400", "tcp", "tcp://127.0.0.1:9400"),
        ("tcp://[::1]:9400", "tcp", "tcp://[::1]:9400"),
        ("unix:///tmp/vllm-nnrp.sock", "ipc", "unix:///tmp/vllm-nnrp.sock"),
        ("nnrps://127.0.0.1:9400", "tcp", "tcp://127.0.0.1:9400"),
        ("ws://127.0.0.1:9401", "websocket", "ws://127.0.0.1:9401/nnrp"),
        ("wss://127.0.0.1:9401/x", "websocket", "wss://127.0.0.1:9401/x"),
        ("quic://127.0.0.1:9402", "quic", "quic://127.0.0.1:9402"),
    ],
)
def test_listen_uris(uri, transport, provider):
    carrier = parse_endpoint(uri)
    assert (carrier.transport, carrier.provider_uri) == (transport, provider)


@pytest.mark.parametrize(
    "uri", ["tcp://127.0.0.1", "tcp://host:notaport", "unix://relative.sock", "http://a:1", "quic://a:1/path", "9400"]
)
def test_bad_listen_uris(uri):
    with pytest.raises(EndpointError):
        parse_endpoint(uri)


def test_limits_have_safe_defaults():
    config = load_config({}, {})
    # no in-flight limit of the plugin's own by default: vLLM queues what HTTP would queue (the per-session
    # credit follows vLLM's max_num_seqs, resolved at start-up)
    assert (config.max_sessions, config.max_in_flight_per_session, config.max_in_flight) == (256, None, None)
    assert config.max_queued_events == 1024 and config.allow_non_loopback is False
    assert config.allow_unauthenticated is False and config.handshake_timeout_ms == 10_000


@pytest.mark.parametrize("uri", ["tcp://0.0.0.0:9400", "tcp://10.1.2.3:9400", "ws://[::]:9401", "tcp://example.com:1"])
def test_non_loopback_without_tls_needs_the_explicit_setting(uri):
    with pytest.raises(ConfigError, match="allow_non_loopback"):
        load_config({"nnrp": {"enabled": True, "listen": [uri]}}, {})
    config = load_config({"nnrp": {"enabled": True, "listen": [uri], "allow_non_loopback": True}}, {})
    assert config.listen == (uri,)


@pytest.mark.parametrize(
    "uri", ["tcp://127.0.0.1:9400", "tcp://[::1]:9400", "tcp://localhost:9400", "unix:///tmp/x.sock"]
)
def test_loopback_needs_nothing(uri):
    assert load_config({"nnrp": {"enabled": True, "listen": [uri]}}, {}).listen == (uri,)


@pytest.mark.parametrize("uri", ["nnrps://0.0.0.0:9400", "wss://127.0.0.1:9401", "quic://127.0.0.1:9402"])
def test_tls_addresses_need_certificate_and_key(tmp_path, uri):
    with pytest.raises(ConfigError, match="tls_cert_file"):
        load_config({"nnrp": {"enabled": True, "listen": [uri]}}, {})
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    block = {"enabled": True, "listen": [uri], "tls_cert_file": str(cert), "tls_key_file": str(key)}
    with pytest.raises(ConfigError, match="not a readable file"):
        load_config({"nnrp": block}, {})
    cert.write_text("x"), key.write_text("x")
    assert load_config({"nnrp": block}, {}).tls_cert_file == str(cert)


def test_unknown_ipc_group_is_an_error():
    with pytest.raises(ConfigError, match="ipc_socket_group"):
        load_config({"nnrp": {"enabled": True, "ipc_socket_group": "no-such-group-xyz"}}, {})


def test_the_environment_listen_is_checked_like_the_config():
    with pytest.raises(ConfigError, match="allow_non_loopback"):
        load_config({"nnrp": {"enabled": True}}, {"VLLM_NNRP_LISTEN": "tcp://0.0.0.0:9400"})


def test_metrics_listen_is_off_unless_configured():
    assert load_config({}, {}).metrics_listen is None
    assert load_config({"nnrp": {"metrics_listen": "127.0.0.1:9401"}}, {}).metrics_listen == "127.0.0.1:9401"


def test_operations_default_to_everything_the_server_offers():
    assert load_config({}, {}).operations is None
    block = {"operations": ["chat.completions.create", "models.list", "embeddings.create"]}
    assert load_config({"nnrp": block}, {}).operations == (
        "chat.completions.create",
        "models.list",
        "embeddings.create",
    )


@pytest.mark.parametrize(
    "operations, fragment",
    [
        (
            ["chat.completions.create", "chat.completion.create"],
            "'chat.completion.create', not an openai-compatible/1 operation",
        ),
        (["nnrp.capabilities"], "'nnrp.capabilities', not an openai-compatible/1 operation"),
        ([], "nnrp.operations"),
        ([1], "nnrp.operations"),
        ({"chat.completions.create": True}, "nnrp.operations"),
    ],
)
def test_operations_outside_the_profile_are_a_config_error(operations, fragment):
    with pytest.raises(ConfigError) as info:
        load_config({"nnrp": {"operations": operations}}, {})
    assert fragment in str(info.value)


class _Binding:
    def __init__(self, name):
        self.name = name

    def operation(self):
        return capabilities.operation(self.name, streaming=self.name != "models.list", non_streaming=True)


def _backend(monkeypatch, served, operations):
    """A VLLMBackend over a state whose serving objects offer ``served`` (bindings stand in for vLLM's)."""
    monkeypatch.setattr(
        backend_module, "_bindings", lambda state, family, binding, priorities: [_Binding(name) for name in served]
    )
    state = types.SimpleNamespace(
        engine_client=None,
        openai_serving_models=types.SimpleNamespace(base_model_paths=[types.SimpleNamespace(name="m")]),
    )
    return backend_module.VLLMBackend(state, operations, vllm_version="0.26.0", binding=binding_for((0, 26)))


ALL = ("chat.completions.create", "responses.create", "models.list", "embeddings.create")


def test_the_backend_serves_only_the_listed_operations(monkeypatch):
    document = _backend(monkeypatch, ALL, None).capabilities()
    assert [op["name"] for op in document["operations"]] == list(ALL) and document["compatibility_levels"] == [1, 2, 3]
    document = _backend(monkeypatch, ALL, ("chat.completions.create",)).capabilities()
    assert [op["name"] for op in document["operations"]] == ["chat.completions.create"]
    assert document["compatibility_levels"] == [1]
    # the listed order does not matter: the document keeps the serving objects' order
    document = _backend(monkeypatch, ALL, ("embeddings.create", "models.list", "responses.create")).capabilities()
    assert [op["name"] for op in document["operations"]] == list(ALL[1:]) and document["compatibility_levels"] == [2, 3]


def test_listing_an_operation_the_server_does_not_serve_refuses_to_start(monkeypatch):
    with pytest.raises(NNRPStartupError) as info:
        _backend(monkeypatch, ("models.list", "embeddings.create"), ("chat.completions.create", "models.list"))
    message = str(info.value)
    assert "chat.completions.create, which this vLLM server does not serve" in message
    assert "it serves: models.list, embeddings.create" in message


def test_listing_no_whole_level_refuses_to_start(monkeypatch):
    with pytest.raises(NNRPStartupError, match=r"\(models.list\) make up no whole openai-compatible/1 level"):
        _backend(monkeypatch, ALL, ("models.list",))


@pytest.mark.parametrize("key", ["accept_timeout_ms", "idle_poll_ms"])
def test_a_key_of_the_removed_native_runtime_is_ignored_with_a_warning(key, caplog):
    """A configuration written for a version whose QUIC ran on nnrp-py's native runtime still starts; the
    warning names the key and says to remove it."""
    with caplog.at_level(logging.WARNING, logger="vllm_nnrp_plugin.config"):
        config = load_config({"nnrp": {key: 500, "max_sessions": 7}})
    assert config.max_sessions == 7 and not hasattr(config, key)
    (record,) = [r for r in caplog.records if key in r.getMessage()]
    assert "ignored" in record.getMessage() and "remove it" in record.getMessage()

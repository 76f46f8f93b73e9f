"""The start-up gate, with plain data standing in for vLLM's version, argv and environment."""

import pytest

from vllm_nnrp_plugin.vllm_binding.gate import NNRPStartupError, startup_check

ON = {"VLLM_PLUGINS": "nnrp"}


def check(environ=ON, argv=("vllm", "serve", "m"), version="0.26.0", probe=True):
    version_tuple = tuple(int(p) for p in version.split("."))
    return startup_check(environ, list(argv), version, version_tuple, probe)


def test_supported_line_selects_the_endpoint_plugin_binding():
    assert check() == "endpoint-plugin-0.26"


@pytest.mark.parametrize("version", ["0.18.1", "0.22.1", "0.25.0", "0.27.0", "0.32.0", "1.0.0"])
def test_other_lines_stop_start_up_with_version_and_anchors(version):
    with pytest.raises(NNRPStartupError) as info:
        check(version=version)
    assert version in str(info.value) and "0.26.0" in str(info.value)


def test_failed_feature_probe_stops_start_up():
    with pytest.raises(NNRPStartupError, match="load_endpoint_plugins"):
        check(probe=False)


def test_not_enabled_does_nothing_even_on_unsupported_vllm():
    assert check(environ={}, version="0.22.1") is None
    assert check(environ={"VLLM_PLUGINS": "other"}) is None
    assert check(argv=("vllm", "serve", "m", "--additional-config", '{"nnrp": {"enabled": false}}')) is None


def test_config_enabling_without_vllm_plugins_names_the_fix():
    argv = ("vllm", "serve", "m", '--additional-config={"nnrp": {"enabled": true}}')
    with pytest.raises(NNRPStartupError, match="VLLM_PLUGINS=nnrp"):
        check(environ={}, argv=argv)


def test_invalid_settings_stop_start_up_before_the_model_loads():
    argv = ("vllm", "serve", "m", "--additional-config", '{"nnrp": {"listen": 5}}')
    with pytest.raises(NNRPStartupError, match="nnrp.listen"):
        check(argv=argv)


def test_yaml_config_file_is_read(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: m\nadditional-config:\n  nnrp:\n    enabled: true\n")
    with pytest.raises(NNRPStartupError, match="VLLM_PLUGINS"):
        check(environ={}, argv=("vllm", "serve", "--config", str(config)))


def test_bad_listen_address_in_the_environment_stops_start_up():
    with pytest.raises(NNRPStartupError, match="ws://x:1"):
        check(environ={**ON, "VLLM_NNRP_LISTEN": "ws://x:1"})


@pytest.mark.parametrize(
    "environ, argv",
    [
        (ON, ("vllm", "serve", "m", "--headless")),
        (ON, ("vllm", "serve", "m", "--grpc")),
        ({**ON, "VLLM_USE_RUST_FRONTEND": "1"}, ("vllm", "serve", "m")),
    ],
)
def test_modes_without_a_python_api_server_stop_start_up(environ, argv):
    with pytest.raises(NNRPStartupError, match="no Python API server"):
        check(environ=environ, argv=argv)

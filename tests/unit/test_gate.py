"""The support band and the start-up gate.

The refused-line checks run the real ``vllm.general_plugins`` entry point (:func:`general.register`) against a
fake ``vllm`` package of that version (version attributes, ``vllm.plugins``, ``build_app`` with the line's
signature in the line's module: ``vllm.entrypoints.openai.api_server`` up to 0.28, imported in the API server;
``vllm.entrypoints.launchers.app`` from 0.29 on, where the API-server module is never imported), as vLLM would call
it while building ``vllm serve``'s parser.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from types import SimpleNamespace

import orjson
import pytest

from vllm_nnrp_plugin.vllm_binding import families, gate, general
from vllm_nnrp_plugin.vllm_binding.families import (
    ENDPOINT_PLUGIN,
    MIDDLEWARE,
    MIDDLEWARE_FLAG,
    MIDDLEWARE_PATH,
    NNRPStartupError,
    Surface,
    select_binding,
)
from vllm_nnrp_plugin.vllm_binding.gate import startup_check

ON = {"VLLM_PLUGINS": "nnrp"}
SERVE = ("vllm", "serve", "m")
WITH_MIDDLEWARE = (*SERVE, "--middleware", MIDDLEWARE_PATH)
ANCHORS = "0.18.1, 0.22.1, 0.26.0, 0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0"
EVERY_ANCHOR = ANCHORS.split(", ")


def build_app_018(args, supported_tasks=None): ...


def build_app_022(args, supported_tasks=None, model_config=None): ...


def surface(version="0.26.0", endpoint_plugins=None, build_app=None, chat=True, relocated=None):
    version_tuple = tuple(int(p) for p in version.split("."))
    newer = version_tuple[:2] >= (0, 22)
    relocated = version_tuple[:2] >= (0, 29) if relocated is None else relocated
    return Surface(
        version=version,
        version_tuple=version_tuple,
        endpoint_plugins=version_tuple[:2] >= (0, 26) if endpoint_plugins is None else endpoint_plugins,
        build_app_params=build_app
        or (("args", "supported_tasks", "model_config") if newer else ("args", "supported_tasks")),
        chat_protocol=chat,
        relocated_launchers=relocated,
    )


def check(environ=ON, argv=SERVE, **kw):
    return startup_check(environ, list(argv), surface(**kw))


@pytest.fixture(autouse=True)
def no_recorded_decision(monkeypatch):
    """Each test starts in a process where the gate has not run yet."""
    monkeypatch.setattr(gate, "_recorded", None)


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install a fake ``vllm`` of a given version as the API server would have it imported."""

    def install(version, *, endpoint_plugins=None, build_app=None, chat=True, relocated=None):
        version_tuple = tuple(int(p) for p in version.split("."))
        if relocated is None:
            relocated = version_tuple[:2] >= (0, 29)
        if endpoint_plugins is None:
            endpoint_plugins = version_tuple[:2] >= (0, 26)
        if build_app is None:
            build_app = build_app_022 if version_tuple[:2] >= (0, 22) else build_app_018

        def package(name, **attrs):
            module = types.ModuleType(name)
            module.__path__ = []  # a package, so find_spec of missing children answers None
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, module)
            return module

        plugins = package("vllm.plugins")
        if endpoint_plugins:
            plugins.load_endpoint_plugins = lambda: []
        package("vllm", __version__=version, __version_tuple__=version_tuple, plugins=plugins)
        package("vllm.entrypoints")
        package("vllm.entrypoints.openai")
        package("vllm.entrypoints.openai.chat_completion")
        if relocated:  # 0.29+: vllm serve never imports the (deprecated) API-server module
            package("vllm.entrypoints.launchers")
            package("vllm.entrypoints.launchers.app", build_app=build_app)
            monkeypatch.delitem(sys.modules, "vllm.entrypoints.openai.api_server", raising=False)
        else:
            package("vllm.entrypoints.openai.api_server", build_app=build_app)
            monkeypatch.delitem(sys.modules, "vllm.entrypoints.launchers", raising=False)
        if chat:
            package("vllm.entrypoints.openai.chat_completion.protocol")
        else:
            monkeypatch.delitem(sys.modules, "vllm.entrypoints.openai.chat_completion.protocol", raising=False)

    return install


def serve(monkeypatch, environ=ON, argv=WITH_MIDDLEWARE):
    """Run the general plugin as `vllm serve` would, with this environment and command line."""
    for key in ("VLLM_PLUGINS", "VLLM_NNRP_LISTEN", "VLLM_USE_RUST_FRONTEND"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", list(argv))
    general.register()


# the four bindings, one tested anchor per line


@pytest.mark.parametrize(
    "version, name, paths",
    [
        ("0.32.0", "vllm-0.32", (ENDPOINT_PLUGIN, MIDDLEWARE)),
        ("0.32.3", "vllm-0.32", (ENDPOINT_PLUGIN, MIDDLEWARE)),
        ("0.18.1", "vllm-0.18", (MIDDLEWARE,)),
        ("0.18.0", "vllm-0.18", (MIDDLEWARE,)),
        ("0.22.1", "vllm-0.22", (MIDDLEWARE,)),
        ("0.22.0", "vllm-0.22", (MIDDLEWARE,)),
        ("0.26.0", "vllm-0.26", (ENDPOINT_PLUGIN, MIDDLEWARE)),
        ("0.27.0", "vllm-0.26", (ENDPOINT_PLUGIN, MIDDLEWARE)),
        ("0.27.1", "vllm-0.26", (ENDPOINT_PLUGIN, MIDDLEWARE)),
        ("0.28.0", "vllm-0.26", (ENDPOINT_PLUGIN, MIDDLEWARE)),
        ("0.29.0", "vllm-0.32", (ENDPOINT_PLUGIN, MIDDLEWARE)),
        ("0.30.0", "vllm-0.32", (ENDPOINT_PLUGIN, MIDDLEWARE)),
    ],
)
def test_each_family_selects_its_named_binding(version, name, paths):
    binding = select_binding(surface(version))
    assert (binding.name, binding.attach_paths) == (name, paths)


@pytest.mark.parametrize("version", EVERY_ANCHOR)
def test_the_real_entry_point_accepts_each_anchor_with_the_middleware(fake_vllm, monkeypatch, version):
    fake_vllm(version)
    serve(monkeypatch)  # no exception: vllm serve goes on
    binding = gate.decision_for(MIDDLEWARE).binding  # the gate ran and recorded its decision
    assert binding.anchor_for(families.family_of(version)) == version


# refused lines: one diagnostic with the version, the missing feature if any, the anchors


@pytest.mark.parametrize(
    "version",
    ["0.17.1", "0.19.0", "0.20.2", "0.21.0", "0.23.0", "0.24.1", "0.25.0", "0.35.0", "1.0.0"],
)
def test_other_lines_stop_vllm_serve_with_version_and_anchors(fake_vllm, monkeypatch, version):
    """Lines from 0.29 on (and so 0.35+, whatever they keep) lay vLLM out as 0.32 does: the refusal comes from
    the general plugin at argument parsing there too, not after the model loaded. Only a line newer than every
    tested one is offered the opt-in."""
    fake_vllm(version)
    with pytest.raises(NNRPStartupError) as info:
        serve(monkeypatch)
    message = str(info.value)
    assert f"vLLM {version} is not supported" in message and f"tested anchors: {ANCHORS}" in message
    assert "0.18.x, 0.22.x, 0.26.x–0.34.x lines only" in message
    assert "Fix:" in message and "\n" not in message
    newest = families.family_of(version) > (0, 34)
    assert (
        'set "nnrp": {"allow_untested_vllm": true} in --additional-config to run it on the vllm-0.34 binding '
        "behind its start-up self-checks" in message
    ) == newest


@pytest.mark.parametrize("version", ["0.35.0", "0.36.2"])
def test_a_newer_line_starts_on_the_newest_binding_when_the_operator_allows_untested_vllm(
    fake_vllm, monkeypatch, version
):
    fake_vllm(version, relocated=True)
    config = orjson.dumps({"nnrp": {"allow_untested_vllm": True}}).decode()
    serve(monkeypatch, argv=(*SERVE, "--additional-config", config))
    decision = gate.decision_for(ENDPOINT_PLUGIN)
    assert decision.binding.name == "vllm-0.34" and decision.attach_path == ENDPOINT_PLUGIN and decision.untested


def test_allow_untested_vllm_does_not_open_the_gaps_between_tested_lines(fake_vllm, monkeypatch):
    fake_vllm("0.24.1")
    config = orjson.dumps({"nnrp": {"allow_untested_vllm": True}}).decode()
    with pytest.raises(NNRPStartupError, match="vLLM 0.24.1 is not supported"):
        serve(monkeypatch, argv=(*WITH_MIDDLEWARE, "--additional-config", config))


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0", "0.34.1"])
def test_the_newest_lines_take_the_vllm_034_binding(fake_vllm, monkeypatch, version):
    fake_vllm(version, relocated=True)
    serve(monkeypatch, argv=SERVE)
    decision = gate.decision_for(ENDPOINT_PLUGIN)
    assert decision.binding.name == "vllm-0.34" and not decision.untested


@pytest.mark.parametrize(
    "version, probe_failure, feature",
    [
        ("0.26.0", {"endpoint_plugins": False}, "vllm.plugins.load_endpoint_plugins"),
        ("0.22.1", {"build_app": build_app_018}, "model_config"),
        ("0.18.1", {"build_app": build_app_022}, "without model_config"),
        ("0.22.1", {"endpoint_plugins": True}, "no vllm.plugins.load_endpoint_plugins"),
        ("0.18.1", {"chat": False}, "ChatCompletionRequest"),
        ("0.32.0", {"relocated": False}, "vllm.entrypoints.launchers.app.build_app"),
        ("0.32.0", {"endpoint_plugins": False}, "vllm.plugins.load_endpoint_plugins"),
        ("0.32.0", {"build_app": build_app_018}, "model_config"),
        ("0.27.1", {"relocated": True}, "not the relocated vllm.entrypoints.launchers"),
        ("0.28.0", {"endpoint_plugins": False}, "vllm.plugins.load_endpoint_plugins"),
        ("0.29.0", {"relocated": False}, "vllm.entrypoints.launchers.app.build_app"),
        ("0.30.0", {"chat": False}, "ChatCompletionRequest"),
    ],
)
def test_a_family_failing_its_probes_stops_vllm_serve_naming_the_feature(
    fake_vllm, monkeypatch, version, probe_failure, feature
):
    fake_vllm(version, **probe_failure)
    with pytest.raises(NNRPStartupError) as info:
        serve(monkeypatch)
    message = str(info.value)
    assert f"vLLM {version} lacks" in message and feature in message and ANCHORS in message


def test_the_relocated_launcher_layout_fails_the_probe():
    with pytest.raises(NNRPStartupError, match="relocated"):
        select_binding(surface("0.26.0", relocated=True))


def test_not_enabled_does_nothing_even_on_unsupported_vllm(fake_vllm, monkeypatch):
    fake_vllm("0.24.0")
    serve(monkeypatch, environ={}, argv=SERVE)
    assert check(environ={}, version="0.24.0") is None
    assert check(environ={"VLLM_PLUGINS": "other"}) is None
    assert check(argv=(*WITH_MIDDLEWARE, "--additional-config", '{"nnrp": {"enabled": false}}')) is None


# attach paths


def test_0_26_attaches_through_the_endpoint_plugin_first():
    attachment = check()
    assert (attachment.binding.name, attachment.attach_path) == ("vllm-0.26", ENDPOINT_PLUGIN)
    assert check(argv=WITH_MIDDLEWARE).attach_path == ENDPOINT_PLUGIN  # both configured: still one listener


def test_0_32_attaches_through_the_endpoint_plugin_first():
    attachment = check(version="0.32.0")
    assert (attachment.binding.name, attachment.attach_path) == ("vllm-0.32", ENDPOINT_PLUGIN)
    assert check(argv=WITH_MIDDLEWARE, version="0.32.0").attach_path == ENDPOINT_PLUGIN
    with pytest.raises(NNRPStartupError, match="VLLM_PLUGINS=nnrp"):
        check(environ={}, argv=(*SERVE, '--additional-config={"nnrp": {"enabled": true}}'), version="0.32.0")


@pytest.mark.parametrize("version", EVERY_ANCHOR)
def test_the_middleware_flag_alone_enables_and_attaches(version):
    attachment = check(environ={}, argv=WITH_MIDDLEWARE, version=version)
    assert attachment.attach_path == MIDDLEWARE
    assert attachment.binding.anchor_for(families.family_of(version)) == version


@pytest.mark.parametrize("version", ["0.18.1", "0.22.1"])
def test_older_lines_without_the_middleware_print_the_exact_flag(fake_vllm, monkeypatch, version):
    fake_vllm(version)
    with pytest.raises(NNRPStartupError) as info:
        serve(monkeypatch, argv=SERVE)
    assert f"add {MIDDLEWARE_FLAG} to vllm serve" in str(info.value)
    assert f"middleware: {MIDDLEWARE_PATH}" in str(info.value)  # the YAML form


def test_middleware_flag_with_equals_sign_and_in_yaml(tmp_path):
    assert (
        check(environ={}, argv=(*SERVE, f"--middleware={MIDDLEWARE_PATH}"), version="0.22.1").attach_path == MIDDLEWARE
    )
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: m\nmiddleware: {MIDDLEWARE_PATH}\n")
    assert (
        check(environ={}, argv=("vllm", "serve", "--config", str(config)), version="0.18.1").attach_path == MIDDLEWARE
    )
    with pytest.raises(NNRPStartupError, match="--middleware"):
        check(argv=("vllm", "serve", "--middleware", "other.Middleware"), version="0.18.1")


def test_config_enabling_without_vllm_plugins_names_both_fixes():
    argv = (*SERVE, '--additional-config={"nnrp": {"enabled": true}}')
    with pytest.raises(NNRPStartupError, match="VLLM_PLUGINS=nnrp") as info:
        check(environ={}, argv=argv)
    assert MIDDLEWARE_FLAG in str(info.value)


def test_invalid_settings_stop_start_up_before_the_model_loads():
    argv = (*SERVE, "--additional-config", '{"nnrp": {"listen": 5}}')
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
    "environ, argv, version",
    [
        (ON, (*WITH_MIDDLEWARE, "--grpc"), "0.18.1"),
        ({**ON, "VLLM_USE_RUST_FRONTEND": "1"}, SERVE, "0.26.0"),
        ({**ON, "VLLM_USE_RUST_FRONTEND": "1"}, WITH_MIDDLEWARE, "0.22.1"),
        (ON, (*SERVE, "--grpc"), "0.32.0"),
        ({**ON, "VLLM_USE_RUST_FRONTEND": "1"}, (*SERVE, "--grpc-port", "50051"), "0.32.0"),
    ],
)
def test_modes_without_a_python_api_server_stop_start_up(environ, argv, version):
    with pytest.raises(NNRPStartupError, match="no Python API server"):
        check(environ=environ, argv=argv, version=version)


@pytest.mark.parametrize(
    "environ, argv, version",
    [
        (ON, (*SERVE, "--headless"), "0.26.0"),
        ({}, (*WITH_MIDDLEWARE, "--headless"), "0.22.1"),
        (ON, (*WITH_MIDDLEWARE, "--headless"), "0.32.0"),
        (ON, (*SERVE, "--headless", "--data-parallel-start-rank", "2"), "0.34.0"),
        (ON, (*SERVE, "--headless"), "0.24.1"),  # a line without a binding: nothing runs here to refuse
    ],
)
def test_a_headless_node_with_nnrp_enabled_starts_and_says_nnrp_runs_with_the_api_server(
    environ, argv, version, caplog
):
    """Multi-node data parallelism runs one image on every node, ``--headless`` on those without an API server; with
    ``VLLM_PLUGINS=nnrp`` set everywhere, those nodes start (vLLM's own arguments, as ``vllm serve`` parses them)."""
    with caplog.at_level("INFO", logger="vllm.nnrp"):
        assert check(environ=environ, argv=argv, version=version) is None
    assert [r.getMessage() for r in caplog.records] == [gate.HEADLESS_NOTE]


def test_0_32_modes_without_a_python_api_server_stop_at_the_real_entry_point(fake_vllm, monkeypatch):
    fake_vllm("0.32.0")
    with pytest.raises(NNRPStartupError, match="with --grpc this process runs no Python API server"):
        serve(monkeypatch, argv=(*SERVE, "--grpc"))
    with pytest.raises(NNRPStartupError, match="VLLM_USE_RUST_FRONTEND=1"):
        serve(monkeypatch, environ={**ON, "VLLM_USE_RUST_FRONTEND": "1"}, argv=SERVE)


# which process runs the gate: the one parsing vllm serve's arguments (process facts observed on 0.32.0)

VLLM = "/venv/bin/vllm"
SERVE_ARGV = (VLLM, "serve", "/models/m", "--port", "8000")
REGISTRY = "vllm.model_executor.models.registry"


@pytest.mark.parametrize(
    "argv, main_module, spawned, api_server_loaded, expected",
    [
        (SERVE_ARGV, None, False, False, True),  # 0.32 `vllm serve` (API server, or parent of N API servers)
        ((*SERVE_ARGV, "--headless"), None, False, False, True),  # the gate runs there: it says NNRP does nothing
        (SERVE_ARGV, "__mp_main__", True, False, False),  # EngineCore, VllmWorker-0, ApiServer_i (spawned)
        ((REGISTRY.replace(".", "/") + ".py",), REGISTRY, False, False, False),  # model inspection subprocess
        ((VLLM, "bench", "serve"), None, False, False, False),
        ((VLLM, "run-batch", "-i", "x"), None, False, False, False),
        (("-m", "--port", "8000"), "vllm.entrypoints.launchers.api_server.entry", False, False, True),
        (("-m", "--port", "8000"), "vllm.entrypoints.openai.api_server", False, False, True),
        (("-m", "serve", "m"), "vllm.entrypoints.cli.main", False, False, True),
        (SERVE_ARGV, None, False, True, True),  # 0.18–0.26 `vllm serve`
        (SERVE_ARGV, "__mp_main__", True, True, True),  # 0.18–0.26 spawned API-server rank
        (("-c",), None, False, False, False),  # any other Python program
    ],
)
def test_the_gate_runs_in_the_process_parsing_vllm_serve_arguments(
    argv, main_module, spawned, api_server_loaded, expected
):
    assert general.is_serve_process(argv, main_module, spawned, api_server_loaded) is expected


def test_with_the_middleware_bad_settings_still_stop_start_up_before_the_model_loads():
    with pytest.raises(NNRPStartupError, match="ws://x:1"):
        check(environ={"VLLM_NNRP_LISTEN": "ws://x:1"}, argv=WITH_MIDDLEWARE, version="0.22.1")


@pytest.mark.parametrize(
    ("serving", "expected"),
    [
        (SimpleNamespace(tool_parser=object()), True),  # 0.18 / 0.22 with --tool-call-parser
        (SimpleNamespace(tool_parser=None, parser_cls=None), False),  # 0.22 without
        (SimpleNamespace(parser_cls=SimpleNamespace(tool_parser_cls=object())), True),  # 0.26 with
        (SimpleNamespace(parser_cls=SimpleNamespace(tool_parser_cls=None)), False),  # 0.26, reasoning parser only
        (SimpleNamespace(parser_cls=None), False),  # 0.26 / 0.32 without
    ],
)
def test_tool_parser_is_found_where_each_line_keeps_it(serving, expected):
    assert families.has_tool_parser(serving) is expected


# the decision is made once and handed on


def test_the_service_start_takes_the_gates_decision_without_probing_again(fake_vllm, monkeypatch):
    fake_vllm("0.22.1")
    serve(monkeypatch, argv=WITH_MIDDLEWARE)
    monkeypatch.setattr(gate, "read_surface", lambda: pytest.fail("vLLM probed a second time"))
    decision = gate.decision_for(MIDDLEWARE)
    assert (decision.vllm_version, decision.binding.name, decision.attach_path) == ("0.22.1", "vllm-0.22", MIDDLEWARE)


def test_where_the_gate_did_not_run_the_service_start_decides_with_the_same_refusals(fake_vllm):
    fake_vllm("0.26.0")
    decision = gate.decision_for(MIDDLEWARE)
    assert (decision.vllm_version, decision.binding.name, decision.attach_path) == ("0.26.0", "vllm-0.26", MIDDLEWARE)
    fake_vllm("0.24.0")
    with pytest.raises(NNRPStartupError, match="vLLM 0.24.0 is not supported"):
        gate.decision_for(MIDDLEWARE)

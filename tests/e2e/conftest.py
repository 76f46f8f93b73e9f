"""A real ``vllm serve`` (CPU, SmolLM2-135M-Instruct) with the plugin enabled, shared by the e2e tests.

Needs the environment built by ``compat/run-vllm-tests.sh`` (vLLM in this interpreter's venv, the model
directory in ``VLLM_NNRP_TEST_MODEL``); without it these tests are skipped with that reason. Servers are started
by the checkout's launcher (:mod:`compat.launcher`), enabled through the installed anchor's own attach path
(:func:`compat.launcher.attach_options`): ``VLLM_PLUGINS=nnrp`` on 0.26 and 0.32, ``VLLM_PLUGINS=nnrp`` plus
``--middleware`` on 0.18/0.22.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pathlib
import time

import orjson
import pytest

from compat.launcher import POOLING_ARGS, SERVED_NAME, VLLMServer, attach_options, installed_vllm
from tests.support import free_port, self_signed
from vllm_nnrp_plugin.client import ProfileClient

__all__ = [
    "HAS_QUIC",
    "QUIC",
    "IN_FLIGHT_PER_SESSION",
    "MAX_SESSIONS",
    "LONG",
    "SERVED_NAME",
    "VLLMServer",
    "attach_options",
    "model_dir",
    "vllm_requests",
    "wait_idle",
]

MODEL_ENV = "VLLM_NNRP_TEST_MODEL"
#: the [quic] extra is installed (it is not in the vLLM 0.33/0.34 environments: aioquic's pyOpenSSL cannot take
#: the cryptography those lines resolve); without it servers listen on no quic:// address
HAS_QUIC = importlib.util.find_spec("aioquic") is not None
#: the "quic" carrier as a test parameter, skipped without the [quic] extra
QUIC = pytest.param(
    "quic", marks=pytest.mark.skipif(not HAS_QUIC, reason="the [quic] extra (aioquic) is not installed")
)
#: the shared server's ``nnrp.max_in_flight_per_session``
IN_FLIGHT_PER_SESSION = 16
MAX_SESSIONS = 300
#: a streamed request that generates for a long time (1000 tokens, EOS ignored): for cancel/shutdown tests
LONG = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Write a long story about the sea."}],
    "max_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
}


def _package_under_test() -> None:
    """With ``VLLM_NNRP_WHEEL`` set (CI: compat/run-vllm-tests.sh), the package must be the installed wheel, not the
    checkout beside these tests."""
    import vllm_nnrp_plugin

    checkout = pathlib.Path(__file__).resolve().parents[2]
    if os.environ.get("VLLM_NNRP_WHEEL") and checkout in pathlib.Path(vllm_nnrp_plugin.__file__).resolve().parents:
        raise pytest.UsageError(f"VLLM_NNRP_WHEEL is set but vllm_nnrp_plugin comes from the checkout {checkout}")


_package_under_test()


def model_dir() -> str:
    model = os.environ.get(MODEL_ENV)
    if not model:
        pytest.skip(f"{MODEL_ENV} is not set: run the e2e tests through compat/run-vllm-tests.sh (tox -e vllm-0.26.0)")
    return model


def vllm_requests(server) -> float:
    """Requests vLLM runs or queues right now (its ``vllm:num_requests_running`` + ``…_waiting`` gauges)."""
    return server.metric("vllm:num_requests_running") + server.metric("vllm:num_requests_waiting")


def wait_idle(server, timeout_s: float = 15.0) -> bool:
    """True once vLLM reports no running and no waiting request (polled every 0.2 s for up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if vllm_requests(server) == 0:
            return True
        time.sleep(0.2)
    return False


def running(server):
    """Yield ``server`` (a started :class:`VLLMServer`) once it answers, and stop it after, whatever happened."""
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_version():
    """(version, family) of the vLLM under test."""
    model_dir()
    return installed_vllm()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, vllm_version):
    """The plugin enabled through the anchor's attach path, listening on every carrier: a TCP port, a unix socket,
    TLS over TCP (``nnrps``), WebSocket plain and with TLS (``ws``, ``wss``) and QUIC where the [quic] extra is
    installed (:data:`HAS_QUIC`) (a self-signed certificate whose DER is ``server.der``). A session's in-flight limit is
    set to 16 (``nnrp.max_in_flight_per_session``; by
    default it is vLLM's ``max_num_seqs``) so that the limit and the ``openai`` transports' spread over sessions
    are reached with CPU-sized fan-outs; ``max_sessions`` is 300, room for 256 sessions on one carrier beside
    the other tests'."""
    workdir = tmp_path_factory.mktemp("vllm")
    cert, key, der = self_signed(workdir)
    nnrp = {
        "tcp": f"tcp://127.0.0.1:{free_port()}",
        "ipc": f"unix://{workdir}/nnrp.sock",
        "nnrps": f"nnrps://127.0.0.1:{free_port()}",
        "ws": f"ws://127.0.0.1:{free_port()}/nnrp",
        "wss": f"wss://127.0.0.1:{free_port()}/nnrp",
    }
    if HAS_QUIC:
        nnrp["quic"] = f"quic://127.0.0.1:{free_port()}"
    env, args = attach_options(vllm_version[1])
    config = {
        "tls_cert_file": cert,
        "tls_key_file": key,
        "max_in_flight_per_session": IN_FLIGHT_PER_SESSION,
        "max_sessions": MAX_SESSIONS,
    }
    additional = orjson.dumps({"nnrp": config}).decode()
    server = VLLMServer(
        model_dir(),
        workdir,
        env={**env, "VLLM_NNRP_LISTEN": ",".join(nnrp.values())},
        extra_args=(*args, "--additional-config", additional),
    )
    server.nnrp, server.der = nnrp, der
    server.version, server.family = vllm_version
    yield from running(server)


TOOL_TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "compat" / "tool_chat_template_hermes.jinja"
#: vLLM's ``olmo3`` reasoning parser works on the text (``<think>`` … ``</think>``, no special tokens) and starts
#: inside the reasoning block, so the small model's answer, which never writes ``</think>``, streams as reasoning
REASONING_ARGS = ("--reasoning-parser", "olmo3")


def _served_on_tcp(tmp_path_factory, vllm_version, name: str, extra_args: tuple[str, ...]):
    """The small model served with ``extra_args``, the plugin enabled through the anchor's attach path and
    listening on a TCP port (``server.nnrp["tcp"]``): yields the server once ready, stops it after."""
    workdir = tmp_path_factory.mktemp(name)
    tcp = f"tcp://127.0.0.1:{free_port()}"
    env, args = attach_options(vllm_version[1])
    server = VLLMServer(model_dir(), workdir, env={**env, "VLLM_NNRP_LISTEN": tcp}, extra_args=(*args, *extra_args))
    server.nnrp = {"tcp": tcp}
    server.version, server.family = vllm_version
    yield from running(server)


@pytest.fixture(scope="session")
def vllm_reasoning_server(tmp_path_factory, vllm_version):
    """A server with a reasoning parser (:data:`REASONING_ARGS`), NNRP on TCP."""
    yield from _served_on_tcp(tmp_path_factory, vllm_version, "vllm-reasoning", REASONING_ARGS)


@pytest.fixture(scope="session")
def vllm_tools_server(tmp_path_factory, vllm_version):
    """A second server with tool calling (``--enable-auto-tool-choice --tool-call-parser hermes`` and a Hermes
    chat template) and tracing on, exporting OTLP/HTTP to a collector started here (``server.collector``)."""
    from tests.e2e.otlp import Collector

    workdir = tmp_path_factory.mktemp("vllm-tools")
    collector = Collector()
    tcp = f"tcp://127.0.0.1:{free_port()}"
    attach_env, attach_args = attach_options(vllm_version[1])
    env = {
        **attach_env,
        "VLLM_NNRP_LISTEN": tcp,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    server = VLLMServer(
        model_dir(),
        workdir,
        env=env,
        extra_args=(
            *attach_args,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--chat-template",
            str(TOOL_TEMPLATE),
            "--otlp-traces-endpoint",
            collector.endpoint,
        ),
    )
    server.nnrp = {"tcp": tcp}
    server.version, server.family = vllm_version
    server.collector = collector
    try:
        yield from running(server)
    finally:
        collector.close()


@pytest.fixture(scope="session")
def vllm_pooling_server(tmp_path_factory, vllm_version):
    """The same model served as an embedding model (:data:`compat.launcher.POOLING_ARGS`: vLLM's ``embed``
    pooling task, no chat), the plugin enabled through the anchor's attach path, listening on a TCP port."""
    yield from _served_on_tcp(tmp_path_factory, vllm_version, "vllm-pooling", POOLING_ARGS)


@contextlib.contextmanager
def profile_client(server):
    """A profile client on ``server``'s NNRP TCP address, closed after."""
    client = asyncio.run(ProfileClient.connect(server.nnrp["tcp"]))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def plain_client(vllm_server):
    """A profile client on the shared server's NNRP TCP address (a server without a tool parser)."""
    with profile_client(vllm_server) as client:
        yield client

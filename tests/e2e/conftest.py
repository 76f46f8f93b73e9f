"""A real ``vllm serve`` (CPU, SmolLM2-135M-Instruct) with the plugin enabled, shared by the e2e tests.

Needs the environment built by ``compat/run-vllm-tests.sh`` (vLLM in this interpreter's venv, the model
directory in ``VLLM_NNRP_TEST_MODEL``); without it these tests are skipped with that reason. The server is
enabled through the installed anchor's own attach path (:func:`attach_options`): ``VLLM_PLUGINS=nnrp`` on
0.26, ``VLLM_PLUGINS=nnrp`` plus ``--middleware`` on 0.18/0.22.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support import free_port

MODEL_ENV = "VLLM_NNRP_TEST_MODEL"
SERVED_NAME = "example-model"
#: a streamed request that generates for a long time (1000 tokens, EOS ignored): for cancel/shutdown tests
LONG = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Write a long story about the sea."}],
    "max_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
}
START_TIMEOUT_S = 600


def installed_vllm() -> tuple[str, tuple[int, int]]:
    """``vllm.__version__`` and its (major, minor) family, read in a subprocess (importing vLLM is slow)."""
    done = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    version = done.stdout.strip().splitlines()[-1]
    major, minor = (int(p) for p in version.split(".")[:2])
    return version, (major, minor)


def attach_options(family: tuple[int, int]) -> tuple[dict[str, str], tuple[str, ...]]:
    """(environment, extra ``vllm serve`` args) enabling NNRP through the line's first attach path."""
    from vllm_nnrp_plugin.vllm_binding.families import MIDDLEWARE_PATH

    if family >= (0, 26):
        return {"VLLM_PLUGINS": "nnrp"}, ()
    return {"VLLM_PLUGINS": "nnrp"}, ("--middleware", MIDDLEWARE_PATH)


def model_dir() -> str:
    model = os.environ.get(MODEL_ENV)
    if not model:
        pytest.skip(f"{MODEL_ENV} is not set: run the e2e tests through compat/run-vllm-tests.sh (tox -e vllm-0.26.0)")
    return model


class VLLMServer:
    """One ``vllm serve`` process; ``http`` is its base URL, ``log`` its combined output file."""

    def __init__(self, workdir: pathlib.Path, *, env: dict[str, str], extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.http = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"vllm-{self.port}.log"
        vllm = pathlib.Path(sys.executable).with_name("vllm")
        base_env = {
            k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_NNRP_LISTEN")
        }
        base_env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        base_env.update(env)
        command = [
            str(vllm), "serve", model_dir(),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", SERVED_NAME,
            "--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager",
            *extra_args,
        ]  # fmt: skip
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(command, env=base_env, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=workdir)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.http}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"vllm serve not ready after {START_TIMEOUT_S} s:\n{self.tail()}")

    def wait_exit(self, timeout_s: float = START_TIMEOUT_S) -> int:
        return self.proc.wait(timeout_s)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def metric(self, name: str) -> float:
        """Sum of a Prometheus sample over all its label sets, from vLLM's own /metrics."""
        text = httpx.get(f"{self.http}/metrics", timeout=10).text
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()


@pytest.fixture(scope="session")
def vllm_version():
    """(version, family) of the vLLM under test."""
    model_dir()
    return installed_vllm()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, vllm_version):
    """The plugin enabled through the anchor's attach path, listening on a TCP port and a unix socket."""
    workdir = tmp_path_factory.mktemp("vllm")
    tcp = f"tcp://127.0.0.1:{free_port()}"
    ipc = f"unix://{workdir}/nnrp.sock"
    env, args = attach_options(vllm_version[1])
    server = VLLMServer(workdir, env={**env, "VLLM_NNRP_LISTEN": f"{tcp},{ipc}"}, extra_args=args)
    server.nnrp = {"tcp": tcp, "ipc": ipc}
    server.version, server.family = vllm_version
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


TOOL_TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "compat" / "tool_chat_template_hermes.jinja"


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
        **attach_env, "VLLM_NNRP_LISTEN": tcp,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200",
    }  # fmt: skip
    server = VLLMServer(workdir, env=env, extra_args=(
        *attach_args,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TOOL_TEMPLATE),
        "--otlp-traces-endpoint", collector.endpoint,
    ))  # fmt: skip
    server.nnrp = {"tcp": tcp}
    server.collector = collector
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        collector.close()

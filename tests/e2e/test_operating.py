"""Operating it safely, inside a real ``vllm serve`` (CPU): exposure misconfiguration stops start-up, no prompt
text in the log, and the one-minute soak (bench/soak.py) with zero lost operations and zero vLLM requests left
running (a session's in-flight limit on every carrier: tests/e2e/test_carriers_e2e.py)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import time

import pytest

from bench import soak
from tests.e2e.conftest import SERVED_NAME, attach_options
from tests.support import envelope, free_port
from vllm_nnrp_plugin.client import ProfileClient

pytestmark = pytest.mark.vllm

MARKER = "zebra-quartz-7731"


def test_no_prompt_text_reaches_the_log(vllm_server):
    client = asyncio.run(ProfileClient.connect(vllm_server.nnrp["tcp"]))
    try:
        ask = {"model": SERVED_NAME, "messages": [{"role": "user", "content": f"Repeat {MARKER}."}], "max_tokens": 4}
        list(client.events(client.submit(envelope(ask)), timeout_s=60))
        list(client.events(client.submit(envelope({**ask, "model": "nope"})), timeout_s=60))
        list(client.events(client.submit(envelope({**ask, "max_tokens": 100000})), timeout_s=60))
        op = client.submit(envelope({**ask, "stream": True, "max_tokens": 200}))
        client.cancel(op)
        list(client.events(op, timeout_s=60))
    finally:
        client.close()
    time.sleep(1)  # a negative check: a second more for any late log line that could carry the prompt
    assert MARKER not in vllm_server.output()


@pytest.mark.parametrize(
    "listen, fragment",
    [
        (lambda: f"tcp://0.0.0.0:{free_port()}", "allow_non_loopback"),
        (lambda: f"quic://127.0.0.1:{free_port()}", "tls_cert_file"),
    ],
)
def test_an_unsafe_exposure_stops_vllm_serve_at_start_up_with_the_fix(tmp_path, vllm_version, listen, fragment):
    vllm = pathlib.Path(sys.executable).with_name("vllm")
    attach_env, attach_args = attach_options(vllm_version[1])
    env = {**os.environ, **attach_env, "VLLM_NNRP_LISTEN": listen()}
    done = subprocess.run(
        [str(vllm), "serve", "unused-model", *attach_args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert fragment in done.stderr and "Fix:" in done.stderr


def test_one_minute_soak_loses_no_operation_and_leaves_no_vllm_request_running(vllm_server):
    args = soak._parser().parse_args(
        [
            "--nnrp",
            f"{vllm_server.nnrp['tcp']},{vllm_server.nnrp['ipc']}",
            "--http",
            vllm_server.http,
            "--pid",
            str(vllm_server.proc.pid),
            "--model-name",
            SERVED_NAME,
            "--duration-s",
            "60",
            "--sessions",
            "64",
            "--streams",
            "4",
            "--workers",
            "4",
            "--kill-every-s",
            "15",
            "--max-tokens",
            "24",
        ]
    )
    result = soak.run_soak(args)
    assert result["operations_lost"] == 0, result
    assert result["vllm_requests_after_load"] == 0, result
    assert result["operations_with_terminal"] > 0 and result["client_processes_killed"] >= 3, result
    assert result["sessions_not_opened"] == 0 and result["workers_hung"] == 0, result

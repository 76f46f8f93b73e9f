"""docs/security.md's recipe, "NNRP behind vLLM's key, over TLS", followed as an operator would, without vLLM: the
documented ``nnrp`` settings (``nnrps://<the server's address>:…``, a certificate and key) loaded as ``vllm serve``
loads them, a listener on that address (here 127.0.0.1 for the page's 192.0.2.10) requiring the key, and the
documented ``vllm-nnrp chat --endpoint nnrps://… --tls-ca …``
run as a separate process with ``VLLM_API_KEY`` exported. The same server refuses a client without the key, one
that does not trust the certificate, and a plain ``tcp://`` address reachable from other hosts."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.support import ServedNNRP, free_port, self_signed
from tests.test_docs_python import ExampleModelBackend
from tests.unit.test_docs_commands import blocks, commands
from vllm_nnrp_plugin.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "security.md"
KEY = "3f1c2a9d8e7b6a5f4e3d2c1b0a998877"
#: the page's stand-in for the server's address, and the address the test serves it on
DOCUMENTED_HOST, LOCAL_HOST = "192.0.2.10", "127.0.0.1"


def documented() -> tuple[dict, list[str]]:
    """The recipe's ``--additional-config`` block and its ``vllm-nnrp`` command line, as the page prints them."""
    (serve,) = [
        c for b in blocks([PAGE]) for c in commands(b) if "vllm serve" in c and f"nnrps://{DOCUMENTED_HOST}" in c
    ]
    additional = json.loads(re.search(r"--additional-config '(.*)'", serve)[1])
    (client,) = [c for b in blocks([PAGE]) for c in commands(b) if c.startswith("vllm-nnrp ")]
    return additional["nnrp"], shlex.split(client)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    settings, _ = documented()
    cert, key, _der = self_signed(tmp_path_factory.mktemp("tls"))
    port = free_port()
    settings = {
        **settings,
        "tls_cert_file": cert,
        "tls_key_file": key,
        "listen": [u.replace(f"{DOCUMENTED_HOST}:9443", f"{LOCAL_HOST}:{port}") for u in settings["listen"]],
    }
    config = load_config({"nnrp": settings}, {"VLLM_PLUGINS": "nnrp", "VLLM_API_KEY": KEY})
    fields = {k: getattr(config, k) for k in ("tls_cert_file", "tls_key_file", "max_in_flight")}
    server = ServedNNRP(config.listen, backend=ExampleModelBackend(), api_keys=(KEY,), **fields)
    yield server, cert, port
    server.stop()


def run_client(argv: list[str], cert: str, port: int, key: str | None) -> subprocess.CompletedProcess:
    """The documented command with the test server's address, port and certificate (server.crt: the self-signed
    one)."""
    argv = [a.replace(f"{DOCUMENTED_HOST}:9443", f"{LOCAL_HOST}:{port}").replace("server.crt", cert) for a in argv]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "OPENAI_API_KEY")}
    if key is not None:
        env["VLLM_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "vllm_nnrp_plugin.client.cli", *argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_the_recipe_listens_on_the_servers_address_over_tls(served):
    server, _cert, port = served
    assert server.bound == [f"nnrps://{LOCAL_HOST}:{port}"]


def test_the_documented_client_with_the_key_gets_an_answer(served):
    server, cert, port = served
    _, argv = documented()
    before = len(server.backend.started)
    done = run_client(argv, cert, port, KEY)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and len(server.backend.started) == before + 1


def test_without_the_key_the_client_is_refused_before_any_model_work(served):
    server, cert, port = served
    _, argv = documented()
    before = len(server.backend.started)
    for key in (None, "not-the-key"):
        done = run_client(argv, cert, port, key)
        assert done.returncode == 2 and "key" in done.stderr.lower(), done.stderr
    assert len(server.backend.started) == before


def test_a_client_that_does_not_trust_the_certificate_is_refused(served, tmp_path):
    server, _cert, port = served
    _, argv = documented()
    other_cert, _, _ = self_signed(tmp_path, "localhost")  # a certificate the server does not hold
    done = run_client(argv, other_cert, port, KEY)
    assert done.returncode == 2 and "certificate" in done.stderr.lower(), done.stderr


def test_the_same_exposure_without_tls_is_refused_at_start_up():
    settings, _ = documented()
    plain = {**settings, "listen": [f"tcp://{DOCUMENTED_HOST}:9400"]}
    with pytest.raises(ConfigError, match="reachable from other hosts without TLS"):
        load_config({"nnrp": plain}, {"VLLM_PLUGINS": "nnrp", "VLLM_API_KEY": KEY})

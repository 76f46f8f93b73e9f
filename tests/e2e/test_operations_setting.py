"""``nnrp.operations`` inside a real ``vllm serve``: naming an operation this server does not serve stops it at
start-up with a message naming what it does serve (the Level-1-only deployment itself is exercised by
``compat/run-conformance.sh``'s ``level1`` run, where the suite's ``unsupported-operation`` case passes)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import VLLMServer, attach_options, model_dir
from tests.support import free_port

pytestmark = pytest.mark.vllm


def test_an_operation_the_server_does_not_serve_stops_vllm_serve(tmp_path, vllm_version):
    if vllm_version[1] != (0, 26):
        pytest.skip(
            "run on the default anchor only: the check is line-independent (vllm_binding/backend.py), and a "
            "start-up refusal stopping vllm serve is proven on every anchor by test_level3's classify server"
        )
    env, args = attach_options(vllm_version[1])
    settings = {
        "nnrp": {
            "listen": [f"tcp://127.0.0.1:{free_port()}"],
            "operations": ["chat.completions.create", "embeddings.create"],
        }
    }
    server = VLLMServer(model_dir(), tmp_path, env=env, extra_args=[*args, "--additional-config", json.dumps(settings)])
    try:
        assert server.wait_exit() != 0
        output = server.output()
        assert "nnrp.operations names embeddings.create, which this vLLM server does not serve" in output
        assert "it serves: chat.completions.create" in output
    finally:
        server.stop()

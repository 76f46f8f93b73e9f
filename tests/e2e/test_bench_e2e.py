"""A short run of the end-to-end benchmark against the shared real ``vllm serve``, and of the parser-cost benchmark
on the installed vLLM's hermes parser (they must run; the numbers of a smoke run mean nothing)."""

from __future__ import annotations

import types

import pytest

from tests.e2e.conftest import model_dir

pytestmark = pytest.mark.vllm


def test_e2e_benchmark_compares_nnrp_and_http_on_the_same_server(vllm_server):
    from bench import e2e

    server = types.SimpleNamespace(http=vllm_server.http, nnrp=vllm_server.nnrp, pid=vllm_server.proc.pid)
    rows = {
        r.id: r for r in e2e.run(server=server, levels=(1, 2), per_worker=1, rounds=1, max_tokens=4, baseline=False)
    }
    for c in (1, 2):
        for metric in ("ttft", "itl", "total", "tokens_per_s"):
            http, nnrp = rows[f"e2e.c{c}.{metric}.http"], rows[f"e2e.c{c}.{metric}.nnrp"]
            assert http.samples and nnrp.samples and nnrp.compare["against"] == http.id
        assert rows[f"e2e.c{c}.ttft.nnrp"].samples == c and rows[f"e2e.c{c}.tokens_per_s.nnrp"].p50 > 0
        assert rows[f"e2e.c{c}.ttft_ratio.nnrp_over_http"].p50 > 0
        overhead = rows[f"e2e.c{c}.ttft_minus_vllm_first_chunk.nnrp"]  # from the operations' diagnostics
        assert overhead.samples == c and 0 < overhead.p50 < rows[f"e2e.c{c}.ttft.nnrp"].p50
    assert 100 < rows["e2e.rss.api_server_with_nnrp"].p50 < 20_000  # MB of a real API-server process


def test_quick_parser_cost_benchmark_drives_vllms_hermes_parser():
    from bench.suite import QUICK

    rows = {r.id: r for r in QUICK["parser"](model=model_dir())}
    for kind in ("content", "tool_call"):
        assert rows[f"parser_cost.{kind}.n16"].p50 > 0 and rows[f"parser_cost.{kind}.n32"].samples == 1
        assert rows[f"parser_cost.{kind}.growth"].p50 > 0

"""The quick load benchmark (``python -m bench load --quick``): its own real ``vllm serve`` of the tiny model
(``--load-format dummy``), HTTP/SSE and NNRP windows (a session per stream, and the agent shape), the floor
(requests drained inside the API server), the cancels under load, the bursts and the idle sessions; and the same
levels on an agent server (``--load-tools``). It must run and fail no request; the numbers of a smoke run mean
nothing."""

from __future__ import annotations

import pathlib

import orjson
import pytest

from tests.e2e.conftest import model_dir

pytestmark = pytest.mark.vllm


def test_tiny_model_keeps_the_real_tokenizer_and_has_no_weights(tmp_path, monkeypatch):
    from bench import tiny_model

    monkeypatch.setenv("VLLM_NNRP_CACHE", str(tmp_path))
    tiny = tiny_model.build(model_dir())
    assert tiny == tiny_model.build(model_dir()) and (tiny / ".complete").is_file()  # built once, then reused
    config = orjson.loads((tiny / "config.json").read_bytes())
    assert {k: config[k] for k in tiny_model.TINY} == tiny_model.TINY
    assert config["architectures"] == ["LlamaForCausalLM"]
    source = {p.name for p in pathlib.Path(model_dir()).iterdir()}
    copied = {p.name for p in tiny.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= copied <= source | {".complete"}
    assert not [name for name in copied if name.endswith(tiny_model.SKIPPED_SUFFIXES)]


def test_quick_load_benchmark_runs_both_protocols_without_failures():
    from bench.suite import QUICK

    rows = {r.id: r for r in QUICK["load"](model=model_dir())}
    cpu = ("api_server_cpu_us_per_token", "engine_cpu_us_per_token", "client_cpu_us_per_token")
    for metric in (*cpu, "tokens_per_s", "ttft", "gap"):
        http, nnrp = rows[f"load.c4.{metric}.http"], rows[f"load.c4.{metric}.nnrp"]
        assert http.samples and nnrp.samples and nnrp.compare["against"] == http.id
        assert f"load.c4.{metric}_ratio.nnrp_over_http" in rows
    for protocol in ("http", "nnrp"):
        assert rows[f"load.c4.failed.{protocol}"].max == 0, rows[f"load.c4.failed.{protocol}"].note
        assert rows[f"load.burst.failed.{protocol}"].max == 0, rows[f"load.burst.failed.{protocol}"].note
        assert rows[f"load.c4.ttft.{protocol}"].samples == 4 and rows[f"load.c4.tokens_per_s.{protocol}"].p50 > 0
        assert rows[f"load.burst.served_ms.{protocol}"].samples == 8
    for metric in (*cpu, "tokens_per_s", "ttft", "gap"):  # the agent shape: 2 sessions of 2 streams
        assert rows[f"load.c4.shared2.{metric}.nnrp"].compare["against"] == f"load.c4.{metric}.http"
        assert f"load.c4.shared2.{metric}_ratio.nnrp_over_http" in rows
    assert rows["load.c4.shared2.failed.nnrp"].max == 0, rows["load.c4.shared2.failed.nnrp"].note
    assert rows["load.c4.shared2.ttft.nnrp"].samples == 4
    assert rows["load.burst.open_ms.nnrp"].samples == 8
    for protocol in ("http", "nnrp"):  # both bursts under the same NNRP load
        assert rows[f"load.burst_under_load.open_ms.{protocol}"].samples == 8
        for name in (f"load.burst_under_load.failed.{protocol}", f"load.burst_under_load.load_failed.{protocol}"):
            assert rows[name].max == 0, rows[name].note
    assert rows["load.burst_under_load.open_ms.nnrp"].compare["against"] == "load.burst_under_load.open_ms.http"
    assert rows["load.cancel.c8.failed.nnrp"].max == 0, rows["load.cancel.c8.failed.nnrp"].note
    assert rows["load.cancel.c8.no_terminal_within_10s.nnrp"].max == 0
    assert (
        rows["load.cancel.c8.client_cancel_to_terminal_ms.nnrp"].samples == 4
    )  # 256-token streams outlast the cancels
    assert rows["load.cancel.c8.server_cancel_to_abort_ms.nnrp"].samples == 4
    assert rows["load.idle.api_server_cpu_pct.sessions_open"].samples == 2
    assert "load.idle.api_server_cpu_pct.sessions_minus_no_sessions" in rows
    # the floor: the same requests drained inside the API server (bench/drain.py), every output token counted
    assert rows["load.c4.failed.floor"].max == 0, rows["load.c4.failed.floor"].note
    assert rows["load.c4.tokens_per_s.floor"].p50 > 0
    # CPU time is read in clock ticks (10 ms, /proc/<pid>/stat): the 64 drained tokens of a quick window may cost less
    # than one, so here only its sample is required (a real run's windows last seconds)
    assert rows["load.c4.api_server_cpu_us_per_token.floor"].samples == 1


def test_quick_load_benchmark_on_an_agent_server_runs_without_failures():
    """``--load-tools``: a hermes tool-call parser on the server and a tool in every request."""
    from bench.suite import QUICK

    rows = {r.id: r for r in QUICK["load"](model=model_dir(), load_tools=True)}
    for head, tail in (
        ("load.tools.c4", "http"),
        ("load.tools.c4", "nnrp"),
        ("load.tools.c4.shared2", "nnrp"),
        ("load.tools.c4", "floor"),
    ):
        assert rows[f"{head}.failed.{tail}"].max == 0, rows[f"{head}.failed.{tail}"].note
        assert rows[f"{head}.tokens_per_s.{tail}"].p50 > 0
    assert rows["load.tools.c4.api_server_cpu_us_per_token.nnrp"].parameters["server"] == "hermes tool parser"
    assert not [r for r in rows if r.startswith(("load.tools.cancel", "load.tools.burst", "load.tools.idle"))]


def test_quick_carriers_benchmark_drives_every_carrier_without_failures():
    """``python -m bench carriers --quick``: one server on tcp, nnrps, ws, wss and quic, the same load client on
    each; every carrier streams, cancels and holds idle sessions without a failure or a new thread."""
    from bench.carriers import BASE, CARRIERS
    from bench.suite import QUICK

    rows = {r.id: r for r in QUICK["carriers"](model=model_dir())}
    for carrier in CARRIERS:
        assert rows[f"carriers.c4.failed.{carrier}"].max == 0, rows[f"carriers.c4.failed.{carrier}"].note
        assert rows[f"carriers.c4.tokens_per_s.{carrier}"].p50 > 0
        assert rows[f"carriers.c4.api_server_cpu_us_per_token.{carrier}"].samples == 1
        cancel = f"carriers.{carrier}.cancel.c8"
        assert rows[f"{cancel}.failed.nnrp"].max == 0 and rows[f"{cancel}.no_terminal_within_10s.nnrp"].max == 0
        assert rows[f"{cancel}.server_cancel_to_abort_ms.nnrp"].samples == 4
        assert rows[f"{cancel}.server_cancel_to_abort_p99_ms.nnrp"].targets
        assert rows[f"carriers.{carrier}.threads.api_server.sessions_minus_no_sessions"].max == 0
    for carrier, base in BASE.items():
        ratio = rows[f"carriers.c4.api_server_cpu_us_per_token_ratio.{carrier}_over_{base}"]
        assert ratio.samples == 1 and ratio.targets

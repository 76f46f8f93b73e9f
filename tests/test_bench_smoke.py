"""A short run of each in-process / loopback benchmark through ``python -m bench --quick`` from the checkout
(it must run and write its results; the numbers of a smoke run mean nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import orjson

from tests.support import ROOT


def test_bench_quick_writes_json_and_markdown_rows(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "mapper",
            "latency",
            "cancel",
            "--quick",
            "--out",
            str(tmp_path),
            "--name",
            "smoke",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    doc = orjson.loads((tmp_path / "smoke.json").read_bytes())
    assert doc["kind"] == "benchmark-results" and doc["adapter"] == "vllm-nnrp-plugin"
    assert doc["machine"]["logical_cpus"] and doc["versions"]["nnrp-py"]
    rows = {row["id"]: row for row in doc["results"]}
    expected = {
        "mapper.feed",
        "mapper.sse_to_partial",
        "event_latency.light.tcp",
        "event_latency.light.tcp_without_nodelay",
        "event_latency.light.ipc",
        "event_latency.heavy.tcp",
        "event_latency.heavy.ipc",
        *(
            f"cancel.{m}.{t}"
            for m in ("no_more_events", "server_saw_cancel", "abort_issued", "client_terminal")
            for t in ("tcp", "ipc")
        ),
    }
    assert set(rows) == expected
    for row in rows.values():
        assert row["outcome"] == "passed" and row["samples"] > 0 and row["p50"] <= row["p95"] <= row["max"]
    assert rows["event_latency.heavy.tcp"]["samples"] >= 8 * 10  # every stream delivered its events
    assert rows["mapper.feed"]["targets"][0] == {
        "stat": "p50",
        "op": ">=",
        "value": 300000,
        "met": rows["mapper.feed"]["target_met"],
    }
    assert rows["event_latency.light.ipc"]["compare"]["against"] == "event_latency.light.tcp"
    table = (tmp_path / "smoke.md").read_text()
    assert "| `cancel.no_more_events.ipc` | us |" in table and "logical CPUs" in table


def test_load_rounds_reach_the_load_benchmark(monkeypatch, tmp_path):
    from bench import suite
    from bench.results import Result

    seen = []

    class Load:
        @staticmethod
        def run(**kw):
            seen.append(kw)
            return [Result.of("load.c4.tokens_per_s.http", "tokens/s", [1.0])]

    monkeypatch.setattr(suite, "_load", lambda: Load)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.0"))  # the unit run has no vLLM
    monkeypatch.setattr(suite, "document", lambda rows, **_: {"rows": [r.id for r in rows]})
    monkeypatch.setattr(suite, "write", lambda doc, out, name: (out / f"{name}.json", _md(out, name)))
    for argv, rounds in ((["load", "--load-rounds", "4"], 4), (["load"], 2), (["load", "--quick"], 1)):
        assert suite.main([*argv, "--out", str(tmp_path), "--model", "m"]) == 0
        assert seen.pop()["rounds"] == rounds


def _md(out, name):
    path = out / f"{name}.md"
    path.write_text("rows\n")
    return path


def _server_cpu(*args: str, timeout_s: float = 120) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "bench.server_cpu", "--streams", "4", "--sessions", "2", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr
    return orjson.loads(done.stdout)


def test_server_cpu_streams_every_chunk_and_reports_the_servers_cpu_per_chunk():
    result = _server_cpu("--chunks", "50", "--interval-us", "500")
    assert result["chunks"] == 200 and result["sessions"] == 2 and result["rounds"] == 1
    (server,) = result["servers"]
    assert server["server_root"] == str(ROOT)
    (events,), (cpu_s,), (us,) = server["events"], server["cpu_s"], server["us_per_chunk"]
    assert 4 < events <= 200 + 4  # a partial per chunk (fewer if merged) and one terminal per stream
    assert cpu_s > 0 and abs(us - cpu_s * 1e6 / 200) < 0.01 and server["median_us_per_chunk"] == us


def test_server_cpu_side_by_side_measures_each_tree_every_round_against_the_first(tmp_path):
    other = tmp_path / "other"
    other.symlink_to(ROOT)  # a second checkout: the same tree under another name
    roots = ["--server-root", str(ROOT), "--server-root", str(other)]
    result = _server_cpu("--chunks", "50", "--interval-us", "500", "--rounds", "2", *roots)
    first, second = result["servers"]
    assert (first["server_root"], second["server_root"]) == (str(ROOT), str(ROOT))  # resolved
    for server in (first, second):
        assert len(server["events"]) == len(server["us_per_chunk"]) == 2 and all(n > 4 for n in server["events"])
    diffs = [b - a for a, b in zip(first["us_per_chunk"], second["us_per_chunk"], strict=True)]
    assert "diff_us" not in first
    assert second["diff_us"]["dearer_rounds"] == sum(d > 0 for d in diffs)
    assert abs(second["diff_us"]["median"] - sum(diffs) / 2) < 0.011

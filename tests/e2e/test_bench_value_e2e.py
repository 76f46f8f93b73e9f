"""The quick value benchmark (``python -m bench value --quick``): its own real ``vllm serve`` of the tiny model
(``--load-format dummy``, ``--scheduling-policy priority``, ``--max-num-seqs 4``) and the three scenarios of
:mod:`bench.value` in tiny sizes: interactive calls beside background streams over NNRP (priority classes) and
HTTP, an agent whose stale calls are superseded / closed / read to the end, calls with a deadline. It must run,
fail no call, and show what holds at any size: a stale call read to the end costs its whole budget, one ended
early costs at least what was read and less than that, and no NNRP result comes long after its deadline (1 s: a
bound, not a timing)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import model_dir

pytestmark = pytest.mark.vllm


def test_quick_value_benchmark_runs_every_scenario_without_failures():
    from bench.suite import QUICK
    from bench.value import AGENT_TOKENS, STALE_AFTER, STALE_RUNS

    rows = {r.id: r for r in QUICK["value"](model=model_dir())}
    runs = {"priority": ("http", "nnrp"), "stale": [run[0] for run in STALE_RUNS], "deadline": ("http", "nnrp")}
    for name in [f"value.{scenario}.failed.{run}" for scenario, names in runs.items() for run in names]:
        assert rows[name].max == 0, rows[name].note
    for protocol in ("http", "nnrp"):  # 4 calls a second for 2 s, all answered
        ttft = rows[f"value.priority.interactive_ttft.{protocol}"]
        assert ttft.samples == 8 and ttft.p50 > 0, ttft.note
        assert rows[f"value.priority.background_tokens_per_s.{protocol}"].p50 > 0
    ratio = rows["value.priority.interactive_ttft_ratio.nnrp_over_http"]
    assert ratio.p95 > 0 and ratio.targets
    # the NNRP runs used the client's scheduling API, not its fallbacks (bench.value_client's features)
    used = rows["value.priority.interactive_ttft.nnrp"].parameters["nnrp_client"].split(",")
    assert {"session_priority_class", "submit_priority_class"} <= set(used)
    assert rows["value.stale.stale_tokens.nnrp_supersede"].parameters["nnrp_client"] == "supersede"
    assert rows["value.deadline.late_pct.nnrp"].parameters["nnrp_client"] == "deadline"
    # 10 calls, 3 of them stale (seeded): read to the end, each costs its whole budget
    read = rows["value.stale.stale_tokens.http_read"]
    assert read.p50 == 3 * AGENT_TOKENS, read.note
    for run in ("nnrp_supersede", "http_close"):  # ended after STALE_AFTER deltas: at least those, less than the budget
        stale = rows[f"value.stale.stale_tokens.{run}"]
        assert 3 * STALE_AFTER <= stale.p50 < 3 * AGENT_TOKENS, stale.note
    assert "value.stale.stale_tokens_ratio.nnrp_supersede_over_http_close" in rows
    deadline_ms = rows["value.deadline.late_pct.nnrp"].parameters["deadline_ms"]
    calls = 8  # 4 a second for 2 s
    completed = rows["value.deadline.completed_latency.nnrp"]
    done = completed.samples if completed.max else 0
    assert done + rows["value.deadline.expired.nnrp"].p50 == calls  # every call completed or ended for its deadline
    assert completed.max <= deadline_ms + 1000, completed  # the server ended the others at their deadline
    assert rows["value.deadline.expired.http"].p50 == 0  # nothing tells vLLM's HTTP server about a deadline
    assert rows["value.deadline.completed_latency.http"].samples == calls

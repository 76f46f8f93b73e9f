"""Two real ``vllm serve`` replicas (the tiny random-weight model of :mod:`bench.tiny_model`, NNRP on 127.0.0.2 and
127.0.0.3, same port) and the ``openai`` SDK in the NNRP client's fleet mode: one replica is stopped with SIGTERM
(vLLM's shutdown runs the plugin's drain, ``nnrp.drain_timeout_ms``) while streams run, then killed outright
after its restart. Every call that had not started completes on the other replica, every stream the drain found
running completes, streams cut by the kill fail with ``APIConnectionError`` within a second, nothing hangs.

Marked ``fleet`` and run only when asked (``-m fleet``): it starts three vLLM servers (about 2–3 minutes)::

    bash compat/run-vllm-tests.sh 0.26.0 -q -p no:cacheprovider -m fleet tests/e2e/test_fleet_e2e.py
"""

from __future__ import annotations

import asyncio

import pytest

from bench import fleet as bench_fleet
from bench import tiny_model
from compat.launcher import free_port
from tests.e2e.conftest import model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]


@pytest.fixture(scope="module")
def replicas(request, tmp_path_factory):
    if "fleet" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("starts several vllm serve replicas: run with -m fleet")
    workdir = str(tmp_path_factory.mktemp("fleet"))
    tiny = str(tiny_model.build(model_dir()))
    port = free_port()
    started = [bench_fleet.Replica(tiny, workdir, host, port, free_port(), 64) for host in bench_fleet.REPLICA_HOSTS]
    try:
        for replica in started:
            replica.start()
        for replica in started:
            replica.wait_ready()
        yield started
    finally:
        for replica in started:
            replica.stop()


def test_a_rolling_restart_and_a_kill_lose_no_unstarted_call_and_hang_nothing(replicas, monkeypatch):
    monkeypatch.setattr(bench_fleet, "SETTLE_S", 4.0)
    rolling = asyncio.run(bench_fleet.scenario("rolling", "fleet", replicas, None, streams=8, max_tokens=32))
    assert rolling["failed_unstarted"] == 0 and rolling["hung"] == 0, rolling
    assert rolling["cut"] == 0, rolling  # the drain let every running stream finish
    assert rolling["ok"] > 50, rolling
    killed = asyncio.run(bench_fleet.scenario("kill", "fleet", replicas, None, streams=8, max_tokens=256))
    assert killed["failed_unstarted"] == 0 and killed["hung"] == 0, killed
    assert killed["ok"] > 8, killed
    if killed["cut"]:
        assert killed["cut_after_kill_s"] is not None and killed["cut_after_kill_s"] < 1.0, killed

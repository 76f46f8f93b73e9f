"""The --middleware attach path in a real Starlette/FastAPI app: lifespan order, HTTP pass-through, and one
listener when the endpoint plugin attached first (the service itself is replaced by a recorder here; inside
real ``vllm serve`` it runs in tests/e2e)."""

from __future__ import annotations

import contextlib

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_nnrp_plugin.vllm_binding import endpoint, middleware
from vllm_nnrp_plugin.vllm_binding.endpoint import NNRPEndpointPlugin
from vllm_nnrp_plugin.vllm_binding.families import NNRPStartupError
from vllm_nnrp_plugin.vllm_binding.middleware import NNRPMiddleware


@pytest.fixture
def calls(monkeypatch):
    calls = []

    async def start(state, attach_path):
        calls.append(("start", attach_path, state.vllm_state))

    async def stop(state):
        calls.append(("stop", state.vllm_state))

    for module in (endpoint, middleware):
        monkeypatch.setattr(module, "start_service", start)
        monkeypatch.setattr(module, "stop_service", stop)
    return calls


def vllm_like_app(calls):
    """An app whose own lifespan fills ``app.state`` and deletes it on the way out, like vLLM's."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.vllm_state = "ready"
        calls.append(("vllm up",))
        try:
            yield
        finally:
            calls.append(("vllm down",))
            app.state.vllm_state = "deleted"

    app = FastAPI(lifespan=lifespan)

    @app.get("/ping")
    def ping():
        return {"ok": True}

    return app


def test_starts_after_vllm_state_is_ready_and_stops_before_it_is_deleted(calls):
    app = vllm_like_app(calls)
    app.add_middleware(NNRPMiddleware)  # what vLLM does for --middleware <class>
    with TestClient(app) as client:
        assert client.get("/ping").json() == {"ok": True}
    assert calls == [("vllm up",), ("start", "middleware", "ready"), ("stop", "ready"), ("vllm down",)]


def test_with_the_endpoint_plugin_too_only_one_listener_starts(calls):
    app = vllm_like_app(calls)
    NNRPEndpointPlugin().attach_router(app)  # build_app: endpoint plugins attach first
    app.add_middleware(NNRPMiddleware)
    with TestClient(app):
        pass
    starts = [c for c in calls if c[0] == "start"]
    assert starts == [("start", "endpoint-plugin", "ready")]
    assert [c for c in calls if c[0] == "stop"] == [("stop", "ready")]


def test_a_start_up_error_fails_the_lifespan_with_the_message(monkeypatch, calls):
    async def refuse(state, attach_path):
        raise NNRPStartupError("vllm-nnrp-plugin: cannot listen. Fix: free the port")

    monkeypatch.setattr(middleware, "start_service", refuse)
    app = vllm_like_app(calls)
    app.add_middleware(NNRPMiddleware)
    with pytest.raises(NNRPStartupError, match="Fix: free the port"):
        with TestClient(app):
            pass
    assert calls[-1] == ("vllm down",)  # vLLM's own lifespan still cleaned up

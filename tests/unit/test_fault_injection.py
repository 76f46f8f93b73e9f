"""``nnrp.fault_injection_backend_error_model`` is installed by the vLLM binding's start-up
(:func:`vllm_nnrp_plugin.vllm_binding.lifecycle.start_service`), around the backend it hands to the service."""

from __future__ import annotations

import asyncio
import types

import pytest

from vllm_nnrp_plugin.profile.errors import ProfileError
from vllm_nnrp_plugin.vllm_binding import lifecycle
from vllm_nnrp_plugin.vllm_binding.fault_injection import BackendErrorInjector


class _Backend:
    """Stands in for :class:`VLLMBackend` (what ``start_service`` calls on it, nothing more)."""

    def __init__(self, state, operations, **_: object) -> None:
        pass

    async def prove_lanes(self) -> None:
        pass

    def model_ids(self) -> list[str]:
        return ["example-model"]

    def stream_paths(self) -> list[tuple[str, str]]:
        return []

    def priority_note(self) -> str:
        return "none"


def _served_backend(monkeypatch, nnrp: dict) -> object:
    """The backend ``start_service`` gives the service for these ``nnrp`` settings."""
    given = {}

    class Service:
        metrics_address = None

        def __init__(self, config, backend, loop, *, keys) -> None:
            given["backend"] = backend

        async def start(self) -> list[str]:
            return ["tcp://127.0.0.1:9400"]

        async def drain(self, grace_s: float) -> None:
            pass

    decision = types.SimpleNamespace(vllm_version="0.0.0", binding=types.SimpleNamespace(name="test"), untested=False)
    monkeypatch.setattr(lifecycle, "VLLMBackend", _Backend)
    monkeypatch.setattr(lifecycle, "NNRPService", Service)
    monkeypatch.setattr(lifecycle, "decision_for", lambda *_: decision)
    monkeypatch.setattr(lifecycle, "api_keys", lambda *_: ())
    monkeypatch.setattr(lifecycle, "stop_before_engine_shutdown", lambda *_, **__: lambda: None)
    state = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(
            additional_config={"nnrp": {"enabled": True, **nnrp}},
            parallel_config=types.SimpleNamespace(),
            scheduler_config=types.SimpleNamespace(max_num_seqs=4),
        ),
        engine_client=None,
    )
    asyncio.run(lifecycle.start_service(state, "endpoint"))
    return given["backend"]


def test_the_start_up_serves_the_backend_itself_by_default(monkeypatch):
    assert isinstance(_served_backend(monkeypatch, {}), _Backend)


def test_the_start_up_wraps_the_backend_when_the_setting_names_a_model(monkeypatch, caplog):
    served = _served_backend(monkeypatch, {"fault_injection_backend_error_model": "backend-error"})
    assert isinstance(served, BackendErrorInjector) and served.model == "backend-error"
    assert "NNRP test-only fault injection is ON" in caplog.text


def test_the_injector_fails_its_model_and_passes_every_other_through():
    class Backend(_Backend):
        async def create(self, operation, body, request_id, traceparent=None, controls=None):
            return "created"

    injector = BackendErrorInjector(Backend(None, None), "backend-error")
    with pytest.raises(ProfileError) as failed:
        asyncio.run(injector.create("chat.completions.create", {"model": "backend-error"}, "r1"))
    assert (failed.value.code, failed.value.status) == ("backend_error", 500)
    assert asyncio.run(injector.create("chat.completions.create", {"model": "m"}, "r2")) == "created"

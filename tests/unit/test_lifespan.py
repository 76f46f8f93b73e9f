import asyncio
import types

from vllm_nnrp_plugin.vllm_binding.endpoint import NNRPEndpointPlugin, nnrp_lifespan


def fake_app(additional_config):
    state = types.SimpleNamespace(vllm_config=types.SimpleNamespace(additional_config=additional_config))
    return types.SimpleNamespace(state=state)


def test_disabled_in_config_starts_nothing(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "nnrp")
    app = fake_app({"nnrp": {"enabled": False}})

    async def run():
        async with nnrp_lifespan(app):
            return getattr(app.state, "nnrp_service", None)

    assert asyncio.run(run()) is None


def test_the_listener_is_never_attached_twice():
    routers = []
    app = types.SimpleNamespace(state=types.SimpleNamespace(), include_router=routers.append)
    plugin = NNRPEndpointPlugin()
    plugin.attach_router(app)
    plugin.attach_router(app)
    assert len(routers) == 1

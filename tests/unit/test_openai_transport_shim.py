"""The deprecated import path ``vllm_nnrp_plugin.openai_transport`` (CHANGELOG.md): it still gives the names the old
module exported, the very objects of :mod:`vllm_nnrp_plugin.client`, and warns with a ``DeprecationWarning`` that
points at :mod:`vllm_nnrp_plugin.client`."""

import importlib
import os
import subprocess
import sys

import pytest

import vllm_nnrp_plugin.client as client

OLD = "vllm_nnrp_plugin.openai_transport"
#: ``__all__`` of the module at the old path, before it moved (git history of vllm_nnrp_plugin/openai_transport.py)
OLD_NAMES = ["AsyncNNRPTransport", "NNRPTransport"]


def _import_fresh():
    sys.modules.pop(OLD, None)
    return importlib.import_module(OLD)


def test_importing_the_old_path_warns_and_names_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"openai_transport is deprecated.*from vllm_nnrp_plugin\.client$"):
        _import_fresh()


def test_the_old_names_are_the_new_objects():
    with pytest.warns(DeprecationWarning):
        old = _import_fresh()
    assert sorted(old.__all__) == OLD_NAMES
    for name in OLD_NAMES:
        assert getattr(old, name) is getattr(client, name)
    from vllm_nnrp_plugin.openai_transport import AsyncNNRPTransport, NNRPTransport  # the old import line works

    assert (NNRPTransport, AsyncNNRPTransport) == (client.NNRPTransport, client.AsyncNNRPTransport)


def test_a_script_sees_the_warning_under_pythons_default_filters():
    """Attributed to the importing code, not to the import machinery: Python shows it in ``__main__`` without
    any ``-W`` option, as it shows every deprecation there."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-c", f"import {OLD}"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "<string>:1: DeprecationWarning: vllm_nnrp_plugin.openai_transport is deprecated" in done.stderr

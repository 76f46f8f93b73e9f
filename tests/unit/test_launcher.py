"""The checkout's ``vllm serve`` launcher (compat/launcher.py) enables NNRP through each line's own attach path,
taken from the family bindings, and never needs pytest. Starting real servers is tested in tests/e2e."""

from __future__ import annotations

import subprocess
import sys

import pytest

from compat.launcher import attach_options
from tests.support import ROOT
from vllm_nnrp_plugin.vllm_binding.families import BINDINGS, ENDPOINT_PLUGIN, MIDDLEWARE_PATH


@pytest.mark.parametrize("binding, family", [(b, f) for b in BINDINGS for f in b.families], ids=str)
def test_each_line_is_enabled_through_its_first_attach_path(binding, family):
    env, args = attach_options(family)
    assert env == {"VLLM_PLUGINS": "nnrp"}
    assert args == (() if binding.attach_paths[0] == ENDPOINT_PLUGIN else ("--middleware", MIDDLEWARE_PATH))


def test_a_line_without_binding_gets_the_explicit_flag_for_the_gate_to_refuse():
    assert attach_options((0, 24)) == ({"VLLM_PLUGINS": "nnrp"}, ("--middleware", MIDDLEWARE_PATH))


def test_the_launcher_and_the_bench_import_without_pytest():
    check = "import sys; sys.modules['pytest'] = None; import compat.launcher, bench.e2e, bench.soak; print('ok')"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

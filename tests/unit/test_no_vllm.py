import subprocess
import sys

CHECK = """
import sys
sys.modules["vllm"] = None  # any `import vllm` now raises ImportError
import vllm_nnrp_plugin.adapter, vllm_nnrp_plugin.service
import vllm_nnrp_plugin.vllm_binding.endpoint, vllm_nnrp_plugin.vllm_binding.gate
from vllm_nnrp_plugin.vllm_binding.general import register
register()  # not inside a vLLM API server: does nothing, imports nothing
assert not [m for m in sys.modules if m.startswith("vllm_nnrp_plugin.client")]  # the server side never imports it
import vllm_nnrp_plugin.client.cli, vllm_nnrp_plugin.client.conformance.runner
from vllm_nnrp_plugin.client import *  # every exported name resolves
print("ok")
"""


def test_the_package_imports_and_registers_without_vllm():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

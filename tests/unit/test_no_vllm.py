import subprocess
import sys

CHECK = """
import sys
sys.modules["vllm"] = None  # any `import vllm` now raises ImportError
import vllm_nnrp_plugin.adapter, vllm_nnrp_plugin.service, vllm_nnrp_plugin.client, vllm_nnrp_plugin.cli
import vllm_nnrp_plugin.vllm_binding.endpoint, vllm_nnrp_plugin.vllm_binding.gate
from vllm_nnrp_plugin.vllm_binding.general import register
register()  # not inside a vLLM API server: does nothing, imports nothing
print("ok")
"""


def test_the_package_imports_and_registers_without_vllm():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

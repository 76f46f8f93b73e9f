import subprocess
import sys

CHECK = """
import sys
sys.modules["vllm"] = None  # any `import vllm` now raises ImportError
import vllm_nnrp_plugin.core.adapter, vllm_nnrp_plugin.service
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


CLIENT_ONLY = """
import sys
import vllm_nnrp_plugin.client.cli, vllm_nnrp_plugin.client.conformance.runner, vllm_nnrp_plugin.client.aio.connection
import vllm_nnrp_plugin.client.openai.transport, vllm_nnrp_plugin.client.native.profile_client
from vllm_nnrp_plugin.client import *
server_side = ("vllm_nnrp_plugin.nnrp_binding", "vllm_nnrp_plugin.vllm_binding", "vllm_nnrp_plugin.service",
               "vllm_nnrp_plugin.core.adapter", "vllm_nnrp_plugin.core.operation")
print(sorted(m for m in sys.modules if m.startswith(server_side)))
"""


def test_the_client_side_imports_nothing_of_the_server_side():
    done = subprocess.run([sys.executable, "-c", CLIENT_ONLY], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)

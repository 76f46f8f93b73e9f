"""Every Python example of README.md and docs/clients.md runs as written against a loopback NNRP server (the
plugin's listener around a backend that replays vLLM 0.26.0's recorded answers for ``example-model``), and does
what the page says: it reaches the server and prints the model's answer.

The only change made to an example before it runs is its address: ``tcp://127.0.0.1:9400`` becomes the loopback
server's port (tests/unit/test_docs_commands.py checks the shell commands, configs and links of every page).
"""

from __future__ import annotations

import contextlib
import io
import pathlib

import pytest

from tests.support import FIXTURES, ServedNNRP, free_port
from tests.test_cli_loopback import ScriptedBackend
from tests.unit.test_docs_commands import blocks
from tests.unit.test_openai_sse import accumulate, items

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "clients.md"]
DOCUMENTED = "tcp://127.0.0.1:9400"
EXAMPLES = [b for b in blocks(PAGES) if b.lang == "python"]
#: what the recordings answer: a streamed chat and a non-streamed one
STREAMED = accumulate(items((FIXTURES / "a-stream-text.sse").read_bytes()))["choices"][0]["content"]


class ExampleModelBackend(ScriptedBackend):
    """``example-model``'s chat answered by vLLM's recorded stream (``a-stream-text``) or body
    (``c-nonstream-text``); everything else as :class:`ScriptedBackend`."""

    async def create(self, operation, body, request_id, traceparent=None, controls=None):
        if body.get("model") == "example-model" and "messages" in body:
            body = {**body, "model": "a-stream-text" if body.get("stream") else "c-nonstream-text"}
        return await super().create(operation, body, request_id, traceparent, controls)


@pytest.fixture(scope="module")
def served():
    server = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), backend=ExampleModelBackend())
    yield server
    server.stop()


def test_the_pages_have_python_examples():
    where = {b.page.name for b in EXAMPLES}
    assert where == {"README.md", "clients.md"}, where
    assert len(EXAMPLES) >= 5
    assert all(DOCUMENTED in b.text for b in EXAMPLES), [b.where for b in EXAMPLES if DOCUMENTED not in b.text]


@pytest.mark.parametrize("block", EXAMPLES, ids=lambda b: b.where)
def test_python_example_runs_as_written(block, served):
    source = block.text.replace(DOCUMENTED, served.bound[0])
    before = len(served.backend.started)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, block.where, "exec"), {"__name__": "__main__"})  # noqa: S102
    assert len(served.backend.started) > before, f"{block.where} sent nothing to the server"
    output = printed.getvalue()
    recorded_nonstreamed = "c-nonstream-text"
    if "stream=True" in block.text or '"stream": True' in block.text:
        assert output.strip() == STREAMED.strip(), output
    else:
        from tests.support import recorded_json

        assert output.strip() == recorded_json(recorded_nonstreamed)["choices"][0]["message"]["content"].strip()


def test_an_example_that_never_calls_the_server_would_fail(served):
    """The check itself: a client constructed and never used (the mistake it exists to catch) sends nothing."""
    source = (
        "import httpx2\nfrom openai import AsyncOpenAI\nfrom vllm_nnrp_plugin.client import AsyncNNRPTransport\n"
        f"client = AsyncOpenAI(base_url='http://nnrp.invalid/v1', api_key='k', "
        f"http_client=httpx2.AsyncClient(transport=AsyncNNRPTransport('{served.bound[0]}')))\n"
    )
    before = len(served.backend.started)
    exec(compile(source, "constructed-only", "exec"), {})  # noqa: S102
    assert len(served.backend.started) == before

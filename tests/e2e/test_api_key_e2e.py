"""A real ``vllm serve --api-key`` with NNRP on ``tcp://``, ``nnrps://`` (the project's own TLS carrier) and
``unix://``: vLLM's HTTP API and NNRP refuse and serve the same clients, through the asyncio client, the
``openai`` SDK over the transports and nnrp-py's native client; the start-up log says what NNRP requires.
(nnrp-py's native client over ``nnrps://`` to a server that requires no key — the interop oracle of the TLS
carrier — runs with the shared server's ``client`` fixture in ``test_vllm_serve.py``.)"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import SERVED_NAME, VLLMServer, attach_options, model_dir
from tests.support import free_port, self_signed
from vllm_nnrp_plugin.client import AsyncNNRPTransport, AuthenticationFailed, ProfileClient, connect
from vllm_nnrp_plugin.client.errors import ClientTransportError
from vllm_nnrp_plugin.nnrp_wire.codecs import SESSION_ERROR_AUTH_FAILED

pytestmark = [pytest.mark.vllm, pytest.mark.binding_core]

KEYS = ("sk-nnrp-e2e-first", "sk-nnrp-e2e-second")
MAX_NUM_SEQS = 8
CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, vllm_version):
    """``vllm serve --api-key K1 K2 --max-num-seqs 8`` with NNRP on TCP, TLS (a self-signed certificate) and a
    socket; no ``nnrp.max_in_flight_per_session``."""
    workdir = tmp_path_factory.mktemp("vllm-keyed")
    cert, key, der = self_signed(workdir)
    listen = {
        "tcp": f"tcp://127.0.0.1:{free_port()}",
        "nnrps": f"nnrps://127.0.0.1:{free_port()}",
        "ipc": f"unix://{workdir}/nnrp.sock",
    }
    env, args = attach_options(vllm_version[1])
    config = orjson.dumps({"nnrp": {"tls_cert_file": cert, "tls_key_file": key}}).decode()
    server = VLLMServer(
        model_dir(),
        workdir,
        env={**env, "VLLM_NNRP_LISTEN": ",".join(listen.values())},
        extra_args=(*args, "--additional-config", config, "--max-num-seqs", str(MAX_NUM_SEQS)),
        api_keys=KEYS,
    )
    server.nnrp, server.der = listen, der
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def http_status(server: VLLMServer, api_key: str | None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{server.http}/v1/models", headers=headers), timeout=10):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code


async def chat(uri: str, der: bytes, api_key: str | None) -> dict:
    conn = await connect(uri, api_key=api_key, trusted_cert_der=der)
    try:
        session = await conn.open_session()
        op = session.submit(
            {"schema_version": "openai-compatible/1", "operation": "chat.completions.create", "body": CHAT}
        )
        return await asyncio.wait_for(op.result(), 120)
    finally:
        await conn.close()


@pytest.mark.parametrize("carrier", ["tcp", "nnrps"])
def test_nnrp_refuses_and_serves_whom_vllms_http_refuses_and_serves(keyed_server, carrier):
    uri = keyed_server.nnrp[carrier]
    assert [http_status(keyed_server, k) for k in (None, "sk-wrong", KEYS[0], KEYS[1])] == [401, 401, 200, 200]
    for api_key in (None, "sk-wrong"):
        with pytest.raises(AuthenticationFailed) as refused:
            asyncio.run(chat(uri, keyed_server.der, api_key))
        assert refused.value.session_error_code == SESSION_ERROR_AUTH_FAILED
    for api_key in KEYS:  # every key vLLM accepts
        assert asyncio.run(chat(uri, keyed_server.der, api_key))["type"] == "response.completed"


def test_a_unix_socket_is_served_without_a_key(keyed_server):
    assert asyncio.run(chat(keyed_server.nnrp["ipc"], b"", None))["type"] == "response.completed"


def test_a_sessions_in_flight_limit_is_vllms_max_num_seqs_by_default(keyed_server):
    """Unset, ``nnrp.max_in_flight_per_session`` is what vLLM's scheduler runs at once (``--max-num-seqs``): the
    capability document says so, and the asyncio client's default ``open_session()`` is granted it."""
    client = asyncio.run(ProfileClient.connect(keyed_server.nnrp["ipc"]))
    try:
        assert client.capabilities()["limits"]["max_in_flight_per_session"] == MAX_NUM_SEQS
    finally:
        client.close()

    async def session_credit() -> int:
        conn = await connect(keyed_server.nnrp["ipc"])
        try:
            return (await conn.open_session()).max_in_flight_operations
        finally:
            await conn.close()

    assert asyncio.run(session_credit()) == MAX_NUM_SEQS


@pytest.mark.parametrize("carrier", ["tcp", "nnrps"])
def test_the_openai_sdk_behaves_as_over_http(keyed_server, carrier):
    async def ask(api_key: str) -> str:
        transport = AsyncNNRPTransport(keyed_server.nnrp[carrier], trusted_cert_der=keyed_server.der)
        async with openai.AsyncOpenAI(
            base_url="http://nnrp.invalid/v1",
            api_key=api_key,
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        ) as sdk:
            answer = await sdk.chat.completions.create(**CHAT)
            return answer.choices[0].message.content

    assert asyncio.run(ask(KEYS[0]))
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(ask("sk-wrong"))
    http = openai.OpenAI(base_url=f"{keyed_server.http}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # the same exception over vLLM's own HTTP
        http.chat.completions.create(**CHAT)


def test_nnrp_pys_native_client_is_refused_and_the_log_says_why(keyed_server):
    with pytest.raises(ClientTransportError) as refused:
        asyncio.run(ProfileClient.connect(keyed_server.nnrp["tcp"]))
    assert refused.value.status.protocol_error_code == SESSION_ERROR_AUTH_FAILED
    log = keyed_server.output()
    assert "NNRP requires vLLM's API key (2 configured" in log and "native client cannot send a key" in log
    assert "auth_failed" in log
    # vLLM itself logs its arguments, keys and --middleware …NNRPMiddleware included: those lines are not ours
    ours = [line for line in log.splitlines() if "nnrp" in line.split("args")[0].lower()]
    assert ours and not any(key in line for key in KEYS for line in ours)
    assert keyed_server.metric("nnrp_auth_refusals_total") >= 1

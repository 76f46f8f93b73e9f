"""What keeps an NNRP server from being reached by more than its operator meant, over real loopback sockets:

* a WebSocket Upgrade from a browser (it carries ``Origin``) is refused with HTTP 403 unless
  ``nnrp.ws_allowed_origins`` accepts that origin; by default a server that requires no API key accepts no browser
  origin, one that requires a key accepts any (the key decides); clients that send no ``Origin`` are not refused;
* ``nnrp.metrics_listen`` on an address other hosts can reach stops start-up unless ``allow_non_loopback``;
* a ``quic://`` address without aioquic installed (the ``[quic]`` extra) stops start-up with the install command,
  and a client asked for a ``quic://`` address without it says the same before connecting.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys

import pytest
from prometheus_client import REGISTRY

from tests.support import ServedNNRP, free_port
from vllm_nnrp_plugin.config import ConfigError, load_config
from vllm_nnrp_plugin.contract.endpoints import QUIC_INSTALL, quic_available
from vllm_nnrp_plugin.nnrp_binding.websocket import ANY_ORIGIN, allowed_origins

ENABLED = {"VLLM_PLUGINS": "nnrp"}
KEY = "sk-origin-key"


def upgrade(uri: str, origin: str | None, path: str = "/nnrp") -> int:
    """Send a WebSocket Upgrade (with ``Origin: origin`` when given) to ``uri``'s port; the server's HTTP status."""
    port = int(uri.rsplit(":", 1)[1].split("/", 1)[0])
    key = base64.b64encode(os.urandom(16)).decode()
    head = (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
    )
    if origin is not None:
        head += f"Origin: {origin}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall((head + "\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
        return int(answer.split(b" ", 2)[1])


def refused_for_origin() -> float:
    """``nnrp_connections_refused_total{reason="origin"}`` of WebSocket addresses (the process's registry)."""
    return (
        REGISTRY.get_sample_value("nnrp_connections_refused_total", {"transport": "websocket", "reason": "origin"})
        or 0.0
    )


@pytest.fixture
def serve():
    servers = []

    def start(**kwargs) -> ServedNNRP:
        server = ServedNNRP((f"ws://127.0.0.1:{free_port()}/nnrp",), **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


# -- the WebSocket Origin check ---------------------------------------------------------------------------------


def test_a_keyless_server_refuses_a_browser_origin_with_403_and_serves_clients_without_one(serve):
    served, before = serve(), refused_for_origin()
    (uri,) = served.bound
    assert upgrade(uri, "https://evil.example") == 403
    assert upgrade(uri, "null") == 403  # a sandboxed page or a file:// one
    assert refused_for_origin() == before + 2
    assert upgrade(uri, None) == 101  # the project's clients and nnrp-py's send no Origin


def test_a_keyed_server_lets_the_key_decide_whatever_the_origin(serve):
    served, before = serve(api_keys=(KEY,)), refused_for_origin()
    (uri,) = served.bound
    assert upgrade(uri, "https://any.example") == 101
    assert refused_for_origin() == before


@pytest.mark.parametrize("keyed", [False, True])
def test_configured_origins_are_the_only_browser_origins_served(serve, keyed):
    served = serve(
        ws_allowed_origins=("https://app.example.com", "http://localhost:3000"), api_keys=(KEY,) if keyed else ()
    )
    (uri,) = served.bound
    assert upgrade(uri, "https://app.example.com") == 101
    assert upgrade(uri, "HTTPS://APP.EXAMPLE.COM") == 101  # origins compare without case
    assert upgrade(uri, "http://localhost:3000") == 101
    assert upgrade(uri, "https://app.example.com.evil.example") == 403
    assert upgrade(uri, "http://app.example.com") == 403  # another scheme is another origin
    assert upgrade(uri, None) == 101


def test_a_star_accepts_every_origin(serve):
    served = serve(ws_allowed_origins=("*",))
    assert upgrade(served.bound[0], "https://anything.example") == 101


def test_what_each_setting_means():
    assert allowed_origins(None, keys_required=False) == frozenset()
    assert allowed_origins(None, keys_required=True) == {ANY_ORIGIN}
    assert allowed_origins(("https://A.example",), keys_required=True) == {"https://a.example"}


@pytest.mark.parametrize("bad", ["app.example.com", "https://app.example.com/", "https://x/path", "ftp://x", ""])
def test_an_entry_that_is_not_an_origin_stops_start_up(bad):
    with pytest.raises(ConfigError, match="ws_allowed_origins"):
        load_config({"nnrp": {"listen": ["ws://127.0.0.1:9400/nnrp"], "ws_allowed_origins": [bad]}}, ENABLED)


def test_origins_load_from_additional_config():
    config = load_config({"nnrp": {"ws_allowed_origins": ["https://app.example.com", "*"]}}, ENABLED)
    assert config.ws_allowed_origins == ("https://app.example.com", "*")
    assert load_config({}, ENABLED).ws_allowed_origins is None


# -- metrics_listen's loopback guard ----------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["0.0.0.0:9401", "10.1.2.3:9401", "[::]:9401", "metrics.example:9401"])
def test_metrics_listen_other_hosts_can_reach_stops_start_up(address):
    with pytest.raises(ConfigError, match=r"metrics_listen .* reachable from other hosts.*allow_non_loopback"):
        load_config({"nnrp": {"metrics_listen": address}}, ENABLED)
    trusted = load_config({"nnrp": {"metrics_listen": address, "allow_non_loopback": True}}, ENABLED)
    assert trusted.metrics_listen == address


@pytest.mark.parametrize("address", ["127.0.0.1:9401", "127.0.0.2:9401", "[::1]:9401", "localhost:9401"])
def test_metrics_listen_on_loopback_starts(address):
    assert load_config({"nnrp": {"metrics_listen": address}}, ENABLED).metrics_listen == address


def test_metrics_listen_is_not_judged_while_nnrp_is_off():
    assert load_config({"nnrp": {"metrics_listen": "0.0.0.0:9401"}}, {}).enabled is False


# -- QUIC without its extra ---------------------------------------------------------------------------------------


@pytest.fixture
def without_aioquic(monkeypatch):
    """aioquic not installed, as after ``pip install vllm-nnrp-plugin`` without ``[quic]``: importing it fails."""
    for name in [m for m in sys.modules if m == "aioquic" or m.startswith("aioquic.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "aioquic", None)
    assert not quic_available()


def test_a_quic_address_without_aioquic_stops_start_up_with_the_install_command(without_aioquic, tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    settings = {"listen": ["quic://127.0.0.1:9443"], "tls_cert_file": str(cert), "tls_key_file": str(cert)}
    with pytest.raises(ConfigError) as refused:
        load_config({"nnrp": settings}, ENABLED)
    assert QUIC_INSTALL in str(refused.value) and "quic://127.0.0.1:9443" in str(refused.value)
    assert QUIC_INSTALL == 'pip install "vllm-nnrp-plugin[quic]"'
    load_config({"nnrp": {**settings, "listen": ["nnrps://127.0.0.1:9443"]}}, ENABLED)  # other carriers start


def test_a_client_asked_for_quic_without_aioquic_says_what_to_install(without_aioquic):
    from vllm_nnrp_plugin.client import ClientAddressError
    from vllm_nnrp_plugin.client.aio.connection import address_of
    from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport

    for attempt in (lambda: address_of("quic://127.0.0.1:9443"), lambda: AsyncNNRPTransport("quic://127.0.0.1:9443")):
        with pytest.raises(ClientAddressError, match=r'pip install "vllm-nnrp-plugin\[quic\]"'):
            attempt()
    assert address_of("tcp://127.0.0.1:9400")[1] == 9400


def test_the_cli_asked_for_quic_without_aioquic_exits_2_with_the_install_command(tmp_path):
    """A real ``vllm-nnrp`` process in which aioquic cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['aioquic'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_nnrp_plugin.client.cli",
            "models",
            "--endpoint",
            "quic://127.0.0.1:9",
            "--timeout",
            "5",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert 'pip install "vllm-nnrp-plugin[quic]"' in done.stderr


def test_the_server_modules_import_without_aioquic(tmp_path):
    """Everything a server without a QUIC address loads imports in a process where aioquic cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['aioquic'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    code = (
        "import vllm_nnrp_plugin.service, vllm_nnrp_plugin.nnrp_binding.listener, vllm_nnrp_plugin.client.cli, "
        "vllm_nnrp_plugin.client.aio.connection, vllm_nnrp_plugin.client.openai.transport; import aioquic"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "ModuleNotFoundError: import of aioquic halted" in done.stderr, done.stderr  # only the last import

"""Balancers in front of two replicas, as docs/deployment.md configures them: HAProxy in ``mode tcp`` with health
checks, NGINX's ``stream`` proxy, and NGINX's HTTP proxy for ``ws://`` (Debian's ``haproxy``, ``nginx`` and
``libnginx-mod-stream``; each case is skipped when its binary is not installed). The replicas are the plugin's real
server on 127.0.0.2 and 127.0.0.3 with vLLM 0.26.0's recorded streams; the balancer listens on 127.0.0.4; the
client is the ``openai`` SDK in the fleet mode over the balancer's one address. TLS both ways: HAProxy ending
``nnrps://`` (plain NNRP to the replicas), and HAProxy relaying end-to-end ``nnrps://`` to replicas holding the
certificate. One replica drains while streams
run through the balancer: every stream completes, every later call completes (on the other replica), and the
drained replica's backend gets no new request."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import socket
import subprocess
import time

import pytest

from tests.support import ServedNNRP, free_port, self_signed, until
from tests.test_fleet import async_sdk, streamed
from tests.test_openai_fanout import TEXT
from vllm_nnrp_plugin.client.openai.transport import AsyncNNRPTransport

BALANCER = "127.0.0.4"
NGINX_STREAM_MODULE = pathlib.Path("/usr/lib/nginx/modules/ngx_stream_module.so")

HAPROXY = """\
defaults
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    retries 3
    option redispatch
frontend nnrp
    bind {balancer}:{port}
    mode tcp
    default_backend replicas
backend replicas
    mode tcp
    balance leastconn
    default-server check inter 200ms fall 1 rise 2
    server r1 127.0.0.2:{replica_port}
    server r2 127.0.0.3:{replica_port}
"""

NGINX = """\
{load_module}
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 1024; }}
{block}
"""

NGINX_STREAM = """\
stream {{
    upstream nnrp_replicas {{
        server 127.0.0.2:{replica_port} max_fails=1 fail_timeout=5s;
        server 127.0.0.3:{replica_port} max_fails=1 fail_timeout=5s;
    }}
    server {{
        listen {balancer}:{port};
        proxy_pass nnrp_replicas;
        proxy_connect_timeout 2s;
        proxy_timeout 1h;
    }}
}}
"""

NGINX_WEBSOCKET = """\
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream nnrp_ws_replicas {{
        server 127.0.0.2:{replica_port} max_fails=1 fail_timeout=5s;
        server 127.0.0.3:{replica_port} max_fails=1 fail_timeout=5s;
    }}
    server {{
        listen {balancer}:{port};
        location /nnrp {{
            proxy_pass http://nnrp_ws_replicas;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection "upgrade";
            proxy_set_header Host $host;
            proxy_connect_timeout 2s;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
        }}
    }}
}}
"""


def _listening(host: str, port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port}")


def _start(command: list[str], port: int, host: str = BALANCER) -> subprocess.Popen:
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _listening(host, port)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"{command[0]} did not start: {proc.communicate(timeout=5)[1].decode()[-2000:]}") from None
    return proc


def haproxy(
    tmp_path, replica_port: int, port: int, *, balancer: str = BALANCER, tls_pem: str | None = None
) -> subprocess.Popen:
    """HAProxy ``mode tcp`` on ``balancer``:``port``; with ``tls_pem`` (certificate and key, PEM) it ends TLS there
    (``ssl crt``, ALPN ``nnrp/1``) and speaks plain NNRP to the replicas."""
    cfg = tmp_path / "haproxy.cfg"
    text = HAPROXY.format(balancer=balancer, port=port, replica_port=replica_port)
    if tls_pem is not None:
        text = text.replace(f"bind {balancer}:{port}", f"bind {balancer}:{port} ssl crt {tls_pem} alpn nnrp/1")
    cfg.write_text(text)
    return _start(["haproxy", "-f", str(cfg)], port, balancer)


def nginx(tmp_path, block: str, replica_port: int, port: int, *, stream: bool) -> subprocess.Popen:
    cfg = tmp_path / "nginx.conf"
    load = f"load_module {NGINX_STREAM_MODULE};" if stream else ""
    cfg.write_text(
        NGINX.format(
            load_module=load,
            dir=tmp_path,
            block=block.format(balancer=BALANCER, port=port, replica_port=replica_port, dir=tmp_path),
        )
    )
    return _start(["nginx", "-c", str(cfg), "-e", str(tmp_path / "error.log")], port)


#: case -> (installed, the replicas' scheme, the client's scheme); the TLS cases put the balancer on 127.0.0.1,
#: the address the test certificate names
CASES = {
    "haproxy-tcp": (shutil.which("haproxy"), "tcp", "tcp"),
    "haproxy-tls-at-the-balancer": (shutil.which("haproxy"), "tcp", "nnrps"),
    "haproxy-tls-end-to-end": (shutil.which("haproxy"), "nnrps", "nnrps"),
    "nginx-stream": (shutil.which("nginx") and NGINX_STREAM_MODULE.exists(), "tcp", "tcp"),
    "nginx-websocket": (shutil.which("nginx"), "ws", "ws"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_replica_drains_behind_the_balancer_and_no_call_is_lost(case, tmp_path):
    available, scheme, client_scheme = CASES[case]
    if not available:
        pytest.skip(f"{case}: the balancer is not installed (Debian: haproxy, nginx, libnginx-mod-stream)")
    replica_port, port = free_port(), free_port()
    path = "/nnrp" if scheme == "ws" else ""
    cert, key, der = self_signed(tmp_path)
    tls = {"tls_cert_file": cert, "tls_key_file": key} if scheme == "nnrps" else {}
    replicas = [ServedNNRP((f"{scheme}://127.0.0.{n}:{replica_port}{path}",), **tls) for n in (2, 3)]
    host = BALANCER
    if case.startswith("haproxy-tls"):
        host = "127.0.0.1"
        pem = tmp_path / "balancer.pem"
        pem.write_text(pathlib.Path(cert).read_text() + pathlib.Path(key).read_text())
        balancer = haproxy(tmp_path, replica_port, port, balancer=host, tls_pem=str(pem) if scheme == "tcp" else None)
    elif case == "haproxy-tcp":
        balancer = haproxy(tmp_path, replica_port, port)
    else:
        balancer = nginx(
            tmp_path, NGINX_STREAM if scheme == "tcp" else NGINX_WEBSOCKET, replica_port, port, stream=scheme == "tcp"
        )
    try:
        address = f"{client_scheme}://{host}:{port}{path}"
        options = {"trusted_cert_der": der} if client_scheme == "nnrps" else {}

        async def main():
            async with async_sdk(AsyncNNRPTransport([address], **options)) as sdk:
                assert await streamed(sdk) == TEXT
                first = next(r for r in replicas if r.backend.started)  # the one the balancer chose
                running = [
                    asyncio.ensure_future(streamed(sdk, extra_body={"pace_s": 0.02, "repeat": 3})) for _ in range(4)
                ]
                assert await until(lambda: first.backend.open_streams >= 4)
                before = len(first.backend.started)
                drained = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(first.service.drain(10.0), first.loop))
                later = await asyncio.gather(*(streamed(sdk) for _ in range(6)))
                texts = await asyncio.gather(*running)
                await drained
                return first, before, later, texts

        first, before, later, texts = asyncio.run(main())
        other = next(r for r in replicas if r is not first)
        assert later == [TEXT] * 6
        assert len(set(texts)) == 1 and texts[0].startswith(TEXT) and len(texts[0]) > len(TEXT)
        assert len(first.backend.started) == before and first.backend.aborted == []
        assert len(other.backend.started) >= 6
    finally:
        balancer.terminate()
        balancer.wait(10)
        for replica in replicas:
            if replica._thread.is_alive():
                replica.stop()

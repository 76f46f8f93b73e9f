"""Start a real ``vllm serve`` (CPU, the small model) with or without the plugin; the one launcher of the checkout.

Used by the end-to-end tests (``tests/e2e/conftest.py``), the benchmarks (``bench/e2e.py``, ``bench/soak.py``)
and the compat scripts (``compat/serve-and-chat.sh``, ``compat/run-conformance.sh``). It needs vLLM in this
interpreter's environment (the ``vllm`` executable next to ``sys.executable``) and nothing from pytest.

Every server gets the same flags (``--host 127.0.0.1 --port P --served-model-name example-model
--max-model-len 2048 --dtype bfloat16 --enforce-eager``), the same environment (offline, no usage stats,
1 GiB CPU KV cache; ``VLLM_PLUGINS`` and ``VLLM_NNRP_LISTEN`` of the caller removed), its combined output in one
log file, a start timeout (default 600 s: ready when ``/v1/models`` answers 200) and a clean stop (SIGTERM, 60 s,
then SIGKILL). NNRP is enabled through the installed line's first attach path (:func:`attach_options`, from
:data:`vllm_nnrp_plugin.vllm_binding.families.BINDINGS`): ``VLLM_PLUGINS=nnrp`` loads the endpoint plugin where
the line has one (0.26–0.32), and lines without it (0.18, 0.22) also get ``--middleware`` naming the plugin's ASGI
middleware.

From a shell (run from the checkout, or with it on ``PYTHONPATH``)::

    python -m compat.launcher [--port N] [--listen URIS] [--log FILE] [--timeout S] MODEL [vllm serve args…] \\
        [-- COMMAND …]

serves MODEL with NNRP on ``--listen`` (comma-separated URIs; default the plugin's default address) and, once
ready, runs COMMAND, stops the server and exits with COMMAND's status; without a COMMAND it serves until
SIGINT/SIGTERM. Exit status 2 when ``vllm serve`` does not become ready (the end of its log goes to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from vllm_nnrp_plugin.vllm_binding.families import ENDPOINT_PLUGIN, MIDDLEWARE_PATH, binding_for

SERVED_NAME = "example-model"
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
#: the environment of every server (the caller's, minus the keys the launcher decides)
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
DECIDED_ENV = ("VLLM_PLUGINS", "VLLM_NNRP_LISTEN")
#: ``vllm serve`` flags that serve the small (causal) model as an embedding model: vLLM's ``embed`` pooling task,
#: so ``app.state.serving_embedding`` and no chat (``ModelConfig.convert``; the same flag on every anchor)
POOLING_ARGS = ("--convert", "embed")


class ServeError(RuntimeError):
    """``vllm serve`` exited during start-up or was not ready in time; the message carries the end of its log."""


#: the kernel's ephemeral port range (``net.ipv4.ip_local_port_range``): ports it hands to ``bind(0)`` and to the
#: local end of outgoing connections
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
#: the lowest port :func:`free_port` picks (below it sit well-known services)
_LOWEST_PICK = 10000
#: ports :func:`free_port` already handed out in this process (never twice)
_picked: set[int] = set()
_pick = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(pathlib.Path(_EPHEMERAL).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):  # TCP carriers and QUIC's UDP
        with socket.socket(socket.AF_INET, kind) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port(span: int = 1) -> int:
    """A port P on 127.0.0.1 with P … P + ``span`` - 1 free for TCP and UDP right now, picked below the kernel's
    ephemeral range and never twice in one process.

    A port from ``bind(0)`` lies inside the ephemeral range, so between the pick and the server's bind the kernel
    can hand it to any outgoing connection or ``bind(0)`` of the starting ``vllm serve`` (its engine's sockets,
    its HTTP clients): the server then fails with "Address already in use". Below the range only explicit
    choices compete."""
    high = _ephemeral_low() - span
    while True:
        port = _pick.randrange(_LOWEST_PICK, high)
        ports = range(port, port + span)
        if _picked.isdisjoint(ports) and all(_bindable(p) for p in ports):
            _picked.update(ports)
            return port


def installed_vllm(python: str = sys.executable) -> tuple[str, tuple[int, int]]:
    """``vllm.__version__`` of ``python``'s environment and its (major, minor) family, read in a subprocess
    (importing vLLM takes seconds and hundreds of MB)."""
    done = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise ServeError(f"cannot import vllm with {python}:\n{done.stderr[-2000:]}")
    version = done.stdout.strip().splitlines()[-1]
    major, minor = (int(p) for p in version.split(".")[:2])
    return version, (major, minor)


def attach_options(family: tuple[int, int]) -> tuple[dict[str, str], tuple[str, ...]]:
    """(environment, extra ``vllm serve`` args) enabling NNRP through the first attach path of ``family``'s
    binding (:func:`~vllm_nnrp_plugin.vllm_binding.families.binding_for`). A line without a binding gets the
    ``--middleware`` flag too: explicit configuration, which the plugin's start-up gate then refuses with its
    message."""
    binding = binding_for(family)
    if binding is not None and binding.attach_paths[0] == ENDPOINT_PLUGIN:
        return {"VLLM_PLUGINS": "nnrp"}, ()
    return {"VLLM_PLUGINS": "nnrp"}, ("--middleware", MIDDLEWARE_PATH)


class VLLMServer:
    """One ``vllm serve MODEL`` process, started by the constructor.

    ``env`` is added to the base environment and ``extra_args`` to the base flags as given (the caller chooses
    whether and how NNRP is enabled; :func:`serve_with_nnrp` applies the line's attach path). ``api_keys``: served
    with ``--api-key K1 K2 …`` (one flag, vLLM takes a list; the readiness probe sends the first). ``http``: base URL;
    ``port``; ``log``: its combined stdout/stderr; ``proc`` / ``pid``: the API-server process.
    """

    def __init__(
        self,
        model: str,
        workdir: str | os.PathLike[str],
        *,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        log: str | os.PathLike[str] | None = None,
        api_keys: Sequence[str] = (),
    ) -> None:
        workdir = pathlib.Path(workdir)
        self.api_key = api_keys[0] if api_keys else None
        self.port = port or free_port()
        self.http = f"http://127.0.0.1:{self.port}"
        self.log = pathlib.Path(log) if log is not None else workdir / f"vllm-{self.port}.log"
        full_env = {k: v for k, v in os.environ.items() if k not in DECIDED_ENV}
        full_env.update(BASE_ENV)
        full_env.update(env or {})
        command = [
            str(pathlib.Path(sys.executable).with_name("vllm")),
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            SERVED_NAME,
            "--max-model-len",
            "2048",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            *extra_args,
            *(("--api-key", *api_keys) if api_keys else ()),
        ]
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(
            command, env=full_env, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=workdir
        )
        self.pid = self.proc.pid

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once ``/v1/models`` answers 200. Raises :class:`ServeError` when the process exits first or
        ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"vllm serve exited with {self.proc.returncode} (log {self.log}):\n{self.tail()}")
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            request = urllib.request.Request(f"{self.http}/v1/models", headers=headers)
            with contextlib.suppress(OSError):  # refused, reset, HTTP errors: not up yet
                with urllib.request.urlopen(request, timeout=2) as response:
                    if response.status == 200:
                        return
            time.sleep(1)
        raise ServeError(f"vllm serve not ready after {timeout_s} s (log {self.log}):\n{self.tail()}")

    def wait_exit(self, timeout_s: float = START_TIMEOUT_S) -> int:
        """The exit status, once the process ended (``subprocess.TimeoutExpired`` after ``timeout_s``)."""
        return self.proc.wait(timeout_s)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def metric(self, name: str) -> float:
        """Sum of a Prometheus sample over all its label sets, from vLLM's own ``/metrics``."""
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=10) as response:
            text = response.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))

    def stop(self) -> None:
        """SIGTERM, wait up to 60 s, then SIGKILL; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_with_nnrp(
    model: str,
    workdir: str | os.PathLike[str],
    *,
    listen: Sequence[str] = (),
    family: tuple[int, int] | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    **kwargs: object,
) -> VLLMServer:
    """A :class:`VLLMServer` with NNRP enabled through the installed line's attach path (``family``: the
    installed vLLM's, read by :func:`installed_vllm` when not given), listening on ``listen`` (the plugin's
    default address when empty)."""
    attach_env, attach_args = attach_options(family or installed_vllm()[1])
    nnrp_env = {**attach_env, **({"VLLM_NNRP_LISTEN": ",".join(listen)} if listen else {}), **(env or {})}
    return VLLMServer(model, workdir, env=nnrp_env, extra_args=(*attach_args, *extra_args), **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m compat.launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, help="vLLM's HTTP port (default: a free one)")
    parser.add_argument("--listen", default="", help="comma-separated NNRP listen URIs (default: the plugin's)")
    parser.add_argument("--log", help="vLLM's log file (default: vllm-PORT.log in a new temporary directory)")
    parser.add_argument(
        "--timeout", type=float, default=START_TIMEOUT_S, help=f"start timeout, s (default {START_TIMEOUT_S})"
    )
    parser.add_argument("model", help="model directory")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="more vllm serve arguments")
    args = parser.parse_args(own)
    workdir = tempfile.mkdtemp(prefix="vllm-nnrp-launcher-")
    listen = [u for u in args.listen.split(",") if u]
    server = serve_with_nnrp(
        args.model, workdir, listen=listen, extra_args=args.serve_args, port=args.port, log=args.log
    )
    print(f"starting vllm serve (pid {server.pid}, log: {server.log}) ...", file=sys.stderr, flush=True)
    with server:
        try:
            server.wait_ready(args.timeout)
        except ServeError as exc:
            print(exc, file=sys.stderr)
            return 2
        for line in server.output().splitlines():
            if "NNRP listening on" in line:
                print(line[line.index("NNRP listening on") :], file=sys.stderr, flush=True)
        if not command:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SystemExit: the with block stops vLLM
            try:
                return server.proc.wait()  # vLLM ended by itself: its status
            except KeyboardInterrupt:
                return 0
        status = subprocess.run(command).returncode
        if status != 0:
            print(f"{command[0]} exited with {status}; vLLM's log: {server.log}\n{server.tail(40)}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())

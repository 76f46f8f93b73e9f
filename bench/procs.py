"""Processes of a benchmark: the :mod:`bench.server` process and client processes, running this checkout (the
server, for a before/after, another one)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from compat.launcher import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent


def env(root: pathlib.Path = ROOT) -> dict[str, str]:
    """This process's environment with the checkout ``root`` first on ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else str(root)}


def endpoint(transport: str, directory: str) -> str:
    """A fresh listen URI: ``tcp://127.0.0.1:<free port>`` or ``unix://<directory>/<n>.sock``."""
    if transport == "ipc":
        return f"unix://{directory}/bench-{free_port()}.sock"
    return f"tcp://127.0.0.1:{free_port()}"


class BenchServer:
    """``python -m bench.server`` on ``uri``, run from the checkout ``root`` (under ``wrapper``, a command line
    prefix such as valgrind's, when given); :meth:`stop` returns the observation
    records (dicts) and sets ``pump_wait_us`` / ``send_us`` (per partial result: outbox wait, time inside nnrp-py's
    send) and ``cpu_s`` (the server's CPU time while serving, s)."""

    def __init__(
        self, uri: str, *, nodelay: bool = True, root: pathlib.Path = ROOT, wrapper: Sequence[str] = ()
    ) -> None:
        flags = [] if nodelay else ["--no-nodelay"]
        self.uri = uri
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "bench.server", *flags, uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env(root),
            cwd=root,
        )
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"bench server on {uri} did not start: {line!r}")

    def stop(self, timeout_s: float = 60) -> list[dict[str, Any]]:
        out, _ = self.proc.communicate(timeout=timeout_s)
        *records, times = [orjson.loads(line) for line in out.splitlines() if line.strip()]
        self.pump_wait_us = [x / 1000 for x in times["pump_wait_ns"]]
        self.send_us = [x / 1000 for x in times["send_ns"]]
        self.cpu_s = times["cpu_s"]
        return records

    def __enter__(self) -> BenchServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def run_clients(module: str, argument_lists: Sequence[Sequence[str]], timeout_s: float = 300) -> list[Any]:
    """Start ``python -m <module> <args>`` once per argument list, all at once; return each one's JSON
    stdout. Raises ``RuntimeError`` when a client fails."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=ROOT
        )
        for args in argument_lists
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark client {module} failed ({proc.returncode}): {err.decode()[-2000:]}")
        results.append(orjson.loads(out))
    return results

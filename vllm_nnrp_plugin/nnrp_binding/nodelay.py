"""Turn off Nagle on the TCP connections nnrp-py's native TCP carrier accepted.

nnrp-py 1.0.0rc4.post20's carrier has no TCP_NODELAY knob and leaves Nagle on, so a burst of small frames (4 partials + terminal) stalls ~40 ms on
loopback TCP. After each accepted TCP session we find this process's connected TCP sockets whose local port
is the listener's port (``/proc/self/fd``) and set TCP_NODELAY on them. Only sockets of our own listener are
touched; each socket once (tracked by inode). Linux only; elsewhere it is a no-op.
"""

from __future__ import annotations

import os
import socket

_FD_DIR = "/proc/self/fd"


class NoDelaySetter:
    """Call :meth:`apply` after every accepted TCP session of the listener bound to ``port``."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._done: set[str] = set()

    def apply(self) -> int:
        """Set TCP_NODELAY on new accepted sockets of the port; returns how many were changed."""
        try:
            fds = os.listdir(_FD_DIR)
        except OSError:
            return 0
        changed = 0
        seen: set[str] = set()
        for name in fds:
            try:
                target = os.readlink(f"{_FD_DIR}/{name}")
            except OSError:
                continue
            if not target.startswith("socket:"):
                continue
            seen.add(target)
            if target in self._done:
                continue
            if self._set_if_ours(int(name)):
                changed += 1
            self._done.add(target)
        self._done &= seen  # forget closed sockets so a reused inode is looked at again
        return changed

    def _set_if_ours(self, fd: int) -> bool:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            if sock.getsockname()[1] != self._port:
                return False
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return True
        except OSError:
            return False
        finally:
            sock.close()  # closes the duplicate only

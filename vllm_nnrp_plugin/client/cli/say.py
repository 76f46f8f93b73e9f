"""The command line's diagnostics on stderr. Much of what they quote was chosen by the server or anything that
answers on the address (a refusal's diagnostic, a ``response.error`` message and code, a drop's event, an
exception's text): :func:`say` writes every line through
:func:`vllm_nnrp_plugin.observability.log_safety.loggable`, so no control character reaches the terminal raw (an
escape sequence cannot move the cursor, retitle the window or clear the screen, a newline cannot forge a line of
its own) and one line holds at most :data:`MAX_LINE_CHARS` characters. What the model writes (the text and the
calls on stdout) is the command's output and is written as it came."""

from __future__ import annotations

import sys

from vllm_nnrp_plugin.observability.log_safety import loggable

__all__ = ["MAX_LINE_CHARS", "reason", "say"]

#: the most characters of one diagnostic line (after escaping), before the marker naming its length
MAX_LINE_CHARS = 4000


def say(line: str) -> None:
    """Write ``line`` (``vllm-nnrp: …``) and a newline to stderr, escaped and bounded (module docstring)."""
    print(loggable(line, MAX_LINE_CHARS), file=sys.stderr)


def reason(exc: BaseException) -> str:
    """Why ``exc`` ended the wait: its text, or ``timed out`` for a timeout that says nothing."""
    return str(exc) or "timed out"

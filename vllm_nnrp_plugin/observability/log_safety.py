"""Client-controlled values made safe for a log line, and a rate limit for log lines about refused input.

Plain functions and plain data: no I/O, no clock (times are passed in), no logging of their own.

* :func:`loggable` turns any value a client sent (a model name, an id, an operation name, an error message that
  echoes the request) into a string a log line can carry as it is: no newline, control character or other
  non-printable character reaches it raw (each is written as a Python-style escape: a newline as ``\\x0a``,
  ESC as ``\\x1b``, a line separator as ``\\u2028``; a backslash as ``\\\\``, so an escape cannot be
  forged), and it is at most :data:`MAX_LOG_CHARS` characters plus a marker naming the original length.
  Containers are described, never walked (a deeply nested JSON array costs nothing).
* :func:`log_value` is :func:`loggable` for a ``key=value`` log line: a string with a space, ``=`` or ``"``
  is quoted (:func:`quote_field`), so a client's value cannot add a field of its own.
* :func:`traceback_text` is a logged exception (what ``logger.exception`` writes) whose messages are
  :func:`loggable`: an exception's text may quote the request (a model name in a file path, a key in a
  ``KeyError``), so it gets the same escaping, bounded at :data:`MAX_EXCEPTION_CHARS`.
* :class:`RefusalLogLimiter` decides, per connection, which log lines about refused input are written: the first
  :data:`REFUSALS_PER_WINDOW` of every :data:`REFUSAL_WINDOW_S` window, then one summary line with the count of
  the ones left out.
"""

from __future__ import annotations

import traceback
from typing import Any

__all__ = [
    "MAX_LOG_CHARS",
    "REFUSALS_PER_WINDOW",
    "REFUSAL_WINDOW_S",
    "RefusalLogLimiter",
    "log_value",
    "loggable",
    "quote_field",
    "traceback_text",
]

#: the most characters of one client-controlled value in a log line (after escaping), before the marker
#: ``…[N chars]`` that names the original length
MAX_LOG_CHARS = 200
#: the most characters of one exception's message in :func:`traceback_text`
MAX_EXCEPTION_CHARS = 1000
#: log lines about refused input written per connection and window; the rest are counted
REFUSALS_PER_WINDOW = 10
#: the window of :data:`REFUSALS_PER_WINDOW`, in seconds
REFUSAL_WINDOW_S = 60.0

_QUOTE_IF = (" ", "=", '"')


def loggable(value: Any, limit: int = MAX_LOG_CHARS) -> str:
    """``value`` as a string that is safe in a log line, at most ``limit`` characters plus a length marker.

    * a ``str``: printable characters as they are; a backslash as ``\\\\``; every other character (newline,
      tab, ESC, DEL, C1 controls, line/paragraph separators, lone surrogates …) as ``\\xNN``, ``\\uNNNN`` or
      ``\\UNNNNNNNN`` (the escapes of Python's ``repr``); an escape is never cut. Longer than ``limit`` after
      escaping: the first characters that fit, then ``…[N chars]`` with N the original length;
    * ``None``, ``True``/``False``, an ``int`` or a ``float``: as JSON writes them (an int of more than
      ``limit`` digits: ``<int of N bits>``);
    * a ``list``/``tuple`` or a ``dict``: ``<array of N items>`` / ``<object of N keys>`` (never walked);
    * ``bytes``: ``<N bytes>``; anything else: ``<type name>``.

    ``limit`` must be at least 1 (``ValueError``). Never raises for any ``value``.
    """
    if limit < 1:
        raise ValueError("limit must be at least 1")
    kind = type(value)
    if kind is str:
        return _text(value, limit)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        if value.bit_length() > 3 * min(limit, 1000):  # surely too many digits: never build them
            return f"<int of {value.bit_length()} bits>"
        digits = str(value)
        return digits if len(digits) <= limit else f"<int of {value.bit_length()} bits>"
    if kind is float:
        return repr(value)[:limit]
    if isinstance(value, (list, tuple)):
        return f"<array of {len(value)} items>"
    if isinstance(value, dict):
        return f"<object of {len(value)} keys>"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if isinstance(value, str):  # a str subclass
        return _text(str.__str__(value), limit)
    return f"<{_text(type(value).__name__, limit)}>"


def log_value(value: Any, limit: int = MAX_LOG_CHARS) -> str:
    """:func:`loggable`, then, for a string, :func:`quote_field`: the value of one ``key=value`` field of a log
    line, which cannot start another field."""
    text = loggable(value, limit)
    return quote_field(text) if isinstance(value, str) else text


def quote_field(text: str) -> str:
    """``text`` (already :func:`loggable`) as one ``key=value`` value: as it is unless it is empty or holds a
    space, ``=`` or ``"``; then in double quotes with each ``"`` written ``\\"`` (a backslash in ``text`` is
    already ``\\\\``, so the quoting cannot be undone from inside)."""
    if text and not any(c in text for c in _QUOTE_IF):
        return text
    return '"' + text.replace('"', '\\"') + '"'


def traceback_text(exc: BaseException, limit: int = MAX_EXCEPTION_CHARS) -> str:
    """``exc`` as ``logger.exception`` would log it — its chain of causes and contexts (oldest first, at most 8),
    each with its traceback and ``module.Type: message`` — except that each message is :func:`loggable` (at
    most ``limit`` characters, escaped: it stays on its line). The frames are the server's own source lines.
    Never raises."""
    chain: list[BaseException] = []
    links: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 8 and all(current is not seen for seen in chain):
        chain.append(current)
        if current.__cause__ is not None:
            current, link = current.__cause__, "The above exception was the direct cause of the following exception:"
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, "During handling of the above exception, another exception occurred:"
        else:
            current, link = None, ""
        links.append(link)
    blocks: list[str] = []
    for error, link in zip(reversed(chain), reversed(links), strict=True):
        if blocks:
            blocks.append(f"\n{link}\n\n")
        if error.__traceback__ is not None:
            blocks.append("Traceback (most recent call last):\n")
            blocks.extend(traceback.format_tb(error.__traceback__))
        kind = type(error)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        try:
            message = str(error)
        except Exception:  # noqa: BLE001 - an exception whose __str__ fails
            message = "<its message cannot be read>"
        blocks.append(f"{name}: {loggable(message, limit)}" if message else name)
    return "".join(blocks)


def _text(text: str, limit: int) -> str:
    size = len(text)
    if size <= limit and "\\" not in text and text.isprintable():
        return text  # the common case: nothing to do
    head = text[:limit]  # escaping never shortens: no more than `limit` characters can be kept
    if "\\" in head or not head.isprintable():
        pieces: list[str] = []
        used = 0
        for char in head:
            piece = _escape(char)
            if used + len(piece) > limit:
                break
            pieces.append(piece)
            used += len(piece)
        else:
            if size <= limit:
                return "".join(pieces)
        return "".join(pieces) + f"…[{size} chars]"
    return head + f"…[{size} chars]"


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char.isprintable():
        return char
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


class RefusalLogLimiter:
    """Which log lines about one connection's refused input to write (one instance per connection; not
    thread-safe: one owner).

    Windows are fixed: the first refusal starts one, and a refusal at least ``window_s`` seconds after that
    start starts the next. In each window the first ``per_window`` refusals are written; the others are only
    counted. :meth:`admit` returns, with its own verdict, the count left out of the windows before (write one
    summary line for it first); :meth:`take_suppressed` returns what is still left out (at the connection's end,
    or from a periodic check once the window is over), so every refusal is either written or counted in exactly
    one summary.

    ``now_s``: the caller's clock in seconds (any monotonic clock, e.g. ``time.monotonic()``); the limiter
    reads none. ``per_window`` ≥ 1 and ``window_s`` > 0 (``ValueError`` otherwise).
    """

    __slots__ = ("per_window", "window_s", "_start", "_count", "_suppressed")

    def __init__(self, per_window: int = REFUSALS_PER_WINDOW, window_s: float = REFUSAL_WINDOW_S) -> None:
        if per_window < 1 or not window_s > 0:
            raise ValueError("per_window must be at least 1 and window_s positive")
        self.per_window = per_window
        self.window_s = window_s
        self._start: float | None = None
        self._count = 0  # refusals in the current window
        self._suppressed = 0  # refusals left out and not yet reported

    @property
    def suppressed(self) -> int:
        """Refusals left out and not reported yet."""
        return self._suppressed

    def admit(self, now_s: float) -> tuple[bool, int]:
        """One more refusal at ``now_s``: ``(write_it, left_out_before)``. ``left_out_before`` > 0 only when this
        refusal opens a new window: that many refusals of the windows before were left out; write one summary
        line for them before this one's own line (when ``write_it``)."""
        reported = 0
        if self._start is None or now_s - self._start >= self.window_s or now_s < self._start:
            reported, self._suppressed = self._suppressed, 0
            self._start, self._count = now_s, 0
        self._count += 1
        if self._count <= self.per_window:
            return True, reported
        self._suppressed += 1
        return False, reported

    def take_suppressed(self, now_s: float | None = None) -> int:
        """The refusals left out and not reported yet, now counted as reported (write one summary line when
        > 0). With ``now_s``, only once the current window is over (0 before: the count keeps growing and a
        later call reports it); without, always (the connection ended)."""
        if now_s is not None and self._start is not None and 0 <= now_s - self._start < self.window_s:
            return 0
        count, self._suppressed = self._suppressed, 0
        return count

"""Client-controlled values in log lines (:mod:`vllm_nnrp_plugin.observability.log_safety`, the operation's log line),
and the rate limit of refused-input log lines: plain data in, plain data out."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_nnrp_plugin.observability import observation as obs
from vllm_nnrp_plugin.observability.log_safety import (
    MAX_LOG_CHARS,
    RefusalLogLimiter,
    log_value,
    loggable,
    quote_field,
    traceback_text,
)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),  # what a model name looks like: untouched
        ("naïve-模型", "naïve-模型"),  # printable non-ASCII stays readable
        ("a\nFORGED forged line", "a\\x0aFORGED forged line"),
        ("\r\t\x00\x1b[31m\x7f\x85", "\\x0d\\x09\\x00\\x1b[31m\\x7f\\x85"),
        ("line\u2028sep\u2029par\u200b", "line\\u2028sep\\u2029par\\u200b"),
        ("back\\x0aslash", "back\\\\x0aslash"),  # a literal backslash cannot pose as an escape
        ("\U000e0001tag", "\\U000e0001tag"),
        (None, "null"),
        (True, "true"),
        (5, "5"),
        (-2.5, "-2.5"),
        (10**400, "<int of 1329 bits>"),
        ([[[]]], "<array of 1 items>"),
        ({"a": 1, "b": 2}, "<object of 2 keys>"),
        (b"\x00\x01", "<2 bytes>"),
        (object(), "<object>"),
    ],
)
def test_values_are_escaped_and_described(value, shown):
    assert loggable(value) == shown


def test_long_values_are_cut_with_the_original_length():
    assert loggable("m" * 900_000) == "m" * MAX_LOG_CHARS + "…[900000 chars]"
    escaped = loggable("\n" * 1000)
    assert escaped == "\\x0a" * (MAX_LOG_CHARS // 4) + "…[1000 chars]"  # never half an escape
    assert loggable("ab\ncd", limit=4) == "ab…[5 chars]"
    with pytest.raises(ValueError):
        loggable("x", limit=0)


def test_a_deeply_nested_value_costs_nothing():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert loggable(deep) == "<array of 1 items>"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=600) | st.binary(max_size=50).map(lambda b: b.decode("latin-1")))
def test_any_text_becomes_one_printable_bounded_line(text):
    shown = loggable(text)
    assert shown.isprintable()  # no newline, control, separator or surrogate reaches the line
    assert len(shown) <= MAX_LOG_CHARS + len(f"…[{len(text)} chars]")
    if len(text) <= MAX_LOG_CHARS // 10:  # short enough never to be cut: the escape is reversible
        assert shown.encode("latin-1", "backslashreplace").decode("unicode_escape") == text


def test_a_field_value_cannot_start_another_field():
    assert log_value("x outcome=completed") == '"x outcome=completed"'
    assert log_value('say "hi"') == '"say \\"hi\\""'
    assert log_value("") == '""'
    assert log_value("plain") == "plain" and log_value(7) == "7"
    assert quote_field("a=b") == '"a=b"'


def test_the_operation_log_line_stays_one_bounded_line_whatever_the_model():
    record = obs.Observation(
        connection_id=3,
        session_id=7,
        operation_id=11,
        frame_id=11,
        transport="tcp",
        submitted_ns=1,
        submitted_unix_ns=1,
    )
    model = "m\nFORGED forged line transport=tcp " + "x" * 900_000
    record.started(2, operation="chat.completions.create", model=model, request_id="chatcmpl-nnrp-1", diagnostics=False)
    line = obs.log_line(record)
    assert "\n" not in line and line.isprintable() and len(line) < 600
    assert 'model="m\\x0aFORGED forged line transport=tcp xxx' in line and f"…[{len(model)} chars]" in line
    fields = [field.split("=", 1) for field in shlex.split(line)[2:]]  # as a key=value log parser reads it
    assert [k for k, _ in fields].count("transport") == 1 and dict(fields)["transport"] == "tcp"
    assert dict(fields)["model"].startswith("m\\x0aFORGED forged line transport=tcp x")  # all inside the value
    assert obs.log_fields(record)["model"].startswith("m\\x0aFORGED")  # the structured fields too
    assert obs.diagnostics(record)["model"].startswith("m\nFORGED")  # the client's own value, as JSON


def test_a_logged_exception_keeps_its_traceback_with_its_messages_escaped_and_bounded():
    def failing():
        try:
            raise ValueError("no model named model\nFORGED line")
        except ValueError as exc:
            raise RuntimeError("x" * 50_000) from exc

    try:
        failing()
    except RuntimeError as exc:
        text = traceback_text(exc)
    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "in failing" in text  # the frames, as logged
    assert "ValueError: no model named model\\x0aFORGED line" in lines  # the message stays on its line
    assert "The above exception was the direct cause of the following exception:" in lines
    assert lines[-1] == "RuntimeError: " + "x" * 1000 + "…[50000 chars]"
    assert not any(line.startswith("FORGED") for line in lines)
    assert traceback_text(ValueError()) == "ValueError"  # never raised: no traceback, no message


# -- the refused-input limiter -------------------------------------------------------------------------------


def test_the_first_refusals_of_a_window_are_written_then_counted_and_summarised_once():
    limiter = RefusalLogLimiter(per_window=3, window_s=10.0)
    verdicts = [limiter.admit(100.0 + i * 0.001) for i in range(1000)]
    assert verdicts[:3] == [(True, 0)] * 3 and verdicts[3:] == [(False, 0)] * 997
    assert limiter.suppressed == 997
    assert limiter.take_suppressed(105.0) == 0  # the window is not over: the count keeps growing
    assert limiter.admit(110.5) == (True, 997)  # a new window: one summary of the last, then this one's line
    assert limiter.suppressed == 0
    for _ in range(5):
        limiter.admit(111.0)
    assert limiter.take_suppressed(121.0) == 3 and limiter.take_suppressed(121.0) == 0
    limiter.admit(111.5)
    assert limiter.take_suppressed() == 1  # the connection ended: whatever is left


def test_every_refusal_is_written_or_counted_in_exactly_one_summary():
    limiter = RefusalLogLimiter(per_window=10, window_s=1.0)
    written = summarised = 0
    for i in range(50_000):  # a flood: 50,000 bad packets in 5 s
        write, earlier = limiter.admit(i / 10_000)
        written += write
        summarised += earlier
    summarised += limiter.take_suppressed()
    assert written == 10 * 5 and written + summarised == 50_000  # 50 lines and 5 summaries, not 50,000 lines


def test_a_clock_that_goes_back_starts_a_new_window():
    limiter = RefusalLogLimiter(per_window=1, window_s=60.0)
    assert limiter.admit(50.0) == (True, 0)
    assert limiter.admit(50.0) == (False, 0)
    assert limiter.admit(10.0) == (True, 1)


def test_limiter_arguments_are_checked():
    with pytest.raises(ValueError):
        RefusalLogLimiter(per_window=0)
    with pytest.raises(ValueError):
        RefusalLogLimiter(window_s=0)

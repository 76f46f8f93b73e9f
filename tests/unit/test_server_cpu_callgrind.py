"""``bench.server_cpu._callgrind_totals``: the event counts of a callgrind output file (valgrind's format: an
``events:`` line naming the columns, then ``summary:`` and/or ``totals:`` with one count per event)."""

import pytest

from bench.server_cpu import CALLGRIND_EVENTS, _callgrind_totals

HEAD = "# callgrind format\nversion: 1\ncreator: callgrind-3.22.0\ncmd: python -m bench.server\n"
EVENTS = "events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\n"


def test_the_summary_line_gives_each_event_its_count(tmp_path):
    out = tmp_path / "callgrind.out"
    out.write_text(
        HEAD
        + EVENTS
        + "summary: 3759925628 1081532929 618450404 69282591 37755765 10904114 21118 157819 595277\n"
        + "fl=(1) x.c\nfn=(1) main\n16 3 1\n"
    )
    totals = _callgrind_totals(out)
    assert totals["Ir"] == 3759925628 and totals["D1mw"] == 10904114 and totals["DLmw"] == 595277
    assert set(CALLGRIND_EVENTS) <= set(totals)


def test_the_totals_line_serves_when_no_summary_came_first(tmp_path):
    out = tmp_path / "callgrind.out"
    out.write_text(HEAD + "events: Ir\n" + "fl=(1) x.c\nfn=(1) main\n16 3\n" + "totals: 42\n")
    assert _callgrind_totals(out) == {"Ir": 42}


def test_a_file_without_counts_is_an_error_naming_it(tmp_path):
    out = tmp_path / "callgrind.out"
    out.write_text(HEAD + EVENTS)
    with pytest.raises(RuntimeError, match="no summary line"):
        _callgrind_totals(out)

"""The compatibility table of docs/compatibility.md, generated from the recorded results of the per-anchor test runs.

  python compat/compat_table.py record 0.22.1 REPORT.xml [SCOPE]  # after a run: compat/results/vllm-0.22.1.json
  python compat/compat_table.py docs                                # rewrite the table in docs/compatibility.md

``record`` reads pytest's JUnit XML report of ``compat/run-vllm-tests.sh VERSION`` and stores the anchor, its
attach path (from the package's bindings), the UTC date, what ran (``SCOPE``: ``whole suite``, the default, or
``binding core``, the e2e tests marked ``binding_core`` that the matrix and the trimmed anchors run; stored in
``vllm-<version>.json`` and ``vllm-<version>-core.json``), the pytest counts and duration, and the result.
``docs`` (also the default, and what ``record`` does after storing) replaces the lines between the
``compat-table`` markers of docs/compatibility.md; a page without both markers, in that order, is an error that
leaves the page untouched. Standard library only.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "compat" / "results"
PAGE = ROOT / "docs" / "compatibility.md"
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"


def attach_path(version: str) -> str:
    sys.path.insert(0, str(ROOT))
    from vllm_nnrp_plugin.vllm_binding.families import binding_for, family_of

    first, *others = binding_for(family_of(version)).attach_paths
    return f"`{first}`" + "".join(f" (also `{p}`)" for p in others)


WHOLE_SUITE = "whole suite"


def record(version: str, report: str, scope: str = WHOLE_SUITE) -> dict:
    suite = ET.parse(report).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0
    result = {
        "anchor": version,
        "attach_path": attach_path(version),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "ran": scope,
        "result": "pass" if ok else "FAIL",
        "passed": passed,
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "duration_s": round(float(suite.get("time", 0.0))),
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"vllm-{version}.json" if scope == WHOLE_SUITE else f"vllm-{version}-core.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    return result


def table() -> str:
    rows = [
        "| anchor | attach path | date (UTC) | what ran | result | tests | duration |",
        "|---|---|---|---|---|---|---|",
    ]
    results = [json.loads(p.read_text()) for p in RESULTS.glob("vllm-*.json")]
    for r in sorted(results, key=lambda r: (tuple(int(p) for p in r["anchor"].split(".")), r.get("ran", WHOLE_SUITE))):
        tests = f"{r['passed']} passed, {r['failed']} failed" + (f", {r['skipped']} skipped" if r["skipped"] else "")
        rows.append(
            f"| {r['anchor']} | {r['attach_path']} | {r['date']} | {r.get('ran', WHOLE_SUITE)} | {r['result']} "
            f"| {tests} | {r['duration_s']} s |"
        )
    return "\n".join(rows)


def render(page: pathlib.Path = PAGE) -> None:
    """Replace the table between the markers of ``page`` with :func:`table`."""
    text = page.read_text()
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{page}: the markers {BEGIN} and {END} are missing; the table was not written")
    page.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    command, *args = sys.argv[1:] or ["docs"]
    if command == "record":
        print(json.dumps(record(*args)))
    elif command != "docs":
        raise SystemExit(f"unknown command {command!r}: record VERSION REPORT [SCOPE], or docs")
    render()

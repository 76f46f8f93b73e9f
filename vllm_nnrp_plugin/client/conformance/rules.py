"""The suite's result validation rules (``nnrp-conformance``'s ``validate-api-profile-results`` over the
``api-profile-case-results`` schema), as pure functions.

For a ``passed`` result: (1) ``terminal`` equals ``expect.terminal``; ``error`` also needs a ``response.error``
event and ``cancelled`` a ``response.cancelled``; (2) expected entries are walked with a cursor: ``min_count`` is
the entry's value, else 0 if ``optional``, else 1; the whole list must hold at least ``min_count`` events of that
type, and when ``min_count > 0`` the first one at or after the cursor must exist (the cursor moves past it);
(3) that event must match ``fields`` (objects as subsets, arrays as positional prefixes, scalars by strict JSON
equality); (4) optional entries without ``min_count`` are not order- or field-checked; (5) extra events are
allowed. ``failed`` and ``skipped`` results are only counted.
"""

from __future__ import annotations

from typing import Any


def matches(expected: Any, actual: Any) -> bool:
    """Subset match: objects by key subset, arrays as positional prefixes, scalars strictly (``1 != 1.0``,
    ``True != 1``)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and matches(v, actual[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(actual) >= len(expected)
            and all(matches(e, a) for e, a in zip(expected, actual, strict=False))
        )
    return type(expected) is type(actual) and expected == actual


def case_problems(expect: dict[str, Any], terminal: str, events: list[dict[str, Any]]) -> list[str]:
    """Why a case with this ``terminal`` and these ``events`` does not meet ``expect`` (empty: it passes)."""
    problems = []
    if terminal != expect["terminal"]:
        problems.append(f"terminal {terminal!r}, expected {expect['terminal']!r}")
    kinds = [e.get("type") for e in events]
    needed = {"error": "response.error", "cancelled": "response.cancelled"}.get(expect["terminal"])
    if needed and needed not in kinds:
        problems.append(f"terminal {expect['terminal']} needs a {needed} event")
    cursor = 0
    for entry in expect["events"]:
        kind = entry["type"]
        min_count = entry.get("min_count", 0 if entry.get("optional") else 1)
        if kinds.count(kind) < min_count:
            problems.append(f"expected at least {min_count} {kind} event(s), saw {kinds.count(kind)}")
            continue
        if min_count == 0:
            continue
        at = next((i for i in range(cursor, len(events)) if kinds[i] == kind), None)
        if at is None:
            problems.append(f"did not observe event {kind} in expected order")
            continue
        cursor = at + 1
        fields = entry.get("fields", {})
        if not all(key in events[at] and matches(value, events[at][key]) for key, value in fields.items()):
            problems.append(f"{kind} event {events[at]} does not match fields {fields}")
    return problems


def results_problems(plan: dict[str, Any], results: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """The summary ``{selected_cases, passed_cases, failed_cases, skipped_cases}`` and every problem: structural
    ones (identity differs from the plan, unknown/duplicate/missing ids) and rule failures of ``passed``
    results."""
    problems = [
        f"{key} {results.get(key)!r} differs from the plan's {plan[key]!r}"
        for key in ("profile", "schema_version", "adapter")
        if results.get(key) != plan[key]
    ]
    cases = {case["id"]: case for case in plan["cases"]}
    seen: set[str] = set()
    summary = {"selected_cases": len(cases), "passed_cases": 0, "failed_cases": 0, "skipped_cases": 0}
    for result in results["results"]:
        case_id = result["id"]
        if case_id not in cases:
            problems.append(f"result for unknown case {case_id}")
            continue
        if case_id in seen:
            problems.append(f"duplicate result for case {case_id}")
            continue
        seen.add(case_id)
        summary[f"{result['outcome']}_cases"] += 1
        if result["outcome"] == "passed":
            problems += [
                f"{case_id}: {p}"
                for p in case_problems(cases[case_id]["expect"], result["terminal"], result.get("events", []))
            ]
    problems += [f"no result for selected case {case_id}" for case_id in cases if case_id not in seen]
    return summary, problems

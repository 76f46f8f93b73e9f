"""Drive planned cases against a live server over NNRP (real client, real transport) and record case results.

Each case becomes one envelope ``{schema_version, operation, body: request.body, nnrp: request.nnrp}`` submitted
on one shared session (so every case also proves the session survived the previous one). Harness controls in
``request.nnrp`` are consumed here and never sent:

* ``cancel_after_events: N`` — FRAME_CANCEL the operation after observing N events (0: right after submit);
* ``raw_payload: str`` — submit these UTF-8 bytes instead of the envelope (malformed-envelope cases);
* ``envelope_override: {...}`` — top-level keys replacing the built envelope's (e.g. a wrong ``schema_version``).

Terminal mapping: RESULT_PUSH ``response.completed`` -> ``success``, ``response.error`` -> ``error``,
``response.cancelled`` -> ``cancelled``; a RESULT_DROP_REASON -> ``cancelled`` with its ``response.cancelled``
diagnostic as the event (the profile's "Wire mapping": a cancellation ends in a drop). No terminal within
``timeout_s`` -> a failed ``error`` case.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from vllm_nnrp_plugin.client.conformance.rules import case_problems
from vllm_nnrp_plugin.client.errors import ClientTimeout
from vllm_nnrp_plugin.client.native.profile_client import ProfileClient
from vllm_nnrp_plugin.profile import SCHEMA_VERSION

HARNESS_KEYS = ("cancel_after_events", "raw_payload", "envelope_override")
_TERMINALS: dict[str | None, str] = {
    "response.completed": "success",
    "response.error": "error",
    "response.cancelled": "cancelled",
}


def submission(case: dict[str, Any]) -> tuple[bytes | dict[str, Any], int | None]:
    """What to submit for ``case`` and its ``cancel_after_events`` (None: never cancel)."""
    request = case["request"]
    hints = dict(request.get("nnrp", {}))
    controls = {key: hints.pop(key) for key in HARNESS_KEYS if key in hints}
    if "raw_payload" in controls:
        return controls["raw_payload"].encode(), controls.get("cancel_after_events")
    envelope: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "operation": case["operation"],
        "body": request["body"],
    }
    if hints:
        envelope["nnrp"] = hints
    envelope.update(controls.get("envelope_override", {}))
    return envelope, controls.get("cancel_after_events")


def run_case(client: ProfileClient, case: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """One case result (``api-profile-case-results`` item), outcome decided by the suite's rules."""
    payload, cancel_after = submission(case)
    started = time.monotonic()
    op = client.submit(payload)
    events: list[dict[str, Any]] = []
    terminal = "error"
    cancelled = False
    message = None
    try:
        if cancel_after == 0:
            client.cancel(op)
            cancelled = True
        for event in client.events(op, timeout_s=timeout_s):
            if event.frame == "result_drop":
                events.append(
                    event.event or {"type": "response.cancelled", "reason": f"drop_reason_{event.drop_reason}"}
                )
                terminal = "cancelled"
                break
            assert event.event is not None  # only a drop may come without a profile event
            events.append(event.event)
            if event.terminal:
                terminal = _TERMINALS.get(event.event.get("type"), "error")
                break
            if cancel_after is not None and not cancelled and len(events) >= cancel_after:
                client.cancel(op)
                cancelled = True
    except ClientTimeout as exc:
        message = str(exc)
    problems = case_problems(case["expect"], terminal, events) if message is None else [message]
    result: dict[str, Any] = {
        "id": case["id"],
        "outcome": "failed" if problems else "passed",
        "terminal": terminal,
        "events": events,
        "diagnostics": {
            "selected_operation": case["operation"],
            "elapsed_ms": int((time.monotonic() - started) * 1000),
            "model": case["request"]["body"].get("model"),
        },
    }
    if problems:
        result["message"] = "; ".join(problems)
    return result


async def run_cases(endpoint: str, cases: list[dict[str, Any]], *, timeout_s: float) -> list[dict[str, Any]]:
    """Every case in order on one session to ``endpoint``."""
    client = await ProfileClient.connect(endpoint)
    try:
        return [run_case(client, case, timeout_s=timeout_s) for case in cases]
    finally:
        client.close()


def summary_line(result: dict[str, Any]) -> str:
    kinds = [e.get("type", "?").removeprefix("response.") for e in result["events"]]
    shown = orjson.dumps(kinds[:8]).decode() + ("…" if len(kinds) > 8 else "")
    line = f"{result['outcome'].upper():6} {result['id']} -> {result['terminal']} {shown}"
    return line + (f"\n       {result['message']}" if "message" in result else "")

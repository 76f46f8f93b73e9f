"""Build an execution plan from recipes and a capabilities manifest (pure; the shapes of the suite's
``api-profile-execution-plan`` and ``api-profile-capabilities`` schemas, selection as the suite's planner does).

Capability tokens: each level N -> ``api.levelN``; each operation -> ``api.<name>``; any operation with
``streaming`` / ``non_streaming`` / ``tool_calls`` / ``cancellation`` true -> ``api.<flag>``; each extension ->
``api.extension.<name>`` (+ ``.critical``). A ``mandatory``/``optional`` recipe is selected only when all its
``required_capabilities`` are declared, else ``not_claimed``; ``experimental``/``deprecated`` recipes are never
planned (informational). Cases keep recipe order; a JSON string that is exactly ``${NAME}`` becomes the
recipe's ``parameters[NAME]``. The plan does not carry ``parameters``.
"""

from __future__ import annotations

import re
from typing import Any

_FLAGS = ("streaming", "non_streaming", "tool_calls", "cancellation")
_PLACEHOLDER = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
PLANNED = ("mandatory", "optional")


def capability_tokens(manifest: dict[str, Any]) -> set[str]:
    """The tokens a capabilities manifest declares."""
    tokens = {f"api.level{level}" for level in manifest["compatibility_levels"]}
    for op in manifest["operations"]:
        tokens.add(f"api.{op['name']}")
        tokens.update(f"api.{flag}" for flag in _FLAGS if op.get(flag))
    for ext in manifest.get("extensions", ()):
        tokens.add(f"api.extension.{ext['name']}")
        if ext["critical"]:
            tokens.add(f"api.extension.{ext['name']}.critical")
    return tokens


def substitute(value: Any, parameters: dict[str, str]) -> Any:
    """``value`` with every string that is exactly ``${NAME}`` replaced (unknown names are kept)."""
    if isinstance(value, dict):
        return {k: substitute(v, parameters) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, parameters) for v in value]
    if isinstance(value, str):
        match = _PLACEHOLDER.match(value)
        if match and match.group(1) in parameters:
            return parameters[match.group(1)]
    return value


def build_plan(
    recipes: list[dict[str, Any]], manifest: dict[str, Any], *, results_path: str, evidence_dir: str
) -> dict[str, Any]:
    """The execution plan (``api-profile-execution-plan`` shape) for ``recipes`` under ``manifest``."""
    tokens = capability_tokens(manifest)
    cases: list[dict[str, Any]] = []
    features: dict[str, dict[str, Any]] = {}
    for recipe in recipes:
        status = recipe.get("status", "mandatory")
        required = list(recipe.get("required_capabilities", []))
        feature = features.setdefault(
            recipe["operation"],
            {
                "feature": recipe["operation"],
                "required_capabilities": [],
                "summary": {"selected_cases": 0, "not_claimed_cases": 0, "informational_cases": 0},
                "statuses": {"mandatory_cases": 0, "optional_cases": 0, "experimental_cases": 0, "deprecated_cases": 0},
                "case_ids": [],
            },
        )
        feature["statuses"][f"{status}_cases"] += 1
        if status not in PLANNED:
            feature["summary"]["informational_cases"] += 1
            continue
        if not set(required) <= tokens:
            feature["summary"]["not_claimed_cases"] += 1
            continue
        feature["summary"]["selected_cases"] += 1
        feature["case_ids"].append(recipe["id"])
        for token in required:
            if token not in feature["required_capabilities"]:
                feature["required_capabilities"].append(token)
        parameters = recipe.get("parameters", {})
        cases.append(
            {
                "id": recipe["id"],
                "operation": recipe["operation"],
                "status": status,
                "required_capabilities": required,
                "request": substitute(recipe["request"], parameters),
                "expect": substitute(recipe["expect"], parameters),
            }
        )
    return {
        "profile": manifest["profile"],
        "schema_version": manifest["schema_version"],
        "adapter": manifest["adapter"],
        "artifacts": {"results_path": results_path, "evidence_dir": evidence_dir},
        "coverage_matrix": list(features.values()),
        "cases": cases,
    }

"""Execution plan and result rules of the conformance harness, on the suite's own recipes and examples
(the ``nnrp-conformance`` suite's rules). Needs the suite (``$NNRP_CONFORMANCE_ROOT`` or
``../shared/nnrp-conformance``)."""

import copy
import pathlib

import pytest

pytest.importorskip("jsonschema")

from vllm_nnrp_plugin.client.conformance.driver import submission  # noqa: E402
from vllm_nnrp_plugin.client.conformance.plan import build_plan, capability_tokens  # noqa: E402
from vllm_nnrp_plugin.client.conformance.rules import case_problems, matches, results_problems  # noqa: E402
from vllm_nnrp_plugin.client.conformance.suite import Suite, locate_suite, read_json  # noqa: E402
from vllm_nnrp_plugin.profile.capabilities import chat_operation, conformance_manifest, runtime_document  # noqa: E402

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def suite():
    try:
        return Suite(locate_suite())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def manifest(**flags):
    document = runtime_document(
        models=["example-model"], owned_by="vllm", operations=[chat_operation(tool_calls=flags.pop("tool_calls", True))]
    )
    document["operations"][0].update(flags)
    return conformance_manifest(document)


def plan_for(suite, m, recipes=None):
    recipes = recipes if recipes is not None else suite.recipes(suite.profile_manifest())
    plan = build_plan(recipes, m, results_path="r.json", evidence_dir="e")
    suite.validate(plan, "execution-plan")
    return plan


def test_the_sample_capabilities_give_the_sample_tokens(suite):
    sample = read_json(suite.root / "docs" / "examples" / "api-profile-capabilities.sample.json")
    assert capability_tokens(sample) == {
        "api.level1",
        "api.chat.completions.create",
        "api.streaming",
        "api.non_streaming",
        "api.tool_calls",
        "api.cancellation",
        "api.extension.vllm.diagnostics",
    }


@pytest.mark.parametrize(
    "flags, selected",
    [({}, 8), ({"tool_calls": False}, 7), ({"cancellation": False}, 7), ({"streaming": False}, 4)],
)
def test_selection_follows_the_contract_examples(suite, flags, selected):
    plan = plan_for(suite, manifest(**flags))
    assert len(plan["cases"]) == selected
    (feature,) = [f for f in plan["coverage_matrix"] if f["feature"] == "chat.completions.create"]
    assert feature["summary"]["selected_cases"] + feature["summary"]["not_claimed_cases"] == 7


def test_model_id_is_substituted_from_each_recipes_parameters(suite):
    cases = {c["id"]: c for c in plan_for(suite, manifest())["cases"]}
    assert cases["openai-compatible.chat.streaming-text"]["request"]["body"]["model"] == "example-model"
    assert cases["openai-compatible.chat.backend-error"]["request"]["body"]["model"] == "backend-error"
    assert "parameters" not in cases["openai-compatible.chat.usage"]


def test_experimental_recipes_are_never_planned(suite):
    recipes = suite.recipes(suite.profile_manifest())
    recipes[0] = {**recipes[0], "status": "experimental"}
    plan = plan_for(suite, manifest(), recipes)
    assert recipes[0]["id"] not in [c["id"] for c in plan["cases"]]
    assert sum(f["summary"]["informational_cases"] for f in plan["coverage_matrix"]) == 1


def test_project_recipes_load_and_validate_against_the_recipe_schema(suite):
    recipes = suite.recipes(RECIPES / "manifest.json")
    assert len(recipes) >= 10 and all(r["id"].startswith("vllm-nnrp.") for r in recipes)
    plan = plan_for(suite, manifest(tool_calls=False), recipes)
    assert "vllm-nnrp.chat.tool-call-required" not in [c["id"] for c in plan["cases"]]


def test_the_sample_results_pass_the_sample_plan(suite):
    plan = read_json(suite.root / "docs" / "examples" / "api-profile-execution-plan.sample.json")
    results = read_json(suite.root / "docs" / "examples" / "api-profile-case-results.sample.json")
    suite.validate(results, "case-results")
    assert results_problems(plan, results) == (
        {"selected_cases": 1, "passed_cases": 1, "failed_cases": 0, "skipped_cases": 0},
        [],
    )
    wrong = copy.deepcopy(results)
    wrong["adapter"] = "other"
    wrong["results"].append(wrong["results"][0])
    _, problems = results_problems(plan, wrong)
    assert any("adapter" in p for p in problems) and any("duplicate" in p for p in problems)
    missing = {**results, "results": []}
    assert results_problems(plan, missing)[1] == ["no result for selected case openai-compatible.chat.streaming-text"]


ERROR_EXPECT = {
    "events": [{"type": "response.error", "fields": {"error": {"code": "backend_error"}}, "min_count": 1}],
    "terminal": "error",
}


def error(code):
    return {"type": "response.error", "error": {"type": "server_error", "code": code, "message": "m"}}


def test_rules_check_the_first_matching_event_in_order_and_its_fields():
    assert case_problems(ERROR_EXPECT, "error", [error("backend_error")]) == []
    # an earlier response.error with another code fails the case (the first one at the cursor is checked)
    assert case_problems(ERROR_EXPECT, "error", [error("x"), error("backend_error")])
    assert case_problems(ERROR_EXPECT, "success", [error("backend_error")])
    ordered = {"events": [{"type": "a"}, {"type": "b"}], "terminal": "success"}
    assert case_problems(ordered, "success", [{"type": "a"}, {"type": "b"}]) == []
    assert case_problems(ordered, "success", [{"type": "b"}, {"type": "a"}])
    optional = {"events": [{"type": "a", "optional": True}, {"type": "c", "min_count": 1}], "terminal": "cancelled"}
    assert case_problems(optional, "cancelled", [{"type": "c"}]) == [
        "terminal cancelled needs a response.cancelled event"
    ]


def test_matching_is_subset_prefix_and_strict_scalars():
    assert matches({"a": [1]}, {"a": [1, 2], "b": 0})
    assert not matches({"a": [1, 2]}, {"a": [1]})
    assert not matches(1, 1.0) and not matches(1, True) and matches("x", "x")


def test_harness_controls_are_consumed_not_sent():
    case = {
        "operation": "chat.completions.create",
        "request": {"body": {"messages": []}, "nnrp": {"cancel_after_events": 1, "diagnostics": True}},
    }
    envelope, cancel_after = submission(case)
    assert cancel_after == 1 and envelope["nnrp"] == {"diagnostics": True}
    raw, _ = submission({"operation": "x", "request": {"body": {}, "nnrp": {"raw_payload": "{bad"}}})
    assert raw == b"{bad"
    override, _ = submission(
        {"operation": "x", "request": {"body": {}, "nnrp": {"envelope_override": {"schema_version": "v0"}}}}
    )
    assert override["schema_version"] == "v0" and "nnrp" not in override


def test_no_suite_recipes_runs_only_the_given_directories(suite):
    from vllm_nnrp_plugin.client.conformance.runner import load_recipes

    both = load_recipes(suite, [RECIPES])
    ours = load_recipes(suite, [RECIPES], suite_recipes=False)
    assert [r["id"] for r in ours] == [r["id"] for r in suite.recipes(RECIPES / "manifest.json")]
    assert all(r["id"].startswith("vllm-nnrp.") for r in ours)
    assert [r["id"] for r in both] == [r["id"] for r in suite.recipes(suite.profile_manifest())] + [
        r["id"] for r in ours
    ]
    plan = plan_for(suite, manifest(), ours)  # the suite's schemas still validate the plan
    assert "openai-compatible.chat.unsupported-operation" not in [c["id"] for c in plan["cases"]]


def test_no_suite_recipes_without_recipe_directories_is_unusable(suite, capsys):
    from vllm_nnrp_plugin.client.conformance.runner import main

    assert main(["--endpoint", "tcp://127.0.0.1:1", "--suite", str(suite.root), "--no-suite-recipes"]) == 2
    assert "no recipes to run" in capsys.readouterr().err

"""``tox -e conformance`` on a fresh clone: without the external nnrp-conformance suite the project's recipes still
run (without the suite's schemas: the project keeps no copy of the suite), the run says the suite was not
found, and ``NNRP_CONFORMANCE_REQUIRED=1`` (CI) turns its absence into a failure before anything is built."""

from __future__ import annotations

import os
import pathlib
import subprocess

import orjson
import pytest

from tests.support import ServedNNRP, free_port
from vllm_nnrp_plugin.client.conformance.runner import load_recipes, main
from vllm_nnrp_plugin.client.conformance.suite import Suite, locate_suite

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "compat" / "run-conformance.sh"
PROJECT_RECIPES = [ROOT / "recipes", ROOT / "recipes" / "responses", ROOT / "recipes" / "level3"]


def plan(**env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NNRP_CONFORMANCE")}
    return subprocess.run(
        ["bash", str(SCRIPT), "--plan"], env={**environ, **env}, capture_output=True, text=True, timeout=60
    )


def test_without_the_suite_the_project_recipes_run_and_the_run_says_so(tmp_path):
    done = plan(NNRP_CONFORMANCE_ROOT=str(tmp_path / "absent"))
    assert done.returncode == 0, done.stderr
    assert f"external nnrp-conformance suite was not found at {tmp_path / 'absent'}" in done.stderr
    assert "https://github.com/NagareWorks/nnrp-conformance" in done.stderr
    assert "schemas from nowhere (no suite: documents not validated); level1: recipes/ only" in done.stderr


def test_ci_can_require_the_suite(tmp_path):
    done = plan(NNRP_CONFORMANCE_ROOT=str(tmp_path / "absent"), NNRP_CONFORMANCE_REQUIRED="1")
    assert done.returncode == 2
    assert "NNRP_CONFORMANCE_REQUIRED=1 requires it" in done.stderr and "plan:" not in done.stderr


def test_a_directory_with_schemas_but_no_profile_is_not_the_suite(tmp_path):
    """A directory holding schemas but no openai-compatible/1 profile must not pass for the external suite."""
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "api-profile-recipe.schema.json").write_text("{}")
    done = plan(NNRP_CONFORMANCE_ROOT=str(tmp_path), NNRP_CONFORMANCE_REQUIRED="1")
    assert done.returncode == 2


def test_with_the_suite_its_recipes_run_too():
    try:
        suite = locate_suite()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    done = plan(NNRP_CONFORMANCE_ROOT=str(suite), NNRP_CONFORMANCE_REQUIRED="1")
    assert done.returncode == 0, done.stderr
    assert f"suite is at {suite}" in done.stderr and "level1: the suite recipes and recipes/" in done.stderr


def test_every_project_recipe_loads_without_the_suite():
    recipes = load_recipes(Suite(None), PROJECT_RECIPES, suite_recipes=False)
    assert len(recipes) >= 10 and all(r["id"].startswith("vllm-nnrp.") for r in recipes)


def test_every_project_recipe_validates_against_the_suites_schemas_when_it_is_there():
    try:
        suite = locate_suite()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    recipes = load_recipes(Suite(suite), PROJECT_RECIPES, suite_recipes=False)
    assert len(recipes) >= 10


def test_the_runner_drives_the_project_recipes_without_the_suite(tmp_path, monkeypatch):
    """The level1 deployment's runner command as run-conformance.sh gives it without the suite, against a loopback
    server: plan, cases and results are made (the recorded backend serves no ``example-model``, so its text cases
    fail: status 1, not 2, which would mean unusable recipes)."""
    pytest.importorskip("jsonschema")
    monkeypatch.setenv("NNRP_CONFORMANCE_ROOT", str(tmp_path / "absent"))
    served = ServedNNRP((f"tcp://127.0.0.1:{free_port()}",), fault_injection_backend_error_model="backend-error")
    try:
        status = main(
            [
                "--endpoint",
                served.bound[0],
                "--no-suite",
                "--recipes",
                str(ROOT / "recipes"),
                "--out",
                str(tmp_path / "out"),
                "--case-timeout",
                "10",
            ]
        )
    finally:
        served.stop()
    assert status in (0, 1)
    results = orjson.loads((tmp_path / "out" / "results.json").read_bytes())["results"]
    ids = {r["id"]: r["outcome"] for r in results}
    assert ids and all(i.startswith("vllm-nnrp.") for i in ids)
    assert ids["vllm-nnrp.chat.malformed-json"] == "passed"

"""``vllm-nnrp conformance``: run the suite's recipes (and project recipes) against a live server.

Steps: fetch the server's capability document over NNRP (``nnrp.capabilities``), derive the conformance
manifest and validate it against ``api-profile-capabilities``; build and validate the execution plan from the
suite's ``openai-compatible/1`` manifest (unless ``--no-suite-recipes``: then only the ``--recipes``
directories; the suite's schemas still validate everything; with ``--no-suite``, no suite at all: the
``--recipes`` directories only, unvalidated) plus each ``--recipes DIR/manifest.json``; drive
every selected case;
write ``capabilities.json``, ``plan.json`` and ``results.json`` into ``--out``; validate the results against
``api-profile-case-results`` and the suite's rules. Exit status: 0 only when every selected case passed and
nothing was structurally wrong; 1 when a case failed; 2 when the suite, the server or a document is unusable.
(The suite's own ``validate-api-profile-results`` exits 0 even with failed cases; this runner does not.)
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib

import orjson

from vllm_nnrp_plugin.client.cli.say import say
from vllm_nnrp_plugin.client.conformance.plan import build_plan
from vllm_nnrp_plugin.client.conformance.rules import results_problems
from vllm_nnrp_plugin.client.conformance.suite import ROOT_ENV, Suite, locate_suite
from vllm_nnrp_plugin.client.errors import ClientError
from vllm_nnrp_plugin.profile.capabilities import conformance_manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        required=True,
        help="a plain (non-TLS) address of the server: tcp://HOST:PORT, unix:///PATH or ws://HOST:PORT/PATH",
    )
    parser.add_argument(
        "--suite", help=f"nnrp-conformance directory (default ${ROOT_ENV}, else ../shared/nnrp-conformance)"
    )
    parser.add_argument(
        "--recipes",
        action="append",
        default=[],
        type=pathlib.Path,
        help="extra recipe directory with a manifest.json (repeatable)",
    )
    parser.add_argument(
        "--no-suite",
        action="store_true",
        help="run without the nnrp-conformance suite: only the --recipes directories, their documents "
        "not validated against the suite's schemas (which are the suite's; get the suite to check "
        "them)",
    )
    parser.add_argument(
        "--no-suite-recipes",
        action="store_true",
        help="run only the --recipes directories, not the suite's openai-compatible/1 recipes "
        "(e.g. against a deployment that serves more than Level 1, where the suite's Level-1 "
        "cases do not apply)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("conformance-results"),
        help="where capabilities.json, plan.json and results.json go (default ./conformance-results)",
    )
    parser.add_argument("--case-timeout", type=float, default=120.0, help="seconds per case (default 120)")


def load_recipes(suite: Suite, directories: list[pathlib.Path], *, suite_recipes: bool = True) -> list[dict]:
    """The suite's ``openai-compatible/1`` recipes (when ``suite_recipes``), then those of each directory's
    ``manifest.json``, in order, each validated against the suite's recipe schema. Raises FileNotFoundError,
    ``jsonschema.ValidationError``, ``orjson.JSONDecodeError``."""
    recipes = suite.recipes(suite.profile_manifest()) if suite_recipes else []
    for directory in directories:
        recipes += suite.recipes(directory / "manifest.json")
    return recipes


def run(args: argparse.Namespace) -> int:
    """Run the suite as described in the module docstring; returns the exit status. Needs ``jsonschema``
    (the ``conformance`` extra)."""
    import jsonschema

    # nnrp-py's native client (driver, ProfileClient) loads only here: it imports aioquic, which the other
    # vllm-nnrp commands do not need unless they connect to a quic:// address
    from vllm_nnrp_plugin.client.conformance.driver import run_cases, summary_line

    try:
        suite = Suite(None if args.no_suite else locate_suite(args.suite))
        recipes = load_recipes(suite, args.recipes, suite_recipes=not (args.no_suite or args.no_suite_recipes))
    except (FileNotFoundError, jsonschema.ValidationError, orjson.JSONDecodeError) as exc:
        say(f"vllm-nnrp conformance: unusable suite or recipes: {exc}")
        return 2
    if not recipes:
        say("vllm-nnrp conformance: no recipes to run (--no-suite-recipes without --recipes)")
        return 2
    try:
        document = asyncio.run(_capabilities(args.endpoint))
    except ClientError as exc:  # no server there, ClientTimeout, a refused fetch
        say(f"vllm-nnrp conformance: cannot fetch capabilities from {args.endpoint}: {exc}")
        return 2
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    manifest = conformance_manifest(document)
    results_path = out / "results.json"
    plan = build_plan(recipes, manifest, results_path=str(results_path), evidence_dir=str(out / "evidence"))
    try:
        suite.validate(manifest, "capabilities")
        suite.validate(plan, "execution-plan")
    except jsonschema.ValidationError as exc:
        say(f"vllm-nnrp conformance: invalid manifest or plan: {exc.message}")
        return 2
    _write(out / "capabilities.json", manifest)
    _write(out / "plan.json", plan)
    print(
        f"server {args.endpoint}: models {[m['id'] for m in document['models']]}, "
        f"{len(plan['cases'])} of {len(recipes)} recipes selected"
    )
    results = {
        "profile": plan["profile"],
        "schema_version": plan["schema_version"],
        "adapter": plan["adapter"],
        "results": asyncio.run(run_cases(args.endpoint, plan["cases"], timeout_s=args.case_timeout)),
    }
    _write(results_path, results)
    for result in results["results"]:
        print(summary_line(result))
    try:
        suite.validate(results, "case-results")
    except jsonschema.ValidationError as exc:
        say(f"vllm-nnrp conformance: results do not match the schema: {exc.message}")
        return 2
    summary, problems = results_problems(plan, results)
    print(orjson.dumps(summary).decode())
    for problem in problems:
        say(f"problem: {problem}")
    if problems or summary["passed_cases"] != summary["selected_cases"]:
        say(f"vllm-nnrp conformance: FAILED ({results_path})")
        return 1
    print(f"vllm-nnrp conformance: all {summary['selected_cases']} selected cases passed ({results_path})")
    return 0


async def _capabilities(endpoint: str) -> dict:
    from vllm_nnrp_plugin.client.native.profile_client import ProfileClient

    client = await ProfileClient.connect(endpoint)
    try:
        return client.capabilities()
    finally:
        client.close()


def _write(path: pathlib.Path, document: dict) -> None:
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-nnrp conformance", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))

"""docs/troubleshooting.md quotes every start-up refusal the package can raise: each ``raise`` of a start-up error
(:class:`~vllm_nnrp_plugin.errors.NNRPStartupError` and its subclasses) and each rule of the settings' validators,
found in the source, has its message's fixed text on the page. A new refusal without its entry fails here."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
PACKAGE = ROOT / "vllm_nnrp_plugin"
#: the start-up errors (every one an NNRPStartupError)
STARTUP_ERRORS = {
    "NNRPStartupError",
    "ConfigError",
    "ListenError",
    "MetricsListenError",
    "RankAddressError",
    "EndpointError",
}
#: modules whose ValueErrors are settings rules (cattrs validators, reported inside "invalid nnrp settings")
RULES = {PACKAGE / "config.py"}
#: a message's fixed pieces shorter than this are connecting words (", ", " of "), not worth quoting
MIN_PIECE = 12


def normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def refusals() -> list[tuple[str, str]]:
    """(where, fixed piece) of every start-up refusal message in the package (the client side excluded)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "client" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            name = getattr(node.exc.func, "id", None)
            if name not in STARTUP_ERRORS and not (name == "ValueError" and path in RULES):
                continue
            pieces = [
                n.value for n in ast.walk(node.exc.args[0]) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            ]
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found += [(where, normal(p)) for p in pieces if len(normal(p)) >= MIN_PIECE]
    return found


REFUSALS = refusals()


def test_the_source_has_the_refusals_this_test_checks():
    where = {w.split(":")[0] for w, _ in REFUSALS}
    assert {
        "vllm_nnrp_plugin/config.py",
        "vllm_nnrp_plugin/vllm_binding/gate.py",
        "vllm_nnrp_plugin/nnrp_binding/exposure.py",
        "vllm_nnrp_plugin/observability/metrics.py",
    } <= where, where
    assert len(REFUSALS) >= 30


@pytest.mark.parametrize("where, piece", REFUSALS, ids=[f"{w}:{p[:30]}" for w, p in REFUSALS])
def test_every_refusal_is_on_the_page(where, piece):
    assert piece in normal(PAGE.read_text()), f"{where}: {piece!r} is not quoted in docs/troubleshooting.md"

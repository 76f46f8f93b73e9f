"""Locate and load the conformance suite (``nnrp-conformance``; read in place, never copied into the project).

Layout used: ``schemas/api-profile-*.schema.json`` and ``profiles/openai-compatible/1/manifest.json`` (suite
manifest schema: ``{profile, schema_version, level, protocol_baselines, recipe_manifests: [relative paths]}``).
A project recipe directory has the same shape: a ``manifest.json`` listing recipe files.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import orjson

ROOT_ENV = "NNRP_CONFORMANCE_ROOT"
DEFAULT_ROOT = pathlib.Path("..") / "shared" / "nnrp-conformance"
PROFILE_DIR = pathlib.Path("profiles") / "openai-compatible" / "1"


def locate_suite(root: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The suite directory: ``root``, else ``$NNRP_CONFORMANCE_ROOT``, else ``../shared/nnrp-conformance`` from
    the current directory. Raises FileNotFoundError naming where it looked and how to point at it."""
    chosen = root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT
    path = pathlib.Path(chosen).resolve()
    if not (path / "schemas" / "api-profile-recipe.schema.json").is_file():
        raise FileNotFoundError(
            f"nnrp-conformance suite not found at {path} (no schemas/api-profile-recipe.schema.json); "
            f"set {ROOT_ENV} to the suite's directory"
        )
    return path


def read_json(path: pathlib.Path) -> Any:
    return orjson.loads(path.read_bytes())


class Suite:
    """The schemas of a located suite (``root``), and loaders that validate what they load against them. Without a
    suite (``root`` ``None``: the project's own recipes only) nothing is validated: the schemas are the suite's, and
    the project keeps no copy of them."""

    def __init__(self, root: pathlib.Path | None) -> None:
        self.root = root
        self.schemas = (
            {}
            if root is None
            else {
                name: read_json(root / "schemas" / f"api-profile-{name}.schema.json")
                for name in ("suite", "recipe", "capabilities", "execution-plan", "case-results")
            }
        )

    def validate(self, document: Any, schema: str) -> None:
        """Raises ``jsonschema.ValidationError`` unless ``document`` matches ``api-profile-<schema>`` (no check
        without a suite). (``jsonschema`` is the ``conformance`` extra, imported only here.)"""
        if self.root is None:
            return
        import jsonschema

        jsonschema.validate(document, self.schemas[schema])

    def profile_manifest(self) -> pathlib.Path:
        """The suite's ``openai-compatible/1`` manifest. Raises FileNotFoundError without a suite."""
        if self.root is None:
            raise FileNotFoundError("no nnrp-conformance suite: its recipes cannot run (--no-suite)")
        return self.root / PROFILE_DIR / "manifest.json"

    def recipes(self, manifest_path: pathlib.Path) -> list[dict[str, Any]]:
        """The recipes a suite manifest lists, in order, each validated against the recipe schema."""
        manifest = read_json(manifest_path)
        self.validate(manifest, "suite")
        recipes = []
        for relative in manifest["recipe_manifests"]:
            recipe = read_json(manifest_path.parent / relative)
            self.validate(recipe, "recipe")
            recipes.append(recipe)
        return recipes

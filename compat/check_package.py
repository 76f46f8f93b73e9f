"""Check a built wheel and sdist of vllm-nnrp-plugin (compat/check-package.sh runs it after ``python -m build`` and
``twine check``): what vLLM and pip read from them, against the checkout they were built from.

    python compat/check_package.py WHEEL SDIST

* the wheel's entry points: ``vllm.general_plugins`` and ``vllm.endpoint_plugins`` name ``nnrp`` (what vLLM's
  plugin loader and ``VLLM_PLUGINS=nnrp`` look up), the console script ``vllm-nnrp``, each pointing at a module
  the wheel holds and a name that module defines;
* every module of ``vllm_nnrp_plugin/`` in the checkout (``git ls-files``, else the file tree) is in the wheel
  and in the sdist;
* the metadata: the version of pyproject.toml, the extras it declares, and no unconditional dependency on
  ``aioquic`` (the ``[quic]`` extra: a plain install must not change the ``cryptography`` vLLM resolved).

Prints one line per problem and exits 1 when there is any; prints nothing else.
"""

from __future__ import annotations

import ast
import configparser
import email.parser
import pathlib
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: (group, name) -> the object it must point at
ENTRY_POINTS = {
    ("vllm.general_plugins", "nnrp"): "vllm_nnrp_plugin.vllm_binding.general:register",
    ("vllm.endpoint_plugins", "nnrp"): "vllm_nnrp_plugin.vllm_binding.endpoint:NNRPEndpointPlugin",
    ("console_scripts", "vllm-nnrp"): "vllm_nnrp_plugin.client.cli:main",
}
#: packages a plain ``pip install vllm-nnrp-plugin`` must not install (they are extras)
NOT_REQUIRED = ("aioquic",)


def checkout_modules(root: pathlib.Path = ROOT) -> set[str]:
    """The package's files in the checkout, relative to ``root`` (tracked ones when it is a git checkout)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "vllm_nnrp_plugin"], capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(root)) for p in (root / "vllm_nnrp_plugin").rglob("*") if p.is_file()]
    return {name for name in listed if "__pycache__" not in name and (root / name).is_file()}


def defines(source: str, name: str) -> bool:
    """True when a module's ``source`` defines ``name`` at top level (def, class, assignment or import)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def wheel_problems(wheel: pathlib.Path, modules: set[str], pyproject: dict) -> list[str]:
    problems = []
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
        if len(dist_info) != 1:
            return [f"{wheel.name}: expected one .dist-info directory, found {sorted(dist_info)}"]
        (info,) = dist_info
        points = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        points.optionxform = str  # entry-point names are case-sensitive
        if f"{info}/entry_points.txt" in names:
            points.read_string(archive.read(f"{info}/entry_points.txt").decode())
        for (group, name), target in ENTRY_POINTS.items():
            found = points.get(group, name, fallback=None)
            if found is None:
                problems.append(f"{wheel.name}: no entry point {name} in [{group}]")
                continue
            if found.strip() != target:
                problems.append(f"{wheel.name}: entry point {name} in [{group}] is {found.strip()!r}, not {target!r}")
            module, _, attribute = found.strip().partition(":")
            path = module.replace(".", "/") + ".py"
            if path not in names:  # a package: its __init__.py defines the attribute
                path = module.replace(".", "/") + "/__init__.py"
            if path not in names:
                problems.append(f"{wheel.name}: entry point {name} in [{group}] names {module}, not in the wheel")
            elif not defines(archive.read(path).decode(), attribute):
                problems.append(f"{wheel.name}: entry point {name} in [{group}]: {module} defines no {attribute}")
        for missing in sorted(modules - names):
            problems.append(f"{wheel.name}: {missing} is in the checkout but not in the wheel")
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
    problems += metadata_problems(wheel.name, metadata, pyproject)
    return problems


def metadata_problems(what: str, metadata, pyproject: dict) -> list[str]:
    project = pyproject["project"]
    problems = []
    if metadata["Version"] != project["version"]:
        problems.append(f"{what}: version {metadata['Version']}, pyproject.toml says {project['version']}")
    extras = set(metadata.get_all("Provides-Extra") or ())
    for extra in sorted(set(project.get("optional-dependencies", {})) - extras):
        problems.append(f"{what}: extra [{extra}] of pyproject.toml is not in the metadata")
    for requirement in metadata.get_all("Requires-Dist") or ():
        name = re.match(r"[A-Za-z0-9._-]+", requirement)[0].lower()
        if name in NOT_REQUIRED and "extra ==" not in requirement:
            problems.append(f"{what}: {requirement!r} is an unconditional dependency (it belongs in an extra)")
    return problems


def sdist_problems(sdist: pathlib.Path, modules: set[str]) -> list[str]:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    problems = [f"{sdist.name}: {m} is in the checkout but not in the sdist" for m in sorted(modules - names)]
    problems += [f"{sdist.name}: no {f}" for f in ("pyproject.toml", "README.md") if f not in names]
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: check_package.py WHEEL SDIST", file=sys.stderr)
        return 2
    wheel, sdist = map(pathlib.Path, argv)
    modules = checkout_modules()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    problems = wheel_problems(wheel, modules, pyproject) + sdist_problems(sdist, modules)
    for problem in problems:
        print(f"check-package: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

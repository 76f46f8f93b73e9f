"""compat/check_package.py, the checks compat/check-package.sh runs on a built wheel and sdist: a wheel as
setuptools makes it from this checkout passes, and each packaging miss the script exists to catch is named."""

from __future__ import annotations

import configparser
import pathlib
import tarfile
import tomllib
import zipfile

import pytest

from compat import check_package

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
MODULES = check_package.checkout_modules()

ENTRY_POINTS = """[console_scripts]
vllm-nnrp = vllm_nnrp_plugin.client.cli:main

[vllm.endpoint_plugins]
nnrp = vllm_nnrp_plugin.vllm_binding.endpoint:NNRPEndpointPlugin

[vllm.general_plugins]
nnrp = vllm_nnrp_plugin.vllm_binding.general:register
"""


def metadata(version: str = VERSION, requires: tuple[str, ...] = ()) -> str:
    extras = PYPROJECT["project"]["optional-dependencies"]
    lines = ["Metadata-Version: 2.4", "Name: vllm-nnrp-plugin", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in (*PYPROJECT["project"]["dependencies"], *requires)]
    for extra, requirements in extras.items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in requirements]
    return "\n".join(lines) + "\n"


def wheel(tmp_path, *, entry_points: str = ENTRY_POINTS, drop: str | None = None, **meta) -> pathlib.Path:
    path = tmp_path / f"vllm_nnrp_plugin-{VERSION}-py3-none-any.whl"
    info = f"vllm_nnrp_plugin-{VERSION}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        for module in MODULES - {drop}:
            archive.write(ROOT / module, module)
        archive.writestr(f"{info}/entry_points.txt", entry_points)
        archive.writestr(f"{info}/METADATA", metadata(**meta))
    return path


def sdist(tmp_path, *, drop: str | None = None) -> pathlib.Path:
    path = tmp_path / f"vllm_nnrp_plugin-{VERSION}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name in [*(MODULES - {drop}), "pyproject.toml", "README.md"]:
            archive.add(ROOT / name, f"vllm_nnrp_plugin-{VERSION}/{name}")
    return path


@pytest.fixture(autouse=True)
def same_checkout(monkeypatch):
    """main() lists the checkout's modules again: the list the synthetic archives were made from (the working tree
    may change while the tests run)."""
    monkeypatch.setattr(check_package, "checkout_modules", lambda root=ROOT: set(MODULES))


def problems(whl: pathlib.Path, sd: pathlib.Path) -> list[str]:
    return check_package.wheel_problems(whl, MODULES, PYPROJECT) + check_package.sdist_problems(sd, MODULES)


def test_the_checkout_has_the_modules_the_entry_points_name():
    assert {"vllm_nnrp_plugin/vllm_binding/endpoint.py", "vllm_nnrp_plugin/client/cli/__init__.py"} <= MODULES


def test_a_wheel_as_built_from_this_checkout_passes(tmp_path):
    assert problems(wheel(tmp_path), sdist(tmp_path)) == []
    assert check_package.main([str(wheel(tmp_path)), str(sdist(tmp_path))]) == 0


@pytest.mark.parametrize(
    "broken, expected",
    [
        (
            {
                "entry_points": ENTRY_POINTS.replace(
                    "nnrp = vllm_nnrp_plugin.vllm_binding.endpoint", "other = vllm_nnrp_plugin.vllm_binding.endpoint"
                )
            },
            "no entry point nnrp in [vllm.endpoint_plugins]",
        ),
        (
            {"entry_points": ENTRY_POINTS.replace("general:register", "general:registr")},
            "vllm_nnrp_plugin.vllm_binding.general defines no registr",
        ),
        ({"entry_points": ENTRY_POINTS.replace("vllm-nnrp =", "vllm-nrp =")}, "no entry point vllm-nnrp"),
        ({"drop": "vllm_nnrp_plugin/vllm_binding/endpoint.py"}, "not in the wheel"),
        ({"version": "0.0.1"}, f"pyproject.toml says {VERSION}"),
        ({"requires": ("aioquic>=1.2,<2",)}, "unconditional dependency"),
    ],
)
def test_each_packaging_miss_is_named(tmp_path, broken, expected, capsys):
    found = problems(wheel(tmp_path, **broken), sdist(tmp_path))
    assert any(expected in p for p in found), found
    assert check_package.main([str(wheel(tmp_path, **broken)), str(sdist(tmp_path))]) == 1
    assert expected in capsys.readouterr().err


def test_a_module_missing_from_the_sdist_is_named(tmp_path):
    found = problems(wheel(tmp_path), sdist(tmp_path, drop="vllm_nnrp_plugin/config.py"))
    assert found == [
        f"vllm_nnrp_plugin-{VERSION}.tar.gz: vllm_nnrp_plugin/config.py is in the checkout but not in the sdist"
    ]


def test_pyproject_declares_what_the_checks_look_for():
    project = PYPROJECT["project"]
    assert not any(r.startswith(("aioquic", "cryptography")) for r in project["dependencies"])
    assert any(r.startswith("aioquic") for r in project["optional-dependencies"]["quic"])
    # the unit tests' environment (tox -e unit) installs aioquic, so the QUIC tests run there
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    extras = [e.strip() for e in ini["testenv:unit"]["extras"].replace("\n", ",").split(",") if e.strip()]
    assert any(r.startswith("aioquic") for e in extras for r in project["optional-dependencies"][e]), extras
    scripts, points = project["scripts"], project["entry-points"]
    assert scripts["vllm-nnrp"] == check_package.ENTRY_POINTS[("console_scripts", "vllm-nnrp")]
    for group in ("vllm.general_plugins", "vllm.endpoint_plugins"):
        assert points[group]["nnrp"] == check_package.ENTRY_POINTS[(group, "nnrp")]

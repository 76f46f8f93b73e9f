"""The commands and examples in README.md and docs/ run as written: every fenced shell command, YAML config, JSON
example and Python snippet is checked against the code it names, without starting vLLM.

* ``vllm-nnrp …`` parses with the CLI's own parser (:func:`vllm_nnrp_plugin.client.cli.build_parser`);
* ``vllm serve …``: its ``--additional-config`` JSON and a YAML file's ``additional-config`` load with
  :func:`vllm_nnrp_plugin.config.load_config` as an enabled server would load them (listen addresses, exposure and
  TLS rules included; certificate paths point at a real certificate made here), and a ``--middleware`` /
  ``middleware`` value names a class that exists;
* ``python -m tox -e ENV`` names environments of tox.ini, ``python -m bench …`` parses with the benchmark's parser,
  ``pip install "…[EXTRA]"`` names extras of pyproject.toml, paths into the checkout exist;
* only programs a fresh machine has (or this package installs) are run, with no placeholder (``…``, ``<name>``);
* JSON blocks parse; Python blocks compile and their ``vllm_nnrp_plugin`` imports resolve;
* relative links between the pages point at files and headings that exist.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import datetime
import importlib
import io
import json
import pathlib
import re
import shlex
import tomllib

import attrs
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from vllm_nnrp_plugin.client.cli import build_parser
from vllm_nnrp_plugin.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: programs a command may start: a fresh Linux machine's, Python's, and what this package and vLLM install
PROGRAMS = frozenset(
    {"python3", "python", "pip", "vllm", "vllm-nnrp", "bash", "curl", "openssl", "grep", "tail", "git", "tox"}
)
SHELL = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
PLACEHOLDER = re.compile(r"…|\.\.\.|<[A-Za-z][\w-]*>|\[--")
MIDDLEWARE_CLASS = "vllm_nnrp_plugin.vllm_binding.middleware.NNRPMiddleware"


@attrs.frozen
class Block:
    page: pathlib.Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(pages: list[pathlib.Path] = PAGES) -> list[Block]:
    found = []
    for page in pages:
        source = page.read_text()
        for match in FENCE.finditer(source):
            indent = len(match["indent"])
            body = "".join(line[indent:] for line in match["body"].splitlines(keepends=True))
            line = source.count("\n", 0, match.start()) + 2
            found.append(Block(page, line, match["lang"].lower(), body))
    return found


def commands(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


ALL = blocks()
SHELL_COMMANDS = [(b, c) for b in ALL if b.lang in SHELL for c in commands(b)]


def _id(item: tuple[Block, str]) -> str:
    block, command = item
    return f"{block.where}:{command[:60]}"


# ---------------------------------------------------------------------------------------------------------- checks


class DocError(AssertionError):
    pass


def check_command(command: str, tls: dict[str, str]) -> None:
    """Check one shell command line (pipelines and ``&&`` chains included); raises :class:`DocError`."""
    if PLACEHOLDER.search(command):
        raise DocError(f"placeholder in a command meant to run as written: {command!r}")
    assignment = re.fullmatch(r"(?:export )?\w+=\$\((?P<inner>.*)\)", command)
    if assignment:  # NAME=$(command …): check the command inside
        check_command(assignment["inner"], tls)
        return
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    simple: list[str] = []
    for token in [*lexer, ";"]:
        if token in (";", "&&", "||", "|"):
            if simple:
                check_simple(simple, tls)
            simple = []
        else:
            simple.append(token)


def check_simple(argv: list[str], tls: dict[str, str]) -> None:
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if not argv:
        return
    program, args = argv[0], argv[1:]
    if program == "export":
        return
    if re.fullmatch(r"\$\w+/bin/python3?", program):  # a virtual environment's Python ($VENV/bin/python)
        program = "python"
    venv = re.fullmatch(r"\.venv/bin/(?P<tool>python3?|pip|tox)", program)  # the README's venv in the checkout
    if venv:
        program = venv["tool"]
    if program not in PROGRAMS:
        raise DocError(f"{program!r} is not a program a fresh machine has or this package installs")
    if program == "vllm-nnrp":
        check_cli(args)
    elif program == "vllm" and args[:1] == ["serve"]:
        check_vllm_serve(args[1:], env, tls)
    elif program in ("python", "python3"):
        check_python(args)
    elif program == "pip":
        check_pip(args)
    elif program == "tox":
        check_tox(args)
    elif program == "bash":
        check_path(args[0])


def check_cli(args: list[str]) -> None:
    error = _parse_error(args)
    if error:
        raise DocError(f"vllm-nnrp {shlex.join(args)}: {error}")


def _parse_error(args: list[str]) -> str | None:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            build_parser().parse_args(args)
        except SystemExit:
            return stderr.getvalue().strip().splitlines()[-1]
    return None


def check_vllm_serve(args: list[str], env: dict[str, str], tls: dict[str, str]) -> None:
    if not args or args[0].startswith("-"):
        raise DocError(f"vllm serve without a model: {args}")
    options = _options(args[1:])
    if "--additional-config" in options:
        try:
            additional = json.loads(options["--additional-config"])
        except json.JSONDecodeError as exc:
            raise DocError(f"--additional-config is not JSON: {exc}") from None
        check_config(additional, env, tls)
    else:
        check_config({}, env, tls)
    if "--middleware" in options:
        check_middleware(options["--middleware"])


def _options(args: list[str]) -> dict[str, str]:
    options = {}
    for i, arg in enumerate(args):
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            options[name] = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return options


def check_config(additional: dict, env: dict[str, str], tls: dict[str, str]) -> None:
    """Load ``additional``'s ``nnrp`` block as a server with NNRP enabled would (``VLLM_PLUGINS=nnrp``, plus the
    command's own environment): keys, types, addresses, exposure and TLS rules. Certificate and key paths are
    replaced by a real certificate and key (the documented files do not exist here)."""
    block = dict(additional.get("nnrp", {}))
    for key in ("tls_cert_file", "tls_key_file"):
        if key in block:
            block[key] = tls[key]
    environ = {"VLLM_PLUGINS": "nnrp", **env}
    try:
        load_config({**additional, "nnrp": block}, environ=environ)
    except ValueError as exc:  # ConfigError
        raise DocError(f"config does not load: {exc}") from None


def check_middleware(dotted: str) -> None:
    if dotted != MIDDLEWARE_CLASS:
        raise DocError(f"--middleware {dotted!r} is not the plugin's middleware {MIDDLEWARE_CLASS}")
    module, _, name = dotted.rpartition(".")
    if not hasattr(importlib.import_module(module), name):
        raise DocError(f"{dotted} does not exist")


def check_python(args: list[str]) -> None:
    if args[:1] != ["-m"]:
        if args:
            check_path(args[0])
        return
    module, rest = args[1], args[2:]
    if module == "tox":
        check_tox(rest)
    elif module == "bench":
        _parse_with(importlib.import_module("bench.suite").parser(), rest, "python -m bench")
    elif module == "bench.soak":
        _parse_with(importlib.import_module("bench.soak")._parser(), rest, "python -m bench.soak")
    elif module == "bench.hostile":
        _parse_with(importlib.import_module("bench.hostile").parser(), rest, "python -m bench.hostile")
    elif module == "bench.server_cpu":
        _parse_with(importlib.import_module("bench.server_cpu").parser(), rest, "python -m bench.server_cpu")
    elif module == "bench.carrier_probe":
        _parse_with(importlib.import_module("bench.carrier_probe").parser(), rest, "python -m bench.carrier_probe")
    elif module == "bench.profile_load":
        _parse_with(importlib.import_module("bench.profile_load").parser(), rest, "python -m bench.profile_load")
    elif module == "bench.fleet":
        _parse_with(importlib.import_module("bench.fleet").parser(), rest, "python -m bench.fleet")
    elif module == "pip":
        check_pip(rest)
    elif module == "venv":  # python3 -m venv DIR: nothing to check but that it names a directory
        if not rest or rest[-1].startswith("-"):
            raise DocError(f"python -m venv without a directory: {rest}")
    elif module == "pytest":
        for arg in rest:
            if not arg.startswith("-"):
                check_path(arg)
    elif module == "vllm_nnrp_plugin.client.conformance":
        check_cli(["conformance", *rest])
    else:
        raise DocError(f"python -m {module}: no check for this module; add one")


def _parse_with(parser, args: list[str], what: str) -> None:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parser.parse_args(args)
        except SystemExit:
            raise DocError(f"{what} {shlex.join(args)}: {stderr.getvalue().strip()}") from None


def check_tox(args: list[str]) -> None:
    args = args[: args.index("--")] if "--" in args else args  # what follows -- goes to the environment
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    envs = {section.removeprefix("testenv:") for section in ini.sections() if section.startswith("testenv:")}
    envs |= {e.strip() for e in ini["tox"]["envlist"].split(",")}
    for name in _options(args).get("-e", "").split(",") if "-e" in args else []:
        if name not in envs:
            raise DocError(f"tox -e {name}: no such environment in tox.ini ({', '.join(sorted(envs))})")


def check_pip(args: list[str]) -> None:
    if args[:1] != ["install"]:
        return
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for arg in args[1:]:
        match = re.fullmatch(r"(?P<name>vllm-nnrp-plugin|\.)\[(?P<extras>[\w,-]+)\]", arg)
        if match:
            for extra in match["extras"].split(","):
                if extra not in extras:
                    raise DocError(f"pip install {arg}: no extra {extra!r} in pyproject.toml ({', '.join(extras)})")


def check_path(path: str) -> None:
    if not path.startswith("-") and "/" in path and not path.startswith(("/", "$", "~")):
        if not (ROOT / path).exists():
            raise DocError(f"{path}: no such file in the checkout")


def check_yaml(text: str, tls: dict[str, str]) -> None:
    document = yaml.safe_load(text)
    if not isinstance(document, dict):
        raise DocError("a YAML example that is not a mapping")
    additional = document.get("additional-config", document.get("additional_config"))
    if additional is None:
        raise DocError("a YAML example without additional-config")
    check_config(additional, {}, tls)
    if "middleware" in document:
        if not isinstance(document["middleware"], str):
            raise DocError("middleware must be a string in a vllm serve --config file (vLLM rejects a list)")
        check_middleware(document["middleware"])


def check_python_block(text: str, where: str) -> None:
    tree = ast.parse(text, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_nnrp_plugin"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    raise DocError(f"{where}: {node.module} has no {alias.name}")


# ---------------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> dict[str, str]:
    """A real self-signed certificate and key, for the examples' ``tls_cert_file`` / ``tls_key_file``."""
    directory = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert, key_file = directory / "nnrp.crt", directory / "nnrp.key"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return {"tls_cert_file": str(cert), "tls_key_file": str(key_file)}


def test_the_pages_have_the_examples_this_test_checks():
    """Guards the extraction itself: a page layout the fence pattern missed would pass every test below vacuously."""
    programs = [command.split()[0] for _, command in SHELL_COMMANDS]
    assert {p.name for p in PAGES} >= {"README.md", "operating.md", "clients.md", "compatibility.md"}
    assert sum(1 for _, c in SHELL_COMMANDS if c.startswith("vllm-nnrp ")) >= 8, programs
    assert sum(1 for _, c in SHELL_COMMANDS if "--additional-config" in c) >= 3
    assert any(b.lang == "yaml" for b in ALL) and any(b.lang == "python" for b in ALL)
    readme = [c for b, c in SHELL_COMMANDS if b.page.name == "README.md" and b.page.parent == ROOT]
    # in a virtual environment: a stock Debian or Ubuntu refuses pip install into its system Python (PEP 668)
    assert 'python3 -m venv .venv && .venv/bin/pip install "tox>=4" && .venv/bin/tox -e demo' in readme
    assert 'python3 -m venv .venv && .venv/bin/pip install "tox>=4" && .venv/bin/tox' in readme
    assert "python3 -m pip install ." in readme  # the package is not on the index: installed from the clone


@pytest.mark.parametrize("item", SHELL_COMMANDS, ids=_id)
def test_shell_command_runs_as_written(item, tls):
    block, command = item
    try:
        check_command(command, tls)
    except DocError as exc:
        pytest.fail(f"{block.where}: {exc}")


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("yaml", "yml")], ids=lambda b: b.where)
def test_yaml_config_loads(block, tls):
    try:
        check_yaml(block.text, tls)
    except DocError as exc:
        pytest.fail(f"{block.where}: {exc}")


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "json"], ids=lambda b: b.where)
def test_json_example_parses(block):
    json.loads(block.text)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=lambda b: b.where)
def test_python_example_compiles_and_its_imports_resolve(block):
    try:
        check_python_block(block.text, block.where)
    except DocError as exc:
        pytest.fail(str(exc))


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m[1]) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for match in LINK.finditer(FENCE.sub("", page.read_text())):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_compatibility_table_is_the_generated_one():
    """compat/compat_table.py writes into docs/compatibility.md between its markers (what compat/run-vllm-tests.sh
    and compat/run-matrix.sh rely on), and the page shows what compat/results/ holds."""
    compat_table = importlib.import_module("compat.compat_table")
    text = compat_table.PAGE.read_text()
    assert compat_table.PAGE == ROOT / "docs" / "compatibility.md"
    head, begin, rest = text.partition(compat_table.BEGIN)
    shown, end, _ = rest.partition(compat_table.END)
    assert begin and end, "the compat-table markers are missing"
    assert shown.strip() == compat_table.table(), "run: python3 compat/compat_table.py docs"


# The checks must be able to fail: what a typo or a stale example looks like.
@pytest.mark.parametrize(
    "command",
    [
        'vllm-nnrp chat --endpoit tcp://127.0.0.1:9400 "Say hello."',  # typo'd flag
        'vllm-nnrp chatt --endpoint tcp://127.0.0.1:9400 "Say hello."',  # unknown subcommand
        "vllm-nnrp embed --encoding-format bytes x",  # a choice the CLI does not offer
        'VLLM_PLUGINS=nnrp vllm serve M --additional-config \'{"nnrp": {"max_session": 8}}\'',  # unknown key
        'VLLM_PLUGINS=nnrp vllm serve M --additional-config \'{"nnrp": {"listen": ["tcp://0.0.0.0:9400"]}}\'',
        'VLLM_PLUGINS=nnrp vllm serve M --additional-config \'{"nnrp": {"listen": ["nnrps://0.0.0.0:1"]}}\'',
        "vllm serve M --middleware vllm_nnrp_plugin.NNRPMiddleware",
        "python3 -m tox -e vllm-0.99.0",
        ".venv/bin/tox -e vllm-0.99.0",
        'pip install "vllm-nnrp-plugin[openia]"',
        "vllm-nnrp chat --endpoint … PROMPT",  # a placeholder
        "wget https://example.invalid/x",  # not a program this test knows a fresh machine has
    ],
)
def test_the_checks_reject_a_broken_example(command, tls):
    with pytest.raises(DocError):
        check_command(command, tls)


def test_the_yaml_check_rejects_a_middleware_list(tls):
    with pytest.raises(DocError):
        check_yaml(f"model: M\nmiddleware: [{MIDDLEWARE_CLASS}]\nadditional-config: {{nnrp: {{}}}}\n", tls)

"""Result rows, percentiles, the machine description, and the JSON / markdown writers.

There is no benchmark-results schema in the NNRP conformance suite (``schemas/`` has only api-profile
documents), so the JSON follows the suite's case-results file: ``{profile, schema_version, adapter,
results: [{id, outcome, …}]}`` plus ``kind``, ``date``, ``command``, ``machine`` and ``versions``. Each row
adds ``unit``, ``samples``, ``p50``, ``p95``, ``mean``, ``max``, ``parameters``, ``targets``
``[{stat, op, value, met}]`` with ``target_met`` (all of them met), and ``compare`` (another row's id and the ratio of
p50s) for side-by-side rows. ``outcome`` is ``passed`` when the measurement ran; whether a target was met
is ``target_met``.
"""

from __future__ import annotations

import datetime
import math
import os
import pathlib
import platform
import subprocess
from collections.abc import Sequence
from typing import Any

import attrs
import orjson


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


@attrs.frozen
class Target:
    """``stat`` (``p50``/``p95``) ``op`` (``<=``/``>=``) ``value`` in the row's unit."""

    stat: str
    op: str
    value: float

    def met(self, row: Result) -> bool:
        measured = getattr(row, self.stat)
        return measured <= self.value if self.op == "<=" else measured >= self.value


@attrs.define
class Result:
    """One measured quantity. ``unit`` e.g. ``us``, ``ms``, ``events/s``, ``MB``."""

    id: str
    unit: str
    samples: int
    p50: float
    p95: float
    mean: float | None = None
    max: float | None = None
    parameters: dict[str, Any] = attrs.field(factory=dict)
    targets: tuple[Target, ...] = ()
    compare: dict[str, Any] | None = None
    note: str | None = None

    @classmethod
    def of(cls, id: str, unit: str, values: Sequence[float], **kw: Any) -> Result:
        """Summarise ``values`` (non-empty)."""
        return cls(
            id=id,
            unit=unit,
            samples=len(values),
            p50=percentile(values, 0.5),
            p95=percentile(values, 0.95),
            mean=sum(values) / len(values),
            max=max(values),
            **kw,
        )

    def versus(self, other: Result) -> None:
        """Record ``self.p50 / other.p50`` (and p95) as this row's ratio to ``other``."""
        self.compare = {
            "against": other.id,
            "p50_ratio": round(self.p50 / other.p50, 3) if other.p50 else None,
            "p95_ratio": round(self.p95 / other.p95, 3) if other.p95 else None,
        }

    def as_json(self) -> dict[str, Any]:
        row = {"id": self.id, "outcome": "passed", **attrs.asdict(self, recurse=True)}
        row["targets"] = [{**attrs.asdict(t), "met": t.met(self)} for t in self.targets]
        row["target_met"] = all(t["met"] for t in row["targets"]) if self.targets else None
        return {k: v for k, v in row.items() if v is not None and v != []}


def machine() -> dict[str, Any]:
    """CPU model, logical CPUs, memory (GB), kernel, Python; the load average when the run started."""
    cpu = "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(pathlib.Path("/proc/meminfo").read_text().split()[1])
    except OSError:
        mem_kb = 0
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gb": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def versions() -> dict[str, Any]:
    """Versions of this package, nnrp-py, vLLM (when importable without starting it) and the git commit."""
    from importlib import metadata

    import vllm_nnrp_plugin

    found: dict[str, Any] = {"vllm-nnrp-plugin": vllm_nnrp_plugin.__version__}
    for dist in ("nnrp-py", "prometheus-client", "opentelemetry-api"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    try:
        found["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=pathlib.Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        found["git_commit"] = None
    return found


def document(rows: Sequence[Result], *, command: str, extra_versions: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results document (see the module docstring)."""
    return {
        "profile": "openai-compatible",
        "schema_version": "openai-compatible/1",
        "adapter": "vllm-nnrp-plugin",
        "kind": "benchmark-results",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "machine": machine(),
        "versions": {**versions(), **(extra_versions or {})},
        "results": [row.as_json() for row in rows],
    }


def markdown(doc: dict[str, Any]) -> str:
    """A markdown table of ``doc`` with the machine, versions and date."""
    m, v = doc["machine"], doc["versions"]
    lines = [
        f"# vllm-nnrp-plugin benchmarks — {doc['date']}",
        "",
        f"* command: `{doc['command']}`",
        f"* machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gb']} GB, Linux {m['kernel']}, "
        f"Python {m['python']}, load average at start {m['load_average_1m']}",
        "* versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None),
        "",
        "| id | unit | samples | p50 | p95 | target | met | ratio (p50 / p95) vs | parameters |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in doc["results"]:
        target_text = ", ".join(f"{t['stat']} {t['op']} {_num(t['value'])}" for t in row.get("targets", ()))
        met = ", ".join("yes" if t["met"] else "**no**" for t in row.get("targets", ()))
        compare = row.get("compare")
        ratio = f"{compare['p50_ratio']} / {compare['p95_ratio']} vs `{compare['against']}`" if compare else ""
        params = ", ".join(f"{k}={val}" for k, val in row.get("parameters", {}).items())
        lines.append(
            f"| `{row['id']}` | {row['unit']} | {row['samples']} | {_num(row['p50'])} | {_num(row['p95'])} "
            f"| {target_text} | {met} | {ratio} | {params} |"
        )
    notes = [(row["id"], row["note"]) for row in doc["results"] if row.get("note")]
    if notes:
        lines += ["", "Notes:", ""] + [f"* `{i}`: {n}" for i, n in notes]
    return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def write(doc: dict[str, Any], directory: pathlib.Path, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``<name>.json`` and ``<name>.md`` into ``directory``; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path, md_path = directory / f"{name}.json", directory / f"{name}.md"
    json_path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    md_path.write_text(markdown(doc))
    return json_path, md_path


def emit(result: Any, json_path: str | None, *, indent: bool = False) -> None:
    """Print ``result`` as JSON on stdout (indented with ``indent``) and, with ``json_path``, write the same text
    and a newline to that file: the output of a ``python -m bench.<tool> [--json FILE]``."""
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2 if indent else 0).decode()
    print(text)
    if json_path:
        pathlib.Path(json_path).write_text(text + "\n")

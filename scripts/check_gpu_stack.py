"""Check that installing the ``gpu`` extra changes nothing the base install chose: one stack for CPU and GPU.

Runs pip's resolver without installing anything (``pip install --dry-run --report``) for ``-e "<project>[gpu]"``
in the running interpreter's environment and compares every package pip would install with what is installed
there. Adding packages (vLLM and its own dependencies) is expected; replacing an installed one (say Ray 2.40 by
another Ray, or numpy 1.x by 2.x) would mean the CPU-tested stack is not the one a GPU user runs. Run it in the
environment made by ``pip install -e ".[dev]"``; the resolver reads package metadata only (no wheel is
installed), and needs the package index.

Exit status: 0 nothing would change; 1 some installed package would change (a table names each); 2 pip could
not resolve the extra (no package index, conflicting pins: pip's own message is printed).

Usage: ``python scripts/check_gpu_stack.py [--extra gpu] [--project DIR]``
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PROJECT_NAME = "colossal-rl"
EXIT_CHANGES, EXIT_UNRESOLVED = 1, 2


@dataclass(frozen=True, order=True)
class Change:
    name: str
    installed: str
    planned: str


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: ``Ray``, ``ray_cpp`` and ``ray.cpp`` compare as ``ray``, ``ray-cpp``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """Canonical name -> version of every distribution in this interpreter's environment."""
    return {canonical_name(dist.metadata["Name"]): dist.version for dist in importlib.metadata.distributions()}


def planned_installs(report: dict[str, Any]) -> dict[str, str]:
    """Canonical name -> version of every package in a ``pip install --report`` (format version 1)."""
    return {canonical_name(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def stack_changes(planned: dict[str, str], installed: dict[str, str], *, project: str = PROJECT_NAME) -> list[Change]:
    """Installed packages pip would replace, the project itself excepted (an editable install re-runs anyway).

    pip plans only what is missing or does not satisfy a requirement, so an installed package in the plan is a
    change even at the same version (another build, e.g. a CUDA wheel for a CPU one).
    """
    return sorted(
        Change(name, installed[name], version)
        for name, version in planned.items()
        if name in installed and name != canonical_name(project)
    )


def format_table(changes: list[Change]) -> str:
    rows = [("package", "installed", "would install")] + [(c.name, c.installed, c.planned) for c in changes]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def resolve(project: Path, extra: str) -> dict[str, Any]:
    """pip's installation report for ``-e project[extra]`` in this environment; RuntimeError if pip fails."""
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-input",
                   "--report", str(report_path), "-e", f"{project}[{extra}]"]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not report_path.exists():
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return json.loads(report_path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", default="gpu", help="the extra to resolve on top of this environment")
    parser.add_argument("--project", type=Path, default=PROJECT_ROOT, help="the project directory")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        report = resolve(args.project, args.extra)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return EXIT_UNRESOLVED
    planned = planned_installs(report)
    changes = stack_changes(planned, installed_versions())
    added = len(planned) - len(changes) - (canonical_name(PROJECT_NAME) in planned)
    elapsed = time.perf_counter() - start
    if changes:
        print(f'pip install -e ".[{args.extra}]" would change {len(changes)} installed package(s):')
        print(format_table(changes))
        return EXIT_CHANGES
    print(f'pip install -e ".[{args.extra}]" changes nothing installed; it adds {added} package(s) ({elapsed:.0f} s)')
    return 0


if __name__ == "__main__":
    sys.exit(main())

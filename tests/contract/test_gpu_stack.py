"""One trainer stack for CPU and GPU: ``pip install -e ".[gpu]"`` (cupy for Ray's NCCL group) adds packages to what
``.[dev]`` installed, and changes none of them (``scripts/check_gpu_stack.py``, pip's resolver in dry-run mode; metadata only, nothing installed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "check_gpu_stack.py"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def load_script():
    spec = importlib.util.spec_from_file_location("check_gpu_stack", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def report(*packages: tuple[str, str]) -> dict:
    """A ``pip install --report`` (format version 1) reduced to what the check reads."""
    return {"version": "1", "install": [{"metadata": {"name": name, "version": version}} for name, version in packages]}


def test_a_replaced_package_is_a_change_and_an_added_one_is_not():
    check = load_script()
    installed = {"ray": "2.40.0", "numpy": "1.26.4", "colossal-rl": "0.1.0"}
    planned = check.planned_installs(
        report(("colossal_rl", "0.1.0"), ("vllm", "0.7.3"), ("NumPy", "2.2.0"), ("Ray", "2.40.0"))
    )
    changes = check.stack_changes(planned, installed)
    assert changes == [check.Change("numpy", "1.26.4", "2.2.0"), check.Change("ray", "2.40.0", "2.40.0")]
    assert check.format_table(changes).splitlines() == [
        "package  installed  would install",
        "numpy    1.26.4     2.2.0",
        "ray      2.40.0     2.40.0",
    ]
    assert check.stack_changes(check.planned_installs(report(("vllm", "0.7.3"))), installed) == []


@pytest.mark.contract
def test_the_gpu_extra_changes_nothing_the_base_install_chose():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    unreachable = result.returncode == 2 and "ResolutionImpossible" not in result.stderr  # not a pin conflict
    if unreachable and not in_ci():
        pytest.skip(f"pip could not reach a package index here: {result.stderr[-1000:]}")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "changes nothing installed" in result.stdout

"""The checkout as the lent GPU machine runs it: a copy on ``PYTHONPATH`` and an interpreter without the project.

For the tests of ``tests/gpu/one_gpu_check.py``'s dry run (``tests/unit/test_one_gpu_check.py`` in the trainers'
environment, ``tests/engines/test_fsdp2_gpu_paths.py`` in the producers').
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
SCRIPT = CHECKOUT / "tests" / "gpu" / "one_gpu_check.py"


def uninstalled_checkout(root: Path) -> Path:
    """The checkout as the lent GPU machine has it: ``colossal_rl/``, ``reward/`` and the script, with nothing
    mapping ``reward/`` to ``colossal_rl.reward`` (no ``colossal_rl/reward``, as a mutation-check copy links it)."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {"__pycache__"} | ({"reward", "assets"} if Path(directory) == CHECKOUT / "colossal_rl" else set())
        return skip & set(names)

    shutil.copytree(CHECKOUT / "colossal_rl", root / "colossal_rl", ignore=ignore)
    (root / "colossal_rl" / "assets").symlink_to(CHECKOUT / "colossal_rl" / "assets", target_is_directory=True)
    shutil.copytree(CHECKOUT / "reward", root / "reward", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "tests" / "gpu" / SCRIPT.name)
    return root


def python_without_the_project(directory: Path, python: str = sys.executable) -> Path:
    """An interpreter that has ``python``'s packages (torch, transformers) but not the project's editable install: a
    bare virtualenv whose first ``.pth`` adds ``python``'s site-packages as a plain path (``.pth`` files there are
    then not run), with copies of that environment's own start-up ``.pth`` files except the editable install's
    (``__editable__*``; the producers' CPU environment has its torchvision hook there, which the GPU machine's matching
    torchvision does not need). Every process the script starts uses it too."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=60)
    listed = [python, "-c", "import site; print('\\n'.join(site.getsitepackages()))"]
    site_packages = subprocess.run(listed, capture_output=True, text=True, check=True, timeout=60).stdout.split()
    (target,) = directory.glob("lib/python*/site-packages")
    paths = target / "00_packages_without_the_project.pth"  # sorted first: the copies below import from there
    paths.write_text("\n".join(site_packages) + "\n")
    for source in site_packages:
        for start_up in Path(source).glob("*.pth"):
            if not start_up.name.startswith("__editable__"):
                shutil.copy(start_up, target / start_up.name)
    return directory / "bin" / "python"

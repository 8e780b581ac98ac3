"""Every test file in the repository is collected by the README's test command.

tests/dist was once skipped twice over without anyone noticing: pytest's default ``norecursedirs``
contains ``dist`` and the repository's ``.gitignore`` had ``dist/``. This guards the first; the
clean-clone CI guards the second.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_test_file_is_collected():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = {line.split("::", 1)[0] for line in done.stdout.splitlines() if "::" in line}
    on_disk = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")}
    assert on_disk - collected == set(), "test files pytest does not collect"
    assert any(name.startswith("tests/dist/") for name in collected)

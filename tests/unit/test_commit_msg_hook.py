"""The commit-msg hook (``scripts/git-hooks/commit-msg``) refuses subjects over 72 characters and empty ones."""

from __future__ import annotations

import subprocess
from pathlib import Path

HOOK = Path(__file__).resolve().parents[2] / "scripts" / "git-hooks" / "commit-msg"


def run_hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run(["bash", str(HOOK), str(path)], capture_output=True, text=True, timeout=30)


def test_a_subject_of_72_characters_with_a_long_body_is_accepted(tmp_path):
    body = "why " * 60
    assert run_hook(tmp_path, "x" * 72 + "\n\n" + body + "\n").returncode == 0


def test_a_subject_of_73_characters_is_refused_with_its_length(tmp_path):
    done = run_hook(tmp_path, "y" * 73 + "\n\nbody\n")
    assert done.returncode == 1
    assert "73 characters, over 72" in done.stderr


def test_git_comment_lines_before_the_subject_do_not_count_and_an_empty_subject_is_refused(tmp_path):
    assert run_hook(tmp_path, "# " + "z" * 100 + "\nShort subject\n").returncode == 0
    assert run_hook(tmp_path, "# only a comment\n").returncode == 1

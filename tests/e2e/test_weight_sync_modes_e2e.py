"""``--weight-sync-mode`` end to end through ``rl_example.py`` on the embedded model: a run in ``shm`` mode trains
two steps with a checkpoint per step, then a second run resumes from it (``-cp``) in ``files`` mode and trains
a third — so both non-default modes sync for real (at start-up and after every step), and a run may change its
mode on resume (the checkpoint holds no sync state). ``broadcast``, the default, is what every other e2e run
uses (the kill-9 resume in ``test_lifecycle_e2e.py`` included).

Kept cheap: two launches. The shm run must leave nothing behind in ``/dev/shm``; the files-mode run must
leave no sync files behind in ``<run dir>/weight_sync``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run(save_dir: Path, mode: str, max_steps: int, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, str(REPO / "rl_example.py"), "--no-wandb", "--weight-sync-mode", mode,
        "--max-steps", str(max_steps), "-si", "1", "-ei", "0", "--timeout", "120", "-sd", str(save_dir), *extra,
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def shm_regions() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("colossal_rl-*")} if Path("/dev/shm").is_dir() else set()


def test_an_shm_run_trains_and_resumes_in_files_mode(tmp_path: Path):
    before = shm_regions()
    first = run(tmp_path / "first", "shm", 2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "shared-memory weight sync /dev/shm/colossal_rl-" in first.stderr
    (run_dir,) = list((tmp_path / "first").iterdir())
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    assert shm_regions() <= before

    resumed = run(tmp_path / "resumed", "files", 3, "-cp", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    (resumed_dir,) = list((tmp_path / "resumed").iterdir())
    assert f"file weight sync through {resumed_dir / 'weight_sync'}" in resumed.stderr
    assert not list((resumed_dir / "weight_sync").glob("*.safetensors")), "the sync files are removed at the end"
    records = read_metrics(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [3]
    assert sum(r["kind"] == "sync" for r in records) >= 2  # the resume's sync of the restored version, and step 3's

"""``python -m colossal_rl.plot`` on a real profiled run through ``rl_example.py`` (Ray, two actors)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from png_checks import PLOT_CURVES, assert_pngs

from colossal_rl.metrics import read_metrics
from colossal_rl.plot import series

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.dist
def test_plots_of_a_real_profiled_run(tmp_path):
    save_dir = tmp_path / "runs"
    run = [
        sys.executable, str(REPO / "rl_example.py"), "--no-wandb", "--max-steps", "2", "-ibs", "4", "-imbs", "4",
        "-tbs", "4", "-tMbs", "4", "-tmbs", "8", "-g", "2", "-mnt", "8", "-kl", "0.01", "--enable_profiling",
        "--timeout", "120", "-sd", str(save_dir),
    ]  # fmt: skip
    done = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = [path for path in save_dir.iterdir() if path.is_dir()]

    done = subprocess.run([sys.executable, "-m", "colossal_rl.plot", str(run_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    records = read_metrics(run_dir / "metrics.jsonl")
    entropy = {"entropy"} if series(records, "train/entropy")[0] else set()
    assert_pngs(run_dir / "plots", PLOT_CURVES | entropy | {"profile_timeline"})

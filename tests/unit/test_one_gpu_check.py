"""``tests/gpu/one_gpu_check.py --dry-run``: the one-GPU check script's plumbing works on the CPU (issue 44, item 9).

The script runs on a lent GPU machine that has no Ray, vLLM or ColossalAI and no package index, so it cannot be
debugged there: this proves here that it imports with nothing more than torch and transformers, runs every check in
its own subprocess (peers and timeouts included), writes one JSON line per check plus a summary (to stdout and to
``--out``), and ends well inside its time limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from uninstalled_checkout import python_without_the_project, uninstalled_checkout

pytestmark = [pytest.mark.slow, pytest.mark.dist]

CHECKOUT = Path(__file__).resolve().parents[2]
SCRIPT = CHECKOUT / "tests" / "gpu" / "one_gpu_check.py"
EXPECTED_CHECKS = {
    "nccl_version",
    "nccl_group",
    "shm_route",
    "transformers_producer",
    "fsdp2_step",
    "bucketed_gloo_from_gpu",
    "bucketed_sync",
    "abort_lonely_member",
    "abort_silent_peer",
}
GPU_ONLY = {"bucketed_gloo_from_gpu"}
FSDP2_ON_CPU = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)
"""torch 2.5.1 (this environment) runs FSDP2 on CUDA only: here ``fsdp2_step``'s dry run says so and is skipped; it
runs in the producers' environment (``tests/engines/test_fsdp2_gpu_paths.py``)."""
DRY_RUN_SKIPS = GPU_ONLY | (set() if FSDP2_ON_CPU else {"fsdp2_step"})
LIMIT_S = 180  # the script's own default limit is 420 s; on the GPU machine it must finish within 8 minutes


def test_the_dry_run_passes_every_check_without_ray_colossalai_or_vllm(tmp_path):
    out = tmp_path / "one_gpu.jsonl"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--timeout-s", str(LIMIT_S)],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=LIMIT_S + 30,
    )
    seconds = time.monotonic() - started
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert out.read_text().splitlines() == done.stdout.splitlines()  # --out holds the same lines
    records, summary = lines[:-1], lines[-1]
    assert {r["check"] for r in records} == EXPECTED_CHECKS
    for record in records:
        assert record["ok"] is True, record
        if record["check"] in GPU_ONLY:
            assert record["skipped"] == "dry-run"
        elif record["check"] in DRY_RUN_SKIPS:
            assert record["skipped"].startswith(f"dry-run: torch {torch.__version__}'s FSDP2 needs CUDA"), record
        else:
            assert "skipped" not in record and "expected_refusal" not in record, record
            assert not record["detail"].get("forbidden_imports"), record
    assert summary["summary"] is True and summary["ok"] is True and summary["dry_run"] is True
    assert summary["failed"] == [] and sorted(summary["skipped"]) == sorted(DRY_RUN_SKIPS)
    assert summary["parent_forbidden_imports"] == []  # the parent process imports neither torch nor ray & co.
    assert summary["seconds"] < LIMIT_S and seconds < 8 * 60
    bucketed = next(r for r in records if r["check"] == "bucketed_sync")
    assert bucketed["detail"]["round_trip"] == "bit-exact" and bucketed["detail"]["receiver"]["ok"]
    silent = next(r for r in records if r["check"] == "abort_silent_peer")
    assert silent["detail"]["outcome"].startswith("CollectiveTimeoutError")


def test_checks_over_their_timeout_are_killed_with_their_peers_and_recorded():
    """Checks cut short (``--check-timeout-s`` below their 3 s collective timeout) are killed, a peer with its check,
    and recorded with their last step; the run goes on to the next check and exits 1."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--timeout-s", "30", "--check-timeout-s", "2.5",
         "--check", "abort_lonely_member", "--check", "abort_silent_peer"],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    seconds = time.monotonic() - started
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    *records, summary = lines
    assert [r["check"] for r in records] == ["abort_lonely_member", "abort_silent_peer"]
    for record in records:
        assert record["ok"] is False and record["detail"]["error"] == "killed after 2s", record
        assert "last_step" in record["detail"]
    assert summary["ok"] is False and summary["failed"] == ["abort_lonely_member", "abort_silent_peer"]
    assert seconds < 2 * (2.5 + 5) + 5, seconds  # each: its timeout, at most the grace to reap it
    assert not surviving_peers(), "a peer outlived its killed check"


def test_a_check_gets_no_start_once_the_runs_limit_is_spent():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--timeout-s", "9", "--check", "nccl_version"],
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    record, summary = (json.loads(line) for line in done.stdout.splitlines())
    assert done.returncode == 1
    assert record == {
        "check": "nccl_version",
        "ok": False,
        "skipped": "the run's --timeout-s was spent",
        "seconds": 0.0,
    }
    assert summary["failed"] == summary["skipped"] == ["nccl_version"]


def surviving_peers(wait_s: float = 5.0) -> str:
    """``--peer`` processes of the script still running after ``wait_s`` (a killed one may take a moment to go)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = subprocess.run(["pgrep", "-af", f"{SCRIPT} --peer"], capture_output=True, text=True).stdout.strip()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_the_transformers_producer_check_runs_from_a_checkout_that_is_not_installed(tmp_path):
    """Issue 61, item 1: on the lent GPU machine the project is not installed (``PYTHONPATH=.``), and
    ``colossal_rl.reward`` exists only through ``setup.py``'s ``package_dir``: the check must find ``reward/``
    itself. Run as there: an uninstalled copy of the checkout on ``PYTHONPATH``, an interpreter without the editable
    install."""
    checkout = uninstalled_checkout(tmp_path / "checkout")
    python = python_without_the_project(tmp_path / "venv")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | {"PYTHONPATH": str(checkout)}
    probe = "import importlib.util as u, colossal_rl as c; print(c.__file__, u.find_spec('colossal_rl.reward'))"
    seen = subprocess.run([python, "-c", probe], cwd=checkout, env=env, capture_output=True, text=True, timeout=60)
    assert seen.stdout.split() == [str(checkout / "colossal_rl" / "__init__.py"), "None"], seen  # as on that machine
    done = subprocess.run(
        [python, str(checkout / "tests" / "gpu" / SCRIPT.name), "--dry-run", "--check", "transformers_producer",
         "--timeout-s", "120"],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    record, summary = (json.loads(line) for line in done.stdout.splitlines())
    assert record["check"] == "transformers_producer" and record["ok"] is True, (record, done.stderr[-2000:])
    assert "skipped" not in record and record["detail"]["model_devices"] == ["cpu"]
    assert done.returncode == 0 and summary["ok"] is True

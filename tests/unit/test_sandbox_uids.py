"""Sandbox uid claims are machine-wide: scorers with different ``$TMPDIR`` never share a uid, and a lock
directory another user could tamper with is refused. Claiming uids runs no program, so no sandbox is needed."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from colossal_rl.reward.sandbox import Sandbox, SandboxConfig
from colossal_rl.reward.sandbox_runtime import LOCK_DIR_ENV, SandboxUnavailable, UidPool, uid_lock_dir

UID_BASE, UID_COUNT = 63000, 4  # a range no other test uses: the lock directory is the machine's
CLAIMER = f"""
import json, sys
from colossal_rl.reward.sandbox_runtime import UidPool
pool = UidPool({UID_BASE}, {UID_COUNT})
print(json.dumps([pool.acquire(timeout_s=10.0) for _ in range(2)]), flush=True)
sys.stdin.read()  # hold the uids until the test closes stdin
"""


@pytest.fixture
def default_lock_dir(monkeypatch):
    monkeypatch.delenv(LOCK_DIR_ENV, raising=False)


def test_lock_dir_does_not_follow_tmpdir(default_lock_dir, monkeypatch, tmp_path):
    default = uid_lock_dir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert uid_lock_dir() == default and not default.is_relative_to(tmp_path)
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "explicit"))
    assert uid_lock_dir() == tmp_path / "explicit"


def test_scorers_with_different_tmpdirs_claim_different_uids(default_lock_dir, tmp_path):
    claimers = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            env = {**os.environ, "TMPDIR": str(tmp_path / name)}
            process = subprocess.Popen(
                [sys.executable, "-c", CLAIMER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            claimers.append(process)
        first, second = (set(json.loads(process.stdout.readline())) for process in claimers)
        assert len(first) == len(second) == 2 and not first & second, (first, second)
        with pytest.raises(SandboxUnavailable, match="no free sandbox uid"):
            UidPool(UID_BASE, UID_COUNT).acquire(timeout_s=0.2)  # all four are held elsewhere
    finally:
        for process in claimers:
            process.communicate(timeout=30)
    pool = UidPool(UID_BASE, UID_COUNT)
    held = {pool.acquire(timeout_s=5.0) for _ in range(UID_COUNT)}  # freed when the claimers exited
    assert held == set(range(UID_BASE, UID_BASE + UID_COUNT))
    for uid in held:
        pool.release(uid)


def test_pools_in_one_process_exclude_each_other(default_lock_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "one"))
    first = UidPool(UID_BASE, 2)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "two"))
    second = UidPool(UID_BASE, 2)
    uid = first.acquire(timeout_s=1.0)
    other = second.acquire(timeout_s=1.0)
    assert uid != other
    with pytest.raises(SandboxUnavailable):
        second.acquire(timeout_s=0.1)
    first.release(uid)
    second.release(other)


def test_lock_dir_others_could_tamper_with_is_refused(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(LOCK_DIR_ENV, str(shared))
    with pytest.raises(SandboxUnavailable, match="another user could hold or fake"):
        UidPool(UID_BASE, UID_COUNT)
    (tmp_path / "link").symlink_to(tmp_path / "private", target_is_directory=True)
    (tmp_path / "private").mkdir(mode=0o700)
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "link"))
    with pytest.raises(SandboxUnavailable, match="not a directory"):
        UidPool(UID_BASE, UID_COUNT)
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "new"))
    pool = UidPool(UID_BASE, UID_COUNT)
    uid = pool.acquire(timeout_s=1.0)
    assert (tmp_path / "new" / f"{uid}.lock").exists() and (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    pool.release(uid)


def test_sandbox_with_a_refused_lock_dir_is_unavailable(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("dedicated uids (and their locks) are used only as root")
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "open"))
    sandbox = Sandbox(SandboxConfig(uid_base=UID_BASE + 8, uid_count=4, max_parallel=1))
    assert sandbox.unavailable is not None and "uid lock directory" in sandbox.unavailable

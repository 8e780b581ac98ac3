"""Reward plug-ins bounded in time (``--reward-timeout``): a call past the limit is an infra_error for that sample
only, its worker is replaced, and no worker outlives the scorer or its parent process."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from colossal_rl.reward import build_reward_scorer
from colossal_rl.reward.bounded_calls import BoundedCallPool
from colossal_rl.reward.user_functions import PLUGIN_FACTORY

PLUGIN = textwrap.dedent(
    """
    import pathlib
    import time

    def score(response, row):
        if response.startswith("hang"):
            if "marker" in row:  # tells the test the call has begun
                pathlib.Path(row["marker"]).write_text("hanging")
            while True:
                time.sleep(1)
        if response == "boom":
            raise RuntimeError("user bug")
        if response == "shout":
            print("this must not reach the replies")
        return float(len(response))
    """
)


@pytest.fixture
def plugin_spec(tmp_path):
    path = tmp_path / "sleepy_reward.py"
    path.write_text(PLUGIN)
    return f"{path}:score"


def worker_processes(among: set[int] | None = None) -> list[psutil.Process]:
    """This process's bounded-call workers still running (zombies excluded); ``among``: only these pids (other
    tests in this process may hold pools of their own)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if among is not None and child.pid not in among:
                continue
            if "colossal_rl.reward.bounded_worker" in " ".join(child.cmdline()) and child.status() != "zombie":
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_hanging_plugin_costs_only_its_samples_and_the_limit(plugin_spec):
    scorer = build_reward_scorer(reward_fn=plugin_spec, reward_timeout_s=1.0)
    try:
        scorer.score_batch(["warm"], [{}])  # workers started and the plug-in loaded: not charged to the limit
        started = time.monotonic()
        records = scorer.score_batch(["a", "hang 1", "bbb", "hang 2", "boom", "shout"], [{}] * 6)
        elapsed = time.monotonic() - started
        assert [r.reward for r in records] == [1.0, 0.0, 3.0, 0.0, 0.0, 5.0]
        assert [r.status for r in records] == ["ok", "infra_error", "ok", "infra_error", "infra_error", "ok"]
        for hung in (records[1], records[3]):
            assert hung.details["error"] == f"reward_fn {plugin_spec} gave no reward within --reward-timeout 1s"
        assert records[4].details["error"] == f"reward_fn {plugin_spec} raised RuntimeError: user bug"
        assert elapsed < 1.0 + 3.0  # the two hangs ran side by side on the two workers
        # the killed workers were replaced: the next batch is scored, by processes that answer
        assert [r.reward for r in scorer.score_batch(["xy", "z"], [{}] * 2)] == [2.0, 1.0]
    finally:
        pids = set(scorer._pool.worker_pids())
        scorer.close()
    assert len(pids) == 2 and worker_processes(pids) == []


def test_close_kills_a_worker_stuck_in_a_call(plugin_spec):
    pool = BoundedCallPool(PLUGIN_FACTORY, plugin_spec, timeout_s=60.0)
    assert pool.call("quick", {}).value.reward == 5.0
    pids = pool.worker_pids()
    assert len(pids) == 2 and {p.pid for p in worker_processes(set(pids))} == set(pids)
    with pytest.raises(TimeoutError):  # a call stuck in "hang" until the pool closes
        pool._executor.submit(pool.call, "hang", {}).result(timeout=0.5)
    pool.close()
    assert worker_processes(set(pids)) == []


def test_workers_die_with_their_parent(plugin_spec, tmp_path):
    """The parent is SIGKILLed mid-call (as Ray kills an actor): its workers go too, no orphan left behind."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from colossal_rl.reward import build_reward_scorer

            scorer = build_reward_scorer(reward_fn={plugin_spec!r}, reward_timeout_s=600)
            scorer.score_batch(["warm"], [{{}}])
            print(*scorer._pool.worker_pids(), flush=True)
            scorer.score_batch(["hang"], [{{"marker": {str(tmp_path / "hanging")!r}}}])
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
        deadline = time.monotonic() + 30
        while not (tmp_path / "hanging").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "hanging").exists()  # one worker is now inside the hanging call
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in pids:  # a failed check leaves no orphan behind either
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_one_summary_line_per_batch_for_failed_samples(plugin_spec, caplog):
    scorer = build_reward_scorer(reward_fn=plugin_spec, reward_timeout_s=5.0)
    try:
        with caplog.at_level("WARNING", logger="colossal_rl.reward.user_functions"):
            scorer.score_batch(["boom", "a", "boom", "boom"], [{}] * 4)
    finally:
        scorer.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "colossal_rl.reward.user_functions"]
    assert lines == [
        f"reward_fn {plugin_spec}: 3 of 4 samples are infra_error (0 past the time limit); "
        f"first: reward_fn {plugin_spec} raised RuntimeError: user bug"
    ]


def test_a_plugin_that_fails_to_load_in_the_worker_is_an_infra_error(tmp_path):
    path = tmp_path / "fragile.py"
    path.write_text(
        "import os\nif os.environ.get('COLOSSAL_RL_BOUNDED_WORKER_SYS_PATH'):\n    raise ImportError('x')\n"
    )
    pool = BoundedCallPool(PLUGIN_FACTORY, f"{path}:f", timeout_s=5.0)
    try:
        outcome = pool.call("a", {})
    finally:
        pool.close()
    assert outcome.status == "failed" and "loading" in outcome.message and "ImportError: x" in outcome.message


def test_a_batch_of_many_hanging_samples_ends_within_its_budget(plugin_spec):
    """Eight hanging samples on two workers would take four limits one after the other; the batch's budget (what a
    producer gets of ``--timeout``) ends it after about one, the samples it could not reach infra_error too."""
    scorer = build_reward_scorer(reward_fn=plugin_spec, reward_timeout_s=2.0, reward_batch_budget_s=2.5)
    try:
        scorer.score_batch(["warm"], [{}])
        started = time.monotonic()
        records = scorer.score_batch(["a", *[f"hang {n}" for n in range(8)], "bbb"], [{}] * 10)
        elapsed = time.monotonic() - started
        assert elapsed < 2.5 + 2.0, elapsed  # the budget, plus one replacement worker's start-up at most
        assert all(record.status == "infra_error" for record in records[1:9])
        assert all(record.details["timed_out"] for record in records[1:9])
        assert any("budget was spent before it was called" in record.details["error"] for record in records[1:9])
        assert scorer.score_batch(["cc"], [{}])[0].reward == 2.0  # the pool still works after the batch
    finally:
        scorer.close()

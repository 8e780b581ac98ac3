"""metrics.jsonl gets every record at once; wandb, started in the background, gets the same records in order."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from colossal_rl.metrics import MetricsLogger, read_metrics


class _FakeWandbRun:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []
        self.finished = False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


@pytest.fixture
def slow_wandb(monkeypatch):
    """A stand-in for the wandb package (what sits around the logger) whose init waits for a signal."""
    release = threading.Event()
    runs: list[_FakeWandbRun] = []

    def init(**kwargs):
        assert release.wait(10), "test never released wandb.init"
        if kwargs["project"] == "broken":
            raise RuntimeError("no wandb service")
        runs.append(_FakeWandbRun())
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_MODE", "offline")
    return release, runs


def test_records_logged_before_wandb_is_ready_reach_it_in_order(tmp_path, slow_wandb):
    release, runs = slow_wandb
    metrics = MetricsLogger(tmp_path, "proj", {"lr": 1.0})
    metrics.log("train", 1, {"train/loss": 0.5, "note": "text"})
    metrics.log("eval", 1, {"eval/math_accuracy": 0.25})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 1]  # on disk before wandb is up
    assert runs == []
    release.set()
    metrics._wandb_start.join(10)
    metrics.log("train", 2, {"train/loss": 0.25})
    metrics.close()
    (run,) = runs
    assert run.logged == [(1, {"train/loss": 0.5}), (1, {"eval/math_accuracy": 0.25}), (2, {"train/loss": 0.25})]
    assert run.finished


def test_close_waits_for_a_wandb_start_still_under_way(tmp_path, slow_wandb):
    release, runs = slow_wandb
    metrics = MetricsLogger(tmp_path, "proj", {})
    metrics.log("train", 1, {"train/loss": 1.0})
    threading.Timer(0.2, release.set).start()
    metrics.close()
    (run,) = runs
    assert run.logged == [(1, {"train/loss": 1.0})] and run.finished


def test_a_wandb_that_cannot_start_leaves_the_jsonl_complete(tmp_path, slow_wandb, caplog):
    release, runs = slow_wandb
    release.set()
    metrics = MetricsLogger(tmp_path, "broken", {})
    metrics.log("train", 1, {"train/loss": 1.0})
    metrics.close()
    assert runs == []
    assert "wandb could not start (no wandb service)" in caplog.text
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["train/loss"] == 1.0


def test_disabled_wandb_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    metrics = MetricsLogger(tmp_path, "proj", {})
    assert metrics._wandb_start is None
    metrics.log("train", 1, {"train/loss": 1.0})
    metrics.close()


def test_step_metrics_are_averaged_over_ranks_except_the_already_global_ones():
    from colossal_rl.metrics import merge_rank_step_metrics

    ranks = [
        {"train/loss": 0.3, "train/entropy": 2.0, "train/reward": 1.0, "train/lr": 1e-4},
        {"train/loss": 0.7, "train/entropy": 9.0, "train/reward": 0.0, "train/lr": 1e-4},
    ]
    assert merge_rank_step_metrics(ranks) == pytest.approx(
        {"train/loss": 0.3, "train/entropy": 2.0, "train/reward": 0.5, "train/lr": 1e-4}
    )

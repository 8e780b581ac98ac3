"""``python -m colossal_rl.plot RUN_DIR``: series picked from metrics records, PNGs written, clear errors.

Fast tests build the run directory with the real writers (MetricsLogger, append_spans); the slow one
plots the run directory of a real two-step run of ``rl_example.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from png_checks import PLOT_CURVES, assert_pngs

from colossal_rl.metrics import MetricsLogger, read_metrics
from colossal_rl.plot import FIGURES, Figure, figure_series, main, metric_names, series
from colossal_rl.profiling import Span, append_spans

REPO = Path(__file__).resolve().parents[2]
CURVES = PLOT_CURVES


def write_run(run_dir: Path, *, profiled: bool = True) -> Path:
    """Records shaped like a real run's (two producers, eval before and after), through the real writers."""
    metrics = MetricsLogger(run_dir, "plot-test", {}, use_wandb=False)
    metrics.log("eval", 0, {"eval/math_accuracy": 0.1, "eval/code_accuracy": 0.0})
    for step in range(3):
        for producer in range(2):
            rollout = {"rollout/reward_mean": 0.1 * step + producer, "rollout/accuracy": 0.2, "producer": producer}
            metrics.log("rollout", step, {**rollout, "rollout/response_length": 8.0 + step})
        train = {"train/reward": 0.1 * step, "train/accuracy": 0.3, "train/kl": float("nan") if step == 1 else 0.01}
        metrics.log("train", step + 1, {**train, "train/data_indices": [0, 1], "buffer/dropped_stale_groups": 0})
        metrics.log("sync", step + 1, {"time/sync_s": 0.02})
    metrics.log("eval", 3, {"eval/math_accuracy": 0.3, "eval/code_accuracy": 0.1})
    metrics.close()
    if profiled:
        append_spans(run_dir, "producer 0", [Span("generate", 0.0, 2.0), Span("reward", 2.0, 2.5)])
        append_spans(run_dir, "trainer 0", [Span("wait", 0.0, 2.5), Span("forward_backward", 2.5, 4.0)])
        append_spans(run_dir, "trainer 0", [Span("optimizer_step", 4.0, 4.2), Span("sync", 4.2, 4.4)])
    return run_dir


# ---------------------------------------------------------------------- series extraction
def test_series_averages_producers_per_step_and_tolerates_missing_and_non_numeric_values(tmp_path):
    records = read_metrics(write_run(tmp_path) / "metrics.jsonl")
    assert series(records, "rollout/reward_mean") == ([0, 1, 2], pytest.approx([0.5, 0.6, 0.7]))
    steps, kl = series(records, "train/kl")  # NaN is stored as the string "nan"
    assert steps == [1, 2, 3] and kl[0] == kl[2] == 0.01 and kl[1] != kl[1]
    assert series(records, "train/entropy") == ([], [])
    assert series(records, "train/data_indices") == ([], [])  # lists are not plottable
    assert series([{"kind": "train", "train/reward": 1.0}], "train/reward") == ([], [])  # no step


def test_wildcards_expand_to_every_eval_task_and_unlogged_figures_are_empty(tmp_path):
    records = read_metrics(write_run(tmp_path) / "metrics.jsonl")
    assert metric_names(records, ("eval/*_accuracy",)) == ["eval/code_accuracy", "eval/math_accuracy"]
    by_name = {figure.name: figure for figure in FIGURES}
    assert figure_series(records, by_name["eval_accuracy"])["eval/math_accuracy"] == ([0, 3], [0.1, 0.3])
    assert figure_series(records, by_name["entropy"]) == {}
    assert figure_series([], Figure(name="x", title="x", patterns=("train/*",))) == {}


def test_multi_turn_runs_get_a_tool_use_figure_from_rollouts_and_evals(tmp_path):
    metrics = MetricsLogger(tmp_path, "plot-test", {}, use_wandb=False)
    for step, rate in enumerate((0.25, 0.5, 0.9)):
        metrics.log(
            "rollout", step, {"rollout/tool_call_rate": rate, "rollout/tool_calls": rate, "rollout/turns": 1 + rate}
        )
    metrics.log("eval", 0, {"eval/arith_accuracy": 0.0, "eval/arith_tool_call_rate": 0.0})
    metrics.log("eval", 3, {"eval/arith_accuracy": 0.9, "eval/arith_tool_call_rate": 1.0})
    metrics.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    tools = {figure.name: figure for figure in FIGURES}["tool_calls"]
    drawn = figure_series(records, tools)
    assert list(drawn) == ["rollout/tool_call_rate", "eval/arith_tool_call_rate", "rollout/tool_calls", "rollout/turns"]
    assert drawn["rollout/tool_call_rate"] == ([0, 1, 2], [0.25, 0.5, 0.9])
    assert drawn["eval/arith_tool_call_rate"] == ([0, 3], [0.0, 1.0])
    assert main([str(tmp_path)]) == 0
    assert "tool_calls" in {path.stem for path in (tmp_path / "plots").glob("*.png")}


# ---------------------------------------------------------------------- the command
def test_main_writes_one_valid_png_per_logged_figure_and_the_timeline(tmp_path, caplog):
    run_dir = write_run(tmp_path / "run")
    with caplog.at_level("INFO"):
        assert main([str(run_dir)]) == 0
    assert_pngs(run_dir / "plots", CURVES | {"profile_timeline"})
    assert any("skipping entropy" in record.getMessage() for record in caplog.records)


def test_unprofiled_run_gets_its_curves_without_a_timeline_into_out(tmp_path, caplog):
    run_dir = write_run(tmp_path / "run", profiled=False)
    with caplog.at_level("INFO"):
        assert main([str(run_dir), "--out", str(tmp_path / "pngs")]) == 0
    assert_pngs(tmp_path / "pngs", CURVES)
    assert not (run_dir / "plots").exists()
    assert any("skipping the timeline" in record.getMessage() for record in caplog.records)


def test_missing_metrics_file_is_an_error_naming_the_path(tmp_path, caplog):
    with caplog.at_level("ERROR"):
        assert main([str(tmp_path)]) == 2
    assert str(tmp_path / "metrics.jsonl") in caplog.records[-1].getMessage()
    assert not (tmp_path / "plots").exists()


def test_module_command_in_a_subprocess(tmp_path):
    run_dir = write_run(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "colossal_rl.plot", str(run_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert_pngs(run_dir / "plots", CURVES | {"profile_timeline"})
    assert str(run_dir / "plots" / "reward.png") in done.stderr

    missing = tmp_path / "not-a-run"
    done = subprocess.run([sys.executable, "-m", "colossal_rl.plot", str(missing)], capture_output=True, text=True)
    assert done.returncode == 2 and str(missing / "metrics.jsonl") in done.stderr

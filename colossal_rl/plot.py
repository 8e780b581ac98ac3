"""PNG plots of a run directory: learning curves from ``metrics.jsonl``, the actor timeline from ``profile.jsonl``.

    python -m colossal_rl.plot RUN_DIR [--out DIR]    # one PNG per figure into RUN_DIR/plots (or DIR)

Figures: reward, accuracy, eval accuracy (one line per task), response length, tool use (multi-turn runs:
tool-call rate in rollouts and evals, calls and turns per episode), KL, entropy and, for
runs with ``--enable_profiling``, the producer/trainer timeline (phases as horizontal bars per actor
over wall time, drawn by :func:`colossal_rl.profiling.render_timeline`). A figure none of whose
metrics were logged (KL with ``-kl 0``, say) is skipped with a note, never an error. The module only
reads files: it imports neither ray nor torch, and matplotlib only when drawing (Agg backend).
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colossal_rl.metrics import read_metrics
from colossal_rl.profiling import PROFILE_FILE, read_spans, render_timeline, save_figure

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TIMELINE_FILE = "profile_timeline.png"
RECORD_FIELDS = frozenset({"kind", "step", "time"})

Series = tuple[list[int], list[float]]


@dataclass(frozen=True)
class Figure:
    name: str
    """File stem of the PNG."""
    title: str
    patterns: tuple[str, ...]
    """Metric names to draw, one line each; ``fnmatch`` wildcards expand to every logged name that matches."""


FIGURES = (
    Figure(name="reward", title="reward", patterns=("train/reward", "rollout/reward_mean")),
    Figure(name="accuracy", title="accuracy", patterns=("train/accuracy", "rollout/accuracy")),
    Figure(name="eval_accuracy", title="eval accuracy", patterns=("eval/*_accuracy",)),
    Figure(name="response_length", title="response length (tokens)", patterns=("rollout/response_length",)),
    Figure(
        name="tool_calls",
        title="tool use (--env): share of episodes calling a tool, calls and turns per episode",
        patterns=("rollout/tool_call_rate", "eval/*_tool_call_rate", "rollout/tool_calls", "rollout/turns"),
    ),
    Figure(name="kl", title="KL to the reference policy", patterns=("train/kl",)),
    Figure(name="entropy", title="policy entropy", patterns=("train/entropy",)),
)


# ---------------------------------------------------------------------- series from records
def _as_float(value: Any) -> float | None:
    """A metric value as a float; None for what is not a number (lists, flags, text)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):  # MetricsLogger stores non-finite floats as "nan", "inf"
        try:
            return float(value)
        except ValueError:
            return None
    return None


def series(records: list[dict[str, Any]], name: str) -> Series:
    """(steps, values) of metric ``name``, averaged over the records of a step; empty if never logged.

    Rollout metrics come once per producer at the same step, hence the mean.
    """
    by_step: dict[int, list[float]] = defaultdict(list)
    for record in records:
        value = _as_float(record.get(name))
        step = record.get("step")
        if value is not None and isinstance(step, int):
            by_step[step].append(value)
    steps = sorted(by_step)
    return steps, [sum(by_step[step]) / len(by_step[step]) for step in steps]


def metric_names(records: list[dict[str, Any]], patterns: tuple[str, ...]) -> list[str]:
    """Logged metric names matching ``patterns``, in pattern order (sorted within a wildcard)."""
    logged = sorted({key for record in records for key in record} - RECORD_FIELDS)
    names: list[str] = []
    for pattern in patterns:
        names += [name for name in logged if fnmatch.fnmatchcase(name, pattern) and name not in names]
    return names


def figure_series(records: list[dict[str, Any]], figure: Figure) -> dict[str, Series]:
    """The non-empty series of ``figure``, by metric name; empty when none of its metrics was logged."""
    picked = {name: series(records, name) for name in metric_names(records, figure.patterns)}
    return {name: points for name, points in picked.items() if points[0]}


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl``; errors name the file."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file (is {run_dir} a run directory?)")
    try:
        return read_metrics(path)
    except ValueError as error:
        raise ValueError(f"{path}: malformed metrics record ({error})") from None


# ---------------------------------------------------------------------- drawing
def render_series(title: str, series_by_name: dict[str, Series], out_path: Path) -> Path:
    """One line per series against the optimizer step, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name, (steps, values) in series_by_name.items():
        axes.plot(steps, values, marker="o", markersize=3, label=name)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return save_figure(figure, out_path)


def plot_timeline(run_dir: Path, out_dir: Path) -> Path | None:
    """The actor timeline from the run's profile, or None (with a note) if the run was not profiled."""
    try:
        spans = read_spans(run_dir)
    except FileNotFoundError as error:
        logger.info("skipping the timeline: %s", error)
        return None
    except ValueError as error:  # a bad profile must not cost the learning curves
        logger.warning("skipping the timeline: %s", error)
        return None
    if not any(spans.values()):
        logger.info("skipping the timeline: %s has no spans", Path(run_dir) / PROFILE_FILE)
        return None
    return render_timeline(spans, Path(out_dir) / TIMELINE_FILE)


def plot_run(run_dir: Path, out_dir: Path, figures: tuple[Figure, ...] = FIGURES) -> list[Path]:
    """Every figure with data, as ``out_dir/<name>.png``; raises if ``run_dir`` has no readable metrics."""
    records = load_records(run_dir)
    written = []
    for figure in figures:
        series_by_name = figure_series(records, figure)
        if not series_by_name:
            logger.info("skipping %s: none of %s was logged", figure.name, ", ".join(figure.patterns))
            continue
        written.append(render_series(figure.title, series_by_name, Path(out_dir) / f"{figure.name}.png"))
    timeline = plot_timeline(run_dir, out_dir)
    if timeline is not None:
        written.append(timeline)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render a run directory's metrics and profile as PNG files.")
    parser.add_argument("run_dir", type=Path, help="A run directory (holds metrics.jsonl).")
    parser.add_argument("--out", type=Path, default=None, help="Where the PNGs go (default: RUN_DIR/plots).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        written = plot_run(args.run_dir, args.out if args.out is not None else args.run_dir / "plots")
    except (FileNotFoundError, ValueError) as error:
        logger.error("%s", error)
        return 2
    if not written:
        logger.warning("nothing to plot in %s", args.run_dir)
    for path in written:
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

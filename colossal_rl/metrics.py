"""Where metrics go: ``metrics.jsonl`` in the run directory, always; wandb too (offline without an API key).

Only the driver logs metrics. Each record is one flat dict with a ``step`` and a ``kind``
(``train``, ``rollout``, ``eval``, ``sync``), appended and flushed immediately so a killed run
keeps everything it logged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def wandb_mode() -> str:
    """``WANDB_MODE`` if the user set it, else online with an API key, else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").is_file()
    return "online" if has_key else "offline"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Appends every record to ``metrics.jsonl`` at once; wandb gets them too once its run has started.

    wandb starts in a background thread (importing it and starting its service takes seconds, which would
    otherwise delay Ray and the actors); records logged before it is ready are kept and handed over in order.
    """

    WANDB_START_TIMEOUT_S = 120.0

    def __init__(self, run_dir: Path, project: str, config_dict: dict[str, Any], use_wandb: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb_run = None
        self._wandb_backlog: list[tuple[int, dict[str, float]]] = []
        self._wandb_lock = threading.Lock()
        self._wandb_start: threading.Thread | None = None
        if use_wandb and wandb_mode() != "disabled":
            self._wandb_start = threading.Thread(
                target=self._start_wandb, args=(project, config_dict), name="wandb-start", daemon=True
            )
            self._wandb_start.start()

    def _start_wandb(self, project: str, config_dict: dict[str, Any]) -> None:
        try:
            import wandb

            run = wandb.init(project=project, dir=str(self.run_dir), config=config_dict, mode=wandb_mode(), reinit=True)
        except Exception as error:  # wandb is a convenience: the jsonl file is the record
            logger.warning("wandb could not start (%s); metrics go to %s only", error, self.path)
            with self._wandb_lock:
                self._wandb_backlog.clear()
            return
        with self._wandb_lock:
            for step, metrics in self._wandb_backlog:
                run.log(metrics, step=step)
            self._wandb_backlog.clear()
            self._wandb_run = run

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb_start is None:
            return
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        with self._wandb_lock:
            if self._wandb_run is not None:
                self._wandb_run.log(numbers, step=step)
            elif self._wandb_start.is_alive():
                self._wandb_backlog.append((step, numbers))

    def close(self) -> None:
        self._file.close()
        if self._wandb_start is None:
            return
        self._wandb_start.join(timeout=self.WANDB_START_TIMEOUT_S)
        if self._wandb_start.is_alive():
            logger.warning("wandb did not start within %.0fs; metrics are in %s", self.WANDB_START_TIMEOUT_S, self.path)
        with self._wandb_lock:
            run, self._wandb_run, self._wandb_start = self._wandb_run, None, None
        if run is not None:
            run.finish()


GLOBAL_STEP_METRICS = ("train/loss", "train/entropy")
"""Step metrics every trainer already reports for the whole step (summed over data-parallel ranks)."""


def merge_rank_step_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One optimizer step's metrics over the trainer ranks: the mean of each, except the already-global ones,
    taken from rank 0."""
    first = per_rank[0]
    merged = {key: sum(metrics[key] for metrics in per_rank) / len(per_rank) for key in first}
    for key in GLOBAL_STEP_METRICS:
        if key in first:
            merged[key] = first[key]
    return merged


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]

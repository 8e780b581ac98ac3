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
    def __init__(self, run_dir: Path, project: str, config_dict: dict[str, Any], use_wandb: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb_run = None
        if use_wandb and wandb_mode() != "disabled":
            self._wandb_run = self._start_wandb(project, config_dict)

    def _start_wandb(self, project: str, config_dict: dict[str, Any]):
        try:
            import wandb

            return wandb.init(
                project=project, dir=str(self.run_dir), config=config_dict, mode=wandb_mode(), reinit=True
            )
        except Exception as error:  # wandb is a convenience: the jsonl file is the record
            logger.warning("wandb could not start (%s); metrics go to %s only", error, self.path)
            return None

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]

"""Files a run writes besides metrics: evaluation generations and rollout samples (jsonl, one record a line).

Driver-side only. Evaluation generations go to ``<eval dir>/<task>_step_<N>.jsonl``, rollout samples
to ``<rollout dir>/rollouts_step_<N>.jsonl``; both directories default to the run directory's
``eval/`` and ``rollouts/``. An eval directory that already holds files is refused unless the
user allows overwriting (or the run resumes, which continues the same series).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class OutputDirError(FileExistsError):
    """An output directory would be overwritten; the message names it and the flag that allows it."""


FAILED_MARKER = "FAILED"
"""In the run directory of a run that stopped with an error: the error, so a failed run is told at a glance."""


def write_failed_marker(run_dir: Path, error: BaseException) -> Path:
    """``<run_dir>/FAILED``: the error's type and message (written whole, through a rename)."""
    path = Path(run_dir) / FAILED_MARKER
    staging = path.with_name(f".{FAILED_MARKER}.tmp")
    message = str(error)
    staging.write_text(
        f"{type(error).__name__}: {message}\n" if message else f"{type(error).__name__}\n", encoding="utf-8"
    )
    staging.replace(path)
    return path


def eval_dir(run_dir: Path, configured: str | None) -> Path:
    return Path(configured) if configured else Path(run_dir) / "eval"


def rollout_dir(run_dir: Path, configured: str | None) -> Path:
    return Path(configured) if configured else Path(run_dir) / "rollouts"


def prepare_eval_dir(directory: Path, *, overwrite: bool) -> Path:
    """Create ``directory``; refuse if it already holds files and ``overwrite`` is off."""
    directory = Path(directory)
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise OutputDirError(
            f"-esd/--eval-save-dir {directory} already holds files; choose another directory or pass "
            "--overwrite-eval-dir"
        )
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def write_eval_generations(directory: Path, step: int, records_by_task: dict[str, list[dict]]) -> list[Path]:
    """One file per task with every producer's records in dataset order."""
    written = []
    for task, records in records_by_task.items():
        ordered = sorted(records, key=lambda record: (record.get("index", 0), record.get("sample", 0)))
        written.append(write_jsonl(Path(directory) / f"{task}_step_{step}.jsonl", ordered))
    return written


def write_rollout_samples(directory: Path, step: int, samples: list[dict]) -> Path:
    return write_jsonl(Path(directory) / f"rollouts_step_{step}.jsonl", samples)

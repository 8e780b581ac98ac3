"""Saving a whole run from the driver, and putting it back: trainer shards, the schedule, rollouts not trained.

The on-disk layout and atomic commit are :mod:`colossal_rl.run_checkpoints.on_disk`'s; this module gathers what
goes in (every trainer rank writes its shards; the schedule loop hands the scheduler's snapshot and the rollouts
of the groups waiting) and hands it back on resume. The driver's counters travel as one :class:`RunProgress`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import ray

from colossal_rl.config import ConfigError, RLConfig
from colossal_rl.driver.actor_groups import TrainerGroup
from colossal_rl.driver.calls import gather
from colossal_rl.run_checkpoints import on_disk as ckpt
from colossal_rl.run_checkpoints.on_disk import RunProgress, SavedChunk

logger = logging.getLogger(__name__)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def config_as_json(config: RLConfig) -> dict:
    """The config as ``state.json`` stores it (tuples as lists), for saving and for comparing on resume."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def save_run(
    *,
    run_dir: Path,
    config: RLConfig,
    progress: RunProgress,
    trainers: TrainerGroup,
    schedule: dict,
    chunks: dict[int, SavedChunk],
    timeout_s: float,
) -> Path:
    """Everything a resume needs, after a training order: trainer state, the scheduler's snapshot (``schedule``),
    the rollouts of the groups delivered and not trained (``chunks``, by chunk id), the counters."""
    staging = ckpt.staging_dir(checkpoints_dir(run_dir), progress.step)
    gather(trainers.save_checkpoint(str(staging)), timeout_s)
    state = ckpt.RunState(
        progress=dataclasses.replace(progress), run_dir=str(run_dir), config=config_as_json(config), schedule=schedule
    )
    final = ckpt.commit(staging, state, chunks)
    ckpt.prune(checkpoints_dir(run_dir), config.run.save_limit)
    return final


def restore_run(checkpoint: Path, *, trainers: TrainerGroup, timeout_s: float) -> tuple[RunProgress, dict, dict]:
    """Load ``checkpoint`` into the trainers; returns the counters, the scheduler's snapshot and, by chunk id, the
    saved chunks' rollouts (``ChunkResult``s whose payloads are back in the object store)."""
    from colossal_rl.driver.actor_messages import ChunkResult

    state = ckpt.load_state(checkpoint)
    progress = state.progress
    steps = gather(trainers.load_checkpoint(str(checkpoint), progress.policy_version), timeout_s)
    if any(step != progress.step for step in steps):
        raise ckpt.CheckpointError(f"{checkpoint}: trainer steps {steps} disagree with the run state ({progress.step})")
    chunks = {
        chunk_id: ChunkResult(chunk_id, saved.producer_rank, ray.put(saved.payload), tuple(saved.batch_rows), (), {})
        for chunk_id, saved in ckpt.load_chunks(checkpoint).items()
    }
    logger.info("resumed from %s at step %d (weights version %d)", checkpoint, progress.step, progress.policy_version)
    return progress, state.schedule, chunks


def checkpoint_to_resume(config: RLConfig) -> tuple[Path | None, RLConfig]:
    """The checkpoint ``-cp`` names, checked against this run's config (fields that must not change), and the
    config to run: with ``--precision auto`` the checkpoint's precision (its shards and weights are in it)."""
    if config.run.checkpoint_path is None:
        return None, config
    checkpoint = ckpt.resolve(config.run.checkpoint_path, fallback=config.run.resume_fallback)
    saved = ckpt.load_state(checkpoint)
    saved_precision = saved.config.get("parallel", {}).get("precision", "auto")
    if config.parallel.precision == "auto" and saved_precision != "auto":
        try:
            parallel = dataclasses.replace(config.parallel, precision=saved_precision)
            config = dataclasses.replace(config, parallel=parallel).validate()
        except ConfigError as error:
            raise ckpt.CheckpointError(f"{checkpoint}: its precision {saved_precision}: {error}") from None
    mismatches = ckpt.resume_mismatches(saved.config, config_as_json(config))
    if mismatches:
        raise ckpt.CheckpointError(
            f"{checkpoint}: cannot resume with a different " + "; ".join(mismatches) + " (use the saved values)"
        )
    return checkpoint, config

"""Saving a whole run from the driver, and putting it back: trainer shards, the buffer, rollouts in flight.

The on-disk layout and atomic commit are :mod:`colossal_rl.run_checkpoints.on_disk`'s; this module gathers what
goes in (every trainer rank writes its shards, the buffer's snapshot, the rollouts already asked for) and
hands it back on resume. The driver's counters travel as one :class:`RunProgress`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import ray

from colossal_rl.config import ConfigError, RLConfig
from colossal_rl.driver.actor_groups import ProducerGroup, TrainerGroup
from colossal_rl.driver.calls import ActorId, Call, Calls, gather
from colossal_rl.run_checkpoints import on_disk as ckpt
from colossal_rl.run_checkpoints.on_disk import RunProgress

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
    buffer,
    produced_metrics: dict[int, list[dict]],
    timeout_s: float,
    stream_schedule: dict | None = None,
) -> Path:
    """Everything a resume needs, after a round: trainer state, rollouts not trained yet, the counters.

    ``produced_metrics``: per round generated and not trained yet, each producer's rollout metrics (the driver waited
    for those rounds first: ``PendingCalls.settle``); their rollouts are in the buffer's snapshot.
    ``stream_schedule``: with ``--schedule stream``, the streaming scheduler's snapshot (after a step)."""
    staging = ckpt.staging_dir(checkpoints_dir(run_dir), progress.step)
    pending_metrics = {str(r): metrics for r, metrics in produced_metrics.items()}
    snapshot = ray.get(buffer.snapshot.remote(), timeout=timeout_s)
    snapshot = snapshot.with_payloads(lambda ref: ray.get(ref, timeout=timeout_s))
    gather(trainers.save_checkpoint(str(staging)), timeout_s)
    state = ckpt.RunState(
        progress=dataclasses.replace(progress),
        run_dir=str(run_dir),
        config=config_as_json(config),
        pending_rollout_metrics=pending_metrics,
        stream_schedule=stream_schedule,
    )
    final = ckpt.commit(staging, state, snapshot)
    ckpt.prune(checkpoints_dir(run_dir), config.run.save_limit)
    return final


def restore_run(
    checkpoint: Path, *, trainers: TrainerGroup, buffer, timeout_s: float
) -> tuple[RunProgress, dict[int, Calls]]:
    """Load ``checkpoint`` into the trainers and the buffer; returns the counters and, per round generated but
    not trained when it was saved, each producer's rollout metrics (as already-finished calls)."""
    state = ckpt.load_state(checkpoint)
    progress = state.progress
    steps = gather(trainers.load_checkpoint(str(checkpoint), progress.policy_version), timeout_s)
    if any(step != progress.step for step in steps):
        raise ckpt.CheckpointError(f"{checkpoint}: trainer steps {steps} disagree with the run state ({progress.step})")
    snapshot = ckpt.load_buffer(checkpoint).with_payloads(ray.put)
    ray.get(buffer.restore.remote(snapshot), timeout=timeout_s)
    pending = {
        int(r): [Call(ActorId(ProducerGroup.kind, rank), "restored", ray.put(m)) for rank, m in enumerate(metrics)]
        for r, metrics in state.pending_rollout_metrics.items()
    }
    logger.info("resumed from %s at step %d (round %d)", checkpoint, progress.step, progress.next_round)
    return progress, pending


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

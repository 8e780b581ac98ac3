"""The driver of a started run (:class:`Driver`): its actors, the weight sync, evals, checkpoints' placement,
export, shut down. The schedule (which rollouts are generated when, what each optimizer step trains, when weights
are synced) is walked by ``schedule_loop.py``'s ``ScheduleLoop`` on a started ``Driver``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray

from colossal_rl.config import RLConfig
from colossal_rl.config_files import CONFIG_FILE
from colossal_rl.driver.actor_groups import TrainerGroup, spawn_actors
from colossal_rl.driver.calls import Calls, RunFailed, cancel_calls, gather, gather_groups
from colossal_rl.driver.node_checks import check_gpu_nodes
from colossal_rl.driver.placement import check_transport_for_cluster, resolve_sync_mode_for_cluster
from colossal_rl.driver.producer_restarts import ProducerRestarts, redo_lost
from colossal_rl.driver.save_and_resume import checkpoints_dir, restore_run
from colossal_rl.driver.weight_sync import SyncOrchestrator
from colossal_rl.metrics import MetricsLogger
from colossal_rl.profiling import PhaseRecorder, Span, append_spans
from colossal_rl.rollout.eval_result import aggregate_eval
from colossal_rl.run_checkpoints import on_disk as ckpt
from colossal_rl.run_checkpoints.on_disk import RunProgress
from colossal_rl.run_outputs import eval_dir, rollout_dir, write_eval_generations
from colossal_rl.startup import first_round_report, process_started_at, spawn_span

logger = logging.getLogger(__name__)
FINAL_MODEL_DIR = "final"
"""Inside the run directory: the trained policy as a Hugging Face model (``run.final_export``)."""


def resume_hint(run_dir: Path) -> str:
    """How to continue a run after a failure the driver cannot repair: the exact command, from its newest checkpoint."""
    found = ckpt.complete_checkpoints(checkpoints_dir(run_dir))
    if not found:
        return "no checkpoint was saved to resume from (-si/--save-interval 0)"
    return f"resume with: python rl_example.py --config {Path(run_dir) / CONFIG_FILE} -cp {found[-1]}"


@dataclass
class StartupTrace:
    """Where this process's time to the first rollouts went (``startup.json``; not in ``RunProgress``: a resumed
    run reports its own start-up)."""

    phases: PhaseRecorder
    origin: float = field(default_factory=process_started_at)
    actors_submitted_at: float = field(default_factory=time.time)
    actors: dict[str, list[Span]] = field(default_factory=dict)
    reported: bool = False


class Driver:
    """Owns the actors of one run; where the run is lives in ``progress``.

    Besides ``progress`` (what a checkpoint saves and a resume restores) it holds the actors and their wiring, the
    producers' restarts (``producer_restarts.py``), the weight sync as formed (``weight_sync.py``), the start-up
    trace, and where outputs go."""

    def __init__(self, config: RLConfig, run_dir: Path, metrics: MetricsLogger, startup: PhaseRecorder | None = None):
        """``startup``: the driver's start-up phases so far (``run_training``'s); the driver adds its own."""
        self.trace = StartupTrace(startup or PhaseRecorder())
        self.train_rows: int | None = None
        """Training prompts the producers hold (over-long ones left out): what the schedule is made of."""
        self.resumed_schedule: dict | None = None
        """The scheduler's snapshot in the checkpoint this run resumed from (None: a fresh run)."""
        self.resumed_chunks: dict = {}
        """Chunk id -> ``ChunkResult`` of the rollouts that checkpoint saved (payloads back in the object store)."""
        check_transport_for_cluster(config.run.weight_sync_backend, ray.nodes())  # before any actor starts
        config = resolve_sync_mode_for_cluster(config, ray.nodes())  # resolved already by run_training; tests
        check_gpu_nodes(config, ray.nodes())  # the GPU nodes' driver and NCCL preload, where the actors will run
        self.config = config
        self.run_dir = run_dir
        self.metrics = metrics
        self.timeout = config.run.timeout_s
        self.buffer, self.producers, self.trainers, self.reward_actors = spawn_actors(config)
        self.progress = RunProgress()
        self.restarts = ProducerRestarts(
            self.producers, max_restarts=config.run.max_actor_restarts, timeout_s=self.timeout
        )
        """The producers' processes (pid, node) and the restarts each has used."""
        self.sync = SyncOrchestrator(
            self.trainers,
            self.producers,
            mode=config.run.weight_sync_mode,
            receivers_per_producer=config.weight_receivers_per_producer,
            run_dir=run_dir,
            producer_nodes=lambda: self.restarts.nodes,
            wait=lambda groups: gather_groups(groups, self.timeout),
            cancel=cancel_calls,
        )
        """The weight sync as formed, and the one way to bring producers to a version."""
        self.last_saved_step = 0
        """Step of the newest checkpoint this process saved or resumed from (``progress.step`` when it was saved)."""
        self.final_model_dir: Path | None = None
        self.eval_dir = eval_dir(run_dir, config.run.eval_save_dir)
        self.rollout_dir = rollout_dir(run_dir, config.run.rollout_save_dir)

    @property
    def step(self) -> int:
        return self.progress.step

    def start(self, resume_from: Path | None = None) -> None:
        """Start every actor and the weight-sync group; with ``resume_from``, restore a checkpoint first."""
        started = time.perf_counter()
        producers, trainers = gather_groups([self.producers.ready(), self.trainers.setup()], self.timeout)
        if self.reward_actors:  # a reward model that cannot load fails here, naming it
            ray.get([actor.ready.remote() for actor in self.reward_actors], timeout=self.timeout)
        self.trace.phases.add("actors", self.trace.actors_submitted_at, time.time())
        train_rows = {info.train_rows for info in producers}
        if len(train_rows) != 1:
            raise RunFailed(f"producers loaded different numbers of training prompts: {sorted(train_rows)}")
        (self.train_rows,) = train_rows
        self.restarts.record_ready(producers)
        dropped = producers[0].dropped_overlong
        self.metrics.log("data", 0, {"data/train_prompts": self.train_rows, "data/dropped_overlong_prompts": dropped})
        for name, info in zip(self.producers.names + self.trainers.names, producers + trainers, strict=True):
            spawn = spawn_span(self.trace.actors_submitted_at, info.startup)
            self.trace.actors[name] = ([spawn] if spawn else []) + list(info.startup)
        if resume_from is not None:
            with self.trace.phases.record("restore"):
                self.progress, self.resumed_schedule, self.resumed_chunks = restore_run(
                    resume_from, trainers=self.trainers, timeout_s=self.timeout
                )
                self.last_saved_step = self.progress.step
        sync_started = time.time()
        self.sync.start(trainers, retain=resume_from is None)
        if resume_from is not None:
            self._sync_weights(self.progress.policy_version, reason="resume")
        self.trace.phases.add("weight sync", sync_started, time.time())
        logger.info("actors ready in %.1fs", time.perf_counter() - started)

    # ------------------------------------------------------------------ waiting, and surviving producer restarts
    def _gather(self, *groups: Calls) -> list[list]:
        """The results of each group's calls, surviving producer deaths while ``--max-actor-restarts`` allows
        (outside the schedule loop: the eval after training, the sync of a resume).

        A producer that died is restarted by Ray; here it gets back the weights of the last completed sync
        and the calls it lost are made again. A dead trainer ends the run (its sharded state cannot be rebuilt
        in place) with the command that resumes from the last checkpoint."""
        return self._gather_calls(lambda: list(groups), remake=False)

    def _gather_sync(self, make: Callable[[], list[Calls]]) -> list[list]:
        """:meth:`_gather` of one weight sync: ``make()`` issues it; after a producer restart it is made again
        whole, on a newly formed group."""
        return self._gather_calls(make, remake=True)

    def _gather_calls(self, make: Callable[[], list[Calls]], *, remake: bool) -> list[list]:
        groups: list[Calls] | None = None
        retries_without_restart = 0
        while True:
            try:
                if groups is None:  # making a sync may form its group again, which waits on every producer
                    groups = make()
                return gather_groups(groups, self.timeout)
            except RunFailed as failure:
                calls = [call for group in groups or [] for call in group]  # none: the group's formation failed
                restarted = self.restarted_producers(failure, calls, whole_sync=remake)
                retries_without_restart = 0 if restarted else retries_without_restart + 1
                if retries_without_restart > 2:  # failing again with nobody restarted: not a producer death
                    raise
            if remake:
                self.sync.broken()
                groups = None
            else:
                groups = [redo_lost(group) for group in groups]

    def restarted_producers(self, failure: RunFailed, calls: list, *, whole_sync: bool) -> list[int]:
        """The producers Ray restarted after ``failure`` (both schedules' recovery starts here), given back the last
        synced version's weights; the sync group is formed again before the next sync. A dead trainer ends the run
        (its sharded state cannot be rebuilt in place) with the command that resumes from the last checkpoint."""
        if failure.any_died(TrainerGroup.kind):
            raise RunFailed(f"{failure}; {resume_hint(self.run_dir)}", failure.outcomes) from None
        restarted = self.restarts.restarted(failure, calls, whole_sync=whole_sync)
        if restarted:
            version = self.progress.policy_version  # the last completed sync's: what the senders retained
            self.restarts.restore_weights(
                restarted, lambda ranks: self.sync.sync_to(version, producers=ranks, reason="producer restart")
            )
            self.metrics.log("faults", self.step, {"faults/producer_restarts": self.restarts.total})
        return restarted

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        (results,) = self._gather(self.producers.evaluate())
        return self.log_eval(results)

    def log_eval(self, results, step: int | None = None) -> dict[str, float]:
        """Log every task's accuracy (mean@k) over all producers' shares, and pass@k with several samples, at
        ``step`` (the weights' step; None: the current one)."""
        step = self.step if step is None else step
        accuracy, logged, records = aggregate_eval(results, self.config.generation.eval_samples)
        self.metrics.log("eval", step, logged)
        write_eval_generations(self.eval_dir, step, records)
        logger.info("eval at step %d: %s", step, {key: round(value, 4) for key, value in logged.items()})
        return accuracy

    def _sync_weights(self, policy_version: int, *, reason: str) -> None:
        started = time.perf_counter()
        (results,) = self._gather_sync(lambda: [self.sync.sync_to(policy_version, reason=reason)])
        self.sync.synced(results)
        self.progress.policy_version = policy_version
        self.metrics.log("sync", self.step, {"time/sync_s": time.perf_counter() - started})

    # ------------------------------------------------------------------ start-up report and profile
    def report_startup(self, arrivals: dict[int, float], produce_seconds: list[float | None]) -> None:
        """Log and write (``startup.json``) where the time to this run's first round of rollouts went (the stream
        schedule: every producer's first chunk). ``arrivals``: producer rank -> when its rollouts arrived (wall
        clock); ``produce_seconds``: per producer, how long generating them took."""
        report = first_round_report(
            origin=self.trace.origin,
            driver=self.trace.phases.drain(),
            actors=self.trace.actors,
            arrivals=arrivals,
            produce_seconds=produce_seconds,
            now=time.time(),
        )
        report.write(self.run_dir)
        for line in report.lines():
            logger.info("%s", line)
        self.metrics.log("startup", self.step, {"time/first_rollout_s": report.time_to_first_rollout_s})
        self.trace.reported = True

    def collect_profile(self) -> None:
        if not self.config.run.enable_profiling:
            return
        spans = gather(self.producers.drain_phases() + self.trainers.drain_phases(), self.timeout)
        for actor, actor_spans in zip(self.producers.names + self.trainers.names, spans, strict=True):
            append_spans(self.run_dir, actor, actor_spans)

    # ------------------------------------------------------------------ checkpoints and the trained model
    def checkpoint_due(self, last: bool) -> bool:
        """A checkpoint is due now (``-si``): ``last``, the run's last training order; else an interval crossed."""
        interval = self.config.run.save_interval
        if not interval:
            return False
        return last or self.step // interval > self.last_saved_step // interval

    def export_final_model(self) -> Path:
        """The trained policy, as a Hugging Face model, into ``<run dir>/final`` (replacing an earlier one).

        When the run has just checkpointed its last step, that checkpoint's export holds these weights: its
        files are hard-linked (no second gather of the weights, no second copy on disk)."""
        final = self.run_dir / FINAL_MODEL_DIR
        shutil.rmtree(final, ignore_errors=True)
        checkpoint = checkpoints_dir(self.run_dir) / ckpt.checkpoint_name(self.step)
        if self.last_saved_step == self.step and (checkpoint / ckpt.EXPORT_DIR).is_dir():
            shutil.copytree(checkpoint / ckpt.EXPORT_DIR, final, copy_function=os.link)
        else:
            gather(self.trainers.export_model(str(final)), self.timeout)
        self.final_model_dir = final
        logger.info("exported the trained policy to %s", final)
        return final

    def shutdown(self, grace_s: float = 15.0) -> None:
        """Ask every actor to clean up (reward workers, sync groups) for at most ``grace_s``, then kill them all.

        An actor still busy (e.g. a trainer waiting for a producer that died) never gets to its
        shutdown call; the kill ends it regardless, so shutdown is bounded.
        """
        refs = self.producers.shutdown() + self.trainers.shutdown()
        refs += [actor.shutdown.remote() for actor in self.reward_actors]
        ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for actor in [*self.producers, *self.trainers, *self.reward_actors, self.buffer]:
            try:
                ray.kill(actor)
            except Exception as error:  # already dead: nothing left to clean up
                logger.debug("kill of an actor failed: %s", error)
        if self.config.run.weight_sync_mode == "shm":  # a trainer killed before closing its region leaves it behind
            from colossal_rl.comm.weight_sync.modes import remove_leftover_regions

            for path in remove_leftover_regions(self.run_dir):
                logger.info("removed the shared-memory weight-sync region %s (its sender did not close it)", path)

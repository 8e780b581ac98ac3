"""The driver of a started run (:class:`Driver`): its actors, the weight sync, evals, checkpoints, export, shut
down, and the round schedule's loop (``--schedule stream`` runs ``stream_loop.py``'s on the same ``Driver``).

Schedule (deterministic, so staleness is exact and a run is reproducible):
  producers generate round r with weights version max(0, r - n_behind);
  trainers train round r holding version r, then push version r + 1 to every producer;
  the eval before training runs on the producers right after the first round's generation (version 0
  still), so it overlaps the first round's training instead of delaying it.
Each actor executes its calls in submission order, so the order of submissions below *is*
the schedule; the driver only waits (always with a timeout) for results and failures.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from tqdm import tqdm

from colossal_rl.config import RLConfig
from colossal_rl.config_files import CONFIG_FILE
from colossal_rl.driver.actor_groups import TrainerGroup, spawn_actors
from colossal_rl.driver.actor_messages import RoundResult
from colossal_rl.driver.calls import Calls, RunFailed, gather, gather_groups
from colossal_rl.driver.pending_calls import PendingCalls
from colossal_rl.driver.placement import check_transport_for_cluster, resolve_sync_mode_for_cluster
from colossal_rl.driver.producer_restarts import ProducerRestarts, redo_lost
from colossal_rl.driver.save_and_resume import checkpoints_dir, restore_run, save_run
from colossal_rl.driver.weight_sync import SyncOrchestrator
from colossal_rl.metrics import MetricsLogger, merge_rank_step_metrics
from colossal_rl.profiling import PhaseRecorder, Span, append_spans
from colossal_rl.rollout.eval_result import aggregate_eval
from colossal_rl.run_checkpoints import on_disk as ckpt
from colossal_rl.run_checkpoints.on_disk import RunProgress
from colossal_rl.run_outputs import eval_dir, rollout_dir, write_eval_generations, write_rollout_samples
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


def total_rounds(config: RLConfig, num_rows: int) -> int:
    from colossal_rl.data import DataError
    from colossal_rl.schedule.prompts import EpisodeSchedule

    schedule = EpisodeSchedule(num_rows, config.schedule.num_producers, config.schedule.inference_batch_size, 0)
    if schedule.rounds_per_episode == 0:
        raise DataError(
            f"{config.data.train_path}: the training set has {num_rows} prompts, fewer than one round needs "
            f"(-i {config.schedule.num_producers} x -ibs {config.schedule.inference_batch_size})"
        )
    rounds = schedule.rounds_per_episode * config.schedule.num_episodes
    if config.schedule.max_steps is not None and config.algorithm.filter_range is None:
        rounds = min(rounds, planned_steps(config, rounds) // config.optimizer_steps_per_round)
    return rounds


def planned_steps(config: RLConfig, rounds: int) -> int:
    """Optimizer steps ``rounds`` rounds train when no group is filtered out: all of them, or ``--max-steps``
    rounded up to a whole round. With dynamic sampling (``filter_range``) rounds train fewer steps, so
    :func:`total_rounds` leaves the rounds uncapped and ``Driver.run`` stops once ``--max-steps`` are trained."""
    per_round = config.optimizer_steps_per_round
    steps = rounds * per_round
    if config.schedule.max_steps is not None:
        steps = min(steps, math.ceil(config.schedule.max_steps / per_round) * per_round)
    return steps


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
    """Owns the actors of one run and walks its round schedule; where the run is lives in ``progress``.

    Besides ``progress`` (what a checkpoint saves and a resume restores) it holds the actors and their wiring, the
    pending calls (``pending_calls.py``), the producers' restarts (``producer_restarts.py``), the weight sync as
    formed (``weight_sync.py``), the start-up trace, and where outputs go."""

    def __init__(self, config: RLConfig, run_dir: Path, metrics: MetricsLogger, startup: PhaseRecorder | None = None):
        """``startup``: the driver's start-up phases so far (``run_training``'s); the driver adds its own."""
        self.trace = StartupTrace(startup or PhaseRecorder())
        self.train_rows: int | None = None
        """Training prompts the producers hold (over-long ones left out): what the round count is made of."""
        check_transport_for_cluster(config.run.weight_sync_backend, ray.nodes())  # before any actor starts
        config = resolve_sync_mode_for_cluster(config, ray.nodes())  # resolved already by run_training; tests
        self.config = config
        self.run_dir = run_dir
        self.metrics = metrics
        self.timeout = config.run.timeout_s
        self.buffer, self.producers, self.trainers = spawn_actors(config)
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
        )
        """The weight sync as formed, and the one way to bring producers to a version."""
        self.last_saved_step = 0
        """Step of the newest checkpoint this process saved or resumed from (``progress.step`` when it was saved)."""
        self.final_model_dir: Path | None = None
        self.pending = PendingCalls(redo_lost=redo_lost, finished=lambda call, result: call._replace(
            ref=ray.put(result), redo=None))  # fmt: skip
        """Produce calls submitted and not trained yet, by round, and the eval before training (its rules in code)."""
        self.eval_dir = eval_dir(run_dir, config.run.eval_save_dir)
        self.rollout_dir = rollout_dir(run_dir, config.run.rollout_save_dir)

    @property
    def step(self) -> int:
        return self.progress.step

    def start(self, resume_from: Path | None = None) -> None:
        """Start every actor and the weight-sync group; with ``resume_from``, restore a checkpoint first."""
        started = time.perf_counter()
        producers, trainers = gather_groups([self.producers.ready(), self.trainers.setup()], self.timeout)
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
                self.progress, finished_rounds = restore_run(
                    resume_from, trainers=self.trainers, buffer=self.buffer, timeout_s=self.timeout
                )
                self.pending.restore(finished_rounds)
                self.last_saved_step = self.progress.step
        sync_started = time.time()
        self.sync.start(trainers, retain=resume_from is None)
        if resume_from is not None:
            self._sync_weights(self.progress.policy_version, reason="resume")
        self.trace.phases.add("weight sync", sync_started, time.time())
        logger.info("actors ready in %.1fs", time.perf_counter() - started)

    # ------------------------------------------------------------------ waiting, and surviving producer restarts
    def _gather(self, *groups: Calls) -> list[list]:
        """The results of each group's calls, surviving producer deaths while ``--max-actor-restarts`` allows.

        A producer that died is restarted by Ray; here it gets back the weights of the last completed sync
        and the calls it lost are made again: its rounds are regenerated exactly (rows and sampling are
        functions of seed, round and producer). A dead trainer ends the run (its sharded state cannot be rebuilt
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
                self._redo_lost_rounds(restarted)
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

    def _redo_lost_rounds(self, ranks: list[int]) -> None:
        """Re-issue what restarted producers lost (the round schedule's calls)."""
        if not ranks:
            return
        # Every call the dead process had not finished is made again now, before any later sync: the rounds it
        # was asked for need exactly these weights (each was submitted after the last completed sync).
        outstanding = [c.ref for c in self.pending.outstanding() if c.actor.rank in ranks]
        ray.wait(outstanding, num_returns=len(outstanding), timeout=min(30.0, self.timeout))
        self.pending.redo_lost()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        (results,) = self._gather(self.producers.evaluate())
        return self.log_eval(results)

    def _submit_eval_before(self) -> None:
        """Queue the eval of the untrained policy on the producers (once; not on resume)."""
        if self.progress.eval_accuracy_before is None and not self.pending.eval_before_submitted:
            self.pending.submit_eval_before(self.producers.evaluate())

    def _log_eval_before(self) -> None:
        """Wait for the eval before training, if queued and not logged yet, and log it at the current step."""
        calls = self.pending.take_eval_before()
        if calls is not None:
            (results,) = self._gather(calls)
            self.progress.eval_accuracy_before = self.log_eval(results)
            self.progress.next_eval_step = self.config.run.eval_interval

    def log_eval(self, results, step: int | None = None) -> dict[str, float]:
        """Log every task's accuracy (mean@k) over all producers' shares, and pass@k with several samples, at
        ``step`` (the weights' step; None: the current one)."""
        step = self.step if step is None else step
        accuracy, logged, records = aggregate_eval(results, self.config.generation.eval_samples)
        self.metrics.log("eval", step, logged)
        write_eval_generations(self.eval_dir, step, records)
        logger.info("eval at step %d: %s", step, {key: round(value, 4) for key, value in logged.items()})
        return accuracy

    def _maybe_evaluate(self) -> None:
        interval = self.config.run.eval_interval
        if interval and self.step >= self.progress.next_eval_step:
            self.evaluate()
            self.progress.next_eval_step = (self.step // interval + 1) * interval

    # ------------------------------------------------------------------ the round loop
    def run(self, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
        """Train rounds ``progress.next_round`` .. ``rounds - 1``, or until ``--max-steps`` optimizer steps are
        trained (the round that reaches them is the last: with dynamic sampling a round may train fewer steps)."""
        total_steps = planned_steps(self.config, rounds)
        max_steps = self.config.schedule.max_steps
        gather(self.trainers.set_total_steps(total_steps), self.timeout)  # the LR schedule's end
        n_behind = self.config.schedule.n_behind
        for r in range(self.progress.next_round, min(self.progress.next_round + n_behind + 1, rounds)):
            if r not in self.pending:  # restored rounds are already in the buffer
                self.pending.submit_round(r, self.producers.produce(r, self.buffer))
            self._submit_eval_before()  # right behind the first round: same weights, and round one need not wait
        self._submit_eval_before()
        progress = tqdm(total=total_steps, initial=self.step, desc="optimizer steps", unit="step")
        for round_index in range(self.progress.next_round, rounds):
            if max_steps is not None and self.step >= max_steps:
                break  # resumed from the checkpoint of the run's last round
            round_started = time.perf_counter()
            self._train_round(round_index, progress)
            self._sync_weights(round_index + 1, reason=f"end of round {round_index}")
            self.progress.next_round = round_index + 1
            self.collect_profile()
            self.metrics.log("sync", self.step, {"time/round_s": time.perf_counter() - round_started})
            last_round = round_index == rounds - 1 or (max_steps is not None and self.step >= max_steps)
            if not last_round:
                self._maybe_evaluate()
            if self.checkpoint_due(last_round):
                self.save_checkpoint()
            if last_round:
                break
            if round_index + 1 + n_behind < rounds:
                next_produce = round_index + 1 + n_behind
                self.pending.submit_round(next_produce, self.producers.produce(next_produce, self.buffer))
        self._log_eval_before()
        progress.close()
        if self.config.run.final_export:
            self.export_final_model()
        return self.progress.eval_accuracy_before, self.evaluate()

    def _train_round(self, round_index: int, progress) -> None:
        sample_step = self._rollout_sample_step()
        train_calls = self.trainers.train_round(round_index, self.buffer, sample_step)
        trained, produced = self._gather(train_calls, self.pending.take_round(round_index))
        if not self.trace.reported:
            arrivals = ray.get(self.buffer.arrival_times.remote(round_index), timeout=self.timeout)
            self.report_startup(arrivals, [metrics.get("time/produce_s") for metrics in produced])
        self._log_eval_before()
        self._log_round(trained, produced, progress)

    def _sync_weights(self, policy_version: int, *, reason: str) -> None:
        started = time.perf_counter()
        (results,) = self._gather_sync(lambda: [self.sync.sync_to(policy_version, reason=reason)])
        self.sync.synced(results)
        self.progress.policy_version = policy_version
        self.metrics.log("sync", self.step, {"time/sync_s": time.perf_counter() - started})

    def _rollout_sample_step(self) -> int | None:
        """Index within the coming round of the step whose rollouts are written, if one is due."""
        interval = self.config.run.log_rollout_interval
        if not interval:
            return None
        for index in range(self.config.steps_per_round):
            if (self.step + index + 1) % interval == 0:
                return index
        return None

    def _log_round(self, trainer_results: list[RoundResult], producer_metrics: list[dict], progress) -> None:
        for rank, metrics in enumerate(producer_metrics):
            self.metrics.log("rollout", self.step, {**metrics, "producer": rank})
        first = trainer_results[0]
        self.progress.dropped_stale_groups += first.dropped_stale_groups
        if first.samples:
            write_rollout_samples(self.rollout_dir, self.step + self._rollout_sample_step() + 1, first.samples)
        for step_index in range(len(first.steps)):
            self.progress.step += 1
            merged = merge_rank_step_metrics([r.steps[step_index] for r in trainer_results])
            merged["buffer/dropped_stale_groups"] = self.progress.dropped_stale_groups
            merged["train/data_indices"] = sorted(i for r in trainer_results for i in r.data_indices[step_index])
            self.metrics.log("train", self.step, merged)
            progress.update(1)
            progress.set_postfix(reward=f"{merged['train/reward']:.3f}", loss=f"{merged['train/loss']:.4f}")

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
    def checkpoint_due(self, last_round: bool) -> bool:
        interval = self.config.run.save_interval
        if not interval:
            return False
        return last_round or self.step // interval > self.last_saved_step // interval

    def save_checkpoint(self) -> Path:
        produced = self.pending.settle(lambda calls: self._gather(calls)[0])  # surviving producer restarts
        final = save_run(
            run_dir=self.run_dir,
            config=self.config,
            progress=self.progress,
            trainers=self.trainers,
            buffer=self.buffer,
            produced_metrics=produced,
            timeout_s=self.timeout,
        )
        self.last_saved_step = self.step
        return final

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
        ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for actor in [*self.producers, *self.trainers, self.buffer]:
            try:
                ray.kill(actor)
            except Exception as error:  # already dead: nothing left to clean up
                logger.debug("kill of an actor failed: %s", error)
        if self.config.run.weight_sync_mode == "shm":  # a trainer killed before closing its region leaves it behind
            from colossal_rl.comm.weight_sync.modes import remove_leftover_regions

            for path in remove_leftover_regions(self.run_dir):
                logger.info("removed the shared-memory weight-sync region %s (its sender did not close it)", path)

"""The streaming schedule's driver loop (``--schedule stream``, issue 35), beside ``run.Driver.run``'s rounds.

The decisions are ``schedule/streaming.py``'s ``StreamingScheduler``; this loop only carries them out and
reports back. After every event, in this order: order the due weight sync (``push_weights`` on the trainers,
``receive_weights`` on every producer), the eval if one is due, the admitted chunks (``produce_chunk`` on their
producers), then the next optimizer step (``train_step`` on every trainer, each data-parallel rank's share
dealt as the round buffer deals, ``token_balance.step_shares``). An actor runs its calls in submission order,
so a sync submitted to a producer between two chunks is taken at that chunk boundary, and a chunk submitted
after it generates with it. Then it waits (``ray.wait``, bounded by ``--timeout``) for whatever answers next:
a chunk, the step, the sync or an eval.

One sync is in flight at a time: a trainer may not overwrite what a producer has not read yet (shm, files).
A checkpoint (``-si``) is taken between two steps: the trainers' state and the scheduler's snapshot; on resume
the rows of chunks in flight and of groups waiting then are handed out again (their rollouts are not saved:
they are generated anew, with the resumed weights), so no row is trained twice in an episode.
A producer that dies is restarted by Ray (``--max-actor-restarts``): it gets the last completed sync's weights,
the rows of its lost chunks are handed out again, a sync it broke is made again on a newly formed group.
Not here yet (``config.py`` refuses them in stream mode): pipeline parallelism, ppo_epochs > 1. Uses the
``Driver``'s actors, start-up, evals, export, shutdown and producer restarts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from tqdm import tqdm

from colossal_rl.comm.buffer import GroupRef
from colossal_rl.comm.token_balance import step_shares
from colossal_rl.driver.actor_groups import chunks_in_flight
from colossal_rl.driver.actor_messages import ChunkResult, StepResult
from colossal_rl.driver.calls import Calls, RunFailed, activity_board, call_outcome, gather, late_message
from colossal_rl.driver.producer_restarts import redo_lost
from colossal_rl.driver.save_and_resume import save_run
from colossal_rl.metrics import merge_rank_step_metrics
from colossal_rl.run_outputs import write_rollout_samples
from colossal_rl.schedule.events import ChunkOrder, StepOrder, TrainGroup
from colossal_rl.schedule.prompts import episode_rows
from colossal_rl.schedule.streaming import StreamingScheduler, StreamingSettings

if TYPE_CHECKING:
    from colossal_rl.config import RLConfig
    from colossal_rl.driver.run import Driver

logger = logging.getLogger(__name__)


def stream_total_steps(config: RLConfig, num_rows: int) -> int:
    """Optimizer steps of a streaming run: every episode's prompts in steps of ``dp_size * train.batch_size``
    groups, at most ``--max-steps``. (Dynamic sampling may leave the prompts short of them: the run ends then.)"""
    from colossal_rl.data import DataError

    per_step = config.parallel.dp_size * config.train.batch_size
    steps = num_rows * config.schedule.num_episodes // per_step
    if steps == 0:
        raise DataError(
            f"{config.data.train_path}: the training set has {num_rows} prompts, fewer than one optimizer step "
            f"trains (dp {config.parallel.dp_size} x -tbs {config.train.batch_size})"
        )
    return steps if config.schedule.max_steps is None else min(steps, config.schedule.max_steps)


def stream_settings(config: RLConfig, total_steps: int) -> StreamingSettings:
    schedule, generation = config.schedule, config.generation
    return StreamingSettings(
        num_producers=schedule.num_producers,
        groups_per_step=config.parallel.dp_size * config.train.batch_size,
        prompts_per_chunk=1 if generation.continuous_batching else generation.microbatch_size,
        max_staleness=schedule.max_staleness,
        total_steps=total_steps,
        sync_every_steps=schedule.sync_every_steps,
        chunks_in_flight_per_producer=chunks_in_flight(config),
        num_episodes=schedule.num_episodes,
    )


@dataclass
class Waiting:
    """Calls the loop waits on: a chunk (``ChunkOrder``), a step (``StepOrder``), a sync or an eval (the step)."""

    kind: str
    calls: Calls
    subject: Any
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class BusyTime:
    """Seconds producers spent producing and trainers training since the loop started: idle fractions, cheaply."""

    started: float = field(default_factory=time.perf_counter)
    producing_s: float = 0.0
    training_s: float = 0.0

    def idle_fractions(self, num_producers: int) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {
            "schedule/producer_idle_fraction": max(0.0, 1.0 - self.producing_s / (elapsed * num_producers)),
            "schedule/trainer_idle_fraction": max(0.0, 1.0 - self.training_s / elapsed),
        }


class StreamLoop:
    """Runs one streaming schedule on a started ``Driver``'s actors (``progress.step`` counts its steps)."""

    def __init__(self, driver: Driver, total_steps: int, resumed: dict | None = None):
        """``resumed``: the scheduler's snapshot in the checkpoint the driver started from."""
        self.driver = driver
        self.config = driver.config
        self.total_steps = total_steps
        self.scheduler = StreamingScheduler(
            stream_settings(self.config, total_steps), episode_rows(driver.train_rows, self.config.data.seed)
        )
        if resumed is not None:
            self.scheduler.restore(resumed, requeue_waiting=True)
            if self.scheduler.steps_done != driver.step:
                raise RunFailed(f"stream schedule at step {self.scheduler.steps_done}, trainers at {driver.step}")
        self.chunks: dict[int, ChunkResult] = {}
        """Chunks whose kept groups may still be trained: where each group's payload is."""
        self.waiting: list[Waiting] = []
        self._unanswered: set = set()  # refs of waited-on calls not seen finished yet
        self.busy = BusyTime()
        self.eval_before_ordered = False
        self._first_chunks: dict[int, tuple[float, float | None]] = {}  # producer -> (arrival, generating seconds)
        logger.info("stream schedule: %s", self.scheduler.settings)

    # ------------------------------------------------------------------ the loop
    def run(self) -> tuple[dict[str, float], dict[str, float]]:
        driver = self.driver
        gather(driver.trainers.set_total_steps(self.total_steps), driver.timeout)  # the LR schedule's end
        progress = tqdm(total=self.total_steps, initial=driver.step, desc="optimizer steps", unit="step")
        while True:
            self._decide()
            if self.scheduler.finished and not self._busy_beyond_chunks():
                break
            item = self._wait_one()
            self._answer(item, gather(item.calls, self.driver.timeout), progress)  # all finished: no wait
        progress.close()
        if driver.step < self.total_steps:
            logger.warning(
                "stream schedule: the prompts of -e %d episode(s) ran out after %d of %d optimizer steps (%d groups "
                "filtered by dynamic sampling, %d dropped as stale); raise -e for more",
                self.config.schedule.num_episodes, driver.step, self.total_steps,
                self.scheduler.counters.filtered_groups, self.scheduler.counters.dropped_stale_groups,
            )  # fmt: skip
        driver.collect_profile()
        if self.config.run.final_export:
            driver.export_final_model()
        return driver.progress.eval_accuracy_before or {}, driver.evaluate()

    def _busy_beyond_chunks(self) -> bool:
        """A step, sync or eval still in flight, or a sync due: the run is not over (chunks in flight are)."""
        return self.scheduler.sync_due() is not None or any(item.kind != "chunk" for item in self.waiting)

    def _kinds(self, kind: str) -> list[Waiting]:
        return [item for item in self.waiting if item.kind == kind]

    def _decide(self) -> None:
        scheduler, driver = self.scheduler, self.driver
        version = scheduler.sync_due()
        if version is not None and not self._kinds("sync"):
            self._submit("sync", driver.sync.sync_to(version, reason=f"step {driver.step}"), version)
            scheduler.sync_ordered(version)
        self._order_eval()
        for order in scheduler.admit():
            calls = driver.producers.produce_chunk(
                order.producer_rank, order.chunk_id, list(order.rows), driver.buffer, order.policy_version
            )
            self._submit("chunk", calls, order)
        if not self.eval_before_ordered:  # behind the first chunks: same weights, and they need not wait for it
            self.eval_before_ordered = True
            if driver.progress.eval_accuracy_before is None:
                self._submit("eval", driver.producers.evaluate(), None)
                driver.progress.next_eval_step = self.config.run.eval_interval
        if not self._kinds("step"):
            step = scheduler.next_step()
            if step is not None:
                self._submit("step", self._train_calls(step), step)

    def _order_eval(self) -> None:
        """The eval every ``-ei`` steps, of the weights synced at that step (submitted behind that sync)."""
        interval, progress = self.config.run.eval_interval, self.driver.progress
        step = self.driver.step
        if not interval or step == 0 or step < progress.next_eval_step or step >= self.total_steps:
            return
        if self.scheduler.synced_version != step or self._kinds("eval"):
            return
        self._submit("eval", self.driver.producers.evaluate(min_version=step), step)
        progress.next_eval_step = (step // interval + 1) * interval

    def _train_calls(self, step: StepOrder) -> Calls:
        """Every trainer's ``train_step`` call; each data-parallel rank's share balanced by token cost."""
        parts = step_shares([group.tokens for group in step.groups], self.config.parallel.dp_size)
        shares = [[self._group_ref(step.groups[index]) for index in part] for part in parts]
        interval = self.config.run.log_rollout_interval
        sample = bool(interval) and (step.step + 1) % interval == 0
        return self.driver.trainers.train_step(step.step, step.trainer_version, shares, sample)

    def _group_ref(self, group: TrainGroup) -> GroupRef:
        chunk = self.chunks[group.chunk_id]
        index = chunk.batch_rows.index(group.row)
        return GroupRef(chunk.payload, index, group.policy_version, group.chunk_id, group.tokens)

    # ------------------------------------------------------------------ waiting
    def _submit(self, kind: str, calls: Calls, subject: Any) -> None:
        self.waiting.append(Waiting(kind, calls, subject))
        self._unanswered.update(call.ref for call in calls)

    def _wait_one(self) -> Waiting:
        """The next waited-on item whose calls all finished (fails fast, naming the actor, when one failed)."""
        while True:
            refs = list(self._unanswered)
            if not refs:
                raise RunFailed(f"stream schedule stalled: nothing in flight, {self.scheduler.metrics()}")
            ready, _ = ray.wait(refs, num_returns=1, timeout=self.driver.timeout)
            if not ready:
                late = [call for item in self.waiting for call in item.calls if call.ref in self._unanswered]
                raise RunFailed(f"stream schedule: {late_message(late, self.driver.timeout, activity_board())}")
            self._unanswered.discard(ready[0])
            item = next(item for item in self.waiting if any(call.ref == ready[0] for call in item.calls))
            if call_outcome(ready[0])[0] != "ok":
                try:
                    gather(item.calls, self.driver.timeout)  # raises RunFailed naming every failed call
                except RunFailed as failure:
                    self._recover(failure, item)  # re-raises unless producers died and were restarted
                    continue
            if not any(call.ref in self._unanswered for call in item.calls):
                self.waiting.remove(item)
                return item

    # ------------------------------------------------------------------ producer restarts
    def _recover(self, failure: RunFailed, item: Waiting) -> None:
        """Producers Ray restarted (``--max-actor-restarts``) get the last completed sync's weights; every call
        they lost is dealt with: a chunk's rows are handed out again (``chunk_lost``), an eval's calls made again,
        a sync made again whole on a newly formed sync group. A dead trainer, or a failure that is no producer
        death, ends the run (with the resume command)."""
        # the restore is queued behind every call they had: once it returns, each of those has failed
        restarted = self.driver.restarted_producers(failure, item.calls, whole_sync=item.kind == "sync")
        if not restarted and not any(_lost(call) for call in item.calls):
            raise failure  # a sync's call failed with its producers alive and not restarted: an error, not a death
        for waiting in list(self.waiting):
            lost = [call for call in waiting.calls if _lost(call)]
            if waiting.kind == "sync" and (lost or restarted):
                self._remake_sync(waiting)
            elif lost and waiting.kind == "chunk":
                self.scheduler.chunk_lost(waiting.subject.chunk_id)
                self._forget(waiting)
                logger.warning(
                    "chunk %d lost with its producer: its rows are handed out again", waiting.subject.chunk_id
                )
            elif lost:
                self._forget(waiting)
                self._submit(waiting.kind, redo_lost(waiting.calls), waiting.subject)

    def _remake_sync(self, sync: Waiting) -> None:
        """Wait (bounded) until every call of a broken sync ended, form the sync group again, and sync anew."""
        driver = self.driver
        ray.wait([call.ref for call in sync.calls], num_returns=len(sync.calls), timeout=driver.timeout)
        self._forget(sync)
        for attempt in range(3):
            driver.sync.broken()
            try:  # forming the group again waits on every producer: one may die meanwhile
                calls = driver.sync.sync_to(sync.subject, reason="sync made again")
                break
            except RunFailed as failure:  # its lost chunks fail in their own waits, and are handed out again
                driver.restarted_producers(failure, [], whole_sync=True)  # raises unless producers were restarted
                if attempt == 2:
                    raise
        self._submit("sync", calls, sync.subject)

    def _forget(self, item: Waiting) -> None:
        self.waiting.remove(item)
        self._unanswered.difference_update(call.ref for call in item.calls)

    def _answer(self, item: Waiting, results: list, progress) -> None:
        """Report a waited-on item whose calls all finished with ``results`` (their results, in order)."""
        if item.kind == "chunk":
            self._chunk_done(item.subject, results[0])
        elif item.kind == "step":
            self._step_done(item.subject, results, progress)
        elif item.kind == "sync":
            self.driver.progress.policy_version = item.subject
            self.driver.sync.synced(results)  # with --max-actor-restarts: what a restarted producer is given
            elapsed = time.perf_counter() - item.submitted_at  # from its order: behind queued chunks and a step
            self.driver.metrics.log("sync", item.subject, {"time/sync_s": elapsed})  # at the step of its weights
        else:
            self._eval_done(item.subject, results)

    # ------------------------------------------------------------------ events
    def _chunk_done(self, order: ChunkOrder, result: ChunkResult) -> None:
        if result.payload is not None:
            self.chunks[order.chunk_id] = result
        self.scheduler.chunk_done(order.chunk_id, list(result.groups))
        self.busy.producing_s += result.metrics.get("time/produce_s", 0.0)
        self._note_first_chunk(result)
        metrics = result.metrics | {"producer": result.producer_rank, "schedule/chunk": order.chunk_id}
        self.driver.metrics.log("rollout", self.driver.step, metrics)

    def _note_first_chunk(self, result: ChunkResult) -> None:
        """The start-up report (``startup.json``) once every producer delivered its first chunk."""
        if self.driver.trace.reported:
            return
        self._first_chunks.setdefault(result.producer_rank, (time.time(), result.metrics.get("time/produce_s")))
        num_producers = self.config.schedule.num_producers
        if len(self._first_chunks) == num_producers:
            arrivals = {rank: arrived for rank, (arrived, _) in self._first_chunks.items()}
            self.driver.report_startup(arrivals, [self._first_chunks[rank][1] for rank in range(num_producers)])

    def _step_done(self, step: StepOrder, results: list[StepResult], progress) -> None:
        self.scheduler.step_done()
        driver = self.driver
        driver.progress.step += 1
        driver.progress.dropped_stale_groups += step.dropped_stale
        self.busy.training_s += results[0].metrics.get("time/train_step_s", 0.0)
        merged = merge_rank_step_metrics([result.metrics for result in results])
        merged["train/data_indices"] = sorted(index for result in results for index in result.data_indices)
        merged |= step_metrics(step) | self.scheduler.metrics()
        merged |= self.busy.idle_fractions(self.config.schedule.num_producers)
        merged["buffer/dropped_stale_groups"] = driver.progress.dropped_stale_groups
        driver.metrics.log("train", driver.step, merged)
        if results[0].samples:
            write_rollout_samples(driver.rollout_dir, driver.step, results[0].samples)
        self._forget_untrainable_chunks()
        self._maybe_checkpoint()
        progress.update(1)
        progress.set_postfix(reward=f"{merged['train/reward']:.3f}", loss=f"{merged['train/loss']:.4f}")

    def _forget_untrainable_chunks(self) -> None:
        """Payload handles of chunks too stale to be trained any more: their objects can be freed."""
        oldest_usable = self.scheduler.steps_done - self.config.schedule.max_staleness
        for chunk_id in [c for c, result in self.chunks.items() if result.groups[0].policy_version < oldest_usable]:
            del self.chunks[chunk_id]

    def _maybe_checkpoint(self) -> None:
        """Save (``-si``) between two steps: trainers' state and the scheduler's snapshot. The weights the trainers
        hold are version ``step`` here (versions count steps): a resume syncs them as that."""
        driver = self.driver
        if not driver.checkpoint_due(driver.step >= self.total_steps):
            return
        save_run(
            run_dir=driver.run_dir,
            config=self.config,
            progress=dataclasses.replace(driver.progress, policy_version=driver.step),
            trainers=driver.trainers,
            buffer=driver.buffer,
            produced_metrics={},
            timeout_s=driver.timeout,
            stream_schedule=self.scheduler.snapshot(),
        )
        driver.last_saved_step = driver.step

    def _eval_done(self, step: int | None, results: list) -> None:
        driver = self.driver
        accuracy = driver.log_eval(results, step=0 if step is None else step)
        if step is None:
            driver.progress.eval_accuracy_before = accuracy


def _lost(call) -> bool:
    """A finished call that failed because its producer died or was restarted."""
    ready, _ = ray.wait([call.ref], timeout=0)
    return bool(ready) and call_outcome(call.ref)[0] in ("died", "restarted")


def step_metrics(step: StepOrder) -> dict[str, float]:
    """The step's groups by staleness (``schedule/step_staleness_<lag>`` counts, and the largest lag) and the
    groups dropped as too stale while it was formed."""
    histogram = step.staleness()
    metrics = {f"schedule/step_staleness_{lag}": float(count) for lag, count in sorted(histogram.items())}
    metrics["schedule/step_staleness_max"] = float(max(histogram, default=0))
    metrics["schedule/step_dropped_stale"] = float(step.dropped_stale)
    metrics["schedule/trainer_version"] = float(step.trainer_version)
    return metrics

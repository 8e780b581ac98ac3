"""The driver's one schedule loop: it carries out either schedule's decisions on the actors.

The decisions are the scheduler's (``schedule/rounds.py``'s ``RoundScheduler`` for ``--schedule rounds``,
``schedule/streaming.py``'s ``StreamingScheduler`` for ``stream``; ``schedules.py`` picks one); this loop only
carries them out and reports back. After every event, in this order: order the due weight sync (``push_weights``
on the trainers, ``receive_weights`` on every producer), the eval if one is due, the admitted chunks
(``produce_chunk`` on their producers), then the next training order (``train_steps`` on every trainer: one
optimizer step of a stream, a whole round of rounds; each data-parallel rank's share of each step dealt by
token cost, ``token_balance.step_shares``). An actor runs its calls in submission order, so a sync submitted to a
producer between two chunks is taken at that chunk boundary, and a chunk submitted after it generates with it.
Then it waits (``ray.wait``, bounded by ``--timeout``) for whatever answers next: a chunk, a training order, the
sync or an eval.

One sync is in flight at a time: a trainer may not overwrite what a producer has not read yet (shm, files).
A checkpoint (``-si``) is taken after a training order: the trainers' state, the scheduler's snapshot and the
rollouts of every group delivered and not trained. The round schedule first waits for the chunks in flight (its
resume is exact); the streaming one hands their rows out again on resume (generated anew, with the resumed
weights), so no row is trained twice in an episode.
A producer that dies is restarted by Ray (``--max-actor-restarts``): it gets the last completed sync's weights;
a chunk it lost is made again as it was (rounds) or its rows handed out again (stream), a sync it broke is made
again on a newly formed group, an eval made again.
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
from colossal_rl.driver.actor_messages import ChunkResult, StepResult
from colossal_rl.driver.calls import Calls, RunFailed, activity_board, call_outcome, gather, late_message
from colossal_rl.driver.producer_restarts import redo_lost
from colossal_rl.driver.save_and_resume import save_run
from colossal_rl.metrics import merge_rank_step_metrics
from colossal_rl.run_checkpoints.on_disk import SavedChunk
from colossal_rl.run_outputs import write_rollout_samples
from colossal_rl.schedule.events import ChunkOrder, Scheduler, StepOrder, TrainGroup

if TYPE_CHECKING:
    from colossal_rl.driver.run import Driver

logger = logging.getLogger(__name__)


@dataclass
class Waiting:
    """Calls the loop waits on: a chunk (``ChunkOrder``), a training order (``StepOrder``), a sync (its version) or
    an eval (its step)."""

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


class ScheduleLoop:
    """Runs one schedule on a started ``Driver``'s actors (``progress.step`` counts its optimizer steps)."""

    def __init__(self, driver: Driver, scheduler: Scheduler, total_steps: int, resumed: dict | None = None):
        """``total_steps``: the optimizer steps planned (the LR schedule's end); ``resumed``: the scheduler's
        snapshot in the checkpoint the driver started from (``driver.resumed_chunks``: its rollouts)."""
        self.driver = driver
        self.config = driver.config
        self.total_steps = total_steps
        self.scheduler = scheduler
        self.chunks: dict[int, ChunkResult] = {}
        """Delivered chunks some of whose kept groups are not trained yet: where each group's payload is."""
        if resumed is not None:
            self.scheduler.restore(resumed)
            if self.scheduler.steps_done != driver.step:
                raise RunFailed(f"schedule at step {self.scheduler.steps_done}, trainers at {driver.step}")
            self.chunks = dict(driver.resumed_chunks)
        self.waiting: list[Waiting] = []
        self._unanswered: set = set()  # refs of waited-on calls not seen finished yet
        self.busy = BusyTime()
        self.eval_before_ordered = False
        self._synced_at_step: dict[int, int] = {}  # version -> the step its sync was ordered at
        self._first_chunks: dict[int, tuple[float, float | None]] = {}  # producer -> (arrival, generating seconds)
        logger.info("%s schedule: %s", self.config.schedule.mode, scheduler.settings)

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
            if item is not None:
                self._answer(item, gather(item.calls, self.driver.timeout), progress)  # all finished: no wait
        progress.close()
        if driver.step < self.total_steps:
            counts = self.scheduler.metrics()
            logger.warning(
                "%s schedule: the prompts of -e %d episode(s) ran out after %d of %d optimizer steps (%d groups "
                "filtered by dynamic sampling, %d dropped as stale); raise -e for more",
                self.config.schedule.mode, self.config.schedule.num_episodes, driver.step, self.total_steps,
                counts["schedule/groups_filtered"], counts["schedule/groups_dropped_stale"],
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
            self._submit("sync", self._sync_calls(version, reason=f"step {driver.step}"), version)
            scheduler.sync_ordered(version)
            self._synced_at_step[version] = driver.step
        self._order_eval()
        for order in scheduler.admit():
            self._submit("chunk", driver.producers.produce_chunk(order, driver.buffer), order)
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
        """The eval every ``-ei`` steps, of the weights synced at that step (submitted behind that sync; none after
        the last step: the run's final eval follows)."""
        interval, progress = self.config.run.eval_interval, self.driver.progress
        step, version = self.driver.step, self.scheduler.synced_version
        if not interval or step == 0 or step < progress.next_eval_step or self.scheduler.finished:
            return
        if self._synced_at_step.get(version) != step or self._kinds("eval"):
            return
        self._submit("eval", self.driver.producers.evaluate(min_version=version), step)
        progress.next_eval_step = (step // interval + 1) * interval

    def _train_calls(self, order: StepOrder) -> Calls:
        """Every trainer's ``train_steps`` call; each data-parallel rank's share of each step balanced by token cost."""
        shares = []
        for groups in order.step_groups():
            parts = step_shares([group.tokens for group in groups], self.config.parallel.dp_size)
            shares.append([[self._group_ref(groups[index]) for index in part] for part in parts])
        return self.driver.trainers.train_steps(order.step, order.trainer_version, shares, self._sample_step(order))

    def _sample_step(self, order: StepOrder) -> int | None:
        """Index within ``order`` of the step whose rollouts are written (``--log-rollout-interval``), if one is due."""
        interval = self.config.run.log_rollout_interval
        if not interval:
            return None
        return next((s for s in range(order.num_steps) if (order.step + s + 1) % interval == 0), None)

    def _group_ref(self, group: TrainGroup) -> GroupRef:
        chunk = self.chunks[group.chunk_id]
        index = chunk.batch_rows.index(group.row)
        return GroupRef(chunk.payload, index, group.policy_version, group.chunk_id, group.tokens)

    # ------------------------------------------------------------------ waiting
    def _submit(self, kind: str, calls: Calls, subject: Any) -> None:
        self.waiting.append(Waiting(kind, calls, subject))
        self._unanswered.update(call.ref for call in calls)

    def _wait_one(self) -> Waiting | None:
        """The next waited-on item whose calls all finished (fails fast, naming the actor, when one failed). None
        when restarted producers were dealt with and nothing is left in flight (one producer under continuous
        batching: every chunk in flight was its), so the loop decides again and orders the rows handed out again."""
        while True:
            refs = list(self._unanswered)
            if not refs:
                raise RunFailed(f"schedule stalled: nothing in flight, {self.scheduler.metrics()}")
            ready, _ = ray.wait(refs, num_returns=1, timeout=self.driver.timeout)
            if not ready:
                late = [call for item in self.waiting for call in item.calls if call.ref in self._unanswered]
                raise RunFailed(
                    f"{self.config.schedule.mode} schedule: {late_message(late, self.driver.timeout, activity_board())}"
                )
            self._unanswered.discard(ready[0])
            item = next(item for item in self.waiting if any(call.ref == ready[0] for call in item.calls))
            if call_outcome(ready[0])[0] != "ok":
                try:
                    gather(item.calls, self.driver.timeout)  # raises RunFailed naming every failed call
                except RunFailed as failure:
                    self._recover(failure, item)  # re-raises unless producers died and were restarted
                    if not self._unanswered:  # every call in flight was lost and none made again: decide anew
                        return None
                    continue
            if not any(call.ref in self._unanswered for call in item.calls):
                self.waiting.remove(item)
                return item

    # ------------------------------------------------------------------ producer restarts
    def _recover(self, failure: RunFailed, item: Waiting) -> None:
        """Producers Ray restarted (``--max-actor-restarts``) get the last completed sync's weights; every call
        they lost is dealt with, in the order it was submitted: a chunk is made again or its rows handed out again
        (the scheduler's ``chunk_lost`` says which), an eval's calls made again, a sync made again whole on a newly
        formed sync group. A dead trainer, or a failure that is no producer death, ends the run (with the resume
        command)."""
        # the restore is queued behind every call they had: once it returns, each of those has failed
        restarted = self.driver.restarted_producers(failure, item.calls, whole_sync=item.kind == "sync")
        if not restarted and not any(_lost(call) for call in item.calls):
            raise failure  # a sync's call failed with its producers alive and not restarted: an error, not a death
        for waiting in list(self.waiting):  # in the order submitted: a lost chunk goes out again before a later sync
            if waiting.kind == "sync" and (restarted or any(_lost(call) for call in waiting.calls)):
                self._remake_sync(waiting)
            else:
                self._redo_lost(waiting)

    def _redo_lost(self, waiting: Waiting) -> None:
        """``waiting`` (not a sync) made again where its producer died: a chunk is made again as ordered or its rows
        handed out again (the scheduler's ``chunk_lost`` says which), any other kind's lost calls made again."""
        lost = [call for call in waiting.calls if _lost(call)]
        if not lost:
            return
        self._forget(waiting)
        if waiting.kind == "chunk":
            again = self.scheduler.chunk_lost(waiting.subject.chunk_id)
            if again is not None:
                self._submit("chunk", redo_lost(waiting.calls), again)
            what = "it is made again" if again is not None else "its rows are handed out again"
            logger.warning("chunk %d lost with its producer: %s", waiting.subject.chunk_id, what)
        else:
            self._submit(waiting.kind, redo_lost(waiting.calls), waiting.subject)

    def _remake_sync(self, sync: Waiting) -> None:
        """Wait (bounded) until every call of a broken sync ended, form the sync group again, and sync anew."""
        driver = self.driver
        ray.wait([call.ref for call in sync.calls], num_returns=len(sync.calls), timeout=driver.timeout)
        self._forget(sync)
        driver.sync.broken()
        self._submit("sync", self._sync_calls(sync.subject, reason="sync made again"), sync.subject)

    def _sync_calls(self, version: int, *, reason: str) -> Calls:
        """The calls of a sync to ``version``. After a producer restart the group is formed again first, which
        waits on every producer: one that dies meanwhile is restarted (or the run ends naming the budget, in
        ``restarted_producers``) and the group formed anew."""
        attempts_left = 3
        while True:
            try:  # a failed formation leaves the group stale: the next attempt forms it again
                return self.driver.sync.sync_to(version, reason=reason)
            except RunFailed as failure:
                if self.driver.restarted_producers(failure, [], whole_sync=True):  # raises unless some restarted
                    for waiting in [item for item in self.waiting if item.kind != "sync"]:
                        self._redo_lost(waiting)  # before this sync: a lost chunk is made at its own version
                attempts_left -= 1
                if attempts_left == 0:
                    raise

    def _forget(self, item: Waiting) -> None:
        self.waiting.remove(item)
        self._unanswered.difference_update(call.ref for call in item.calls)

    def _answer(self, item: Waiting, results: list, progress) -> None:
        """Report a waited-on item whose calls all finished with ``results`` (their results, in order)."""
        if item.kind == "chunk":
            self._chunk_done(item.subject, results[0])
        elif item.kind == "step":
            self._step_done(item.subject, results, progress, time.perf_counter() - item.submitted_at)
        elif item.kind == "sync":
            self.driver.progress.policy_version = item.subject
            self.driver.sync.synced(results)  # with --max-actor-restarts: what a restarted producer is given
            elapsed = time.perf_counter() - item.submitted_at  # from its order: behind queued chunks and a step
            step = self._synced_at_step.get(item.subject, self.driver.step)  # at the step of its weights
            self.driver.metrics.log("sync", step, {"time/sync_s": elapsed})
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

    def _step_done(self, order: StepOrder, results: list[list[StepResult]], progress, elapsed_s: float) -> None:
        """A training order finished, ``elapsed_s`` after it was submitted: ``results[trainer][k]`` is each trainer's
        k-th optimizer step of it (the last step's metrics carry ``time/train_order_s``)."""
        self.scheduler.step_done()
        driver = self.driver
        driver.progress.dropped_stale_groups += order.dropped_stale
        schedule = step_metrics(order) | self.scheduler.metrics()
        for index, steps in enumerate(zip(*results, strict=True)):
            driver.progress.step += 1
            self.busy.training_s += steps[0].metrics.get("time/train_step_s", 0.0)
            merged = merge_rank_step_metrics([result.metrics for result in steps])
            merged["train/data_indices"] = sorted(index for result in steps for index in result.data_indices)
            merged |= schedule | self.busy.idle_fractions(self.config.schedule.num_producers)
            merged["buffer/dropped_stale_groups"] = driver.progress.dropped_stale_groups
            if index == len(results[0]) - 1:
                merged["time/train_order_s"] = elapsed_s
            driver.metrics.log("train", driver.step, merged)
            if steps[0].samples:
                write_rollout_samples(driver.rollout_dir, driver.step, steps[0].samples)
            progress.update(1)
            progress.set_postfix(reward=f"{merged['train/reward']:.3f}", loss=f"{merged['train/loss']:.4f}")
        self._forget_trained_chunks()
        self._maybe_checkpoint(progress)

    def _forget_trained_chunks(self) -> None:
        """Payload handles of chunks none of whose groups waits any more (trained or dropped): freed."""
        waiting = {group.chunk_id for group in self.scheduler.waiting_groups()}
        for chunk_id in [chunk_id for chunk_id in self.chunks if chunk_id not in waiting]:
            del self.chunks[chunk_id]

    def _maybe_checkpoint(self, progress) -> None:
        """Save (``-si``) after a training order: trainers' state, the scheduler's snapshot and the rollouts of the
        groups waiting. The weights the trainers hold are version ``scheduler.trainer_version``: a resume syncs
        them as that. A scheduler that ``settles_before_snapshot`` has its chunks in flight waited for first."""
        driver = self.driver
        if not driver.checkpoint_due(self.scheduler.finished or driver.step >= self.total_steps):
            return
        while self.scheduler.settles_before_snapshot and self._kinds("chunk"):
            item = self._wait_one()
            if item is not None:  # None: lost chunks were made again (rounds), and are waited for here too
                self._answer(item, gather(item.calls, driver.timeout), progress)
        waiting = {group.chunk_id for group in self.scheduler.waiting_groups()}
        save_run(
            run_dir=driver.run_dir,
            config=self.config,
            progress=dataclasses.replace(driver.progress, policy_version=self.scheduler.trainer_version),
            trainers=driver.trainers,
            schedule=self.scheduler.snapshot(),
            chunks={chunk_id: _saved(self.chunks[chunk_id], driver.timeout) for chunk_id in sorted(waiting)},
            timeout_s=driver.timeout,
        )
        driver.last_saved_step = driver.step

    def _eval_done(self, step: int | None, results: list) -> None:
        driver = self.driver
        accuracy = driver.log_eval(results, step=0 if step is None else step)
        if step is None:
            driver.progress.eval_accuracy_before = accuracy


def _saved(chunk: ChunkResult, timeout_s: float) -> SavedChunk:
    return SavedChunk(ray.get(chunk.payload, timeout=timeout_s), chunk.batch_rows, chunk.producer_rank)


def _lost(call) -> bool:
    """A finished call that failed because its producer died or was restarted."""
    ready, _ = ray.wait([call.ref], timeout=0)
    return bool(ready) and call_outcome(call.ref)[0] in ("died", "restarted")


def step_metrics(step: StepOrder) -> dict[str, float]:
    """The order's groups by staleness (``schedule/step_staleness_<lag>`` counts, and the largest lag) and the
    groups dropped as too stale while it was formed."""
    histogram = step.staleness()
    metrics = {f"schedule/step_staleness_{lag}": float(count) for lag, count in sorted(histogram.items())}
    metrics["schedule/step_staleness_max"] = float(max(histogram, default=0))
    metrics["schedule/step_dropped_stale"] = float(step.dropped_stale)
    metrics["schedule/trainer_version"] = float(step.trainer_version)
    return metrics

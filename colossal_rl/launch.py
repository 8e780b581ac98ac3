"""The driver: place the actors, run the round schedule, log, shut down — on one screen.

Schedule (deterministic, so staleness is exact and a run is reproducible):
  producers generate round r with weights version max(0, r - n_behind);
  trainers train round r holding version r, then push version r + 1 to every producer.
Each actor executes its calls in submission order, so the order of submissions below *is*
the schedule; the driver only waits (always with a timeout) for results and failures.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from tqdm import tqdm

from colossal_rl.config import RLConfig
from colossal_rl.metrics import MetricsLogger

logger = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run stopped because an actor failed or did not answer in time; the message names it."""


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    steps: int
    rounds: int
    wall_time_s: float
    eval_accuracy_before: dict[str, float]
    eval_accuracy_after: dict[str, float]
    dropped_stale_groups: int


def _last_line(error: BaseException) -> str:
    """The final line of a (possibly remote) exception: the error itself, without the traceback wall."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _gather(named_refs: list[tuple[str, ray.ObjectRef]], timeout_s: float) -> list:
    """Results of the refs in order; raises :class:`RunFailed` naming the first actor that failed or hung."""
    refs = [ref for _, ref in named_refs]
    ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for name, ref in named_refs:
        if ref in ready:
            try:
                ray.get(ref)
            except Exception as error:
                raise RunFailed(f"{name} failed: {_last_line(error)}") from error
    if not_ready:
        late = [name for name, ref in named_refs if ref in not_ready]
        raise RunFailed(f"no answer within {timeout_s:.0f}s from: {', '.join(late)}")
    return ray.get(refs)


def init_ray(config: RLConfig) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    runtime_env = {"env_vars": env}
    if config.run.master_address:
        ray.init(address="auto", _temp_dir=config.run.ray_dir, runtime_env=runtime_env, log_to_driver=True)
        return
    num_actors = config.schedule.num_producers + config.parallel.num_trainers + 1
    ray.init(
        num_cpus=max(num_actors, os.cpu_count() or 1),
        _temp_dir=config.run.ray_dir,
        runtime_env=runtime_env,
        include_dashboard=False,
        log_to_driver=True,
    )


def total_rounds(config: RLConfig, num_rows: int) -> int:
    from colossal_rl.data import DataError, EpisodeSchedule

    schedule = EpisodeSchedule(num_rows, config.schedule.num_producers, config.schedule.inference_batch_size, 0)
    if schedule.rounds_per_episode == 0:
        raise DataError(
            f"{config.data.train_path}: the training set has {num_rows} prompts, fewer than one round needs "
            f"(-i {config.schedule.num_producers} x -ibs {config.schedule.inference_batch_size})"
        )
    rounds = schedule.rounds_per_episode * config.schedule.num_episodes
    if config.schedule.max_steps is not None:
        rounds = min(rounds, math.ceil(config.schedule.max_steps / config.steps_per_round))
    return rounds


class Driver:
    """Owns the actors of one run."""

    def __init__(self, config: RLConfig, run_dir: Path, metrics: MetricsLogger):
        from colossal_rl.actors import BufferActor, ProducerActor, TrainerActor, free_port

        self.config = config
        self.run_dir = run_dir
        self.metrics = metrics
        self.timeout = config.run.timeout_s
        sched, par = config.schedule, config.parallel
        threads = max(1, (os.cpu_count() or 1) // (sched.num_producers + par.num_trainers))
        self.buffer = BufferActor.remote(
            num_producers=sched.num_producers,
            dp_size=par.dp_size,
            groups_per_step=config.train.batch_size,
            n_behind=sched.n_behind,
        )
        master_port = free_port() if config.run.master_address is None else config.run.master_port
        self.trainers = [
            TrainerActor.remote(rank, par.num_trainers, config, "127.0.0.1", master_port, threads)
            for rank in range(par.num_trainers)
        ]
        self.producers = [ProducerActor.remote(rank, config, threads) for rank in range(sched.num_producers)]
        self.step = 0
        self.dropped_stale_groups = 0

    def named(self, method: str, actors: str, *args) -> list[tuple[str, ray.ObjectRef]]:
        group = self.trainers if actors == "trainer" else self.producers
        return [
            (f"{actors} {rank} ({method})", getattr(actor, method).remote(*args)) for rank, actor in enumerate(group)
        ]

    def start(self) -> None:
        started = time.perf_counter()
        _gather(self.named("ready", "producer") + self.named("setup", "trainer"), self.timeout)
        host, port = ray.get(self.trainers[0].weight_sync_address.remote(), timeout=self.timeout)
        world = 1 + len(self.producers)
        _gather(
            self.named("setup_weight_sync", "trainer", host, port, world)
            + self.named("join_weight_sync", "producer", host, port, world),
            self.timeout,
        )
        logger.info("actors ready in %.1fs", time.perf_counter() - started)

    def evaluate(self) -> dict[str, float]:
        results = _gather(self.named("evaluate", "producer"), self.timeout)
        return self._log_eval(results)

    def _log_eval(self, results) -> dict[str, float]:
        correct: dict[str, float] = {}
        counts: dict[str, int] = {}
        for per_producer in results:
            for result in per_producer:
                correct[result.task] = correct.get(result.task, 0.0) + result.accuracy * result.num_prompts
                counts[result.task] = counts.get(result.task, 0) + result.num_prompts
        accuracy = {task: correct[task] / max(counts[task], 1) for task in correct}
        self.metrics.log("eval", self.step, {f"eval/{task}_accuracy": acc for task, acc in accuracy.items()})
        logger.info("eval at step %d: %s", self.step, {k: round(v, 4) for k, v in accuracy.items()})
        return accuracy

    def run(self, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
        n_behind = self.config.schedule.n_behind
        eval_interval = self.config.run.eval_interval
        before = self.evaluate()
        pending_produce = {
            r: self.named("produce", "producer", r, self.buffer) for r in range(min(n_behind + 1, rounds))
        }
        next_eval = eval_interval
        progress = tqdm(total=rounds * self.config.steps_per_round, desc="optimizer steps", unit="step")
        for round_index in range(rounds):
            round_started = time.perf_counter()
            train_refs = self.named("train_round", "trainer", round_index, self.buffer)
            results = _gather(train_refs + pending_produce.pop(round_index), self.timeout)
            self._log_round(results[: len(self.trainers)], results[len(self.trainers) :], progress)
            sync_started = time.perf_counter()
            _gather(
                self.named("push_weights", "trainer", round_index + 1)
                + self.named("receive_weights", "producer", round_index + 1),
                self.timeout,
            )
            self.metrics.log(
                "sync",
                self.step,
                {
                    "time/sync_s": time.perf_counter() - sync_started,
                    "time/round_s": time.perf_counter() - round_started,
                },
            )
            if eval_interval and self.step >= next_eval and round_index < rounds - 1:
                self.evaluate()
                next_eval = (self.step // eval_interval + 1) * eval_interval
            if round_index + 1 + n_behind < rounds:
                pending_produce[round_index + 1 + n_behind] = self.named(
                    "produce", "producer", round_index + 1 + n_behind, self.buffer
                )
        progress.close()
        after = self.evaluate()
        return before, after

    def _log_round(self, trainer_results: list[dict], producer_metrics: list[dict], progress) -> None:
        for rank, metrics in enumerate(producer_metrics):
            self.metrics.log("rollout", self.step, {**metrics, "producer": rank})
        first = trainer_results[0]
        self.dropped_stale_groups += first["dropped_stale_groups"]
        for step_index, rank0_metrics in enumerate(first["steps"]):
            self.step += 1
            merged = {
                k: sum(r["steps"][step_index][k] for r in trainer_results) / len(trainer_results) for k in rank0_metrics
            }
            merged["train/loss"] = rank0_metrics["train/loss"]  # already the global loss
            merged["buffer/dropped_stale_groups"] = self.dropped_stale_groups
            self.metrics.log("train", self.step, merged)
            progress.update(1)
            progress.set_postfix(reward=f"{merged['train/reward']:.3f}", loss=f"{merged['train/loss']:.4f}")

    def shutdown(self) -> None:
        for actor in self.producers + self.trainers:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception as error:  # the actor may already be dead; we are cleaning up either way
                logger.debug("shutdown of an actor failed: %s", error)
        for actor in self.producers + self.trainers + [self.buffer]:
            ray.kill(actor)


def make_run_dir(config: RLConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run.save_dir) / f"{config.run.project.replace(' ', '_')}-{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def run_training(config: RLConfig, *, use_wandb: bool = True) -> RunSummary:
    """Train with ``config`` (validated here) and return what happened; Ray is started if needed."""
    from colossal_rl.data import load_jsonl_rows

    config.validate()
    started = time.perf_counter()
    rounds = total_rounds(config, len(load_jsonl_rows(config.data.train_path)))
    run_dir = make_run_dir(config)
    metrics = MetricsLogger(run_dir, config.run.project, dataclasses.asdict(config), use_wandb=use_wandb)
    logger.info("run directory: %s (%d rounds, %d steps per round)", run_dir, rounds, config.steps_per_round)
    started_ray = not ray.is_initialized()
    init_ray(config)
    driver = None
    try:
        driver = Driver(config, run_dir, metrics)
        driver.start()
        before, after = driver.run(rounds)
    finally:
        if driver is not None:
            driver.shutdown()
        metrics.close()
        if started_ray:
            ray.shutdown()
    return RunSummary(
        run_dir=str(run_dir),
        steps=driver.step,
        rounds=rounds,
        wall_time_s=time.perf_counter() - started,
        eval_accuracy_before=before,
        eval_accuracy_after=after,
        dropped_stale_groups=driver.dropped_stale_groups,
    )

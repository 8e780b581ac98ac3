"""The driver: place the actors, run the round schedule, log, shut down — on one screen.

Schedule (deterministic, so staleness is exact and a run is reproducible):
  producers generate round r with weights version max(0, r - n_behind);
  trainers train round r holding version r, then push version r + 1 to every producer;
  the eval before training runs on the producers right after the first round's generation (version 0
  still), so it overlaps the first round's training instead of delaying it.
Each actor executes its calls in submission order, so the order of submissions below *is*
the schedule; the driver only waits (always with a timeout) for results and failures.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from tqdm import tqdm

from colossal_rl import checkpoint as ckpt
from colossal_rl.comm.sync_stages import stage_senders
from colossal_rl.config import RLConfig
from colossal_rl.config_files import CONFIG_FILE, config_to_yaml
from colossal_rl.metrics import MetricsLogger, merge_rank_step_metrics
from colossal_rl.placement import check_transport_for_cluster
from colossal_rl.profiling import PhaseRecorder, Span, append_spans
from colossal_rl.rollout.eval_result import aggregate_eval
from colossal_rl.run_outputs import (
    eval_dir,
    prepare_eval_dir,
    rollout_dir,
    write_eval_generations,
    write_rollout_samples,
)
from colossal_rl.startup import FIRST_ROUND, StartupReport, process_started_at, spawn_span

logger = logging.getLogger(__name__)
FINAL_MODEL_DIR = "final"
"""Inside the run directory: the trained policy as a Hugging Face model (``run.final_export``)."""


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
    final_model_dir: str | None = None
    """The trained policy as a Hugging Face model (``run.final_export``), None when not exported."""


def _last_line(error: BaseException) -> str:
    """The final line of a (possibly remote) exception: the error itself, without the traceback wall."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _failure(name: str, ref: ray.ObjectRef) -> tuple[bool, str] | None:
    """(actor died?, message) if ``ref`` (ready) holds an error, else None."""
    try:
        ray.get(ref)
    except ray.exceptions.ActorDiedError as error:
        return True, f"{name} died: {_last_line(error)}"
    except Exception as error:
        return False, f"{name} failed: {_last_line(error)}"
    return None


def _gather(named_refs: list[tuple[str, ray.ObjectRef]], timeout_s: float, settle_s: float = 3.0) -> list:
    """Results of the refs in order; raises :class:`RunFailed` naming the actors that failed or hung.

    Fails fast: the first failure ends the wait, even while other actors are still blocked (e.g. a
    trainer waiting for rollouts from the producer that just died). Failures that follow within
    ``settle_s`` are reported too, dead actors first: they are the cause, their peers the symptom.
    """
    names = {ref: name for name, ref in named_refs}
    pending = list(names)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = [names[ref] for ref in pending]
            raise RunFailed(f"no answer within {timeout_s:.0f}s from: {', '.join(late)}")
        first = _failure(names[ready[0]], ready[0])
        if first is not None:
            more, _ = ray.wait(pending, num_returns=len(pending), timeout=settle_s) if pending else ([], [])
            failures = [first] + [f for f in (_failure(names[ref], ref) for ref in more) if f is not None]
            failures.sort(key=lambda failure: not failure[0])
            raise RunFailed("; ".join(message for _, message in failures))
    return ray.get([ref for _, ref in named_refs])


def init_ray(config: RLConfig) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    runtime_env = {"env_vars": env}
    if config.run.master_address:
        from colossal_rl.placement import ray_address

        address = ray_address(config.run.master_address)
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, _temp_dir=config.run.ray_dir, runtime_env=runtime_env, log_to_driver=True)
        return
    num_actors = config.schedule.num_producers + config.parallel.num_trainers + 1
    # address="local": always a fresh local instance, never a cluster another process happens to have
    # running on this machine (ray.init() without an address would join it); --master_address joins one.
    ray.init(
        address="local",
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
        rounds = min(rounds, math.ceil(config.schedule.max_steps / config.optimizer_steps_per_round))
    return rounds


class Driver:
    """Owns the actors of one run."""

    def __init__(self, config: RLConfig, run_dir: Path, metrics: MetricsLogger, startup: PhaseRecorder | None = None):
        """``startup``: the driver's start-up phases so far (``run_training``'s); the driver adds its own."""
        from colossal_rl.actors import BufferActor, ProducerActor, TrainerActor, free_port
        from colossal_rl.placement import actor_options, threads_per_actor, trainer_master_port

        self.startup = startup or PhaseRecorder()
        self.startup_origin = process_started_at()
        self.actors_submitted_at = time.time()
        self.actor_startup: dict[str, list[Span]] = {}
        self.train_rows: int | None = None
        self.startup_reported = False

        check_transport_for_cluster(config.run.weight_sync_backend, ray.nodes())  # before any actor starts
        self.config = config
        self.run_dir = run_dir
        self.metrics = metrics
        self.timeout = config.run.timeout_s
        sched, par = config.schedule, config.parallel
        producer_threads, trainer_threads = threads_per_actor(
            os.cpu_count() or 1,
            sched.num_producers,
            par.num_trainers,
            config.run.producer_threads,
            config.run.trainer_threads,
        )
        self.buffer = BufferActor.remote(
            num_producers=sched.num_producers,
            dp_size=par.dp_size,
            groups_per_step=config.train.batch_size,
            n_behind=sched.n_behind,
            takers_per_rank=par.tp_size * par.pp_size,
        )
        master_port = trainer_master_port(
            config.run.master_port, joins_cluster=config.run.master_address is not None, free_port=free_port
        )
        placement = actor_options(
            ray.nodes(),
            num_producers=sched.num_producers,
            producer_gpus=config.generation.tensor_parallel_size,
            num_trainers=par.num_trainers,
        )
        self.trainers = [
            TrainerActor.options(**placement.trainers[rank]).remote(
                rank, par.num_trainers, config, placement.trainer_master_address, master_port, trainer_threads
            )
            for rank in range(par.num_trainers)
        ]
        self.producers = [
            ProducerActor.options(**placement.producers[rank]).remote(rank, config, producer_threads)
            for rank in range(sched.num_producers)
        ]
        self.step = 0
        self.next_round = 0
        self.policy_version = 0
        self.dropped_stale_groups = 0
        self.final_model_dir: Path | None = None
        self.next_eval_step = 0
        self.last_saved_step = 0
        self.eval_before: dict[str, float] | None = None
        self.eval_before_refs: list[tuple[str, ray.ObjectRef]] | None = None
        self.pending_produce: dict[int, list[tuple[str, ray.ObjectRef]]] = {}
        self.eval_dir = eval_dir(run_dir, config.run.eval_save_dir)
        self.rollout_dir = rollout_dir(run_dir, config.run.rollout_save_dir)

    def named(self, method: str, actors: str, *args) -> list[tuple[str, ray.ObjectRef]]:
        group = self.trainers if actors == "trainer" else self.producers
        return [
            (f"{actors} {rank} ({method})", getattr(actor, method).remote(*args)) for rank, actor in enumerate(group)
        ]

    def start(self, resume_from: Path | None = None) -> None:
        """Start every actor and the weight-sync group; with ``resume_from``, restore a checkpoint first."""
        started = time.perf_counter()
        ready = _gather(self.named("ready", "producer") + self.named("setup", "trainer"), self.timeout)
        self.startup.add("actors", self.actors_submitted_at, time.time())
        names = [f"producer {r}" for r in range(len(self.producers))] + [
            f"trainer {r}" for r in range(len(self.trainers))
        ]
        train_rows = {info["train_rows"] for info in ready[: len(self.producers)]}
        if len(train_rows) != 1:
            raise RunFailed(f"producers loaded different numbers of training prompts: {sorted(train_rows)}")
        (self.train_rows,) = train_rows
        """Training prompts the producers hold (over-long ones left out): what the round count is made of."""
        for name, info in zip(names, ready, strict=True):
            spawn = spawn_span(self.actors_submitted_at, info["startup"])
            self.actor_startup[name] = ([spawn] if spawn else []) + list(info["startup"])
        if resume_from is not None:
            with self.startup.record("restore"):
                self._restore(resume_from)
        sync_started = time.time()
        senders = stage_senders([info["sync_stage"] for info in ready[len(self.producers) :]])
        addresses = _gather(
            [
                (f"trainer {rank} (weight_sync_address)", self.trainers[rank].weight_sync_address.remote())
                for rank in senders
            ],
            self.timeout,
        )
        world = 1 + len(self.producers)
        _gather(
            self.named("setup_weight_sync", "trainer", addresses, world)
            + self.named("join_weight_sync", "producer", addresses, world),
            self.timeout,
        )
        if resume_from is not None:
            self._sync_weights(self.policy_version)
        self.startup.add("weight sync", sync_started, time.time())
        logger.info("actors ready in %.1fs", time.perf_counter() - started)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        results = _gather(self.named("evaluate", "producer"), self.timeout)
        return self._log_eval(results)

    def _submit_eval_before(self) -> None:
        """Queue the eval of the untrained policy on the producers (once; not on resume)."""
        if self.eval_before is None and self.eval_before_refs is None:
            self.eval_before_refs = self.named("evaluate", "producer")

    def _log_eval_before(self) -> None:
        """Wait for the eval before training, if queued and not logged yet, and log it at the current step."""
        if self.eval_before_refs is not None:
            self.eval_before = self._log_eval(_gather(self.eval_before_refs, self.timeout))
            self.eval_before_refs = None
            self.next_eval_step = self.config.run.eval_interval

    def _log_eval(self, results) -> dict[str, float]:
        """Log every task's accuracy (mean@k) over all producers' shares, and pass@k with several samples."""
        accuracy, logged, records = aggregate_eval(results, self.config.generation.eval_samples)
        self.metrics.log("eval", self.step, logged)
        write_eval_generations(self.eval_dir, self.step, records)
        logger.info("eval at step %d: %s", self.step, {key: round(value, 4) for key, value in logged.items()})
        return accuracy

    # ------------------------------------------------------------------ the round loop
    def run(self, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
        total_steps = rounds * self.config.optimizer_steps_per_round
        _gather(self.named("set_total_steps", "trainer", total_steps), self.timeout)  # the LR schedule's end
        n_behind = self.config.schedule.n_behind
        for r in range(self.next_round, min(self.next_round + n_behind + 1, rounds)):
            if r not in self.pending_produce:  # restored rounds are already in the buffer
                self.pending_produce[r] = self.named("produce", "producer", r, self.buffer)
            self._submit_eval_before()  # right behind the first round: same weights, and round one need not wait
        self._submit_eval_before()
        progress = tqdm(
            total=rounds * self.config.optimizer_steps_per_round, initial=self.step, desc="optimizer steps", unit="step"
        )
        for round_index in range(self.next_round, rounds):
            round_started = time.perf_counter()
            self._train_round(round_index, progress)
            self._sync_weights(round_index + 1)
            self.next_round = round_index + 1
            self._collect_profile()
            self.metrics.log("sync", self.step, {"time/round_s": time.perf_counter() - round_started})
            last_round = round_index == rounds - 1
            if not last_round:
                self._maybe_evaluate()
            if self._checkpoint_due(last_round):
                self.save_checkpoint()
            if round_index + 1 + n_behind < rounds:
                next_produce = round_index + 1 + n_behind
                self.pending_produce[next_produce] = self.named("produce", "producer", next_produce, self.buffer)
        self._log_eval_before()
        progress.close()
        if self.config.run.final_export:
            self.export_final_model()
        return self.eval_before, self.evaluate()

    def export_final_model(self) -> Path:
        """The trained policy, as a Hugging Face model, into ``<run dir>/final`` (replacing an earlier one).

        When the run has just checkpointed its last step, that checkpoint's export holds these weights: its
        files are hard-linked (no second gather of the weights, no second copy on disk)."""
        final = self.run_dir / FINAL_MODEL_DIR
        shutil.rmtree(final, ignore_errors=True)
        checkpoint = self.run_dir / "checkpoints" / ckpt.checkpoint_name(self.step)
        if self.last_saved_step == self.step and (checkpoint / ckpt.EXPORT_DIR).is_dir():
            shutil.copytree(checkpoint / ckpt.EXPORT_DIR, final, copy_function=os.link)
        else:
            _gather(self.named("export_model", "trainer", str(final)), self.timeout)
        self.final_model_dir = final
        logger.info("exported the trained policy to %s", final)
        return final

    def _train_round(self, round_index: int, progress) -> None:
        sample_step = self._rollout_sample_step()
        train_refs = self.named("train_round", "trainer", round_index, self.buffer, sample_step)
        results = _gather(train_refs + self.pending_produce.pop(round_index), self.timeout)
        if not self.startup_reported:
            self._report_startup(round_index, results[len(self.trainers) :])
        self._log_eval_before()
        self._log_round(results[: len(self.trainers)], results[len(self.trainers) :], progress)

    def _report_startup(self, round_index: int, producer_metrics: list[dict]) -> None:
        """Log and write (``startup.json``) where the time to this run's first round of rollouts went."""
        arrivals = ray.get(self.buffer.arrival_times.remote(round_index), timeout=self.timeout)
        ready_at = max(arrivals.values()) if arrivals else time.time()
        driver = self.startup.drain()
        if driver and driver[-1].end < ready_at:  # what the driver waited for after its own last phase
            driver.append(Span(FIRST_ROUND, driver[-1].end, ready_at))
        spans = {"driver": tuple(driver)}
        for rank, metrics in enumerate(producer_metrics):
            name = f"producer {rank}"
            actor_spans = list(self.actor_startup.get(name, []))
            if rank in arrivals and "time/produce_s" in metrics:  # restored rounds were not produced by this run
                actor_spans.append(Span(FIRST_ROUND, arrivals[rank] - metrics["time/produce_s"], arrivals[rank]))
            spans[name] = tuple(actor_spans)
        spans |= {name: tuple(s) for name, s in self.actor_startup.items() if name.startswith("trainer")}
        report = StartupReport(
            origin=self.startup_origin,
            spans=spans,
            first_round_ready_at=ready_at,
        )
        report.write(self.run_dir)
        for line in report.lines():
            logger.info("%s", line)
        self.metrics.log("startup", self.step, {"time/first_rollout_s": report.time_to_first_rollout_s})
        self.startup_reported = True

    def _sync_weights(self, version: int) -> None:
        started = time.perf_counter()
        _gather(
            self.named("push_weights", "trainer", version) + self.named("receive_weights", "producer", version),
            self.timeout,
        )
        self.policy_version = version
        self.metrics.log("sync", self.step, {"time/sync_s": time.perf_counter() - started})

    def _collect_profile(self) -> None:
        if not self.config.run.enable_profiling:
            return
        spans = _gather(self.named("drain_phases", "producer") + self.named("drain_phases", "trainer"), self.timeout)
        actors = [f"producer {r}" for r in range(len(self.producers))] + [
            f"trainer {r}" for r in range(len(self.trainers))
        ]
        for actor, actor_spans in zip(actors, spans, strict=True):
            append_spans(self.run_dir, actor, actor_spans)

    def _maybe_evaluate(self) -> None:
        interval = self.config.run.eval_interval
        if interval and self.step >= self.next_eval_step:
            self.evaluate()
            self.next_eval_step = (self.step // interval + 1) * interval

    def _rollout_sample_step(self) -> int | None:
        """Index within the coming round of the step whose rollouts are written, if one is due."""
        interval = self.config.run.log_rollout_interval
        if not interval:
            return None
        for index in range(self.config.steps_per_round):
            if (self.step + index + 1) % interval == 0:
                return index
        return None

    def _log_round(self, trainer_results: list[dict], producer_metrics: list[dict], progress) -> None:
        for rank, metrics in enumerate(producer_metrics):
            self.metrics.log("rollout", self.step, {**metrics, "producer": rank})
        first = trainer_results[0]
        self.dropped_stale_groups += first["dropped_stale_groups"]
        if first["samples"]:
            write_rollout_samples(self.rollout_dir, self.step + self._rollout_sample_step() + 1, first["samples"])
        for step_index in range(len(first["steps"])):
            self.step += 1
            merged = merge_rank_step_metrics([r["steps"][step_index] for r in trainer_results])
            merged["buffer/dropped_stale_groups"] = self.dropped_stale_groups
            merged["train/data_indices"] = sorted(i for r in trainer_results for i in r["data_indices"][step_index])
            self.metrics.log("train", self.step, merged)
            progress.update(1)
            progress.set_postfix(reward=f"{merged['train/reward']:.3f}", loss=f"{merged['train/loss']:.4f}")

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self, last_round: bool) -> bool:
        interval = self.config.run.save_interval
        if not interval:
            return False
        return last_round or self.step // interval > self.last_saved_step // interval

    def save_checkpoint(self) -> Path:
        """Everything a resume needs, after a round: trainer state, rollouts not trained yet, counters."""
        checkpoints = self.run_dir / "checkpoints"
        staging = ckpt.staging_dir(checkpoints, self.step)
        # Rollouts already asked for are part of the state: wait for them and store them.
        pending_metrics = {str(r): _gather(refs, self.timeout) for r, refs in self.pending_produce.items()}
        snapshot = ray.get(self.buffer.snapshot.remote(), timeout=self.timeout)
        snapshot = snapshot.with_payloads(lambda ref: ray.get(ref, timeout=self.timeout))
        _gather(self.named("save_checkpoint", "trainer", str(staging)), self.timeout)
        state = ckpt.RunState(
            step=self.step,
            next_round=self.next_round,
            policy_version=self.policy_version,
            dropped_stale_groups=self.dropped_stale_groups,
            next_eval_step=self.next_eval_step,
            eval_accuracy_before=self.eval_before or {},
            run_dir=str(self.run_dir),
            config=json.loads(json.dumps(dataclasses.asdict(self.config))),
            pending_rollout_metrics=pending_metrics,
        )
        final = ckpt.commit(staging, state, snapshot)
        ckpt.prune(checkpoints, self.config.run.save_limit)
        self.last_saved_step = self.step
        return final

    def _restore(self, checkpoint: Path) -> None:
        state = ckpt.load_state(checkpoint)
        steps = _gather(self.named("load_checkpoint", "trainer", str(checkpoint), state.policy_version), self.timeout)
        if any(step != state.step for step in steps):
            raise ckpt.CheckpointError(
                f"{checkpoint}: trainer steps {steps} disagree with the run state ({state.step})"
            )
        snapshot = ckpt.load_buffer(checkpoint).with_payloads(ray.put)
        ray.get(self.buffer.restore.remote(snapshot), timeout=self.timeout)
        for r, metrics in state.pending_rollout_metrics.items():
            self.pending_produce[int(r)] = [
                (f"producer {rank} (restored)", ray.put(m)) for rank, m in enumerate(metrics)
            ]
        self.step = self.last_saved_step = state.step
        self.next_round = state.next_round
        self.policy_version = state.policy_version
        self.dropped_stale_groups = state.dropped_stale_groups
        self.next_eval_step = state.next_eval_step
        self.eval_before = state.eval_accuracy_before
        logger.info("resumed from %s at step %d (round %d)", checkpoint, self.step, self.next_round)

    def shutdown(self, grace_s: float = 15.0) -> None:
        """Ask every actor to clean up (reward workers, sync groups) for at most ``grace_s``, then kill them all.

        An actor still busy (e.g. a trainer waiting for a producer that died) never gets to its
        shutdown call; the kill ends it regardless, so shutdown is bounded.
        """
        refs = [actor.shutdown.remote() for actor in self.producers + self.trainers]
        ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for actor in self.producers + self.trainers + [self.buffer]:
            try:
                ray.kill(actor)
            except Exception as error:  # already dead: nothing left to clean up
                logger.debug("kill of an actor failed: %s", error)


def make_run_dir(config: RLConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run.save_dir) / f"{config.run.project.replace(' ', '_')}-{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def _checkpoint_to_resume(config: RLConfig) -> Path | None:
    """The checkpoint ``-cp`` names, checked against this run's config (fields that must not change)."""
    if config.run.checkpoint_path is None:
        return None
    checkpoint = ckpt.resolve(config.run.checkpoint_path)
    saved = ckpt.load_state(checkpoint)
    mismatches = ckpt.resume_mismatches(saved.config, json.loads(json.dumps(dataclasses.asdict(config))))
    if mismatches:
        raise ckpt.CheckpointError(
            f"{checkpoint}: cannot resume with a different " + "; ".join(mismatches) + " (use the saved values)"
        )
    return checkpoint


def run_training(config: RLConfig, *, use_wandb: bool = True) -> RunSummary:
    """Train with ``config`` (validated here) and return what happened; Ray is started if needed."""
    from colossal_rl.data_sources import RowKeys, load_prompt_rows

    startup = PhaseRecorder()
    startup.add("python+flags", process_started_at(), time.time())
    started = time.perf_counter()
    with startup.record("inputs"):
        config.validate()
        rows_in_source = len(load_prompt_rows(config.data.train_path, RowKeys.for_config(config)))
        rounds = total_rounds(config, rows_in_source)  # an upper bound, checked before Ray starts
        resume_from = _checkpoint_to_resume(config)
        if config.run.eval_save_dir:
            prepare_eval_dir(
                Path(config.run.eval_save_dir), overwrite=config.run.overwrite_eval_dir or resume_from is not None
            )
        run_dir = make_run_dir(config)
        (run_dir / CONFIG_FILE).write_text(config_to_yaml(config), encoding="utf-8")  # --config takes it back
    with startup.record("metrics"):
        metrics = MetricsLogger(run_dir, config.run.project, dataclasses.asdict(config), use_wandb=use_wandb)
    logger.info(
        "run directory: %s (%d rounds, %d optimizer steps per round)", run_dir, rounds, config.optimizer_steps_per_round
    )
    started_ray = not ray.is_initialized()
    with startup.record("ray start"):
        init_ray(config)
    driver = None
    try:
        driver = Driver(config, run_dir, metrics, startup)
        driver.start(resume_from)
        if driver.train_rows != rows_in_source:  # over-long prompts were left out by the producers
            rounds = total_rounds(config, driver.train_rows)
            logger.info("%d training prompts fit -mpt: %d rounds", driver.train_rows, rounds)
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
        final_model_dir=None if driver.final_model_dir is None else str(driver.final_model_dir),
    )

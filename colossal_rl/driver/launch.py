"""Launching a run: the config resolved and its inputs checked, Ray started, the actors placed and started (a
:class:`~colossal_rl.driver.run.Driver`), the schedule's loop run, everything shut down — on one screen.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from colossal_rl.config import RLConfig
from colossal_rl.config_files import CONFIG_FILE, config_to_yaml
from colossal_rl.driver.placement import resolve_precision_for_cluster, resolve_sync_mode_for_cluster
from colossal_rl.driver.run import Driver
from colossal_rl.driver.save_and_resume import checkpoint_to_resume
from colossal_rl.driver.schedule_loop import ScheduleLoop
from colossal_rl.driver.schedules import make_scheduler, plan_schedule
from colossal_rl.local_ray import shutdown_local_ray
from colossal_rl.metrics import MetricsLogger
from colossal_rl.profiling import PhaseRecorder
from colossal_rl.run_outputs import prepare_eval_dir, write_failed_marker
from colossal_rl.startup import process_started_at

logger = logging.getLogger(__name__)


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


def init_ray(config: RLConfig) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "NCCL_CUMEM_ENABLE": "0",
    }  # fmt: skip  (the vLLM producers get 0 too, from producer_env: vLLM 0.32 no longer sets it itself)
    runtime_env = {"env_vars": env}
    if config.run.master_address:
        from colossal_rl.ray_address import ray_address

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


def make_run_dir(config: RLConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run.save_dir) / f"{config.run.project.replace(' ', '_')}-{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def resolve_auto_choices(config: RLConfig) -> RLConfig:
    """``--precision auto`` and ``--weight-sync-mode auto`` resolved for the devices of the Ray cluster (bf16 and
    ``shm`` on GPUs: docs/gpu.md), each logged; the run's ``config.yaml`` holds what was chosen."""
    nodes = ray.nodes()
    if config.parallel.precision == "auto":
        config = resolve_precision_for_cluster(config, nodes)
        logger.info("training precision %s (--precision auto)", config.parallel.precision)
    if config.run.weight_sync_mode == "auto":
        config = resolve_sync_mode_for_cluster(config, nodes)
        logger.info("weight sync mode %s (--weight-sync-mode auto)", config.run.weight_sync_mode)
    return config


def run_training(config: RLConfig, *, use_wandb: bool = True) -> RunSummary:
    """Train with ``config`` (resolved and validated here, with its inputs) and return what happened; Ray is
    started if needed."""
    from colossal_rl.config_resolve import resolve
    from colossal_rl.driver.trainer_backend import resolve_trainer_backend
    from colossal_rl.input_checks import check_inputs
    from colossal_rl.producer_env import ensure_producer_env

    startup = PhaseRecorder()
    startup.add("python+flags", process_started_at(), time.time())
    started = time.perf_counter()
    with startup.record("inputs"):
        config = resolve(config).validate()  # the derived fields: as the command line makes them
        rows_in_source = check_inputs(config).train_rows
        config = resolve_trainer_backend(config)  # may build the producers' environment (first use: minutes)
        plan = plan_schedule(config, rows_in_source)  # an upper bound, checked before Ray starts
        resume_from, config = checkpoint_to_resume(config)  # --precision auto: the checkpoint's
        if config.run.eval_save_dir:
            prepare_eval_dir(
                Path(config.run.eval_save_dir), overwrite=config.run.overwrite_eval_dir or resume_from is not None
            )
        run_dir = make_run_dir(config)
    if config.generation.backend == "vllm" or config.parallel.trainer_backend == "fsdp2":
        with startup.record("producer env"):  # built once (minutes), found again in milliseconds
            ensure_producer_env()
    started_ray = not ray.is_initialized()
    with startup.record("ray start"):
        init_ray(config)
    driver = metrics = None
    try:
        config = resolve_auto_choices(config)
        (run_dir / CONFIG_FILE).write_text(config_to_yaml(config), encoding="utf-8")  # --config takes it back
        with startup.record("metrics"):
            metrics = MetricsLogger(run_dir, config.run.project, dataclasses.asdict(config), use_wandb=use_wandb)
        logger.info("run directory: %s (%s)", run_dir, plan.describe(config))
        driver = Driver(config, run_dir, metrics, startup)
        driver.start(resume_from)
        scheduler, plan = make_scheduler(config, driver.train_rows)  # over-long prompts were left out
        if driver.train_rows != rows_in_source:
            logger.info("%d training prompts fit -mpt: %s", driver.train_rows, plan.describe(config))
        before, after = ScheduleLoop(driver, scheduler, plan.total_steps, driver.resumed_schedule).run()
    except BaseException as error:  # Ctrl-C included: the run directory tells it did not finish
        write_failed_marker(run_dir, error)
        raise
    finally:
        if driver is not None:
            driver.shutdown()
        if metrics is not None:
            metrics.close()
        if started_ray and not config.run.master_address:
            shutdown_local_ray()  # and every process of the local instance gone: nothing of the run outlives it
        elif started_ray:
            ray.shutdown()
    return RunSummary(
        run_dir=str(run_dir),
        steps=driver.step,
        rounds=plan.rounds,
        wall_time_s=time.perf_counter() - started,
        eval_accuracy_before=before,
        eval_accuracy_after=after,
        dropped_stale_groups=driver.progress.dropped_stale_groups,
        final_model_dir=None if driver.final_model_dir is None else str(driver.final_model_dir),
    )

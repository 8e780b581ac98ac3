"""Which schedule a run drives, and its plan: the config's ``--schedule`` made into a scheduler and its step count.

``rounds`` (the default, ColossalChat's): ``schedule/rounds.py``'s ``RoundScheduler``; ``stream``:
``schedule/streaming.py``'s ``StreamingScheduler``. Either is driven by the one loop, ``schedule_loop.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from colossal_rl.config import RLConfig
from colossal_rl.driver.actor_groups import chunks_in_flight
from colossal_rl.schedule.events import Scheduler
from colossal_rl.schedule.prompts import EpisodeSchedule, episode_rows
from colossal_rl.schedule.rounds import RoundScheduler, RoundSettings
from colossal_rl.schedule.streaming import StreamingScheduler, StreamingSettings


@dataclass(frozen=True)
class SchedulePlan:
    """How long a run is: optimizer steps (the LR schedule's end) and, for the round schedule, rounds."""

    total_steps: int
    rounds: int = 0

    def describe(self, config: RLConfig) -> str:
        if config.schedule.mode == "stream":
            return f"stream schedule: {self.total_steps} optimizer steps"
        return f"{self.rounds} rounds, {config.optimizer_steps_per_round} optimizer steps per round"


def plan_schedule(config: RLConfig, num_rows: int) -> SchedulePlan:
    """The plan of a run over ``num_rows`` training prompts (a clear error naming the file when too few)."""
    if config.schedule.mode == "stream":
        return SchedulePlan(stream_total_steps(config, num_rows))
    rounds = total_rounds(config, num_rows)
    return SchedulePlan(planned_steps(config, rounds), rounds)


def make_scheduler(config: RLConfig, num_rows: int) -> tuple[Scheduler, SchedulePlan]:
    """The run's scheduler over ``num_rows`` training prompts (ordered by ``episode_rows``), and its plan."""
    plan = plan_schedule(config, num_rows)
    rows = episode_rows(num_rows, config.data.seed)
    if config.schedule.mode == "stream":
        return StreamingScheduler(stream_settings(config, plan.total_steps), rows), plan
    return RoundScheduler(round_settings(config, plan.rounds), rows), plan


def round_settings(config: RLConfig, rounds: int) -> RoundSettings:
    return RoundSettings(
        num_producers=config.schedule.num_producers,
        prompts_per_producer=config.schedule.inference_batch_size,
        groups_per_step=config.parallel.dp_size * config.train.batch_size,
        n_behind=config.schedule.n_behind,
        total_rounds=rounds,
        ppo_epochs=config.train.ppo_epochs,
        max_steps=config.schedule.max_steps,
    )


def total_rounds(config: RLConfig, num_rows: int) -> int:
    from colossal_rl.data import DataError

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
    :func:`total_rounds` leaves the rounds uncapped and the round schedule stops once ``--max-steps`` are trained."""
    per_round = config.optimizer_steps_per_round
    steps = rounds * per_round
    if config.schedule.max_steps is not None:
        steps = min(steps, math.ceil(config.schedule.max_steps / per_round) * per_round)
    return steps


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

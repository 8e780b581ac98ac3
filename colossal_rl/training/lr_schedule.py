"""Learning-rate schedules: the factor on the configured learning rate at each optimizer step.

    constant   linear warm-up over ``warmup_steps``, then 1
    cosine     linear warm-up, then half a cosine from 1 down to ``min_lr_ratio`` at the run's last step
               (ColossalChat's and verl's schedule)

Pure functions of the step, registered by the name ``--lr-schedule`` takes. The run's length (its total
optimizer steps) is known to the driver once the producers have loaded the data; it hands it to the trainers
before the first step (:class:`ScheduleHorizon`), and a resumed run recomputes the same value from the same
config.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from colossal_rl.algorithms.registry import Registry

LR_SCHEDULES: Registry[Callable[..., float]] = Registry("learning-rate schedule")


def _warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / max(1, warmup_steps))


@LR_SCHEDULES.register("constant")
def constant_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up from 1/warmup_steps, then 1."""
    return _warmup(step, warmup_steps)


@LR_SCHEDULES.register("cosine")
def cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up, then cosine decay from 1 at step ``warmup_steps`` to ``min_lr_ratio`` at the last step
    (``total_steps - 1``), held there if the run goes on."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    decay_steps = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ScheduleHorizon:
    """The run's total optimizer steps, set by the driver before training (the schedule reads it lazily)."""

    def __init__(self, total_steps: int | None = None):
        self.total_steps = total_steps


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: str,
    *,
    warmup_steps: int,
    min_lr_ratio: float,
    horizon: ScheduleHorizon,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying ``LR_SCHEDULES[schedule]``; ``horizon`` is read at each step (set before the first)."""
    factor = LR_SCHEDULES.get(schedule)

    def lr_lambda(step: int) -> float:
        total = horizon.total_steps
        if total is None:
            # LambdaLR evaluates step 0 when built, before the driver sets the horizon; no schedule's step 0
            # depends on it, and constant never does. Any later step without it is a wiring bug.
            if step > 0 and schedule != "constant":
                raise RuntimeError(f"the {schedule} learning-rate schedule needs the run's total steps")
            total = 0
        return factor(step, warmup_steps=warmup_steps, total_steps=total, min_lr_ratio=min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

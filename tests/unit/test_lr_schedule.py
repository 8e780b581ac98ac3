"""Learning-rate schedules: warm-up, cosine decay to the minimum ratio at the run's last step, the horizon."""

from __future__ import annotations

import pytest
import torch

from colossal_rl.config import LR_SCHEDULE_NAMES
from colossal_rl.training.lr_schedule import (
    LR_SCHEDULES,
    ScheduleHorizon,
    constant_factor,
    cosine_factor,
    make_lr_scheduler,
)


def test_the_config_names_every_registered_schedule():
    assert tuple(LR_SCHEDULES.names()) == LR_SCHEDULE_NAMES


def test_constant_warms_up_linearly_then_holds():
    factors = [constant_factor(s, warmup_steps=4, total_steps=0, min_lr_ratio=0.0) for s in range(6)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert constant_factor(0, warmup_steps=0, total_steps=0, min_lr_ratio=0.0) == 1.0


def test_cosine_runs_from_one_after_warm_up_to_the_minimum_at_the_last_step():
    def factor(step):
        return cosine_factor(step, warmup_steps=2, total_steps=12, min_lr_ratio=0.1)

    assert [factor(0), factor(1)] == [0.5, 1.0]  # warm-up
    assert factor(2) == 1.0  # decay starts at the end of warm-up
    assert factor(5) == pytest.approx(0.1 + 0.9 * 0.75)  # a third of the 9 decay steps: (1 + cos(pi/3)) / 2
    assert factor(11) == pytest.approx(0.1)  # the run's last step
    assert factor(20) == pytest.approx(0.1)  # held if the run goes on
    decay = [factor(s) for s in range(2, 12)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))


def _lrs(schedule: str, steps: int, horizon: ScheduleHorizon) -> list[float]:
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.2)
    scheduler = make_lr_scheduler(optimizer, schedule, warmup_steps=1, min_lr_ratio=0.5, horizon=horizon)
    applied = []
    for _ in range(steps):
        applied.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return applied


def test_the_scheduler_applies_the_factor_to_the_learning_rate():
    # warm-up 1 step, 3 steps in all: decay starts at step 1 and reaches 0.5 x lr at step 2, then holds
    assert _lrs("cosine", 4, ScheduleHorizon(3)) == pytest.approx([0.2, 0.2, 0.1, 0.1])
    assert _lrs("constant", 3, ScheduleHorizon()) == pytest.approx([0.2, 0.2, 0.2])  # needs no horizon


def test_a_decaying_schedule_without_the_runs_length_fails_at_its_first_step():
    horizon = ScheduleHorizon()
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.2)
    scheduler = make_lr_scheduler(optimizer, "cosine", warmup_steps=0, min_lr_ratio=0.0, horizon=horizon)
    assert scheduler.get_last_lr() == [0.2]  # built before the driver sets it: step 0 needs none
    optimizer.step()
    with pytest.raises(RuntimeError, match="cosine learning-rate schedule needs the run's total steps"):
        scheduler.step()
    horizon.total_steps = 2
    scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(0.0)]

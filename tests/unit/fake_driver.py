"""What ``ScheduleLoop`` uses of a ``Driver``, on fake actor groups whose every call lands in ``log`` (tests only)."""

from __future__ import annotations

from types import SimpleNamespace

from fake_actor_groups import fake_sync

from colossal_rl.config import RLConfig
from colossal_rl.driver.run import Driver
from colossal_rl.driver.schedule_loop import ScheduleLoop
from colossal_rl.run_checkpoints.on_disk import RunProgress

PROGRESS = SimpleNamespace(update=lambda n: None, set_postfix=lambda **kw: None)
"""A stand-in for the loop's progress bar."""


class FakeDriver:
    """A started ``Driver``'s surface: fake trainers and producers (2), a formed sync, counters, logged metrics."""

    checkpoint_due = Driver.checkpoint_due

    def __init__(self, config: RLConfig, train_rows: int = 16):
        self.config, self.train_rows, self.timeout = config, train_rows, 1.0
        self.sync, self.log, ready = fake_sync(num_trainers=1, num_producers=2)
        self.sync.start(ready, retain=True)
        self.log.clear()
        self.trainers, self.producers = self.sync.trainers, self.sync.producers
        self.buffer, self.rollout_dir, self.run_dir = "buffer", None, None
        self.progress, self.last_saved_step = RunProgress(), 0
        self.resumed_chunks: dict = {}
        self.trace = SimpleNamespace(reported=True)
        self.logged: list = []
        self.metrics = SimpleNamespace(log=lambda kind, step, values: self.logged.append((kind, step, values)))
        self.evals: list = []

    @property
    def step(self) -> int:
        return self.progress.step

    def log_eval(self, results, step=None):
        self.evals.append(step)
        return {"math": 0.5}


def calls(driver: FakeDriver) -> list[tuple[str, str]]:
    """The calls made since the last look, (actor, method), and forget them."""
    made = [(actor, method) for actor, method, _ in driver.log]
    driver.log.clear()
    return made


def kinds(loop: ScheduleLoop) -> list[str]:
    return [item.kind for item in loop.waiting]

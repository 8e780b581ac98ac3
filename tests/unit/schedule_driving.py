"""A seeded random driver of a schedule (tests only): every interleaving of events a real driver could see."""

from __future__ import annotations

import random
from collections.abc import Callable

from colossal_rl.schedule.events import ChunkOrder, FinishedGroup, StepOrder


class RandomDriver:
    """Reports chunks (whole or, with ``partial``, a few groups at a time) and steps in a random order, orders
    due syncs after a random delay, and asks for every decision after every event."""

    def __init__(self, scheduler, seed: int, *, keep: float = 1.0, partial: bool = False, on_admit=None):
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.keep = keep
        self.partial = partial
        self.on_admit: Callable[[list[ChunkOrder]], None] = on_admit or (lambda orders: None)
        self.in_flight: dict[int, tuple[ChunkOrder, list[int]]] = {}  # chunk -> (order, rows not reported)
        self.admitted: list[ChunkOrder] = []
        self.steps: list[StepOrder] = []
        self.open_step: StepOrder | None = None

    def decide(self) -> None:
        due = self.scheduler.sync_due()
        if due is not None and self.rng.random() < 0.7:
            self.scheduler.sync_ordered(due)
        orders = self.scheduler.admit()
        self.on_admit(orders)
        for order in orders:
            self.in_flight[order.chunk_id] = (order, list(order.rows))
        self.admitted.extend(orders)
        if self.open_step is None:
            self.open_step = self.scheduler.next_step()
            if self.open_step is not None:
                self.steps.append(self.open_step)

    def run(self, max_events: int = 100_000) -> None:
        for _ in range(max_events):
            self.decide()
            if self.scheduler.finished and self.open_step is None:
                return
            events = (["chunk"] if self.in_flight else []) + (["step"] if self.open_step else [])
            if not events:
                due = self.scheduler.sync_due()
                assert due is not None, "deadlock: nothing in flight, no step, no sync due, not finished"
                self.scheduler.sync_ordered(due)
            elif self.rng.choice(events) == "chunk":
                self.report_chunk(self.rng.choice(sorted(self.in_flight)))
            else:
                self.scheduler.step_done()
                self.open_step = None
        raise AssertionError("the run did not finish")

    def report_chunk(self, chunk_id: int) -> None:
        order, rows = self.in_flight[chunk_id]
        count = self.rng.randint(1, len(rows)) if self.partial else len(rows)
        reported, rest = rows[:count], rows[count:]
        groups = [
            FinishedGroup(row, order.policy_version, tokens=10 + row, kept=self.rng.random() < self.keep)
            for row in reported
        ]
        if self.partial:
            self.scheduler.groups_done(chunk_id, groups)
        else:
            self.scheduler.chunk_done(chunk_id, groups)
        if rest:
            self.in_flight[chunk_id] = (order, rest)
        else:
            del self.in_flight[chunk_id]

    def trained_rows(self) -> list[tuple[int, int]]:
        """(episode, row) of every group trained, in step order."""
        return [(group.episode, group.row) for step in self.steps for group in step.groups]

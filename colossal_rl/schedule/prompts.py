"""The one order prompts are handed out in, for every schedule: each episode is one seeded permutation of the
training rows (:func:`episode_rows`).

The round schedule cuts an episode's order into rounds, each producer its own contiguous slice
(:class:`EpisodeSchedule`, a pure function of seed, round and producer: resume needs no sampler state). The stream
schedule hands the same order out chunk by chunk (:class:`EpochOrder`): a row at most once per episode, from a
cursor that only moves forward, or again only after it was given back (``requeue``: a chunk in flight at a
checkpoint, or lost with its producer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EpochRows = Callable[[int], Sequence[int]]
"""Episode index -> that episode's dataset rows in the order they are handed out (each row at most once)."""


def episode_rows(num_rows: int, seed: int) -> EpochRows:
    """Every row once per episode: episode ``e``'s order is ``torch.randperm(num_rows)`` seeded ``seed + e``. A new
    permutation each episode means no row is left out systematically where an episode does not use them all."""
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")

    def rows(episode: int) -> list[int]:
        import torch  # here, not at import: the driver and the simulator count rounds without torch

        return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + episode)).tolist()

    return rows


def round_slice(order: Sequence[int], round_in_episode: int, producer_rank: int, prompts_per_producer: int,
                num_producers: int) -> list[int]:  # fmt: skip
    """Producer ``producer_rank``'s rows of round ``round_in_episode``, cut from its episode's ``order``: rounds take
    consecutive ``num_producers * prompts_per_producer`` rows of it, each producer its own contiguous slice."""
    start = (round_in_episode * num_producers + producer_rank) * prompts_per_producer
    return list(order[start : start + prompts_per_producer])


@dataclass(frozen=True)
class EpisodeSchedule:
    """Which rows producer ``p`` generates in round ``r`` (:func:`episode_rows` cut by :func:`round_slice`).

    The last ``num_rows % rows_per_round`` rows of each episode's order are not used in that episode (reported by
    :meth:`unused_rows_per_episode`)."""

    num_rows: int
    num_producers: int
    prompts_per_producer: int
    seed: int

    @property
    def rows_per_round(self) -> int:
        return self.num_producers * self.prompts_per_producer

    @property
    def rounds_per_episode(self) -> int:
        return self.num_rows // self.rows_per_round

    def unused_rows_per_episode(self) -> int:
        return self.num_rows - self.rounds_per_episode * self.rows_per_round

    def rows_for(self, global_round: int, producer_rank: int) -> list[int]:
        episode, round_in_episode = divmod(global_round, self.rounds_per_episode)
        order = episode_rows(self.num_rows, self.seed)(episode)
        return round_slice(order, round_in_episode, producer_rank, self.prompts_per_producer, self.num_producers)


class EpochOrder:
    """Hands out prompt rows, one episode at a time, and takes back rows whose groups were lost."""

    def __init__(self, epoch_rows: EpochRows, num_episodes: int | None = None):
        self._epoch_rows = epoch_rows
        self.num_episodes = num_episodes
        """None: episodes without end (the schedule's step count ends the run)."""
        self.episode = 0
        self.cursor = 0
        """Rows of ``episode``'s order handed out so far."""
        self._order: list[int] | None = None
        self._requeued: deque[tuple[int, int]] = deque()  # (episode, row), handed out before the cursor's

    def _episode_order(self) -> list[int]:
        if self._order is None:
            order = [int(row) for row in self._epoch_rows(self.episode)]
            if len(set(order)) != len(order):
                raise ValueError(f"episode {self.episode}'s order names a row twice")
            if not order:
                raise ValueError(f"episode {self.episode}'s order is empty")
            self._order = order
        return self._order

    def _advance_episode(self) -> bool:
        """Move the cursor to the next episode's start when the current one is used up; False: no episode left."""
        while self.cursor >= len(self._episode_order()):
            if self.num_episodes is not None and self.episode + 1 >= self.num_episodes:
                return False
            self.episode, self.cursor, self._order = self.episode + 1, 0, None
        return True

    def exhausted(self) -> bool:
        return not self._requeued and not self._advance_episode()

    def take(self, max_rows: int) -> tuple[int, list[int]]:
        """(episode, up to ``max_rows`` rows of it): given-back rows first, else the order's next ones; no chunk
        mixes episodes, so a row appears at most once in it. ([] when every episode is used up.)"""
        if self._requeued:
            episode = self._requeued[0][0]
            rows: list[int] = []
            while self._requeued and self._requeued[0][0] == episode and len(rows) < max_rows:
                rows.append(self._requeued.popleft()[1])
            return episode, rows
        if not self._advance_episode():
            return self.episode, []
        order = self._episode_order()
        rows = order[self.cursor : self.cursor + max_rows]
        self.cursor += len(rows)
        return self.episode, rows

    def requeue(self, episode: int, rows: Sequence[int]) -> None:
        """Give back rows handed out earlier and never trained: they are handed out next."""
        self._requeued.extend((episode, int(row)) for row in rows)

    def requeued(self) -> list[tuple[int, int]]:
        return list(self._requeued)

    def snapshot(self) -> dict:
        return {"episode": self.episode, "cursor": self.cursor, "requeued": [list(p) for p in self._requeued]}

    def restore(self, state: dict) -> None:
        self.episode, self.cursor, self._order = int(state["episode"]), int(state["cursor"]), None
        self._requeued = deque((int(episode), int(row)) for episode, row in state["requeued"])

"""The shared rollout buffer: which groups each data-parallel trainer rank trains on, round by round.

Producers register their batches (a handle to the payload in Ray's object store, never the
payload itself) per round. When every producer has delivered round ``r``, the round's groups
join a pool in (round, producer, group) order; the pool is cut into whole optimizer steps of
``dp_size * groups_per_step`` groups and dealt round-robin to the ranks, so every rank runs the
same number of steps. Groups left over (possible when filtering drops groups) wait for the
next round; groups whose policy version is more than ``n_behind`` versions older than the
trainers' are dropped and counted. Plain class: the Ray shell lives in ``colossal_rl/actors.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GroupRef:
    """One prompt group: the payload handle of its batch and its index inside that batch."""

    payload: Any
    group_index: int
    policy_version: int
    round_index: int


@dataclass(frozen=True)
class Assignment:
    """What one trainer rank trains on for one round."""

    round_index: int
    num_steps: int
    groups: list[GroupRef]  # num_steps * groups_per_step groups, step-major
    dropped_stale_groups: int
    carried_over_groups: int


@dataclass
class _RoundState:
    deliveries: dict[int, tuple[Any, int, int]] = field(default_factory=dict)  # producer -> (payload, groups, version)


class RoundBuffer:
    def __init__(self, *, num_producers: int, dp_size: int, groups_per_step: int, n_behind: int):
        self.num_producers = num_producers
        self.dp_size = dp_size
        self.groups_per_step = groups_per_step
        self.n_behind = n_behind
        self._rounds: dict[int, _RoundState] = {}
        self._pool: list[GroupRef] = []
        self._assignments: dict[int, dict[int, Assignment]] = {}  # round -> rank -> assignment not yet taken
        self.dropped_stale_groups = 0
        self._last_dealt_round = -1

    def put(self, round_index: int, producer_rank: int, payload: Any, num_groups: int, policy_version: int) -> None:
        if round_index <= self._last_dealt_round:
            raise ValueError(f"round {round_index} was already dealt out; producer {producer_rank} delivered late")
        state = self._rounds.setdefault(round_index, _RoundState())
        if producer_rank in state.deliveries:
            raise ValueError(f"producer {producer_rank} delivered round {round_index} twice")
        state.deliveries[producer_rank] = (payload, num_groups, policy_version)

    def is_complete(self, round_index: int) -> bool:
        if round_index in self._assignments:
            return True
        state = self._rounds.get(round_index)
        return state is not None and len(state.deliveries) == self.num_producers

    def take(self, round_index: int, dp_rank: int, trainer_version: int) -> Assignment:
        """This rank's share of ``round_index`` (the round must be complete)."""
        if round_index not in self._assignments:
            if round_index != self._last_dealt_round + 1:
                raise ValueError(f"round {round_index} asked for before round {self._last_dealt_round + 1}")
            if not self.is_complete(round_index):
                raise RuntimeError(f"round {round_index} is not complete")
            self._deal(round_index, trainer_version)
        pending = self._assignments[round_index]
        if dp_rank not in pending:
            raise ValueError(f"rank {dp_rank} already took round {round_index}")
        assignment = pending.pop(dp_rank)
        if not pending:
            del self._assignments[round_index]
        return assignment

    def _deal(self, round_index: int, trainer_version: int) -> None:
        state = self._rounds.pop(round_index)
        self._last_dealt_round = round_index
        carried = len(self._pool)
        for producer in sorted(state.deliveries):
            payload, num_groups, version = state.deliveries[producer]
            self._pool.extend(GroupRef(payload, g, version, round_index) for g in range(num_groups))
        fresh = [g for g in self._pool if trainer_version - g.policy_version <= self.n_behind]
        dropped = len(self._pool) - len(fresh)
        self.dropped_stale_groups += dropped
        per_step = self.dp_size * self.groups_per_step
        num_steps = len(fresh) // per_step
        dealt, self._pool = fresh[: num_steps * per_step], fresh[num_steps * per_step :]
        self._assignments[round_index] = {
            rank: Assignment(
                round_index=round_index,
                num_steps=num_steps,
                groups=self._rank_share(dealt, rank),
                dropped_stale_groups=dropped,
                carried_over_groups=carried,
            )
            for rank in range(self.dp_size)
        }

    def _rank_share(self, dealt: list[GroupRef], rank: int) -> list[GroupRef]:
        """Step-major: step s of rank d trains groups [s*per_step + d*gps, ... + gps)."""
        gps, per_step = self.groups_per_step, self.dp_size * self.groups_per_step
        share = []
        for step_start in range(0, len(dealt), per_step):
            share.extend(dealt[step_start + rank * gps : step_start + (rank + 1) * gps])
        return share

    def pooled_groups(self) -> int:
        return len(self._pool)

"""The shared rollout buffer: which groups each data-parallel trainer rank trains on, round by round.

Producers register their batches (a handle to the payload in Ray's object store, never the
payload itself) per round. When every producer has delivered round ``r``, the round's groups
join a pool in (round, producer, group) order; the pool is cut into whole optimizer steps of
``dp_size * groups_per_step`` groups and dealt round-robin to the ranks, so every rank runs the
same number of steps. Within a step, groups whose token costs the producers reported are dealt so that every
rank computes about as many tokens (``token_balance.py``); without costs, rank ``d`` takes the ``d``-th
contiguous slice. Every data-parallel rank may have several takers (its tensor- and
pipeline-parallel ranks, ``takers_per_rank``): each of them gets the same assignment. Groups left over (possible when filtering drops groups) wait for the
next round; groups whose policy version is more than ``n_behind`` versions older than the
trainers' are dropped and counted. Plain class: the Ray shell lives in ``colossal_rl/driver/actors.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colossal_rl.comm.token_balance import step_shares


@dataclass(frozen=True)
class GroupRef:
    """One prompt group: the payload handle of its batch and its index inside that batch."""

    payload: Any
    group_index: int
    policy_version: int
    round_index: int
    tokens: int = 0
    """Tokens the trainer's forward computes for this group (0: not reported)."""


@dataclass(frozen=True)
class Assignment:
    """What one trainer rank trains on for one round."""

    round_index: int
    num_steps: int
    groups: list[GroupRef]  # num_steps * groups_per_step groups, step-major
    dropped_stale_groups: int
    carried_over_groups: int


@dataclass(frozen=True)
class BufferSnapshot:
    """Everything the buffer holds between rounds, with each distinct payload listed once.

    ``rounds``: round -> producer -> (payload index, num groups, policy version, group token costs), rounds
    delivered but not dealt yet; ``pool``: (payload index, group index, policy version, round, tokens) of
    carried-over groups. Snapshots written before token costs existed (3- and 4-tuples) restore with costs 0.
    A checkpoint stores the payloads themselves, so a resumed run trains on exactly the rollouts the
    interrupted one had already generated.
    """

    payloads: list[Any]
    rounds: dict[int, dict[int, tuple]]
    pool: list[tuple]
    last_dealt_round: int
    dropped_stale_groups: int

    def with_payloads(self, convert: Callable[[Any], Any]) -> BufferSnapshot:
        """The same snapshot with every payload replaced by ``convert(payload)`` (e.g. fetch or re-put)."""
        return BufferSnapshot(
            payloads=[convert(payload) for payload in self.payloads],
            rounds=self.rounds,
            pool=self.pool,
            last_dealt_round=self.last_dealt_round,
            dropped_stale_groups=self.dropped_stale_groups,
        )


@dataclass
class _RoundState:
    # producer -> (payload, groups, version, per-group token costs or ())
    deliveries: dict[int, tuple[Any, int, int, tuple[int, ...]]] = field(default_factory=dict)


class RoundBuffer:
    def __init__(
        self, *, num_producers: int, dp_size: int, groups_per_step: int, n_behind: int, takers_per_rank: int = 1
    ):
        if takers_per_rank < 1:
            raise ValueError(f"takers_per_rank must be >= 1, got {takers_per_rank}")
        self.num_producers = num_producers
        self.dp_size = dp_size
        self.takers_per_rank = takers_per_rank
        """Trainer ranks sharing one data-parallel rank (tp_size * pp_size): all train on the same groups."""
        self.groups_per_step = groups_per_step
        self.n_behind = n_behind
        self._rounds: dict[int, _RoundState] = {}
        self._pool: list[GroupRef] = []
        self._assignments: dict[int, dict[int, Assignment]] = {}  # round -> rank -> assignment not yet taken
        self._takes_left: dict[int, dict[int, int]] = {}  # round -> rank -> takers that have not taken it yet
        self.dropped_stale_groups = 0
        self._last_dealt_round = -1

    def put(
        self,
        round_index: int,
        producer_rank: int,
        payload: Any,
        num_groups: int,
        policy_version: int,
        group_tokens: tuple[int, ...] = (),
    ) -> None:
        """Register a producer's batch of ``num_groups`` groups; ``group_tokens``: each group's token cost."""
        if group_tokens and len(group_tokens) != num_groups:
            raise ValueError(f"producer {producer_rank}: {len(group_tokens)} token costs for {num_groups} groups")
        if round_index <= self._last_dealt_round:
            raise ValueError(f"round {round_index} was already dealt out; producer {producer_rank} delivered late")
        state = self._rounds.setdefault(round_index, _RoundState())
        if producer_rank in state.deliveries:
            raise ValueError(f"producer {producer_rank} delivered round {round_index} twice")
        state.deliveries[producer_rank] = (payload, num_groups, policy_version, tuple(group_tokens))

    def has_delivery(self, round_index: int, producer_rank: int) -> bool:
        """Whether ``producer_rank``'s share of ``round_index`` arrived already (a dealt round's shares all did)."""
        if round_index <= self._last_dealt_round:
            return True
        state = self._rounds.get(round_index)
        return state is not None and producer_rank in state.deliveries

    def is_complete(self, round_index: int) -> bool:
        if round_index in self._assignments:
            return True
        state = self._rounds.get(round_index)
        return state is not None and len(state.deliveries) == self.num_producers

    def take(self, round_index: int, dp_rank: int, trainer_policy_version: int) -> Assignment:
        """This rank's share of ``round_index`` (the round must be complete)."""
        if round_index not in self._assignments:
            if round_index != self._last_dealt_round + 1:
                raise ValueError(f"round {round_index} asked for before round {self._last_dealt_round + 1}")
            if not self.is_complete(round_index):
                raise RuntimeError(f"round {round_index} is not complete")
            self._deal(round_index, trainer_policy_version)
        pending, takes_left = self._assignments[round_index], self._takes_left[round_index]
        if dp_rank not in pending:
            raise ValueError(
                f"rank {dp_rank} already took round {round_index} ({self.takers_per_rank} taker(s) per rank)"
            )
        assignment = pending[dp_rank]
        takes_left[dp_rank] -= 1
        if takes_left[dp_rank] == 0:
            del pending[dp_rank], takes_left[dp_rank]
        if not pending:
            del self._assignments[round_index], self._takes_left[round_index]
        return assignment

    def _deal(self, round_index: int, trainer_policy_version: int) -> None:
        state = self._rounds.pop(round_index)
        self._last_dealt_round = round_index
        carried = len(self._pool)
        for producer in sorted(state.deliveries):
            payload, num_groups, version, tokens = state.deliveries[producer]
            self._pool.extend(
                GroupRef(payload, g, version, round_index, tokens[g] if tokens else 0) for g in range(num_groups)
            )
        fresh = [g for g in self._pool if trainer_policy_version - g.policy_version <= self.n_behind]
        dropped = len(self._pool) - len(fresh)
        self.dropped_stale_groups += dropped
        per_step = self.dp_size * self.groups_per_step
        num_steps = len(fresh) // per_step
        dealt, self._pool = fresh[: num_steps * per_step], fresh[num_steps * per_step :]
        shares = self._rank_shares(dealt)
        self._assignments[round_index] = {
            rank: Assignment(
                round_index=round_index,
                num_steps=num_steps,
                groups=shares[rank],
                dropped_stale_groups=dropped,
                carried_over_groups=carried,
            )
            for rank in range(self.dp_size)
        }
        self._takes_left[round_index] = dict.fromkeys(range(self.dp_size), self.takers_per_rank)

    def _rank_shares(self, dealt: list[GroupRef]) -> list[list[GroupRef]]:
        """Step-major shares: each step's ``dp_size * gps`` groups split into ``gps`` per rank
        (``token_balance.step_shares``)."""
        per_step = self.dp_size * self.groups_per_step
        shares: list[list[GroupRef]] = [[] for _ in range(self.dp_size)]
        for step_start in range(0, len(dealt), per_step):
            step = dealt[step_start : step_start + per_step]
            for rank, part in enumerate(step_shares([group.tokens for group in step], self.dp_size)):
                shares[rank].extend(step[i] for i in part)
        return shares

    def pooled_groups(self) -> int:
        return len(self._pool)

    def snapshot(self) -> BufferSnapshot:
        """State between rounds (every dealt round fully taken); payload handles are listed once each."""
        if self._assignments:
            raise RuntimeError(f"rounds {sorted(self._assignments)} were dealt but not taken by every rank")
        payloads: list[Any] = []
        index_of: dict[int, int] = {}

        def index(payload: Any) -> int:
            if id(payload) not in index_of:
                index_of[id(payload)] = len(payloads)
                payloads.append(payload)
            return index_of[id(payload)]

        rounds = {
            r: {
                p: (index(payload), groups, version, tokens)
                for p, (payload, groups, version, tokens) in state.deliveries.items()
            }
            for r, state in self._rounds.items()
        }
        pool = [(index(g.payload), g.group_index, g.policy_version, g.round_index, g.tokens) for g in self._pool]
        return BufferSnapshot(payloads, rounds, pool, self._last_dealt_round, self.dropped_stale_groups)

    def restore(self, snapshot: BufferSnapshot) -> None:
        """Put back what :meth:`snapshot` saw (into an empty buffer)."""
        if self._rounds or self._pool or self._assignments or self._last_dealt_round != -1:
            raise RuntimeError("restore needs a fresh buffer")
        payloads = snapshot.payloads
        for r, deliveries in snapshot.rounds.items():
            state = self._rounds.setdefault(r, _RoundState())
            for p, (i, groups, version, *tokens) in deliveries.items():
                state.deliveries[p] = (payloads[i], groups, version, tuple(tokens[0]) if tokens else ())
        self._pool = [GroupRef(payloads[entry[0]], *entry[1:]) for entry in snapshot.pool]
        self._last_dealt_round = snapshot.last_dealt_round
        self.dropped_stale_groups = snapshot.dropped_stale_groups

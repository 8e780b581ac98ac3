"""Tensor- and pipeline-parallel ranks share a data-parallel rank: each of them takes the same groups."""

from __future__ import annotations

import pytest

from colossal_rl.comm.buffer import RoundBuffer


def _groups(assignment) -> list[tuple[str, int]]:
    return [(g.payload, g.group_index) for g in assignment.groups]


def test_every_taker_of_a_rank_gets_the_same_assignment_once():
    # -t 4 -tp 2: dp_size 2, two takers per data-parallel rank.
    buffer = RoundBuffer(num_producers=2, dp_size=2, groups_per_step=2, n_behind=1, takers_per_rank=2)
    buffer.put(0, 0, "p0", 4, 0)
    buffer.put(0, 1, "p1", 4, 0)
    rank0 = [buffer.take(0, 0, 0), buffer.take(0, 0, 0)]
    with pytest.raises(ValueError, match="already took round 0"):
        buffer.take(0, 0, 0)  # a third taker of rank 0
    rank1 = [buffer.take(0, 1, 0), buffer.take(0, 1, 0)]
    assert _groups(rank0[0]) == _groups(rank0[1])
    assert _groups(rank1[0]) == _groups(rank1[1])
    dealt = sorted(_groups(rank0[0]) + _groups(rank1[0]))
    assert dealt == sorted((p, g) for p in ("p0", "p1") for g in range(4))
    buffer.snapshot()  # the round counts as fully taken


def test_a_round_stays_dealt_until_every_taker_took_it():
    buffer = RoundBuffer(num_producers=1, dp_size=1, groups_per_step=1, n_behind=1, takers_per_rank=2)
    buffer.put(0, 0, "p0", 2, 0)
    taken = buffer.take(0, 0, 0)
    with pytest.raises(RuntimeError, match="not taken by every rank"):
        buffer.snapshot()
    buffer.put(1, 0, "p1", 2, 0)  # the next round may arrive meanwhile
    assert _groups(buffer.take(0, 0, 0)) == _groups(taken) == [("p0", 0), ("p0", 1)]
    assert buffer.snapshot().last_dealt_round == 0


def test_takers_per_rank_must_be_positive():
    with pytest.raises(ValueError, match="takers_per_rank"):
        RoundBuffer(num_producers=1, dp_size=1, groups_per_step=1, n_behind=1, takers_per_rank=0)

"""One prompt order for every schedule (``schedule/prompts.py``): rounds cut each episode's permutation into
producer slices, streams hand the same permutation out chunk by chunk, and the round order is the one runs have
always used (a changed order would change every run's curve)."""

from __future__ import annotations

from colossal_rl.schedule.prompts import EpisodeSchedule, EpochOrder, episode_rows
from colossal_rl.schedule.rounds import RoundScheduler, RoundSettings

ROUNDS_BEFORE = [[10, 15, 1, 9, 11], [20, 7, 14, 21, 12], [5, 18, 17, 0, 16], [3, 6, 8, 2, 4],
                 [8, 21, 5, 12, 17], [9, 20, 10, 7, 22], [5, 15, 2, 4, 8], [1, 17, 3, 10, 7]]  # fmt: skip
"""``EpisodeSchedule(23, 2, 5, seed=7).rows_for(r, p)`` for r in (0, 1, 2, 5), p in (0, 1), as computed before the
orders were made one (``data.EpisodeSchedule``, torch.randperm seeded ``seed + episode``)."""


def test_the_round_order_is_the_one_runs_always_had():
    plan = EpisodeSchedule(num_rows=23, num_producers=2, prompts_per_producer=5, seed=7)
    assert [plan.rows_for(r, p) for r in (0, 1, 2, 5) for p in (0, 1)] == ROUNDS_BEFORE


def test_streams_hand_out_the_rounds_order_chunk_by_chunk():
    plan = EpisodeSchedule(num_rows=23, num_producers=2, prompts_per_producer=5, seed=7)
    order = EpochOrder(episode_rows(23, 7), num_episodes=3)
    for episode in range(3):
        rounds = [plan.rows_for(episode * plan.rounds_per_episode + r, p) for r in range(2) for p in range(2)]
        streamed = []
        while len(streamed) < 4:  # two rounds of two producers
            taken_episode, rows = order.take(5)
            assert taken_episode == episode
            streamed.append(rows)
        assert streamed == rounds  # the same rows, in the same order
        order.take(3)  # the 3 rows rounds leave unused this episode


def test_the_round_scheduler_deals_the_production_order():
    settings = RoundSettings(num_producers=2, prompts_per_producer=5, groups_per_step=5, n_behind=0, total_rounds=4)
    scheduler = RoundScheduler(settings, episode_rows(23, 7))
    plan = EpisodeSchedule(num_rows=23, num_producers=2, prompts_per_producer=5, seed=7)
    for round_index in range(4):
        for rank in range(2):
            episode, rows = scheduler.rows_for(round_index, rank)
            assert (episode, list(rows)) == (round_index // 2, plan.rows_for(round_index, rank))


def test_each_episode_is_a_new_permutation_of_every_row():
    rows = episode_rows(23, 7)
    assert sorted(rows(0)) == sorted(rows(1)) == list(range(23))
    assert rows(0) != rows(1) and rows(0) == episode_rows(23, 7)(0) != episode_rows(23, 8)(0)

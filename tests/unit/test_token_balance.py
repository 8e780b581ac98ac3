"""Dealing a step's groups to data-parallel ranks by token cost: the partition, the producers' costs, and the
schedule loop using them (every step of an order dealt on its own: equal group counts, balanced tokens)."""

import itertools
import random

import pytest
import torch
from fake_driver import PROGRESS, FakeDriver

from colossal_rl.batch import RolloutBatch
from colossal_rl.comm.token_balance import balanced_parts, group_token_costs, step_shares
from colossal_rl.config import GenerationConfig, ParallelConfig, RLConfig, RunConfig, ScheduleConfig, TrainConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.driver.actor_messages import ChunkResult
from colossal_rl.driver.schedule_loop import ScheduleLoop
from colossal_rl.driver.schedules import make_scheduler
from colossal_rl.schedule.events import FinishedGroup


def loads(costs, parts):
    return [sum(costs[i] for i in part) for part in parts]


def best_max_load(costs, num_parts):
    """Brute force: the smallest possible maximum load over equal-size partitions (small inputs only)."""
    size = len(costs) // num_parts
    best = float("inf")

    def search(remaining, current_max):
        nonlocal best
        if not remaining:
            best = min(best, current_max)
            return
        first, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, size - 1):
            part = (first, *others)
            left = [i for i in rest if i not in others]
            search(left, max(current_max, sum(costs[i] for i in part)))

    search(list(range(len(costs))), 0)
    return best


def test_parts_have_equal_sizes_cover_every_index_once_and_list_them_in_order():
    costs = [5, 90, 3, 3, 40, 41, 7, 60, 2, 11, 12, 30]
    parts = balanced_parts(costs, 3)
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    assert all(p == sorted(p) for p in parts)


def test_long_groups_are_spread_instead_of_dealt_side_by_side():
    costs = [100, 100, 1, 1]  # dealt by position, rank 0 would compute 200 tokens and rank 1 two
    assert loads(costs, balanced_parts(costs, 2)) == [101, 101]


@pytest.mark.parametrize("seed", range(20))
def test_max_load_is_within_a_third_of_the_optimum(seed):
    rng = random.Random(seed)
    num_parts = rng.choice([2, 3])
    costs = [rng.randint(20, 400) for _ in range(num_parts * rng.choice([2, 3]))]
    got = max(loads(costs, balanced_parts(costs, num_parts)))
    assert got <= best_max_load(costs, num_parts) * 4 / 3


def test_uneven_count_is_refused():
    with pytest.raises(ValueError, match="5 items cannot be split into 2 parts"):
        balanced_parts([1, 2, 3, 4, 5], 2)


def make_batch(prompt_lengths, response_lengths, group_size):
    n = len(response_lengths)
    prompt_mask = torch.zeros((n, 6), dtype=torch.long)
    response_mask = torch.zeros((n, 5), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        prompt_mask[i, 6 - p :] = 1
        response_mask[i, :r] = 1
    return RolloutBatch(
        prompt_ids=torch.ones((n, 6), dtype=torch.long),
        prompt_mask=prompt_mask,
        response_ids=torch.ones((n, 5), dtype=torch.long),
        response_mask=response_mask,
        behaviour_logprobs=torch.zeros((n, 5)),
        rewards=torch.zeros(n),
        answer_correct=torch.zeros(n),
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.zeros(n),
        group_size=group_size,
        policy_version=0,
    )


def test_group_costs_count_the_prompt_once_per_group_when_it_is_shared():
    batch = make_batch([4, 4, 2, 2], [5, 1, 3, 3], group_size=2)
    assert group_token_costs(batch, shared_prompt=False) == [4 + 5 + 4 + 1, 2 + 3 + 2 + 3]
    assert group_token_costs(batch, shared_prompt=True) == [4 + 5 + 1, 2 + 3 + 3]


def round_loop_on_two_ranks() -> tuple[ScheduleLoop, FakeDriver]:
    """The schedule loop under the round schedule on fake actors (no Ray): 2 data-parallel ranks, 2 producers of 4
    prompts a round, steps of 2 groups per rank."""
    config = resolve(
        RLConfig(
            generation=GenerationConfig(microbatch_size=2),
            train=TrainConfig(batch_size=2, minibatch_size=2),
            parallel=ParallelConfig(num_trainers=2),
            schedule=ScheduleConfig(num_producers=2, inference_batch_size=4, n_behind=0),
            run=RunConfig(eval_interval=0, save_interval=0, log_rollout_interval=0, final_export=False),
        )
    )
    assert config.parallel.dp_size == 2
    driver = FakeDriver(config, train_rows=16)
    scheduler, plan = make_scheduler(config, driver.train_rows)
    return ScheduleLoop(driver, scheduler, plan.total_steps), driver


def test_the_schedule_loop_deals_each_step_of_a_round_balanced_with_equal_group_counts():
    """A round of two steps over 2 data-parallel ranks (2 producers of 4 prompts, steps of 2 x 2 groups): each step
    is dealt from its own groups, 2 to each rank, by the token costs the producers reported."""
    loop, driver = round_loop_on_two_ranks()
    loop._decide()
    costs = {0: (100, 90, 10, 5), 1: (7, 7, 7, 7)}  # by position, step 0's rank 0 would compute 190 tokens, rank 1 15
    for item in [item for item in loop.waiting if item.kind == "chunk"]:
        order = item.subject
        groups = tuple(FinishedGroup(row, 0, cost) for row, cost in zip(order.rows, costs[order.chunk_id], strict=True))
        loop._forget(item)
        payload = f"payload {order.chunk_id}"
        loop._answer(
            item, [ChunkResult(order.chunk_id, order.producer_rank, payload, order.rows, groups, {})], PROGRESS
        )
    driver.log.clear()
    loop._decide()
    ((first_step, _, shares, _),) = [args for actor, method, args in driver.log if actor == "trainer 0"]
    assert [method for _, method, _ in driver.log] == ["train_steps"] * len(driver.trainers)
    assert (first_step, len(shares)) == (0, 2)  # one order of the round's two steps
    assert all([len(share) for share in step] == [2, 2] for step in shares)
    step0, step1 = ([[(ref.payload, ref.group_index) for ref in share] for share in step] for step in shares)
    assert sorted(step0[0] + step0[1]) == [("payload 0", g) for g in range(4)]
    assert [sum(ref.tokens for ref in share) for share in shares[0]] == [105, 100]
    assert sorted(step1[0] + step1[1]) == [("payload 1", g) for g in range(4)]  # step 1 from step 1's groups


def test_step_shares_balance_known_costs_and_slice_otherwise():
    """The dealing of every step of either schedule (``driver/schedule_loop.py``)."""
    assert step_shares([100, 1, 1, 100], 2) == balanced_parts([100, 1, 1, 100], 2)
    shares = step_shares([100, 100, 1, 1], 2)
    assert sorted(sum([100, 100, 1, 1][i] for i in part) for part in shares) == [101, 101]
    assert step_shares([0, 5, 7, 9], 2) == [[0, 1], [2, 3]]  # a cost unknown: contiguous slices
    assert step_shares([3, 4, 5], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="3 groups cannot be dealt to 2 ranks equally"):
        step_shares([1, 2, 3], 2)

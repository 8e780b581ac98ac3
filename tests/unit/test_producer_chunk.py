"""Producer.produce_chunk (the producer call of both schedules) on the embedded model, no Ray: the kept groups'
batch and a fact per row — the version generation started with, the token cost, kept or filtered by DAPO's dynamic
sampling — with sampling seeded by the chunk's seed index; with partial rollouts a weight load lands while the
chunk's rows decode, and the batch carries which version sampled each token."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from colossal_rl.batch import RolloutBatch
from colossal_rl.comm.token_balance import group_token_costs
from colossal_rl.config import GenerationConfig, RLConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.presets import algorithm_preset
from colossal_rl.reward.records import OK, RewardRecord
from colossal_rl.rollout.producer import Producer
from colossal_rl.schedule.prompts import EpisodeSchedule

GROUP_SIZE = 4


class EveryOtherGroupAgrees:
    """Group g of a call (group-major samples): all correct when g is even (dynamic sampling drops it), half
    correct when odd (kept)."""

    def score_batch(self, responses: list[str], rows: list[dict]) -> list[RewardRecord]:
        records = []
        for index in range(len(responses)):
            group, sample = divmod(index, GROUP_SIZE)
            correct = group % 2 == 0 or sample % 2 == 0
            records.append(RewardRecord(float(correct), True, correct, OK))
        return records


@pytest.fixture(scope="module")
def producer() -> Producer:
    config = RLConfig(
        generation=GenerationConfig(num_generations=GROUP_SIZE, microbatch_size=4, max_new_tokens=8),
        # every tiny-model response hits max_new_tokens: keep truncated ones, or no group would be kept
        algorithm=dataclasses.replace(
            algorithm_preset("DAPO", kl_coeff=0.0, max_new_tokens=8, n_behind=1), filter_truncated_response=False
        ),
    )
    return Producer(0, resolve(config), reward_scorer=EveryOtherGroupAgrees())


def test_a_chunk_reports_every_row_and_returns_the_kept_groups(producer):
    producer.policy_version = 3  # as after three syncs
    rows = [5, 2, 7, 0]
    chunk = producer.produce_chunk(chunk_id=11, rows=rows)
    assert [group.row for group in chunk.groups] == rows
    assert [group.kept for group in chunk.groups] == [False, True, False, True]
    assert {group.policy_version for group in chunk.groups} == {3}
    batch = chunk.batch
    assert isinstance(batch, RolloutBatch)
    assert batch.data_indices == [2, 0]  # the kept rows, in the chunk's order
    assert batch.policy_version == 3 and batch.group_size == GROUP_SIZE
    assert batch.advantages is not None
    shared = producer.config.sequence_layout == "shared_prompt"
    costs = group_token_costs(batch, shared_prompt=shared)
    assert [group.tokens for group in chunk.groups if group.kept] == costs
    assert all(cost > 0 for cost in costs)
    assert [group.tokens for group in chunk.groups if not group.kept] == [0, 0]
    assert chunk.metrics["rollout/groups_filtered"] == 2.0
    assert "time/produce_s" in chunk.metrics


def test_a_chunk_whose_groups_are_all_filtered_has_no_batch(producer):
    chunk = producer.produce_chunk(chunk_id=12, rows=[4, 6])  # group 0 agrees, group 1 does not
    assert [group.kept for group in chunk.groups] == [False, True]
    chunk = producer.produce_chunk(chunk_id=13, rows=[4])
    assert chunk.batch is None
    assert [(group.row, group.kept, group.tokens) for group in chunk.groups] == [(4, False, 0)]


def test_a_chunk_samples_by_its_seed_index_alone_as_a_rounds_share_does(producer):
    """The round schedule orders round r's share of producer p as chunk ``r * num_producers + p`` seeded with
    ``seed_index=r`` (what a round's sampling was always seeded with): the samples depend on the seed index alone —
    not on the chunk id, nor on the RNG state before the call — and without one the chunk id seeds them."""
    num_producers, round_index = 2, 3
    plan = EpisodeSchedule(len(producer.train_data), num_producers, 2, producer.config.data.seed)
    rows = plan.rows_for(round_index, producer.rank)
    keep_all = dataclasses.replace(producer.config.algorithm, filter_range=None)
    original = producer.config
    producer.config = dataclasses.replace(original, algorithm=keep_all)

    def sampled(chunk_id: int, seed_index: int | None, rng_state: int) -> torch.Tensor:
        torch.manual_seed(rng_state)  # whatever ran before the call
        chunk = producer.produce_chunk(chunk_id, rows, seed_index=seed_index)
        assert chunk.batch.data_indices == rows
        return chunk.batch.response_ids

    try:
        share_chunk = round_index * num_producers + producer.rank
        as_round = sampled(share_chunk, seed_index=round_index, rng_state=0)
        again = sampled(share_chunk, seed_index=round_index, rng_state=1)
        other_chunk_same_seed = sampled(99, seed_index=round_index, rng_state=2)
        chunk_id_seeds = sampled(round_index, seed_index=None, rng_state=3)
        other_seed = sampled(share_chunk, seed_index=None, rng_state=4)  # seeded with the chunk id, 6
    finally:
        producer.config = original
    assert torch.equal(as_round, again)
    assert torch.equal(as_round, other_chunk_same_seed)
    assert torch.equal(as_round, chunk_id_seeds)
    assert not torch.equal(as_round, other_seed)


@pytest.fixture(scope="module")
def continuous_producer(producer) -> Producer:
    config = dataclasses.replace(
        producer.config,
        generation=dataclasses.replace(producer.config.generation, continuous_batching=True, microbatch_size=2),
        schedule=dataclasses.replace(producer.config.schedule, mode="stream"),
    )
    continuous = Producer(0, config, reward_scorer=EveryOtherGroupAgrees())
    yield continuous
    continuous.close()


def test_continuous_batching_chunks_report_as_batched_ones(continuous_producer):
    """Through the shared engine: the same facts per row; a weight load lands between chunks, labels the next."""
    rows = [5, 2, 7, 0]
    chunk = continuous_producer.produce_chunk(chunk_id=1, rows=rows, min_version=0)
    assert [group.row for group in chunk.groups] == rows
    assert [group.kept for group in chunk.groups] == [False, True, False, True]
    assert {group.policy_version for group in chunk.groups} == {0}
    assert chunk.batch.data_indices == [2, 0] and chunk.batch.group_size == GROUP_SIZE
    assert chunk.batch.behaviour_logprobs.shape == chunk.batch.response_ids.shape
    assert bool((chunk.batch.behaviour_logprobs[chunk.batch.response_mask == 0] == 0).all())
    weights = continuous_producer.backend.named_weights()
    continuous_producer.load_weights(1, weights)
    chunk = continuous_producer.produce_chunk(chunk_id=2, rows=[3, 1], min_version=1)
    assert {group.policy_version for group in chunk.groups} == {1}
    assert continuous_producer.engine.policy_version == continuous_producer.policy_version == 1


@pytest.fixture(scope="module")
def partial_producer(continuous_producer) -> Producer:
    generation = dataclasses.replace(continuous_producer.config.generation, partial_rollouts=True)
    partial = Producer(
        0, dataclasses.replace(continuous_producer.config, generation=generation), EveryOtherGroupAgrees()
    )
    yield partial
    partial.close()


def test_with_partial_rollouts_a_load_lands_mid_chunk_and_the_batch_says_which_version_sampled_each_token(
    partial_producer,
):
    engine = partial_producer.engine
    chunks = []
    caller = threading.Thread(
        target=lambda: chunks.append(partial_producer.produce_chunk(chunk_id=1, rows=[5, 2, 7, 0], min_version=0))
    )
    with engine.exclusive():  # decoding paused: the load comes between two steps of the running rows
        caller.start()
        engine._wait_for(lambda: engine.batcher.running_rows > 0, time.monotonic() + 60, "running rows")
        new_weights = {name: tensor + 0.01 for name, tensor in partial_producer.backend.named_weights().items()}
        partial_producer.load_weights(1, new_weights)
        assert engine.batcher.running_rows > 0 and engine.policy_version == 1
    caller.join(60)
    (chunk,) = chunks
    # -imbs 2: rows 5 and 2 were running at the load, 7 and 0 waited and were admitted with version 1
    assert [group.policy_version for group in chunk.groups] == [0, 0, 1, 1]  # at admission: staleness's version
    assert chunk.metrics["rollout/multi_version_fraction"] == 0.5  # the 8 samples of rows 5 and 2, of 16
    batch = chunk.batch  # rows 2 (spanning v0 and v1) and 0 (v1 only)
    assert batch.data_indices == [2, 0] and batch.policy_version == 0
    assert batch.token_versions.shape == batch.response_ids.shape
    assert bool((batch.token_versions[batch.response_mask == 0] == -1).all())
    assert set(batch.token_versions[:GROUP_SIZE][batch.response_mask[:GROUP_SIZE] == 1].tolist()) == {0, 1}
    assert set(batch.token_versions[GROUP_SIZE:][batch.response_mask[GROUP_SIZE:] == 1].tolist()) == {1}
    assert 0 < chunk.metrics["rollout/later_version_token_fraction"] < 1

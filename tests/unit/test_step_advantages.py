"""Batch-level advantages are the optimizer step's, whatever the schedule cut the step's groups into.

A step's groups reach the trainer in producer batches: a round's shares, stream chunks, or one group each
(continuous batching). Producers run each estimator's per-group part; the trainer finishes it over the whole
step (``training/step_advantages.py``), its data-parallel shares' moments summed. Checked here: (1) the two
stages over any producer split and any share split equal the full-batch estimator over the step, and the old
per-producer-batch estimate does not; (2) the same through ``postprocess_rollout``, ``concat_batches`` and two
shares finishing in step with a real summing all-reduce (threads), against verl's REINFORCE++-baseline over the
whole step's tokens; (3) a real trainer (one process) trains every micro-batch of a step on advantages finished
over the step, including a second data-parallel share brought in through its sum over ranks.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.testing import assert_close
from verl_reference import verl_reinforce_ppb

from colossal_rl.algorithms import ADVANTAGE_ESTIMATORS, BATCH_STAGES, batch_moments, batch_stage, group_part
from colossal_rl.batch import RolloutBatch, concat_batches
from colossal_rl.config import AlgorithmConfig
from colossal_rl.rollout.postprocess import postprocess_rollout
from colossal_rl.training.step_advantages import step_advantages

GROUP = 4
GROUPS = 8
EPS = 1e-6
MAX_TOKENS = 10
BATCH_LEVEL = BATCH_STAGES.names()
SPLITS = {
    "rounds": [[0, 2, 4, 6], [1, 3, 5, 7]],  # two producers' shares of a round, dealt alternately
    "stream": [[0, 1, 2], [3, 4, 5], [6, 7]],  # stream chunks of 3 groups
    "continuous": [[g] for g in range(GROUPS)],  # continuous batching: every group its own batch
}
SHARES = {"one_rank": [list(range(GROUPS))], "two_ranks": [[0, 1, 2, 5], [3, 4, 6, 7]]}


def test_the_batch_level_estimators_are_the_three_known_ones():
    assert BATCH_LEVEL == ["reinforce", "reinforce_ppb", "reinforce_ppb_sample"]
    for name in ("grpo", "dr_grpo", "rloo", "dpo_pairs"):  # group-level: the producer's advantages are final
        assert batch_stage(name) is None and group_part(name) is ADVANTAGE_ESTIMATORS.get(name)


def _step(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards, response lengths and valid mask [GROUPS * GROUP] of one step: 0/1 or Gaussian rewards, about a
    fifth of the samples invalid, and (odd seeds) one group entirely invalid."""
    generator = torch.Generator().manual_seed(seed)
    n = GROUPS * GROUP
    if seed % 2:
        rewards = torch.randint(0, 2, (n,), generator=generator).float()
    else:
        rewards = torch.randn(n, generator=generator)
    lengths = torch.randint(1, MAX_TOKENS + 1, (n,), generator=generator)
    valid = torch.rand(n, generator=generator) > 0.2
    if seed % 2:
        valid[5 * GROUP : 6 * GROUP] = False
    return rewards, lengths, valid.float()


def _samples(groups: list[int]) -> torch.Tensor:
    return torch.tensor([g * GROUP + j for g in groups for j in range(GROUP)])


def _per_batch(fn, rewards, lengths, valid, split) -> torch.Tensor:
    """``fn`` (estimator-shaped) run on each producer batch of ``split`` alone, in the step's sample order."""
    out = torch.zeros_like(rewards)
    for groups in split:
        idx = _samples(groups)
        out[idx] = fn(rewards[idx], GROUP, EPS, valid[idx], response_lengths=lengths[idx])
    return out


def _finish(name, values, weights, shares) -> torch.Tensor:
    """The trainer's stage: each share's moments, summed over the shares (the all-reduce), each share finished."""
    stage = BATCH_STAGES.get(name)
    indices = [_samples(groups) for groups in shares]
    moments = sum(batch_moments(values[idx], weights[idx]) for idx in indices)
    out = torch.zeros_like(values)
    for idx in indices:
        out[idx] = stage.finish(values[idx], weights[idx], moments, EPS)
    return out


@pytest.mark.parametrize("name", BATCH_LEVEL)
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("seed", range(4))
def test_producer_split_and_step_stage_equal_the_full_batch_estimator(name, split, seed):
    rewards, lengths, valid = _step(seed)
    full = ADVANTAGE_ESTIMATORS.get(name)(rewards, GROUP, EPS, valid, response_lengths=lengths)
    stage = BATCH_STAGES.get(name)
    values = _per_batch(stage.group_part, rewards, lengths, valid, SPLITS[split])
    weights = stage.weights(rewards, valid, lengths)
    for shares in SHARES.values():
        assert_close(_finish(name, values, weights, shares), full, atol=1e-6, rtol=1e-6)
    # the old bug: the whole estimator per producer batch gives other advantages for the same groups
    old = _per_batch(ADVANTAGE_ESTIMATORS.get(name), rewards, lengths, valid, SPLITS[split])
    assert not torch.allclose(old, full, atol=1e-3)


def test_continuous_batching_turned_whitening_into_group_normalisation():
    """What the bug did to REINFORCE++-baseline: whitening one group's centred rewards over its own tokens is
    a (token-weighted) group normalisation; the step stage whitens over the step's tokens instead."""
    rewards, lengths, valid = _step(0)
    old = _per_batch(ADVANTAGE_ESTIMATORS.get("reinforce_ppb"), rewards, lengths, valid, SPLITS["continuous"])
    for g in range(GROUPS):  # every group's tokens whitened to mean 0 on their own
        idx = _samples([g])
        assert abs(float((old[idx] * lengths[idx] * valid[idx]).sum())) < 1e-4
    full = ADVANTAGE_ESTIMATORS.get("reinforce_ppb")(rewards, GROUP, EPS, valid, response_lengths=lengths)
    assert not torch.allclose(old, full, atol=1e-2)


# ---------------------------------------------------------------- through the producer and trainer code


class SummingAllReduce:
    """An all-reduce (SUM) between threads: each of ``ranks`` callers gets the sum of every caller's tensor."""

    def __init__(self, ranks: int):
        self.parts: list[torch.Tensor | None] = [None] * ranks
        self.barrier = threading.Barrier(ranks, timeout=30)
        self.calls = 0

    def for_rank(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.parts)
            self.barrier.wait()  # nobody overwrites a part before everyone has summed
            self.calls += rank == 0
            return total

        return all_reduce


def _producer_batch(groups: list[int], rewards, lengths, valid) -> RolloutBatch:
    idx = _samples(groups)
    n = len(idx)
    width = int(lengths[idx].max())  # each producer batch pads to its own longest response, as producers do
    response_mask = (torch.arange(width)[None, :] < lengths[idx, None]).long()
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=response_mask.clone(),
        response_mask=response_mask,
        behaviour_logprobs=torch.zeros(n, width),
        rewards=rewards[idx],
        answer_correct=rewards[idx].clamp(0, 1),
        loss_mask=valid[idx],
        truncated=torch.zeros(n, dtype=torch.bool),
        group_size=GROUP,
        policy_version=0,
        data_indices=list(groups),
    )


def _schedule_then_step(name: str, split: list[list[int]], shares: list[list[int]], rewards, lengths, valid):
    """Producers post-process each batch of ``split``; the buffer hands the step's groups over in a shuffled
    order; each data-parallel share finishes its advantages in step with the others. Advantages [N] in the
    step's original sample order."""
    algo = AlgorithmConfig(advantage_estimator=name)
    processed = [postprocess_rollout(_producer_batch(g, rewards, lengths, valid), algo, MAX_TOKENS)[0] for g in split]
    step = concat_batches(processed, pad_token_id=0)
    order = list(range(step.num_groups))
    random.Random(len(split)).shuffle(order)
    step = step.select_groups(order)
    reduce = SummingAllReduce(len(shares))
    position = {group: i for i, group in enumerate(step.data_indices)}
    share_batches = [step.select_groups([position[g] for g in groups]) for groups in shares]
    with ThreadPoolExecutor(len(shares)) as pool:
        finished = list(
            pool.map(lambda r: step_advantages(share_batches[r], algo, reduce.for_rank(r)), range(len(shares)))
        )
    assert reduce.calls == 1  # once per optimizer step
    out = torch.zeros_like(rewards)
    for batch in finished:
        out[_samples(batch.data_indices)] = batch.advantages
    return out


@pytest.mark.parametrize("name", BATCH_LEVEL)
@pytest.mark.parametrize("seed", range(2))
def test_same_groups_get_the_same_advantages_under_rounds_stream_and_continuous_batching(name, seed):
    rewards, lengths, valid = _step(seed)
    full = ADVANTAGE_ESTIMATORS.get(name)(rewards, GROUP, EPS, valid, response_lengths=lengths)
    for split in SPLITS.values():
        for shares in SHARES.values():
            assert_close(_schedule_then_step(name, split, shares, rewards, lengths, valid), full, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_ppb_matches_verl_over_the_whole_step(seed):
    """verl computes REINFORCE++-baseline over the batch it updates on; so does a step assembled from one-group
    producer batches (continuous batching) and finished on two data-parallel shares."""
    rewards, lengths, valid = _step(seed)
    valid = torch.ones_like(valid)  # verl has no invalid samples: every response is scored
    mask = (torch.arange(MAX_TOKENS)[None, :] < lengths[:, None]).float()
    expected = verl_reinforce_ppb(rewards, mask, [i // GROUP for i in range(len(rewards))])
    advantages = _schedule_then_step(
        "reinforce_ppb", SPLITS["continuous"], SHARES["two_ranks"], rewards, lengths, valid
    )
    assert_close((advantages[:, None] * mask).double(), expected, atol=1e-6, rtol=0)


def test_a_group_level_estimator_needs_no_all_reduce():
    rewards, lengths, valid = _step(0)
    batch = postprocess_rollout(_producer_batch(list(range(GROUPS)), rewards, lengths, valid), AlgorithmConfig(), 8)[0]

    def refuse(tensor):
        raise AssertionError("grpo's advantages are final on the producer")

    assert step_advantages(batch, AlgorithmConfig(), refuse) is batch


# ---------------------------------------------------------------- a real trainer


def _recording(trainer, seen: list) -> None:
    """Make ``trainer``'s objective record (optimizer step, advantages) of every micro-batch it is called on."""
    loss = trainer.objective.loss

    def recorded(**kwargs):
        seen.append((trainer.step, kwargs["advantages"].detach().clone()))
        return loss(**kwargs)

    trainer.objective = dataclasses.replace(trainer.objective, loss=recorded)


def _lengths(batch: RolloutBatch) -> torch.Tensor:
    return batch.policy_token_mask().sum(-1)


def _postprocessed(algo: AlgorithmConfig, seed: int) -> RolloutBatch:
    from trainer_harness import make_batch

    batch = make_batch(num_groups=4, seed=seed)
    rewards = torch.randn(batch.num_samples, generator=torch.Generator().manual_seed(seed))
    loss_mask = torch.ones(batch.num_samples)
    loss_mask[[2, 9]] = 0  # infra errors
    batch = dataclasses.replace(batch, rewards=rewards, loss_mask=loss_mask, advantages=None)
    return postprocess_rollout(batch, algo, max_new_tokens=8)[0]


@pytest.fixture(scope="module")
def ppb_trainer():
    from trainer_harness import make_config, make_trainer

    algo = AlgorithmConfig(advantage_estimator="reinforce_ppb")
    # 4 groups of 4 per step, 2 groups per chunk, 4 samples per micro-batch: 4 micro-batches per step
    config = make_config(algorithm=algo, train={"ppo_epochs": 2})
    return make_trainer(config), algo


def test_the_trainer_finishes_a_step_over_every_data_parallel_share(ppb_trainer):
    trainer, algo = ppb_trainer
    share, other = _postprocessed(algo, seed=0), _postprocessed(algo, seed=1)
    stage = BATCH_STAGES.get("reinforce_ppb")
    other_moments = batch_moments(other.advantages, stage.weights(other.advantages, other.loss_mask, _lengths(other)))
    seen: list = []
    loss = trainer.objective.loss
    _recording(trainer, seen)
    sums: list = []
    original_sum = trainer._sum_over_ranks

    def with_a_second_rank(moments: torch.Tensor) -> torch.Tensor:
        sums.append(moments)
        return original_sum(moments) + other_moments  # the real collective (world 1), plus rank 1's share

    trainer._sum_over_ranks = with_a_second_rank
    try:
        trainer.train_step(share)
    finally:
        del trainer._sum_over_ranks
        trainer.objective = dataclasses.replace(trainer.objective, loss=loss)
    assert len(sums) == 1 and len(seen) == 4  # one sum for the step's four micro-batches
    union = concat_batches([share, other], pad_token_id=0)
    full = ADVANTAGE_ESTIMATORS.get("reinforce_ppb")(
        union.rewards, GROUP, EPS, union.loss_mask, response_lengths=_lengths(union)
    )
    assert_close(torch.cat([advantages for _, advantages in seen]), full[: share.num_samples])
    alone = ADVANTAGE_ESTIMATORS.get("reinforce_ppb")(
        share.rewards, GROUP, EPS, share.loss_mask, response_lengths=_lengths(share)
    )
    assert not torch.allclose(full[: share.num_samples], alone, atol=1e-3)


def test_every_optimizer_step_of_a_round_is_finished_over_its_own_batch(ppb_trainer):
    """Two steps, two epochs (the second re-shuffles the groups into new steps): each step trains on the
    advantages of its own batch, the same in all its micro-batches, and returns them with its samples."""
    trainer, algo = ppb_trainer
    steps = [_postprocessed(algo, seed=2), _postprocessed(algo, seed=3)]
    seen: list = []
    loss = trainer.objective.loss
    _recording(trainer, seen)
    try:
        first_step = trainer.step
        trained = trainer.train_epochs(steps, round_index=0)
    finally:
        trainer.objective = dataclasses.replace(trainer.objective, loss=loss)
    assert len(trained) == 4
    for index, (_, batch) in enumerate(trained):
        full = ADVANTAGE_ESTIMATORS.get("reinforce_ppb")(
            batch.rewards, GROUP, EPS, batch.loss_mask, response_lengths=_lengths(batch)
        )
        assert_close(batch.advantages, full)
        used = torch.cat([advantages for step, advantages in seen if step == first_step + index])
        assert_close(used, full)

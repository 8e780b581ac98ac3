"""Requests from many callers scored as few batches (``reward/request_batching.py``): each caller gets its own
scores in order, concurrent requests share a batch up to ``max_batch`` samples without being split, a lone request
waits at most ``max_wait_s``, and a failing batch fails only its own requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from colossal_rl.reward.request_batching import RequestBatcher


def doubled(calls: list):
    def score(samples: list[int]) -> list[int]:
        calls.append(list(samples))
        return [2 * sample for sample in samples]

    return score


def test_concurrent_callers_share_batches_and_each_gets_its_own_scores_in_order():
    calls: list = []
    batcher = RequestBatcher(doubled(calls), max_batch=8, max_wait_s=0.2)

    async def main():
        return await asyncio.gather(*(batcher.score([10 * caller + i for i in range(3)]) for caller in range(4)))

    results = asyncio.run(main())
    assert results == [[2 * (10 * caller + i) for i in range(3)] for caller in range(4)]
    assert [len(call) for call in calls] == [6, 6]  # 8 samples at most, and no request of 3 split in two
    assert batcher.stats.as_dict() == {"batches": 2.0, "samples": 12.0, "requests_per_batch": 2.0, "largest_batch": 6.0}


def test_a_lone_request_is_scored_after_at_most_max_wait_s():
    batcher = RequestBatcher(doubled([]), max_batch=64, max_wait_s=0.3)

    async def main():
        started = time.perf_counter()
        scores = await batcher.score([1, 2])
        return scores, time.perf_counter() - started

    scores, elapsed = asyncio.run(main())
    assert scores == [2, 4] and 0.25 < elapsed < 2.0


def test_a_request_larger_than_max_batch_is_scored_whole():
    calls: list = []
    batcher = RequestBatcher(doubled(calls), max_batch=2, max_wait_s=0.0)
    assert asyncio.run(batcher.score([1, 2, 3])) == [2, 4, 6]
    assert calls == [[1, 2, 3]]


def test_a_failing_batch_fails_its_requests_only_and_the_batcher_goes_on():
    def score(samples: list[int]) -> list[int]:
        if 13 in samples:
            raise ValueError("unlucky")
        return samples

    batcher = RequestBatcher(score, max_batch=4, max_wait_s=0.0)

    async def main():
        with pytest.raises(ValueError, match="unlucky"):
            await batcher.score([13])
        return await batcher.score([1, 2])

    assert asyncio.run(main()) == [1, 2]


def test_a_scorer_returning_too_few_scores_fails_the_batch_naming_the_counts():
    batcher = RequestBatcher(lambda samples: samples[:-1], max_batch=4, max_wait_s=0.0)
    with pytest.raises(RuntimeError, match="scored 1 of 2 samples"):
        asyncio.run(batcher.score([1, 2]))


def test_no_request_is_lost_when_one_arrives_as_the_wait_times_out():
    calls: list = []
    batcher = RequestBatcher(doubled(calls), max_batch=100, max_wait_s=0.01)

    async def main():
        results = []
        for round_index in range(30):  # requests landing around each flush's deadline
            first = asyncio.ensure_future(batcher.score([round_index]))
            await asyncio.sleep(0.01)
            second = asyncio.ensure_future(batcher.score([1000 + round_index]))
            results.append(await asyncio.wait_for(asyncio.gather(first, second), 5))
        return results

    results = asyncio.run(main())
    assert results == [[[2 * r], [2 * (1000 + r)]] for r in range(30)]
    assert sorted(sample for call in calls for sample in call) == sorted(
        list(range(30)) + [1000 + r for r in range(30)]
    )


@pytest.mark.parametrize("max_batch, max_wait_s", [(0, 0.1), (4, -1.0)])
def test_bad_settings_are_refused(max_batch, max_wait_s):
    with pytest.raises(ValueError):
        RequestBatcher(doubled([]), max_batch=max_batch, max_wait_s=max_wait_s)


def test_a_batch_holding_a_request_of_every_caller_is_scored_without_waiting():
    calls: list = []
    batcher = RequestBatcher(doubled(calls), max_batch=100, max_wait_s=5.0, max_callers=2)

    async def main():
        started = time.perf_counter()
        results = await asyncio.gather(batcher.score([1]), batcher.score([2]))
        return results, time.perf_counter() - started

    results, elapsed = asyncio.run(main())
    assert results == [[2], [4]] and calls == [[1, 2]] and elapsed < 1.0  # not the 5 s wait

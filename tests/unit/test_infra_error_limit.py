"""A producer stops the run once more than --max-infra-error-fraction of its rewards failed for infra reasons."""

from __future__ import annotations

import dataclasses

import pytest

from colossal_rl.config import RewardConfig, RLConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.reward.records import OK, RewardRecord, infra_error
from colossal_rl.rollout.producer import InfraErrorRateExceeded, Producer


class _Scorer:
    """Stands in for the reward scorer around the producer: the first ``failing`` records are infra errors."""

    def __init__(self, failing: int):
        self.failing = failing

    def score_batch(self, responses, rows):
        return [
            infra_error("verifier down") if i < self.failing else RewardRecord(1.0, True, True, OK, {})
            for i in range(len(responses))
        ]


@pytest.fixture(scope="module")
def producer() -> Producer:
    return Producer(0, resolve(RLConfig()), reward_scorer=None)


@pytest.mark.parametrize(("limit", "stops"), [(0.25, True), (0.5, False)])
def test_the_limit_is_the_flags(producer, limit, stops):
    producer.config = dataclasses.replace(RLConfig(), reward=RewardConfig(max_infra_error_fraction=limit))
    producer.reward_scorer, producer._scored, producer._infra_errors = _Scorer(failing=20), 0, 0
    if stops:
        with pytest.raises(InfraErrorRateExceeded, match=r"20 of 64 rewards failed .* --max-infra-error-fraction 0.25"):
            producer._score(["x"] * 64, [{}] * 64)
    else:
        assert len(producer._score(["x"] * 64, [{}] * 64)) == 64


def test_fewer_than_64_scores_never_stop_the_run(producer):
    producer.config = dataclasses.replace(RLConfig(), reward=RewardConfig(max_infra_error_fraction=0.0))
    producer.reward_scorer, producer._scored, producer._infra_errors = _Scorer(failing=63), 0, 0
    assert len(producer._score(["x"] * 63, [{}] * 63)) == 63

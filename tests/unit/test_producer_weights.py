"""Producer.load_weights: a producer only ever moves to a newer weights version (the embedded model, no Ray)."""

from __future__ import annotations

import pytest
import torch

from colossal_rl.config import RLConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.rollout.producer import Producer


@pytest.fixture(scope="module")
def producer() -> Producer:
    return Producer(0, resolve(RLConfig()), reward_scorer=None)


def scaled(weights: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {name: tensor * factor for name, tensor in weights.items()}


def assert_holds(producer: Producer, expected: dict[str, torch.Tensor]) -> None:
    held = producer.backend.named_weights()
    assert held.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name


def test_load_weights_refuses_a_version_that_is_not_newer(producer):
    assert producer.policy_version == 0
    base = producer.backend.named_weights()
    version_2 = scaled(base, 0.5)
    producer.load_weights(2, version_2)
    assert producer.policy_version == 2
    assert_holds(producer, version_2)
    for stale in (2, 1, 0):  # a repeated sync, an older one, the initial weights
        with pytest.raises(ValueError, match=rf"weights version {stale} is not newer than 2"):
            producer.load_weights(stale, scaled(base, 0.25))
        assert producer.policy_version == 2
        assert_holds(producer, version_2)  # nothing of the refused weights was loaded
    producer.load_weights(3, base)
    assert producer.policy_version == 3
    assert_holds(producer, base)

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


def test_weights_the_engine_receives_itself_go_through_the_continuous_batching_engine():
    """``--vllm-weight-receive workers`` with ``--continuous-batching``: the receive is the load, so it runs at the
    engine service's safe point (no request in the engine, the next ones labelled with the new version)."""
    calls = []

    class Service:
        def load_weights(self, load, version, *, timeout_s):
            calls.append(("safe point", version))
            load()

    class Backend:
        def receive_weights(self, version, *, loaded_version):
            calls.append(("receive", version, loaded_version))

    producer = object.__new__(Producer)  # only what receive_weights_in_engine reaches: no model
    producer.config, producer.policy_version = resolve(RLConfig()), 1
    producer.engine, producer.backend = Service(), Backend()
    producer.receive_weights_in_engine(2)
    assert calls == [("safe point", 2), ("receive", 2, 1)]
    assert producer.policy_version == 2

"""Both continuous batchers are the ``Batcher`` that ``EngineService`` drives (``rollout/batcher.py``): every member
the Protocol declares exists on the transformers one and the vLLM one, methods with the Protocol's parameters
(names, kinds, defaults), properties as properties, attributes set by the constructor. No model, no vLLM."""

from __future__ import annotations

import inspect

import pytest
import torch

from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.batcher import Batcher
from colossal_rl.rollout.continuous_batching import ContinuousBatcher
from colossal_rl.rollout.vllm_continuous import VllmContinuousBatcher
from colossal_rl.rollout.vllm_partial_rollouts import VllmPartialBatcher

SAMPLING = SamplingSettings(temperature=1.0, max_new_tokens=4)


def protocol_members() -> dict[str, str]:
    """Name -> ``method``, ``property`` or ``attribute``, as the Protocol declares it."""
    members = {name: "attribute" for name in Batcher.__annotations__}
    for name, value in vars(Batcher).items():
        if isinstance(value, property):
            members[name] = "property"
        elif inspect.isfunction(value) and not name.startswith("_"):
            members[name] = "method"
    return members


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def transformers_batcher() -> ContinuousBatcher:
    return ContinuousBatcher(torch.nn.Linear(1, 1), SAMPLING, 2, max_rows=4, eos_token_ids=[0], pad_token_id=0)


def vllm_batcher() -> VllmContinuousBatcher:
    return VllmContinuousBatcher(object(), SAMPLING, 2, max_rows=4, pad_token_id=0, stop_token_ids=[0],
                                 sampling_params=dict)  # fmt: skip


def test_the_protocol_declares_what_the_engine_service_uses():
    assert protocol_members() == {
        "policy_version": "attribute",
        "running_rows": "property",
        "waiting_prompts": "property",
        "idle": "property",
        "submit": "method",
        "step": "method",
        "before_new_weights": "method",
        "take_new_weights": "method",
    }


def vllm_partial_batcher() -> VllmPartialBatcher:
    return VllmPartialBatcher(object(), SAMPLING, 2, max_rows=4, pad_token_id=0, stop_token_ids=[0],
                              sampling_params=dict, streamed_sampling_params=dict)  # fmt: skip


@pytest.mark.parametrize("make", [transformers_batcher, vllm_batcher, vllm_partial_batcher],
                         ids=["transformers", "vllm", "vllm_partial"])  # fmt: skip
def test_both_batchers_implement_every_member_of_the_protocol(make):
    batcher = make()
    for name, kind in protocol_members().items():
        if kind == "attribute":
            assert isinstance(getattr(batcher, name), int), name
        elif kind == "property":
            assert isinstance(inspect.getattr_static(type(batcher), name), property), name
        else:
            assert parameters(getattr(type(batcher), name)) == parameters(getattr(Batcher, name)), name

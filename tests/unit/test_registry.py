"""The name registries: refuse duplicates, list known names on a bad lookup."""

import pytest

from colossal_rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, Registry


def test_register_and_get():
    registry = Registry("thing")

    @registry.register("double")
    def double(x):
        return 2 * x

    assert registry.get("double") is double
    assert registry["double"](3) == 6
    assert "double" in registry and "triple" not in registry
    assert registry.names() == ["double"] and len(registry) == 1


def test_duplicate_name_is_refused():
    registry = Registry("thing")
    registry.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="'a' is already registered"):
        registry.register("a")(lambda: 2)
    assert registry.get("a")() == 1


def test_unknown_name_lists_known_names():
    with pytest.raises(
        ValueError, match=r"unknown advantage estimator 'ppo'; known: dpo_pairs, dr_grpo, grpo, reinforce, "
    ):
        ADVANTAGE_ESTIMATORS.get("ppo")


def test_builtin_registries_hold_the_documented_names():
    assert ADVANTAGE_ESTIMATORS.names() == [
        "dpo_pairs",
        "dr_grpo",
        "grpo",
        "reinforce",
        "reinforce_ppb",
        "reinforce_ppb_sample",
        "rloo",
    ]
    assert POLICY_LOSSES.names() == ["clipped", "gspo"]
    assert LOSS_AGGREGATIONS.names() == ["sample_level", "seq_mean_token_sum", "token_level"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]


def test_builtin_registries_refuse_overwriting():
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda *args: None)

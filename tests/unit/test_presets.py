"""Algorithm presets: every preset validates and names functions that exist."""

import pytest

from colossal_rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from colossal_rl.presets import PRESETS, algorithm_preset

RUN = {"kl_coeff": 0.01, "max_new_tokens": 512, "n_behind": 1}


@pytest.mark.parametrize("name", PRESETS.names())
def test_each_preset_validates_and_resolves_its_functions(name):
    config = algorithm_preset(name, **RUN)
    config.validate()
    assert config.name == name
    ADVANTAGE_ESTIMATORS.get(config.advantage_estimator)
    POLICY_LOSSES.get(config.policy_loss)
    LOSS_AGGREGATIONS.get(config.loss_aggregation)
    KL_ESTIMATORS.get(config.kl_estimator)


def test_known_presets():
    assert PRESETS.names() == ["DAPO", "DR_GRPO", "GRPO", "GSPO", "ONLINE_DPO", "REINFORCE_PPB", "RLOO"]


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown algorithm preset 'PPO'; known: DAPO, DR_GRPO, GRPO"):
        algorithm_preset("PPO", **RUN)


def test_dapo_defaults():
    config = algorithm_preset("DAPO", **RUN)
    assert config.filter_range == (0.01, 0.99)
    assert (config.clip_eps_low, config.clip_eps_high) == (0.2, 0.28)
    assert config.loss_aggregation == "token_level"
    assert config.soft_over_length_punishment and config.filter_truncated_response
    assert config.cache_length == 128
    assert config.kl_coeff == 0.0
    assert config.skip_threshold == 20.0
    assert algorithm_preset("DAPO", kl_coeff=0.0, max_new_tokens=8192, n_behind=0).cache_length == 1024


def test_grpo_family_defaults():
    grpo = algorithm_preset("GRPO", **RUN)
    assert (grpo.advantage_estimator, grpo.loss_aggregation, grpo.kl_coeff) == ("grpo", "sample_level", 0.01)
    assert grpo.clip_eps_low == grpo.clip_eps_high
    dr_grpo = algorithm_preset("DR_GRPO", **RUN)
    assert (dr_grpo.advantage_estimator, dr_grpo.loss_aggregation) == ("dr_grpo", "seq_mean_token_sum")
    gspo = algorithm_preset("GSPO", **RUN)
    assert (gspo.policy_loss, gspo.clip_eps_low, gspo.clip_eps_high) == ("gspo", 3e-4, 4e-4)
    assert algorithm_preset("RLOO", **RUN).advantage_estimator == "rloo"
    assert algorithm_preset("REINFORCE_PPB", **RUN).advantage_estimator == "reinforce_ppb"


POLICY_GRADIENT_PRESETS = [name for name in PRESETS.names() if name != "ONLINE_DPO"]  # DPO has no ratio to weight


@pytest.mark.parametrize("name", POLICY_GRADIENT_PRESETS)
def test_truncated_is_cap_follows_staleness(name):
    assert algorithm_preset(name, kl_coeff=0.0, max_new_tokens=64, n_behind=2).truncated_is_cap == 2.0
    assert algorithm_preset(name, kl_coeff=0.0, max_new_tokens=64, n_behind=0).truncated_is_cap is None

"""The names config.py writes as ``Literal`` types (so it imports no torch) are exactly its registries' names.

``LR_SCHEDULE_NAMES`` and ``OBJECTIVE_NAMES`` are checked beside their registries (test_lr_schedule.py,
test_online_dpo.py); the flags' choices come from these ``Literal`` types and ``-a``'s from ``PRESETS``.
"""

from typing import get_args

from colossal_rl import config
from colossal_rl.algorithms import KL_ESTIMATORS, LOSS_AGGREGATIONS
from colossal_rl.training.sequence_layout import SEQUENCE_LAYOUTS
from reward import REWARD_TYPES


def test_loss_aggregations_and_kl_estimators_are_the_registries_names():
    assert sorted(get_args(config.LossAggregation)) == LOSS_AGGREGATIONS.names()
    assert sorted(get_args(config.KLEstimator)) == KL_ESTIMATORS.names()


def test_reward_types_are_the_reward_packages():
    assert set(get_args(config.RewardType)) == set(REWARD_TYPES)


def test_sequence_layouts_are_the_trainers_and_auto():
    assert set(get_args(config.SequenceLayout)) == {"auto", *SEQUENCE_LAYOUTS}


def test_lr_schedule_names_are_its_literal():
    assert config.LR_SCHEDULE_NAMES == get_args(config.LrSchedule)


def test_reward_normalisations_are_the_reward_models():
    from reward.reward_model import NORMALISATIONS

    assert set(get_args(config.RewardNormalisation)) == set(NORMALISATIONS)


def test_served_reward_types_are_the_reward_packages_model_types():
    from reward.model_rewards import MODEL_REWARD_TYPES

    assert config.SERVED_REWARD_TYPES == MODEL_REWARD_TYPES

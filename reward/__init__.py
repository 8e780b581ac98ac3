"""Rewards: math answers (``boxed``, ``think_answer_tags``), code (``code``), user plug-ins, rewards scored by a model
(``model``: a reward model; ``judge``: a generative judge, :mod:`.model_rewards`), and weighted sums of them
(``reward_mix``).

Usage::

    from colossal_rl.reward import build_reward_scorer
    scorer = build_reward_scorer(reward_type="boxed")
    records = scorer.score_batch(responses, rows)   # one RewardRecord per response, never raises per sample
    scorer.close()

Scorers are safe to call from any thread (Ray actor threads included): math-verify runs in
killable worker processes and programs run in a bubblewrap sandbox, with no signals used in
the calling process. Importing this package imports neither math-verify nor sympy.
"""

from .combined import CombinedScorer
from .factory import REWARD_TYPES, RewardScorer, build_reward_scorer
from .math_scorer import MathRewardConfig
from .model_rewards import JudgeSettings, build_served_scorer
from .records import (
    AMBIGUOUS_ANSWER,
    FORMAT_ERROR,
    INFRA_ERROR,
    OK,
    STATUSES,
    STRING_FALLBACK,
    TIMEOUT,
    RewardRecord,
)
from .sandbox import SandboxConfig
from .user_functions import RewardConfigError

__all__ = [
    "AMBIGUOUS_ANSWER",
    "CombinedScorer",
    "FORMAT_ERROR",
    "INFRA_ERROR",
    "JudgeSettings",
    "OK",
    "REWARD_TYPES",
    "STATUSES",
    "STRING_FALLBACK",
    "TIMEOUT",
    "MathRewardConfig",
    "RewardConfigError",
    "RewardRecord",
    "RewardScorer",
    "SandboxConfig",
    "build_reward_scorer",
    "build_served_scorer",
]

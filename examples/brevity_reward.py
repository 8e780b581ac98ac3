"""An example reward plug-in for ``--reward-mix`` (or ``--reward-fn``): a bonus for short answers.

    python rl_example.py --reward-mix boxed=1,examples/brevity_reward.py:brevity=0.2

``brevity(response, row)`` is 1.0 for an empty response, falling linearly to 0.0 at ``LIMIT_CHARS`` characters
and beyond. Mixed with ``boxed`` it is logged as ``rollout/reward_brevity_mean``; ``boxed`` first, so
``rollout/accuracy`` stays the math answer's.
"""

from __future__ import annotations

from typing import Any

LIMIT_CHARS = 2000


def brevity(response: str, row: dict[str, Any]) -> float:
    return max(0.0, 1.0 - len(response) / LIMIT_CHARS)

"""A producer's reward scorer whose samples are scored by a reward actor that every producer feeds.

``-rt model``: the reward model runs on its own Ray actor(s) (``driver/actors.RewardModelActor``, ``--reward-actors``)
that batch the requests of all producers together (``reward/request_batching.py``). Producer ``p`` sends its
samples (each prompt's messages and reference answer, and the response) to actor ``p mod N`` and waits, bounded by ``timeout_s``. When
the actor dies, Ray restarts it (``--max-actor-restarts``) and the request is sent again, so every sample is scored
once; a request that cannot be answered (no restart left, or no answer in time) gives every sample of it an
``infra_error`` naming the actor and why, never a hang: the run goes on under ``--max-infra-error-fraction``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from colossal_rl.reward.records import RewardRecord, infra_error

logger = logging.getLogger(__name__)
SENT_ROW_KEYS = ("messages", "gt_answer")
"""What a reward actor gets of a row: the prompt's messages (its chat template renders them) and the reference
answer (a judge's ``{reference}``); images and test cases stay on the producer."""


class RemoteRewardScorer:
    """``RewardScorer`` (``score_batch``, ``close``) over one of the run's reward actors."""

    def __init__(self, actors: list[Any], producer_rank: int, *, timeout_s: float, attempts: int = 3, label: str):
        if not actors:
            raise ValueError("a remote reward scorer needs at least one reward actor")
        self.actor_index = producer_rank % len(actors)
        self._actor = actors[self.actor_index]
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.label = label

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        if not responses:
            return []
        sent = [{key: row[key] for key in SENT_ROW_KEYS if key in row} for row in rows]
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(1, self.attempts + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                records = ray.get(self._actor.score.remote(sent, responses), timeout=left)
            except GetTimeoutError:
                return self._failed(len(responses), f"no answer within {self.timeout_s:.0f}s")
            except RayActorError as error:  # died: Ray restarts it while restarts are left; send again
                reason = f"died ({type(error).__name__})"
                logger.warning("reward actor %d %s on attempt %d of %d", self.actor_index, reason, attempt,
                               self.attempts)  # fmt: skip
                if attempt < self.attempts:
                    time.sleep(min(1.0 * attempt, max(0.0, deadline - time.monotonic())))
                continue
            if len(records) != len(responses):
                return self._failed(len(responses), f"answered {len(records)} records for {len(responses)} samples")
            return list(records)
        return self._failed(len(responses), f"unavailable after {self.attempts} attempts")

    def _failed(self, count: int, reason: str) -> list[RewardRecord]:
        message = f"{self.label}: reward actor {self.actor_index} {reason}"
        logger.warning("%s: %d sample(s) are infra_error", message, count)
        return [infra_error(message) for _ in range(count)]

    def close(self) -> None:
        """Nothing to release here: the reward actors belong to the driver, which ends them."""

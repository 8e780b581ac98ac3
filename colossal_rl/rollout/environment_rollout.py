"""Episodes that take turns (``--env``): the rows' episodes, and their rollout batch.

The multi-turn case of the producer's one rollout path (``Producer._rollout``): plain functions and one small
class the :class:`~colossal_rl.rollout.producer.Producer` holds when ``environment.name`` is set; without ``--env``
the environment is the one-step one and the producer generates its groups batched instead. Episodes run
``generation.microbatch_size`` prompts (times their samples) at a time, like the single-turn generate calls.
"""

from __future__ import annotations

from typing import Any

import torch

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import RLConfig
from colossal_rl.environments import EnvironmentContext, environment_factory
from colossal_rl.prompts import system_prompt_for
from colossal_rl.rollout.backend import InferenceBackend, SamplingSettings
from colossal_rl.rollout.chat_turns import ChatTurns
from colossal_rl.rollout.multi_turn import (
    Episode,
    MultiTurnLimits,
    MultiTurnOutput,
    collate,
    log_environment_errors,
    run_episodes,
)


class EnvironmentRollouts:
    """Makes one environment per sample and runs the episodes of a list of rows."""

    def __init__(self, config: RLConfig, tokenizer, reward_scorer, pad_token_id: int):
        system_prompt = system_prompt_for(config.reward.reward_type, config.data.system_prompt)
        self.factory = environment_factory(config.environment.name)
        self.context = EnvironmentContext(reward_scorer=reward_scorer, system_prompt=system_prompt)
        self.chat = ChatTurns(tokenizer)
        self.limits = MultiTurnLimits(
            max_turns=config.environment.max_turns, max_total_tokens=config.environment.max_total_tokens
        )
        self.rows_per_call = config.generation.microbatch_size
        self.pad_token_id = pad_token_id

    def run(
        self, backend: InferenceBackend, rows: list[dict[str, Any]], num_samples: int, sampling: SamplingSettings
    ) -> MultiTurnOutput:
        """``num_samples`` episodes of every row, group-major; the environments' errors logged in one line."""
        episodes: list[Episode] = []
        for start in range(0, len(rows), self.rows_per_call):
            part = [row for row in rows[start : start + self.rows_per_call] for _ in range(num_samples)]
            environments = [self.factory(self.context) for _ in part]
            episodes += run_episodes(backend, self.chat, environments, part, sampling, self.limits)
        log_environment_errors(episodes)
        return collate(episodes, self.pad_token_id)


def episodes_batch(output: MultiTurnOutput, tokenizer, *, group_size: int, **batch_fields: Any) -> RolloutBatch:
    """The rollout batch of ``output`` (rewards, correctness and statuses from each episode's environment);
    ``batch_fields``: the producer's (policy version, round, rank, prompts, data indices)."""
    episodes = output.episodes
    statuses = [e.status for e in episodes]
    return RolloutBatch(
        prompt_ids=output.prompt_ids,
        prompt_mask=output.prompt_mask,
        response_ids=output.response_ids,
        response_mask=output.response_mask,
        policy_mask=output.policy_mask,
        behaviour_logprobs=output.behaviour_logprobs,
        rewards=output.rewards,
        answer_correct=torch.tensor([float(e.answer_ok) for e in episodes]),
        loss_mask=torch.tensor([0.0 if status == "infra_error" else 1.0 for status in statuses]),
        truncated=output.truncated,
        group_size=group_size,
        responses=[tokenizer.decode(e.response_ids) for e in episodes],
        reward_status=statuses,
        **batch_fields,
    )

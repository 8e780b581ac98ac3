"""Environments scored by the run's verifiable reward: the single-turn one and the base of the tool environments.

:class:`SingleTurnEnvironment` is today's rollout as an environment: one turn, scored by the reward scorer
(``-rt``/``--reward-fn``), done. :class:`ToolEnvironment` lets the policy call tools first: a turn with
``<tool_call>`` blocks is answered with their results, a turn without one is the final answer and is scored the
same way. The scorer never raises for a sample (``colossal_rl.reward``), so neither do these.
"""

from __future__ import annotations

from typing import Any

from colossal_rl.data import build_messages
from colossal_rl.environments.base import EnvironmentContext, Message, StepResult
from colossal_rl.environments.tool_calls import Tool, parse_tool_calls, run_calls
from colossal_rl.reward.combined import COMPONENTS

REWARD_COMPONENTS = "reward_components"
"""A final step's ``info`` key: a reward mix's component rewards (``Episode.reward_components``)."""


def score_final_answer(context: EnvironmentContext, text: str, row: dict[str, Any]) -> StepResult:
    """The episode's end: ``text`` scored against ``row`` by the run's reward scorer."""
    record = context.reward_scorer.score_batch([text], [row])[0]
    info = {"status": record.status, "answer_ok": bool(record.answer_ok)}
    if COMPONENTS in record.details:  # a --reward-mix: each component's reward, for rollout/reward_<name>_mean
        info[REWARD_COMPONENTS] = dict(record.details[COMPONENTS])
    return StepResult(reward=float(record.reward), done=True, info=info)


class SingleTurnEnvironment:
    """One turn, scored: ``python rl_example.py`` without ``--env`` is exactly this."""

    def __init__(self, context: EnvironmentContext):
        self.context = context
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.row = row
        return build_messages(row["messages"], self.context.system_prompt)

    def step(self, text: str) -> StepResult:
        return score_final_answer(self.context, text, self.row)

    def close(self) -> None:
        pass


class ToolEnvironment:
    """Tool calls until a turn without one: that turn is the answer, scored by the run's reward."""

    def __init__(self, context: EnvironmentContext, tools: list[Tool]):
        self.context = context
        self.tools = tuple(tools)
        """The tools the policy may call (the rollout shows their schemas in the prompt)."""
        self._by_name = {tool.name: tool for tool in tools}
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.row = row
        return build_messages(row["messages"], self.context.system_prompt)

    def step(self, text: str) -> StepResult:
        parsed = parse_tool_calls(text)
        if not parsed.calls:
            return score_final_answer(self.context, text, self.row)
        messages, errors = run_calls(parsed.calls, self._by_name)
        return StepResult(observation=tuple(messages), tool_calls=len(parsed.calls), tool_errors=errors)

    def close(self) -> None:
        pass

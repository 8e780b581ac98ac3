"""What an environment is: made per prompt row, ``reset(row)`` opens the episode, ``step(text)`` answers a turn.

An episode is: ``messages = env.reset(row)`` (the prompt's chat messages), then for each policy turn
``result = env.step(turn_text)`` until ``result.done``. The environment sees and returns text and chat messages
only; tokens (chat template, masks, budgets) are the rollout's business (``colossal_rl/rollout/multi_turn.py``).
An environment must never raise for anything the policy writes: a bad turn is an observation (an error the
policy reads) or a final reward of 0. It must never run policy output in our process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
"""A chat message: ``{"role": "user" | "tool" | ..., "content": str}`` (tool messages may carry ``name``)."""


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What the environment answers to one policy turn."""

    observation: tuple[Message, ...] = ()
    """Messages the policy sees next (tool results, feedback); empty when the episode is done."""
    reward: float | None = None
    """The episode's reward when this turn earns one (usually the last); None: no reward yet."""
    done: bool = False
    """The episode is over: no further turn is generated."""
    tool_calls: int = 0
    """Tool calls the turn made (well-formed or not): for the rollout's logs."""
    tool_errors: int = 0
    """Of those, the calls that became an error observation (malformed, unknown tool, tool failure)."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable diagnostics (e.g. the reward record's status), logged with the turn."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (a new object per prompt row and sample)."""

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The episode's first messages (system prompt, the row's question) for the policy's first turn."""
        ...

    def step(self, text: str) -> StepResult:
        """React to the policy's turn ``text`` (decoded, special tokens removed)."""
        ...

    def close(self) -> None:
        """Release what the episode holds (processes, files); called once, whatever happened."""
        ...


@dataclass(frozen=True, kw_only=True)
class EnvironmentContext:
    """What the run hands every environment it makes: built once per producer, shared by its episodes."""

    reward_scorer: Any
    """The run's verifiable reward (``colossal_rl.reward.RewardScorer``): scores final answers."""
    system_prompt: str | None = None
    """The run's system prompt (``-s`` or the reward type's); tool environments append their tools to it."""
    options: dict[str, Any] = field(default_factory=dict)
    """Environment-specific settings (e.g. the Python tool's sandbox limits)."""

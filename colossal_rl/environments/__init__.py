"""Environments: what the policy talks to over one or several turns, and what rewards it (issue 36).

- ``base.py``: the interface (``Environment``: ``reset(row)`` -> first messages, ``step(text)`` ->
  ``StepResult``) and the ``EnvironmentContext`` a run gives every environment.
- ``scored.py``: ``SingleTurnEnvironment`` (today's one-turn rollout, scored by the run's reward) and
  ``ToolEnvironment`` (tool calls, then a final answer scored the same way).
- ``tool_calls.py``: Qwen's ``<tool_call>`` format: parsing (never raises), ``Tool``, running a turn's calls.
- ``calculator.py``: the calculator tool (safe, bounded arithmetic; no ``eval``) and ``--env calculator``.
- ``python_tool.py``: a Python tool run in the code sandbox, one process per call, and ``--env python``.
- ``registry.py``: names -> factories, ``--env path.py:Class`` plug-ins, the check before Ray starts.

Token-level work (chat templates, masks, budgets) is not here: see ``colossal_rl/rollout/multi_turn.py``.
"""

from colossal_rl.environments.base import Environment, EnvironmentContext, Message, StepResult
from colossal_rl.environments.registry import (
    DEFAULT_ENVIRONMENT,
    ENVIRONMENTS,
    EnvironmentConfigError,
    check_environment,
    environment_factory,
)

__all__ = [
    "DEFAULT_ENVIRONMENT",
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentConfigError",
    "EnvironmentContext",
    "Message",
    "StepResult",
    "check_environment",
    "environment_factory",
]

"""Token-in, token-out multi-turn rollouts: the policy and an environment take turns, on any inference backend.

Each turn generates for every running episode in one ``backend.generate`` call from its full token history
(prompt, earlier turns, observations), appends the sampled ids exactly as sampled with their behaviour log-probs
(text is decoded for the environment, never re-tokenised), steps the environment with the turn's text, and appends
the observation's ids (``chat_turns.py``: chat-template formatted, tokenised once). An episode ends when the
environment says done, after ``max_turns`` policy turns, or when its response (policy and environment tokens)
reaches ``max_total_tokens``: a turn is cut to the room left, and an observation that leaves no room for another
turn ends the episode instead. ``policy_mask`` is 1 on sampled tokens, 0 on the environment's; the environment's
tokens stay in the response as context (``RolloutBatch.policy_mask``). A plug-in environment that raises in
``step`` ends its episode with status ``infra_error`` (masked out of the loss), never the rollout; its errors
(``step``'s and ``close``'s) are kept on the episodes, counted (``rollout/env_errors``) and logged once per
rollout batch (:func:`log_environment_errors`), not once each.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from colossal_rl.environments.base import Environment, StepResult
from colossal_rl.environments.scored import REWARD_COMPONENTS
from colossal_rl.rollout.backend import InferenceBackend, SamplingSettings
from colossal_rl.rollout.chat_turns import ChatTurns, episode_tools

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MultiTurnLimits:
    max_turns: int = 4
    """Policy turns per episode."""
    max_total_tokens: int = 256
    """Response tokens per episode (the policy's and the environment's, prompt excluded)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ValueError(
                f"max_turns and max_total_tokens must be >= 1, got {self.max_turns}, {self.max_total_tokens}"
            )


@dataclass(frozen=True, kw_only=True)
class TurnLog:
    generated_tokens: int
    """Tokens the policy sampled this turn (after any cut to the episode's budget)."""
    observation_tokens: int
    """Environment tokens appended after it (0 when the episode ended)."""
    tool_calls: int
    tool_errors: int
    generate_s: float
    """Wall time of the turn's generate call (shared by every episode running that turn)."""
    environment_s: float
    """Wall time of this episode's ``step``."""
    truncated: bool
    """The turn ended at its token limit (``max_new_tokens`` or the episode's budget), not by itself."""


@dataclass(frozen=True, kw_only=True)
class Episode:
    prompt_ids: list[int]
    response_ids: list[int]
    """Every turn's sampled ids and the observations between them, in order."""
    policy_mask: list[int]
    """1 on sampled ids, 0 on the environment's (same length as ``response_ids``)."""
    behaviour_logprobs: list[float]
    """log p of each sampled id at the sampling temperature; 0 on the environment's ids."""
    reward: float
    """The last reward the environment gave (0 if none)."""
    status: str
    """The final step's ``info["status"]`` (the reward record's), ``no_reward`` or ``infra_error``."""
    answer_ok: bool
    end: str
    """Why it ended: ``done``, ``max_turns``, ``max_tokens`` or ``environment_error``."""
    truncated: bool
    """Ended by a limit, or its last turn was cut at its token limit (an answer the policy did not finish)."""
    turns: tuple[TurnLog, ...]
    turn_texts: tuple[str, ...]
    """Each policy turn's decoded text, as the environment saw it."""
    environment_error: str = ""
    """What the environment raised (``step`` or ``close``), ``"Type: message"``; empty when it raised nothing."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """A ``--reward-mix``'s component rewards (the final step's ``info["reward_components"]``); empty otherwise."""


@dataclass
class _Running:
    """One episode while it runs (mutable)."""

    environment: Environment
    tools: tuple
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[TurnLog] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    end: str | None = None
    error: str = ""

    def room(self, limits: MultiTurnLimits) -> int:
        return limits.max_total_tokens - len(self.response_ids)

    def append(self, ids: list[int], *, policy: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.policy_mask += [int(policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def run_episodes(
    backend: InferenceBackend,
    chat: ChatTurns,
    environments: list[Environment],
    rows: list[dict[str, Any]],
    sampling: SamplingSettings,
    limits: MultiTurnLimits,
) -> list[Episode]:
    """Run one episode per environment (``environments[i]`` on ``rows[i]``) to its end; closes every environment.
    What an environment raised is on its episode (``Episode.environment_error``), not logged here."""
    if len(environments) != len(rows):
        raise ValueError(f"{len(environments)} environments for {len(rows)} rows")
    try:
        running = [_start(chat, environment, row) for environment, row in zip(environments, rows, strict=True)]
        for turn in range(limits.max_turns):
            active = [episode for episode in running if episode.end is None]
            if not active:
                break
            _play_turn(backend, chat, active, sampling, limits, last_turn=turn == limits.max_turns - 1)
    except BaseException:
        for environment in environments:
            _close(environment)  # its errors are secondary to the one on its way up
        raise
    for episode in running:
        episode.error = episode.error or _close(episode.environment)
    return [_finish(episode) for episode in running]


def log_environment_errors(episodes: list[Episode]) -> None:
    """One warning for every episode of a rollout batch whose environment raised: their count, the first error."""
    failed = [episode for episode in episodes if episode.environment_error]
    if failed:
        logger.warning(
            "environment raised in %d of %d episodes (counted in rollout/env_errors); first: %s",
            len(failed),
            len(episodes),
            failed[0].environment_error,
        )


def _start(chat: ChatTurns, environment: Environment, row: dict[str, Any]) -> _Running:
    """The episode's start: ``reset``'s messages as its prompt. A ``reset`` that raises (a plug-in's bug) ends only
    this episode, before its first turn: its prompt is the row's own messages, it has no response, and it is an
    infra_error (no reward, out of the loss)."""
    tools = episode_tools(environment)
    try:
        messages = environment.reset(row)
    except Exception as error:
        fallback = row.get("messages")
        if isinstance(fallback, dict):
            fallback = [fallback]
        elif not isinstance(fallback, list):
            fallback = [{"role": "user", "content": str(fallback or "")}]
        episode = _Running(environment=environment, tools=tools, prompt_ids=chat.prompt_ids(fallback, tools))
        episode.end, episode.reward, episode.info = "environment_error", 0.0, {"status": "infra_error"}
        episode.error = _describe(environment, "reset", error)
        return episode
    return _Running(environment=environment, tools=tools, prompt_ids=chat.prompt_ids(messages, tools))


def _play_turn(
    backend: InferenceBackend,
    chat: ChatTurns,
    active: list[_Running],
    sampling: SamplingSettings,
    limits: MultiTurnLimits,
    *,
    last_turn: bool,
) -> None:
    """One policy turn for every running episode, in one generate call, then each environment's answer."""
    max_new = min(sampling.max_new_tokens, max(episode.room(limits) for episode in active))
    started = time.perf_counter()
    output = backend.generate(
        [episode.prompt_ids + episode.response_ids for episode in active], 1, replace(sampling, max_new_tokens=max_new)
    )
    generate_s = time.perf_counter() - started
    for row, episode in enumerate(active):
        length = int(output.response_mask[row].sum())
        cut = min(length, episode.room(limits))
        ids = [int(t) for t in output.response_ids[row, :cut]]
        episode.append(ids, policy=True, logprobs=[float(x) for x in output.behaviour_logprobs[row, :cut]])
        truncated = bool(output.truncated[row]) or cut < length
        _answer_turn(chat, episode, ids, limits, last_turn=last_turn, generate_s=generate_s, truncated=truncated)


def _answer_turn(
    chat: ChatTurns,
    episode: _Running,
    ids: list[int],
    limits: MultiTurnLimits,
    *,
    last_turn: bool,
    generate_s: float,
    truncated: bool,
) -> None:
    """Step the environment with the turn's text and append its observation, or end the episode."""
    text = chat.tokenizer.decode(ids, skip_special_tokens=True)
    episode.texts.append(text)
    started = time.perf_counter()
    result, error = _step(episode.environment, text)
    environment_s = time.perf_counter() - started
    if result is None:
        episode.end, episode.reward, episode.info = "environment_error", 0.0, {"status": "infra_error"}
        episode.error = error
    else:
        episode.reward = result.reward if result.reward is not None else episode.reward
        episode.info = result.info or episode.info
    observation: list[int] = []
    if episode.end is None:
        if result.done:
            episode.end = "done"
        elif last_turn:
            episode.end = "max_turns"
        elif episode.room(limits) <= 0:
            episode.end = "max_tokens"
        else:
            observation = chat.observation_ids(result.observation, ids[-1] if ids else None)
            if len(observation) >= episode.room(limits):  # no room left for the policy's next turn
                episode.end, observation = "max_tokens", []
            episode.append(observation, policy=False)
    episode.turns.append(
        TurnLog(
            generated_tokens=len(ids),
            observation_tokens=len(observation),
            tool_calls=0 if result is None else result.tool_calls,
            tool_errors=0 if result is None else result.tool_errors,
            generate_s=generate_s,
            environment_s=environment_s,
            truncated=truncated,
        )
    )


def _step(environment: Environment, text: str) -> tuple[StepResult | None, str]:
    """The environment's answer, or None and what it raised (a plug-in's bug must not end the rollout)."""
    try:
        return environment.step(text), ""
    except Exception as error:
        return None, _describe(environment, "step", error)


def _close(environment: Environment) -> str:
    """Close the environment; what it raised, or ``""``."""
    close = getattr(environment, "close", None)
    if callable(close):
        try:
            close()
        except Exception as error:
            return _describe(environment, "close", error)
    return ""


def _describe(environment: Environment, method: str, error: Exception) -> str:
    return f"{type(environment).__name__}.{method} raised {type(error).__name__}: {error}"[:500]


def _finish(episode: _Running) -> Episode:
    scored = episode.reward is not None
    status = episode.info.get("status", "ok" if scored else "no_reward")
    return Episode(
        prompt_ids=episode.prompt_ids,
        response_ids=episode.response_ids,
        policy_mask=episode.policy_mask,
        behaviour_logprobs=episode.logprobs,
        reward=float(episode.reward) if scored else 0.0,
        status=str(status),
        answer_ok=bool(episode.info.get("answer_ok", scored and episode.reward > 0)),
        end=episode.end or "max_turns",
        truncated=episode.end != "done" or bool(episode.turns and episode.turns[-1].truncated),
        turns=tuple(episode.turns),
        turn_texts=tuple(episode.texts),
        environment_error=episode.error,
        reward_components=dict(episode.info.get(REWARD_COMPONENTS, {})),
    )


@dataclass(frozen=True, kw_only=True)
class MultiTurnOutput:
    """Episodes as padded tensors, in ``RolloutBatch``'s layout (N episodes, group-major)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    response_ids: torch.Tensor  # [N, R] right-padded: every turn and observation
    response_mask: torch.Tensor  # [N, R] 1 on every real response token, the environment's included
    policy_mask: torch.Tensor  # [N, R] 1 on sampled tokens only
    behaviour_logprobs: torch.Tensor  # [N, R] 0 on environment tokens and padding
    rewards: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool: ``Episode.truncated``
    episodes: list[Episode]


def collate(episodes: list[Episode], pad_token_id: int) -> MultiTurnOutput:
    """Pad ``episodes`` into tensors (prompts left, responses right)."""
    n = len(episodes)
    prompt_width = max(len(e.prompt_ids) for e in episodes)
    response_width = max(1, max(len(e.response_ids) for e in episodes))
    prompt_ids = torch.full((n, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, prompt_width), dtype=torch.long)
    response_ids = torch.full((n, response_width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n, response_width), dtype=torch.long)
    policy_mask = torch.zeros((n, response_width), dtype=torch.long)
    logprobs = torch.zeros((n, response_width), dtype=torch.float32)
    for row, episode in enumerate(episodes):
        p, r = len(episode.prompt_ids), len(episode.response_ids)
        prompt_ids[row, prompt_width - p :] = torch.tensor(episode.prompt_ids, dtype=torch.long)
        prompt_mask[row, prompt_width - p :] = 1
        if r:
            response_ids[row, :r] = torch.tensor(episode.response_ids, dtype=torch.long)
            response_mask[row, :r] = 1
            policy_mask[row, :r] = torch.tensor(episode.policy_mask, dtype=torch.long)
            logprobs[row, :r] = torch.tensor(episode.behaviour_logprobs, dtype=torch.float32)
    return MultiTurnOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        policy_mask=policy_mask,
        behaviour_logprobs=logprobs,
        rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),
        episodes=episodes,
    )


def turn_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Means over episodes of what their turns did: ``rollout/turns``, ``rollout/tool_calls``, ...; the fraction
    of episodes that called a tool at least once (``rollout/tool_call_rate``) and by how they ended
    (``rollout/end_<reason>``); the count of episodes whose environment raised (``rollout/env_errors``)."""
    n = max(len(episodes), 1)
    metrics = {
        "rollout/turns": sum(len(e.turns) for e in episodes) / n,
        "rollout/tool_calls": sum(t.tool_calls for e in episodes for t in e.turns) / n,
        "rollout/tool_call_rate": sum(any(t.tool_calls for t in e.turns) for e in episodes) / n,
        "rollout/tool_errors": sum(t.tool_errors for e in episodes for t in e.turns) / n,
        "rollout/policy_tokens": sum(sum(e.policy_mask) for e in episodes) / n,
        "rollout/environment_tokens": sum(len(e.policy_mask) - sum(e.policy_mask) for e in episodes) / n,
        "rollout/env_errors": float(sum(bool(e.environment_error) for e in episodes)),
        "time/environment_s": sum(t.environment_s for e in episodes for t in e.turns),
    }
    for reason in ("done", "max_turns", "max_tokens", "environment_error"):
        metrics[f"rollout/end_{reason}"] = sum(e.end == reason for e in episodes) / n
    return metrics

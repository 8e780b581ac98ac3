"""Rewards scored by a model, not a verifier: ``-rt model`` (a reward model) and ``-rt judge`` (a generative judge).

Two places build them. A reward actor builds the scorer it serves (:func:`build_served_scorer`: the reward model, or
the judge's local model) and batches every producer's requests into it. A producer builds its side
(:func:`build_model_reward_scorer`): for a served reward the client to its reward actor (handed in as ``served``,
``colossal_rl/comm/remote_reward.py``), for a judge behind ``--judge-url`` the endpoint client itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from .scorer import RewardScorer
from .user_functions import RewardConfigError

MODEL_REWARD_TYPES = ("model", "judge")


def scoring_dtype(device: str) -> str:
    """The torch dtype a served reward model or local judge loads in on ``device``: ``bfloat16`` on CUDA devices,
    as the trainers' ``--precision auto`` (half the memory of float32: a 14B judge is 28 GB, not 56, before its KV
    cache), ``float32`` elsewhere (CPU scores then equal a float32 reference's)."""
    return "bfloat16" if device.split(":")[0] == "cuda" else "float32"


@dataclass(frozen=True, kw_only=True)
class JudgeSettings:
    """``-rt judge``: its template file, verdict rule, and where the judge runs (an endpoint or a local model)."""

    template: str
    rule: str = "number"
    url: str | None = None
    """An OpenAI-compatible endpoint; None: the judge model (``model``, a path) runs on the reward actors."""
    model: str | None = None
    token_file: str | None = None
    concurrency: int = 8


def build_model_reward_scorer(
    reward_type: str,
    *,
    served: RewardScorer | None,
    judge: JudgeSettings | None,
    timeout_s: float,
    batch_budget_s: float | None,
) -> RewardScorer:
    """A producer's scorer for ``reward_type`` (``model`` or ``judge``): ``served`` (the client to the reward actors)
    unless it is a judge behind an endpoint, which the producer asks itself (each request bounded by ``timeout_s``,
    a batch by ``batch_budget_s``)."""
    if reward_type == "judge":
        if judge is None:
            raise RewardConfigError("reward type 'judge' needs its settings (--judge-template, --judge-model)")
        if judge.url is not None:
            return _endpoint_judge(judge, timeout_s, batch_budget_s)
    elif reward_type != "model":
        raise RewardConfigError(f"{reward_type!r} is not a model-scored reward type {MODEL_REWARD_TYPES}")
    if served is None:
        raise RewardConfigError(
            f"reward type {reward_type!r} is scored on the run's reward actors: the producer needs their client"
        )
    return served


def _endpoint_judge(judge: JudgeSettings, timeout_s: float, batch_budget_s: float | None) -> RewardScorer:
    from .judge import JudgeScorer, JudgeTemplate, parse_verdict_rule
    from .judge_client import JudgeEndpointConfig, OpenAICompatibleJudge

    if judge.model is None:
        raise RewardConfigError("--judge-url needs --judge-model: the model name the endpoint serves the judge under")
    endpoint = JudgeEndpointConfig(
        url=judge.url or "",
        model=judge.model,
        token_file=judge.token_file,
        timeout_s=timeout_s,
        deadline_s=batch_budget_s or 300.0,
        concurrency=judge.concurrency,
    )
    template, rule = JudgeTemplate.from_file(judge.template), parse_verdict_rule(judge.rule)
    return JudgeScorer(template, rule, OpenAICompatibleJudge(endpoint))


def build_served_scorer(
    reward_type: str,
    *,
    reward_model: str | None = None,
    normalisation: str = "sigmoid",
    batch_size: int = 64,
    judge: JudgeSettings | None = None,
    device: str = "cpu",
) -> RewardScorer:
    """What a reward actor scores with: the reward model (``model``) or the judge on its local model (``judge``), in
    :func:`scoring_dtype`'s dtype for ``device``."""
    if reward_type == "model":
        from .reward_model import RewardModelConfig, RewardModelScorer

        if reward_model is None:
            raise RewardConfigError("reward type 'model' needs --reward-model PATH_OR_NAME")
        config = RewardModelConfig(
            normalisation=normalisation, batch_size=batch_size, device=device, dtype=scoring_dtype(device)
        )
        return RewardModelScorer(reward_model, config)
    if reward_type == "judge":
        from .judge import JudgeScorer, JudgeTemplate, parse_verdict_rule
        from .judge_local import LocalModelJudge

        if judge is None or judge.model is None:
            raise RewardConfigError("a local judge needs --judge-template and --judge-model (its path or hub name)")
        backend = LocalModelJudge(judge.model, device=device, batch_size=batch_size, dtype=scoring_dtype(device))
        return JudgeScorer(JudgeTemplate.from_file(judge.template), parse_verdict_rule(judge.rule), backend)
    raise RewardConfigError(f"{reward_type!r} is not served by reward actors; served types: {MODEL_REWARD_TYPES}")

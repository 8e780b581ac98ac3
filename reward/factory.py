"""``build_reward_scorer``: the one place that turns reward settings into a scorer."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .code_runner import LocalCodeRunner, RemoteCodeRunner
from .code_scorer import CodeScorer
from .combined import CombinedScorer, Component, component_name
from .math_scorer import EXTRACTORS, MathRewardConfig, MathScorer
from .model_rewards import MODEL_REWARD_TYPES, JudgeSettings, build_model_reward_scorer
from .sandbox import SandboxConfig
from .scorer import RewardScorer
from .user_functions import PluginScorer, RewardConfigError, load_reward_fn

REWARD_TYPES = (*EXTRACTORS, "code", *MODEL_REWARD_TYPES)
TOKEN_ENV = "COLOSSAL_RL_VERIFIER_TOKEN"
TOKEN_FILE_ENV = "COLOSSAL_RL_VERIFIER_TOKEN_FILE"
_REMOTE_OPTIONS = {"verifier_token", "verifier_token_file", "verifier_timeout_s", "verifier_concurrency"}


def _make_config(cls: type, options: dict[str, Any], what: str):
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise RewardConfigError(f"unknown option(s) {unknown} for {what}; valid options: {sorted(valid)}")
    return cls(**options)


def _verifier_token(options: dict[str, Any]) -> str:
    token = options.get("verifier_token") or os.environ.get(TOKEN_ENV)
    token_file = options.get("verifier_token_file") or os.environ.get(TOKEN_FILE_ENV)
    if not token and token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as error:
            raise RewardConfigError(f"verifier token file {token_file}: {error}") from None
    if not token:
        raise RewardConfigError(
            f"code_verifier_url needs the server's token: option verifier_token(_file) or ${TOKEN_ENV}(_FILE)"
        )
    return token


def _code_scorer(code_verifier_url: str | None, options: dict[str, Any]) -> CodeScorer:
    if code_verifier_url is None:
        return CodeScorer(LocalCodeRunner(_make_config(SandboxConfig, options, "reward type 'code' (local sandbox)")))
    unknown = sorted(set(options) - _REMOTE_OPTIONS)
    if unknown:
        raise RewardConfigError(
            f"option(s) {unknown} do not apply with code_verifier_url (set them on the server); "
            f"valid: {sorted(_REMOTE_OPTIONS)}"
        )
    runner = RemoteCodeRunner(
        code_verifier_url,
        _verifier_token(options),
        timeout_s=float(options.get("verifier_timeout_s", 180.0)),
        concurrency=int(options.get("verifier_concurrency", 8)),
    )
    return CodeScorer(runner)


def build_reward_scorer(
    reward_type: str = "boxed",
    code_verifier_url: str | None = None,
    reward_fn: str | None = None,
    reward_timeout_s: float = 10.0,
    reward_batch_budget_s: float | None = None,
    reward_mix: Sequence[tuple[str, float]] = (),
    served: RewardScorer | None = None,
    judge: JudgeSettings | None = None,
    **options: Any,
) -> RewardScorer:
    """A scorer for ``reward_type``; ``reward_fn`` (a user plug-in) replaces the built-in scorer, each call run in a
    worker process and bounded by ``reward_timeout_s`` (a run passes ``--reward-timeout``; this default is its), a
    whole batch by ``reward_batch_budget_s`` (a run passes half its ``--timeout``).

    Options: math types take :class:`MathRewardConfig` fields (``timeout_s``, ``num_workers``, ...);
    ``code`` takes :class:`SandboxConfig` fields, or with ``code_verifier_url`` the client options
    ``verifier_token``, ``verifier_token_file``, ``verifier_timeout_s``, ``verifier_concurrency``.
    ``reward_mix``: ``(spec, weight)`` pairs, each spec a reward type or a plug-in spec; the scorer is their weighted
    sum (:class:`~.combined.CombinedScorer`, the first component's status and answer_ok), built-in components with
    their default options (``code_verifier_url`` goes to a ``code`` component), plug-ins bounded as ``reward_fn`` is.
    ``model`` and ``judge`` (:mod:`.model_rewards`): ``served`` is the producer's client to the run's reward actors,
    ``judge`` the judge's settings (an endpoint judge is asked from here).
    Raises :class:`RewardConfigError` for anything invalid.
    """
    if reward_mix:
        if reward_fn is not None or options:
            given = ["reward_fn"] * (reward_fn is not None) + sorted(options)
            raise RewardConfigError(f"{given} do not apply with reward_mix: put a plug-in in the mix itself")
        models = {"served": served, "judge": judge}
        return _combined_scorer(reward_mix, code_verifier_url, reward_timeout_s, reward_batch_budget_s, models)
    if reward_fn is not None:
        if options:
            raise RewardConfigError(f"options {sorted(options)} do not apply to a reward_fn plug-in")
        return PluginScorer(
            load_reward_fn(reward_fn), reward_fn, timeout_s=reward_timeout_s, batch_budget_s=reward_batch_budget_s
        )
    if reward_type not in REWARD_TYPES:
        raise RewardConfigError(f"unknown reward_type {reward_type!r}; expected one of {list(REWARD_TYPES)}")
    if reward_type in MODEL_REWARD_TYPES:
        if options or code_verifier_url is not None:
            raise RewardConfigError(f"options {sorted(options)} / code_verifier_url do not apply to {reward_type!r}")
        return build_model_reward_scorer(
            reward_type, served=served, judge=judge, timeout_s=reward_timeout_s, batch_budget_s=reward_batch_budget_s
        )
    if reward_type == "code":
        return _code_scorer(code_verifier_url, options)
    if code_verifier_url is not None:
        raise RewardConfigError(f"code_verifier_url applies to reward_type 'code', not {reward_type!r}")
    config = _make_config(MathRewardConfig, options, f"reward type {reward_type!r}")
    return MathScorer(reward_type, config)


def _combined_scorer(
    reward_mix: Sequence[tuple[str, float]],
    code_verifier_url: str | None,
    reward_timeout_s: float,
    reward_batch_budget_s: float | None,
    models: dict[str, Any],
) -> CombinedScorer:
    """The weighted sum of ``reward_mix``'s scorers; components already built are closed if a later one fails."""
    specs = [spec for spec, _ in reward_mix]
    if code_verifier_url is not None and "code" not in specs:
        raise RewardConfigError(f"code_verifier_url applies to a 'code' component, and the mix is {specs}")
    components: list[Component] = []
    try:
        for spec, weight in reward_mix:
            if spec in MODEL_REWARD_TYPES:
                scorer = build_reward_scorer(
                    spec, reward_timeout_s=reward_timeout_s, reward_batch_budget_s=reward_batch_budget_s, **models
                )
            elif spec in REWARD_TYPES:
                url = code_verifier_url if spec == "code" else None
                scorer = build_reward_scorer(spec, url, reward_timeout_s=reward_timeout_s)
            elif ":" in spec:
                scorer = build_reward_scorer(
                    reward_fn=spec, reward_timeout_s=reward_timeout_s, reward_batch_budget_s=reward_batch_budget_s
                )
            else:
                raise RewardConfigError(
                    f"reward mix component {spec!r}: neither a reward type {list(REWARD_TYPES)} nor a plug-in "
                    "'path/to/file.py:function' or 'module:function'"
                )
            components.append(Component(component_name(spec), float(weight), scorer))
        return CombinedScorer(components)
    except BaseException:
        for component in components:
            component.scorer.close()
        raise

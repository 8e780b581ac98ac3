"""The fields a run config derives from its other fields, filled in once: :func:`resolve`.

A derived field left unset (None) takes its value from the rest of the config here, and only here; a value
set explicitly (by ``RLConfig(...)``, a flag or a ``--config`` file) is kept. Every run goes through
:func:`resolve`: ``run_training`` resolves the config it is given, and the command line resolves the config
it builds (to print it with ``--print-config`` and to name the flag in errors), so ``RLConfig(...)`` and the
flags that set the same fields make the same run. Pure and idempotent: a resolved config resolves to itself.
Imports no torch.
"""

from __future__ import annotations

from colossal_rl.config import (
    EMBEDDED_EVAL_DATA,
    EMBEDDED_TRAIN_DATA,
    TRUNCATED_IS_CAP,
    AlgorithmConfig,
    DataConfig,
    GenerationConfig,
    RLConfig,
    replace,
)

__all__ = ["DATA_SEED_OFFSET", "SOFT_PUNISHMENT_MAX_WINDOW", "resolve", "resolve_algorithm"]

DATA_SEED_OFFSET = 42
"""``data.seed`` = ``run.seed`` + this, unless set (ColossalChat's default pair: run seed 0, data seed 42)."""
SOFT_PUNISHMENT_MAX_WINDOW = 1024
"""DAPO's soft over-length window: a quarter of the response budget, at most this many tokens."""
THINK_ANSWER_STOP = "</answer>"
"""Generation stops after the answer tag with the ``think_answer_tags`` reward (the rest would not be scored)."""


def resolve(config: RLConfig) -> RLConfig:
    """``config`` with every derived field that is unset (None) filled in from the other fields."""
    return replace(
        config,
        data=_resolve_data(config.data, run_seed=config.run.seed),
        generation=_resolve_generation(config.generation, reward_type=config.reward.reward_type),
        algorithm=resolve_algorithm(
            config.algorithm, max_new_tokens=config.generation.max_new_tokens, n_behind=config.schedule.policy_lag
        ),
    )


def resolve_algorithm(algorithm: AlgorithmConfig, *, max_new_tokens: int, n_behind: int) -> AlgorithmConfig:
    """The algorithm's fields that depend on the run: DAPO's soft punishment window (``cache_length``) on the
    response budget, the truncated importance weight's cap on whether producers may run behind."""
    changes = {}
    if algorithm.cache_length is None:
        window = min(SOFT_PUNISHMENT_MAX_WINDOW, max_new_tokens // 4)
        changes["cache_length"] = window if algorithm.soft_over_length_punishment else 0
    if algorithm.truncated_is_cap is None and algorithm.truncated_is_when_behind and n_behind > 0:
        changes["truncated_is_cap"] = TRUNCATED_IS_CAP
    return replace(algorithm, **changes)


def _resolve_data(data: DataConfig, *, run_seed: int) -> DataConfig:
    changes = {}
    if data.seed is None:
        changes["seed"] = run_seed + DATA_SEED_OFFSET
    if data.eval_paths is None:
        embedded = data.train_path == str(EMBEDDED_TRAIN_DATA)
        changes["eval_paths"] = (("math", str(EMBEDDED_EVAL_DATA)),) if embedded else ()
    return replace(data, **changes)


def _resolve_generation(generation: GenerationConfig, *, reward_type: str) -> GenerationConfig:
    if generation.stop_strings is not None:
        return generation
    stop_strings = (THINK_ANSWER_STOP,) if reward_type == "think_answer_tags" else ()
    return replace(generation, stop_strings=stop_strings)

"""Training engines by name: ``colossalai`` (Booster plugins, the trainers' environment) and ``fsdp2`` (torch's
``fully_shard``, the producers' environment with today's torch and transformers). Imported only when chosen.

Which engine a run uses is ``parallel.trainer_backend`` (``--trainer-backend``); the driver resolves ``auto`` before
Ray starts (``colossal_rl/trainer_backend.py``). A trainer built outside a run with ``auto`` takes ColossalAI where
it is installed, else FSDP2.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colossal_rl.config import RLConfig
    from colossal_rl.training.engines.base import TrainEngine

ENGINES: dict[str, str] = {
    "colossalai": "colossal_rl.training.engines.colossalai_engine:ColossalAIEngine",
    "fsdp2": "colossal_rl.training.engines.fsdp2_engine:FSDP2Engine",
}
"""Engine name -> ``module:class``; the class takes the run's config."""


def engine_name(config: RLConfig) -> str:
    """The engine ``config`` asks for, with ``auto`` resolved in this process (ColossalAI if installed)."""
    name = config.parallel.trainer_backend
    if name == "auto":
        return "colossalai" if importlib.util.find_spec("colossalai") is not None else "fsdp2"
    return name


def make_engine(config: RLConfig) -> TrainEngine:
    name = engine_name(config)
    if name not in ENGINES:
        raise ValueError(f"parallel.trainer_backend: unknown engine {name!r}; choose from {sorted(ENGINES)}")
    module_name, class_name = ENGINES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)(config)

"""Several named rewards as one: ``reward = Σ weight_i · reward_i`` (``--reward-mix``, TRL's ``reward_weights``).

Each component is an ordinary scorer (a built-in type or a plug-in, each bounded in time as it is alone); this
module only runs them side by side and adds their rewards up. The FIRST component is the verifiable one: its
status, format_ok and answer_ok are the combined record's, so ``rollout/accuracy`` counts its answers. A sample
that any component could not score is an ``infra_error`` naming that component (masked out of the loss, as
always). Every record carries each component's reward in ``details["components"]`` (what
``rollout/reward_<name>_mean`` averages) and its details in ``details["component_details"]``.
Imports neither torch nor Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .records import INFRA_ERROR, RewardRecord, infra_error
from .scorer import RewardScorer
from .user_functions import RewardConfigError

COMPONENTS = "components"
"""``details`` key of a combined record: component name -> its (unweighted) reward."""
COMPONENT_DETAILS = "component_details"
"""``details`` key of a combined record: component name -> its record's details."""


def component_name(spec: str) -> str:
    """The name a mix component is logged under: a built-in type's own (``boxed``), a plug-in's function name
    (``my_rewards.py:brevity`` -> ``brevity``). ``config.mix_component_name`` is the same rule (the config imports
    nothing of ``reward/``)."""
    return spec.rpartition(":")[2]


@dataclass(frozen=True)
class Component:
    name: str
    weight: float
    scorer: RewardScorer


def combine_records(components: Sequence[tuple[str, float]], records: Sequence[RewardRecord]) -> RewardRecord:
    """One sample's record from its components' ``(name, weight)`` and records, in the mix's order."""
    rewards = {name: float(record.reward) for (name, _), record in zip(components, records, strict=True)}
    details = {
        COMPONENTS: rewards,
        COMPONENT_DETAILS: {name: record.details for (name, _), record in zip(components, records, strict=True)},
    }
    for (name, _), record in zip(components, records, strict=True):
        if record.status == INFRA_ERROR:
            error = record.details.get("error", "")
            return infra_error(f"reward mix component {name!r} could not score: {error}", component=name, **details)
    total = sum(weight * record.reward for (_, weight), record in zip(components, records, strict=True))
    first = records[0]
    return RewardRecord(float(total), first.format_ok, first.answer_ok, first.status, details)


def component_means(per_sample: Sequence[Mapping[str, float]], names: Sequence[str]) -> dict[str, float]:
    """Each named component's mean reward over ``per_sample`` (the samples to average: leave infra errors out); a
    sample without a component's reward (an episode that never answered) counts 0; no samples: 0."""
    count = max(len(per_sample), 1)
    return {name: sum(float(sample.get(name, 0.0)) for sample in per_sample) / count for name in names}


class CombinedScorer:
    """Scores with every component, in parallel threads (each scorer bounds its own calls), and combines the
    records (:func:`combine_records`). Weight 0 is allowed: the component is scored and logged, not trained on."""

    def __init__(self, components: Sequence[Component]):
        if not components:
            raise RewardConfigError("a reward mix needs at least one component")
        names = [component.name for component in components]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise RewardConfigError(
                f"reward mix: component name(s) {repeated} repeat; each is logged as rollout/reward_<name>_mean, "
                "so give the plug-in functions different names"
            )
        self.components = tuple(components)

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        if len(responses) != len(rows):
            raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
        # side by side, so a batch takes as long as its slowest component, within the one batch budget
        with ThreadPoolExecutor(max_workers=len(self.components), thread_name_prefix="reward-mix") as pool:
            futures = [pool.submit(c.scorer.score_batch, responses, rows) for c in self.components]
            per_component = [future.result() for future in futures]
        weights = [(c.name, c.weight) for c in self.components]
        return [combine_records(weights, records) for records in zip(*per_component, strict=True)]

    def close(self) -> None:
        for component in self.components:
            component.scorer.close()

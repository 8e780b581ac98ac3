"""``ProducerRestarts.restore_weights``: a producer killed again while it is given its weights back is restarted
while its budget allows, and past the budget the run ends naming ``--max-actor-restarts``, wherever the kill lands
(in the sync's calls, or while the sync group is formed again before them)."""

from __future__ import annotations

import pytest

from colossal_rl.driver.calls import ActorId, RunFailed
from colossal_rl.driver.producer_restarts import ProducerRestarts

PRODUCER_0 = ActorId("producer", 0)


def killed_while_joining(ranks):
    raise RunFailed("producer 0 (join_weight_sync) died: the actor is dead", {PRODUCER_0: "died"})


def test_a_producer_killed_while_its_sync_group_forms_again_past_its_budget_ends_the_run_naming_the_budget():
    restarts = ProducerRestarts([object()], max_restarts=1, timeout_s=1.0)
    with pytest.raises(RunFailed, match=r"join_weight_sync\) died.*--max-actor-restarts 1 used up") as failed:
        restarts.restore_weights([0], killed_while_joining)
    assert failed.value.outcomes == {PRODUCER_0: "died"}
    assert restarts.counts == [1]

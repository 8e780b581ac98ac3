"""A producer's scorer over a shared reward actor (``colossal_rl/comm/remote_reward.py``), around fake actor handles:
producer ``p`` uses actor ``p mod N``; a dead actor's request is sent again (Ray restarts it), every sample scored
once; no answer in time, or no restart left, makes every sample an ``infra_error`` naming the actor, never a hang."""

from __future__ import annotations

import time

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from colossal_rl.comm import remote_reward
from colossal_rl.comm.remote_reward import RemoteRewardScorer
from colossal_rl.reward.records import INFRA_ERROR, RewardRecord


class FakeActor:
    """``score.remote(messages, responses)`` returns a 'ref' (a callable) that ``ray.get`` (patched) calls."""

    def __init__(self, name: str, outcomes: list):
        self.name, self.outcomes, self.requests = name, outcomes, []
        self.score = self

    def remote(self, messages, responses):
        self.requests.append((messages, responses))
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        return lambda: self._answer(outcome, responses)

    def _answer(self, outcome, responses):
        if outcome == "died":
            raise RayActorError()
        if outcome == "slow":
            raise GetTimeoutError()
        return [RewardRecord(float(len(r)), True, True, "ok", {"actor": self.name}) for r in responses]


@pytest.fixture(autouse=True)
def fake_ray_get(monkeypatch):
    monkeypatch.setattr(remote_reward.ray, "get", lambda ref, timeout: ref())
    monkeypatch.setattr(remote_reward.time, "sleep", lambda seconds: None)


ROWS = [{"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}, {"messages": [], "answer": "x"}]


def test_a_rows_messages_and_reference_answer_are_sent_and_nothing_else():
    actor = FakeActor("a0", [])
    row = {"messages": [{"role": "user", "content": "2+2?"}], "gt_answer": "4", "images": ["big.png"]}
    RemoteRewardScorer([actor], 0, timeout_s=5, label="-rt judge").score_batch(["4"], [row])
    assert actor.requests == [([{"messages": row["messages"], "gt_answer": "4"}], ["4"])]


def test_each_producer_sends_to_its_actor_the_prompts_messages_and_responses():
    actors = [FakeActor("a0", []), FakeActor("a1", [])]
    records = RemoteRewardScorer(actors, 3, timeout_s=5, label="-rt model").score_batch(["ab", "abc"], ROWS)
    assert [r.reward for r in records] == [2.0, 3.0] and {r.details["actor"] for r in records} == {"a1"}
    sent = [{"messages": row["messages"]} for row in ROWS]  # the messages, and a reference answer when there is one
    assert actors[1].requests == [(sent, ["ab", "abc"])]
    assert actors[0].requests == []


def test_a_dead_actor_is_asked_again_and_every_sample_is_scored_once():
    actor = FakeActor("a0", ["died", "ok"])
    records = RemoteRewardScorer([actor], 0, timeout_s=5, label="-rt model").score_batch(["ab", "abc"], ROWS)
    assert [r.status for r in records] == ["ok", "ok"] and len(actor.requests) == 2


def test_an_actor_dead_on_every_attempt_gives_infra_errors_naming_it():
    actor = FakeActor("a0", ["died"] * 3)
    records = RemoteRewardScorer([actor], 0, timeout_s=5, attempts=3, label="-rt model").score_batch(["ab"], ROWS[:1])
    assert [r.status for r in records] == [INFRA_ERROR] and len(actor.requests) == 3
    assert records[0].details["error"] == "-rt model: reward actor 0 unavailable after 3 attempts"


def test_no_answer_in_time_gives_infra_errors_at_once():
    actor = FakeActor("a0", ["slow", "ok"])
    started = time.perf_counter()
    records = RemoteRewardScorer([actor], 0, timeout_s=5, label="-rt model").score_batch(["ab", "c"], ROWS)
    assert [r.status for r in records] == [INFRA_ERROR] * 2 and len(actor.requests) == 1
    assert "no answer within 5s" in records[0].details["error"] and time.perf_counter() - started < 1


def test_an_empty_batch_asks_nothing():
    actor = FakeActor("a0", [])
    assert RemoteRewardScorer([actor], 0, timeout_s=5, label="-rt model").score_batch([], []) == []
    assert actor.requests == []

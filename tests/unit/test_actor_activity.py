"""What a busy actor is doing, as the driver tells it when the actor does not answer in time: phases published on
an activity board (a fake store here, Ray's key-value store in a run) and named in the timeout message."""

import pytest

from colossal_rl.config import RewardConfig
from colossal_rl.driver.calls import ActorId, Call, late_message
from colossal_rl.profiling import Activity, ActivityBoard, PhaseRecorder


class DictStore:
    def __init__(self):
        self.values = {}

    def put(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values.get(key)


class BrokenStore:
    def put(self, key, value):
        raise ConnectionError("GCS unreachable")

    def get(self, key):
        raise ConnectionError("GCS unreachable")


def test_a_recorder_publishes_each_phase_with_its_detail_and_idle_after_it():
    board = ActivityBoard(DictStore(), run="job1")
    recorder = PhaseRecorder(enabled=False)  # publishing does not need profiling on
    recorder.publish_to(board, "producer 0")
    assert board.read("producer 0") is None
    with recorder.record("generate"):
        assert board.read("producer 0").phase == "generate"
        with recorder.record("reward", "--reward-fn hang.py:score"):
            now = board.read("producer 0")
            assert (now.phase, now.detail) == ("reward", "--reward-fn hang.py:score")
        assert board.read("producer 0").phase == "generate"  # back in the enclosing phase
    after = board.read("producer 0")
    assert (after.phase, after.detail) == ("idle", "after generate")
    assert ActivityBoard(board.store, run="job2").read("producer 0") is None  # another run's keys


def test_a_failing_store_costs_the_diagnosis_not_the_phase():
    recorder = PhaseRecorder()
    recorder.publish_to(ActivityBoard(BrokenStore(), run="job1"), "trainer 0")
    with recorder.record("wait"):
        pass
    assert [span.phase for span in recorder.drain()] == ["wait"]
    assert ActivityBoard(BrokenStore(), run="job1").read("trainer 0") is None


def test_the_timeout_message_says_what_each_late_actor_is_doing():
    board = ActivityBoard(DictStore(), run="job1")
    label = RewardConfig(reward_fn="plugins/hang.py:score").label
    board.publish("producer 0", Activity("reward", label, since=1000.0))
    board.publish("trainer 0", Activity("wait", "", since=1002.0))
    late = [
        Call(ActorId("trainer", 0), "train_steps", ref=None),
        Call(ActorId("producer", 0), "produce", ref=None),
        Call(ActorId("producer", 1), "produce", ref=None),  # published nothing (yet)
    ]
    assert late_message(late, 60, board, now=1060.4) == (
        "no answer within 60s from: trainer 0 (train_steps; now wait, for 58s), "
        "producer 0 (produce; now reward, --reward-fn plugins/hang.py:score, for 60s), producer 1 (produce)"
    )


@pytest.mark.parametrize(
    ("reward", "label"),
    [(RewardConfig(), "-rt boxed"), (RewardConfig(reward_type="code"), "-rt code")],
)
def test_the_reward_label_names_the_built_in_reward(reward, label):
    assert reward.label == label

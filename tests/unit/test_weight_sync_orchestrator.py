"""The one weight-sync orchestrator (``colossal_rl/driver/weight_sync.py``): which actors get which calls, in which
order, for each caller (a run's start, a resume, the schedule loop's syncs, a sync made again, a
producer restart), on fake actor groups that log every call they are asked for. No Ray."""

from __future__ import annotations

from fake_actor_groups import fake_sync as orchestrator
from fake_actor_groups import results


def methods(log: list) -> list[tuple[str, str]]:
    return [(actor, method) for actor, method, _ in log]


FORMATION = [
    ("trainer 0", "weight_sync_address"),
    ("trainer 0", "setup_weight_sync"),
    ("trainer 1", "setup_weight_sync"),
    ("producer 0", "join_weight_sync"),
    ("producer 1", "join_weight_sync"),
]
SYNC = [
    ("trainer 0", "push_weights"),
    ("trainer 1", "push_weights"),
    ("producer 0", "receive_weights"),
    ("producer 1", "receive_weights"),
]


def test_a_run_starts_by_forming_the_sync_from_the_senders_keeping_version_0():
    sync, log, ready = orchestrator()
    sync.start(ready, retain=True)
    assert methods(log) == FORMATION
    assert sync.senders == [0] and sync.formations == 1 and not sync.stale
    assert sync.retained_weights == ["copy v0"]
    assert log[1][2][1] is True  # the trainers are asked to retain


def test_a_resume_forms_without_a_copy_then_syncs_every_producer_to_the_checkpoints_version():
    sync, log, ready = orchestrator()
    sync.start(ready, retain=False)
    assert sync.retained_weights == [] and log[1][2][1] is False
    log.clear()
    calls = sync.sync_to(7, reason="resume")
    assert methods(log) == SYNC and [call.method for call in calls] == [method for _, method in SYNC]
    assert all(args == (7,) for _, _, args in log)
    sync.synced(results(calls))
    assert sync.retained_weights == ["copy 7"]


def test_a_sync_of_every_producer_pushes_from_the_trainers_first_then_the_producers_receive():
    sync, log, ready = orchestrator(num_trainers=1, num_producers=3)
    sync.start(ready, retain=True)
    log.clear()
    sync.sync_to(1, reason="end of round 0")
    assert methods(log) == [("trainer 0", "push_weights")] + [(f"producer {r}", "receive_weights") for r in range(3)]


def test_a_completed_sync_with_no_copy_keeps_the_previous_one():
    """Without ``--max-actor-restarts`` the trainers retain nothing: the old (version 0) copy stays."""
    sync, log, ready = orchestrator()
    sync.start(ready, retain=True)
    sync.synced([[], [], None, None])
    assert sync.retained_weights == ["copy v0"]


def test_a_restarted_producer_alone_loads_the_retained_copy_and_the_next_sync_forms_the_group_again():
    sync, log, ready = orchestrator(num_producers=3)
    sync.start(ready, retain=True)
    sync.synced(results(sync.sync_to(4, reason="step 4")))
    log.clear()

    sync.sync_to(4, producers=[1], reason="producer restart")
    assert log == [("producer 1", "restore_weights", (4, ["copy 4"]))]  # no trainer and no other producer called
    assert sync.stale
    log.clear()

    sync.sync_to(5, reason="step 5")
    assert methods(log) == FORMATION[:3] + [(f"producer {r}", "join_weight_sync") for r in range(3)] + [
        ("trainer 0", "push_weights"),
        ("trainer 1", "push_weights"),
    ] + [(f"producer {r}", "receive_weights") for r in range(3)]
    assert sync.formations == 2 and not sync.stale
    assert log[1][2][1] is False  # formed again without a copy: the copy of version 4 stays the restart's


def test_a_broken_sync_made_again_forms_the_group_anew_once():
    sync, log, ready = orchestrator()
    sync.start(ready, retain=True)
    sync.broken()
    log.clear()
    sync.sync_to(3, reason="sync made again")
    sync.sync_to(4, reason="step 4")
    assert methods(log) == FORMATION + SYNC + SYNC
    assert sync.formations == 2


def test_each_formation_gets_fresh_file_prefixes():
    sync, log, ready = orchestrator(mode="files")
    sync.start(ready, retain=True)
    sync.broken()
    sync.sync_to(1, reason="step 1")
    prefixes = [args[0][0].file_prefix for _, method, args in log if method == "setup_weight_sync" and args[0]]
    assert prefixes[0] == "f1-stage0" and prefixes[-1] == "f2-stage0"


def test_a_formation_a_producer_died_in_cancels_all_its_calls_and_stays_to_be_formed():
    """The trainer hosting the group would otherwise wait for the dead producer until ``--timeout``, and every
    later call on it (the next formation) behind that."""
    import pytest

    from colossal_rl.driver.calls import RunFailed

    sync, log, ready = orchestrator()
    wait = sync.wait

    def producer_1_died(groups):
        if any(call.method == "join_weight_sync" for calls in groups for call in calls):
            raise RunFailed("producer 1 (join_weight_sync) died", {groups[-1][1].actor: "died"})
        return wait(groups)

    sync.wait = producer_1_died
    with pytest.raises(RunFailed, match="producer 1"):
        sync.start(ready, retain=True)
    cancelled = [args for actor, method, args in log if method == "cancel"]
    assert cancelled == [
        (
            "trainer 0 (setup_weight_sync)",
            "trainer 1 (setup_weight_sync)",
            "producer 0 (join_weight_sync)",
            "producer 1 (join_weight_sync)",
        )
    ]
    sync.wait = wait
    log.clear()
    sync.sync_to(1, reason="test")  # the group was never formed: the next sync forms it first
    assert methods(log) == FORMATION + SYNC and sync.formations == 2

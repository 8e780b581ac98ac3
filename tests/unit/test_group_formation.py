"""A weight-sync group forms only with every member (``gather_members``), waits for them at most ``--timeout``, and
stops waiting at once when its formation is abandoned: a member died, the driver cancelled the formation's calls,
and the trainer hosting the group must be free for the next formation instead of waiting out the timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from colossal_rl.comm.process_group import (
    MEMBERS_KEY,
    CollectiveTimeoutError,
    FormationAbandoned,
    create_standalone_group,
    find_free_port,
    formations_abandoned_when,
    gather_members,
)


def form_in_thread(form) -> dict:
    """Run ``form()`` in a daemon thread; what it returned or raised, and when it ended (None: still running)."""
    outcome: dict = {"ended": None}

    def body():
        try:
            outcome["result"] = form()
        except Exception as error:  # noqa: BLE001
            outcome["error"] = error
        outcome["ended"] = time.monotonic()

    threading.Thread(target=body, daemon=True).start()
    return outcome


def wait_until_ended(outcome: dict, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while outcome["ended"] is None and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_host_of_a_group_a_member_never_joins_stops_waiting_once_the_formation_is_abandoned():
    port, abandon = find_free_port(), threading.Event()

    def host():
        with formations_abandoned_when(abandon.is_set):
            return create_standalone_group("gloo", 0, 2, "127.0.0.1", port, timeout_s=600.0)

    outcome = form_in_thread(host)
    time.sleep(1.0)
    assert outcome["ended"] is None  # still waiting for member 1
    abandoned_at = time.monotonic()
    abandon.set()
    wait_until_ended(outcome, timeout_s=60)  # a tenth of its own timeout, however loaded the machine
    assert outcome["ended"] is not None, "the host waited on after its formation was abandoned"
    assert outcome["ended"] - abandoned_at < 60
    assert isinstance(outcome.get("error"), FormationAbandoned), outcome
    assert "1 of 2 members joined" in str(outcome["error"])


def test_without_abandonment_a_missing_member_times_the_formation_out_naming_the_count():
    port = find_free_port()
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"could not gather all 2 members within 1\.5s"):
        create_standalone_group("gloo", 0, 2, "127.0.0.1", port, timeout_s=1.5)
    assert time.monotonic() - started < 10


def test_a_formation_abandoned_in_another_thread_does_not_stop_this_ones():
    """The abandonment is the caller's (a Ray call's), per thread: another thread's formation is untouched."""
    port = find_free_port()
    with formations_abandoned_when(lambda: True):
        members = [form_in_thread(lambda rank=rank: create_standalone_group("gloo", rank, 2, "127.0.0.1", port, 20.0))
                   for rank in (0, 1)]  # fmt: skip
    for outcome in members:
        wait_until_ended(outcome, timeout_s=30)
    assert [type(outcome.get("result")).__name__ for outcome in members] == ["StandaloneGroup"] * 2, members


def test_every_member_counts_itself_once_and_waits_for_the_last():
    store, clock = dist.HashStore(), [0.0]
    ended: list[int] = []

    def member(rank):
        gather_members(store, rank=rank, world_size=3, timeout_s=30, name="g", clock=lambda: clock[0])
        ended.append(rank)

    threads = [threading.Thread(target=member, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    assert ended == [] and store.add(MEMBERS_KEY, 0) == 2
    member(2)
    for thread in threads:
        thread.join(timeout=5)
    assert sorted(ended) == [0, 1, 2] and store.add(MEMBERS_KEY, 0) == 3


def test_the_member_wait_is_bounded_by_its_own_clock():
    store, now = dist.HashStore(), [0.0]

    def sleep(seconds):
        now[0] += seconds

    with pytest.raises(
        CollectiveTimeoutError, match=r"rank 1 could not gather all 2 members within 5\.0s \(1 joined\)"
    ):
        gather_members(store, rank=1, world_size=2, timeout_s=5.0, name="g", clock=lambda: now[0], sleep=sleep)
    assert 5.0 <= now[0] < 5.2

"""Every wait of the trainers' collectives is bounded by ``--timeout`` (issue 33, items 6 and 10)."""

from __future__ import annotations

import dataclasses
import datetime
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from process_members import run_members

from colossal_rl.comm.process_group import (
    CollectiveError,
    CollectiveTimeoutError,
    StandaloneGroup,
    create_standalone_group,
    find_free_port,
)
from colossal_rl.config import RLConfig
from colossal_rl.profiling import PhaseRecorder


class Recorded(Exception):
    pass


def test_the_trainers_process_group_gets_the_runs_timeout(monkeypatch):
    """Without one, torch's default (10 minutes) bounds ColossalAI's collectives whatever --timeout says."""
    import colossal_rl.training.booster_plugins as booster_plugins
    from colossal_rl.training.trainer import Trainer

    def record(**kwargs):
        raise Recorded(kwargs)

    monkeypatch.setattr(booster_plugins.dist, "init_process_group", record)
    config = RLConfig()
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, timeout_s=1234.0))
    with pytest.raises(Recorded) as recorded:
        Trainer(0, 1, config, "127.0.0.1", 0).setup()
    assert recorded.value.args[0]["timeout"] == datetime.timedelta(seconds=1234.0)


# --- item 6: an NCCL weight-sync collective that never finishes -----------------------------------------------

SYNC_TIMEOUT_S = 0.5


class NeverCompletingWork:
    """ProcessGroupNCCL's ``Work`` without blocking wait: ``wait`` only orders CUDA streams and returns at once;
    whether the collective finished is ``is_completed``'s to say (here: never, as with a dead member)."""

    def __init__(self):
        self.waits = 0

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        return True


class FakeNcclProcessGroup:
    def __init__(self):
        self.works: list[NeverCompletingWork] = []
        self.shut_down = False

    def broadcast(self, tensors, options):
        self.works.append(NeverCompletingWork())
        return self.works[-1]

    def _shutdown(self):
        self.shut_down = True


def nccl_group(process_group) -> StandaloneGroup:
    return StandaloneGroup(
        process_group, dist.HashStore(), backend="nccl", name="sync", rank=0, world_size=2, timeout_s=SYNC_TIMEOUT_S
    )


def test_an_nccl_broadcast_that_never_finishes_times_out_aborts_and_breaks_the_group():
    process_group = FakeNcclProcessGroup()
    group = nccl_group(process_group)
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"broadcast of 8 x torch.uint8 from 0 did not finish within 0.5s"):
        group.broadcast(torch.zeros(8, dtype=torch.uint8), 0)
    assert SYNC_TIMEOUT_S <= time.monotonic() - started < 10 * SYNC_TIMEOUT_S
    assert process_group.shut_down  # the communicator is aborted: its kernels return, nothing queues behind them
    assert process_group.works[0].waits == 0  # never made the current stream wait for a stuck kernel
    with pytest.raises(RuntimeError, match="was destroyed"):  # unusable: the driver forms a new group
        group.broadcast_async(torch.zeros(8, dtype=torch.uint8), 0)


def test_a_gloo_broadcast_to_a_member_that_died_fails_the_same_way():
    """The gloo path, for comparison: a CollectiveError naming the broadcast and the group, which the driver's
    recovery (a new group, the sync made again) handles; the NCCL timeout above is one too."""
    port = find_free_port()

    def sender():
        group = create_standalone_group("gloo", 0, 2, "127.0.0.1", port, timeout_s=10.0)
        group.store.set("sender_formed", "1")
        try:
            group.broadcast(torch.zeros(8, dtype=torch.uint8), 0)
        except CollectiveError as error:
            return error
        return None

    def dying_member():
        group = create_standalone_group("gloo", 1, 2, "127.0.0.1", port, timeout_s=10.0)
        # once the sender's side of the group is formed too (gloo connects both sides; leaving before the other
        # finished would fail its formation instead, a failure the driver's recovery handles elsewhere)
        group.store.wait(["sender_formed"], datetime.timedelta(seconds=10))
        return "left"  # its process ends without receiving: a producer killed mid-sync

    error, _ = run_members([sender, dying_member], timeout_s=30)
    assert isinstance(error, CollectiveError), error
    assert "broadcast of 8 x torch.uint8 from 0 failed" in str(error)


def test_a_member_below_a_dead_one_fails_at_once_instead_of_waiting_out_the_timeout():
    """gloo broadcasts down a tree: with member 1 dead, the sender fails sending to it and never reaches member 2.
    The sender leaves the group on that failure, so member 2's receive fails as a member death (CollectiveError),
    not as a CollectiveTimeoutError after ``timeout_s`` (a run's ``--timeout``: its recovery waited that long).
    The sender's process lives on until member 2 has its answer, as a trainer does after a failed sync."""
    import multiprocessing

    port, timeout_s = find_free_port(), 20.0
    member_2_done = multiprocessing.get_context("fork").Event()

    def sender():
        group = create_standalone_group("gloo", 0, 3, "127.0.0.1", port, timeout_s=timeout_s)
        group.store.set("formed/0", "1")
        time.sleep(1.0)  # member 1's process has ended
        try:
            group.broadcast(torch.ones(1024), 0)
            return None
        except CollectiveError as error:
            failure = CollectiveError(str(error))  # what Ray keeps of a failed call: its text, not its frames
        member_2_done.wait(timeout_s + 10)  # the process lives on, its group object still referenced
        return failure

    def dying_member():
        group = create_standalone_group("gloo", 1, 3, "127.0.0.1", port, timeout_s=timeout_s)
        # leaves once the others' sides of the group are formed too (else their formation fails instead)
        group.store.wait(["formed/0", "formed/2"], datetime.timedelta(seconds=timeout_s))
        return "left"

    def member_below():
        group = create_standalone_group("gloo", 2, 3, "127.0.0.1", port, timeout_s=timeout_s)
        group.store.set("formed/2", "1")
        try:
            group.broadcast(torch.zeros(1024), 0)
            return None
        except CollectiveError as error:
            return error
        finally:
            member_2_done.set()

    sent, _, received = run_members([sender, dying_member, member_below], timeout_s=2 * timeout_s)
    assert isinstance(sent, CollectiveError), sent
    assert isinstance(received, CollectiveError) and not isinstance(received, CollectiveTimeoutError), received


def test_a_sync_takes_the_restart_copy_before_sending():
    """A send that times out must not leave the host copy behind it: on NCCL a copy queued after a stuck
    broadcast would never run. The copy is taken first (and kept only when the sync completes)."""
    from colossal_rl.driver.actors import TrainerActor

    calls = []
    state = {"w": torch.ones(2)}
    trainer = SimpleNamespace(
        phases=PhaseRecorder(), stage_state_dict=lambda: state, policy_version=0,
    )  # fmt: skip
    actor = SimpleNamespace(
        trainer=trainer,
        sender=SimpleNamespace(send=lambda s, v: calls.append("send")),
        _retain=lambda s: calls.append("retain") or ["copy"],
    )
    push_weights = TrainerActor.__ray_metadata__.modified_class.push_weights
    assert push_weights(actor, 3) == ["copy"]
    assert calls == ["retain", "send"] and trainer.policy_version == 3


@pytest.mark.parametrize("restarts", [0, 2])
def test_the_restart_copy_is_taken_only_with_elastic_producers(monkeypatch, restarts):
    """The host copy of the weights every sync costs a device-to-host copy and an object-store put of the whole
    stage (docs/guides/run-lifecycle.md, "Failures"); ``--max-actor-restarts 0`` turns it off."""
    import colossal_rl.driver.actors as actors

    put = []
    monkeypatch.setattr(actors.ray, "put", lambda value: put.append(value) or "ref")
    config = RLConfig()
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, max_actor_restarts=restarts))
    retain = actors.TrainerActor.__ray_metadata__.modified_class._retain
    assert retain(SimpleNamespace(config=config), {"w": torch.ones(2)}) == ([] if restarts == 0 else ["ref"])
    assert len(put) == (0 if restarts == 0 else 1)
    assert retain(SimpleNamespace(config=config), None) == []  # a rank that sends no stage keeps nothing

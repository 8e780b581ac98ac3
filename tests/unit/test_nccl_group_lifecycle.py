"""An NCCL weight-sync group's life on CPU (issue 44, items 4-6 and the release check): forming, timing out, aborting.

The NCCL branch of ``colossal_rl/comm/process_group.py`` needs a GPU to run for real, so these tests drive it with
fake process groups shaped like torch's ``ProcessGroupNCCL`` (``(store, rank, size, options)``, ``Options()._timeout``,
asynchronous collectives returning a ``Work`` whose ``wait`` does not block) that record what the group does to them,
an injectable clock, and real ``TCPStore``s. Which abort method the real classes offer is checked against torch
2.5.1's real ``ProcessGroupNCCL`` here and torch 2.13's in ``tests/vllm_engine/test_nccl_abort_torch213.py``.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from colossal_rl.comm.nccl_release import NcclVersionMismatchError, loaded_nccl_version
from colossal_rl.comm.process_group import (
    WATCHDOG_GRACE_S,
    CollectiveError,
    CollectiveTimeoutError,
    StandaloneGroup,
    _check_nccl_releases,
    _make_process_group,
    abort_method_name,
    abort_nccl,
    create_standalone_group,
    find_free_port,
    gather_members,
    group_store_for,
)


class SteppingClock:
    """A monotonic clock that advances ``step`` seconds at every reading: deadlines pass without waiting for them."""

    def __init__(self, step: float):
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class CompletedWork:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


class NeverCompletingWork(CompletedWork):
    """An NCCL ``Work`` of a collective a member never joins: ``wait`` returns at once, ``is_completed`` never."""

    def is_completed(self) -> bool:
        return False


class RecordedOptions:
    """``ProcessGroupNCCL.Options``: the watchdog's timeout the group sets stays here for the test to read."""

    def __init__(self):
        self._timeout = datetime.timedelta(minutes=10)  # torch's default


class FakeProcessGroupNCCL:
    """torch's ``ProcessGroupNCCL`` as ``process_group.py`` uses it, recording collectives and aborts (with the
    clock's time when one is given). Offers ``abort``, like torch 2.13's; subclasses offer other methods."""

    Options = RecordedOptions
    created: list[FakeProcessGroupNCCL] = []

    def __init__(self, store, rank: int, size: int, options: RecordedOptions, clock: SteppingClock | None = None):
        self.store, self.rank, self.size, self.options = store, rank, size, options
        self.clock = clock
        self.calls: list[tuple[str, float | None]] = []
        self.collectives: list[tuple[str, list[torch.Tensor]]] = []
        FakeProcessGroupNCCL.created.append(self)

    def _record(self, what: str) -> None:
        self.calls.append((what, None if self.clock is None else self.clock.now))

    def allreduce(self, tensors, options=None):
        self.collectives.append(("allreduce", tensors))
        return CompletedWork()

    def broadcast(self, tensors, options):
        self.collectives.append(("broadcast", tensors))
        return NeverCompletingWork()

    def abort(self) -> None:
        self._record("abort")


def offering(*methods: str) -> type:
    """A fake ``ProcessGroupNCCL`` class whose only ways to abort are ``methods`` (each records its call)."""

    def recorder(name):
        return lambda self: self._record(name)

    namespace = {"abort": None} | {name: recorder(name) for name in methods}
    return type(f"ProcessGroupNCCLWith_{'_'.join(methods) or 'nothing'}", (FakeProcessGroupNCCL,), namespace)


def nccl_group(process_group, timeout_s: float, clock=time.monotonic) -> StandaloneGroup:
    return StandaloneGroup(
        process_group, dist.HashStore(), backend="nccl", name="sync", rank=0, world_size=2, timeout_s=timeout_s,
        clock=clock,
    )  # fmt: skip


# --- item 4: the abort each torch offers -----------------------------------------------------------------------


def test_the_abort_picked_for_torch_2_5_exists_on_its_real_process_group_nccl():
    """The trainers' torch: ``ProcessGroupNCCL`` has ``_shutdown`` and no ``abort`` (no GPU needed to look)."""
    assert torch.__version__.startswith("2.5.")
    name = abort_method_name(dist.ProcessGroupNCCL)
    assert name == "_shutdown"
    assert callable(getattr(dist.ProcessGroupNCCL, name))


@pytest.mark.parametrize(
    ("offered", "called"),
    [
        (("abort",), "abort"),  # torch 2.13 without the others' spelling
        (("_shutdown",), "_shutdown"),  # torch 2.5
        (("shutdown",), "shutdown"),
        (("abort", "shutdown"), "abort"),  # torch 2.13: abort first, shutdown may wait for the stuck kernel
        (("abort", "_shutdown", "shutdown"), "abort"),
        (("_shutdown", "shutdown"), "_shutdown"),
    ],
    ids=lambda value: "+".join(value) if isinstance(value, tuple) else value,
)
def test_a_timed_out_broadcast_aborts_with_what_the_torch_offers(offered, called):
    process_group = offering(*offered)(dist.HashStore(), 0, 2, RecordedOptions())
    group = nccl_group(process_group, timeout_s=0.2)
    with pytest.raises(CollectiveTimeoutError, match="did not finish within 0.2s"):
        group.broadcast(torch.zeros(4), 0)
    assert process_group.calls == [(called, None)]


def test_a_torch_that_cannot_abort_is_refused_when_the_group_forms():
    """Finding out at the first timed-out sync would be too late: the kernel would spin on with nothing to end it."""
    FakeProcessGroupNCCL.created.clear()
    with pytest.raises(CollectiveError, match="offers none of abort, _shutdown, shutdown"):
        _make_process_group("nccl", dist.HashStore(), 0, 2, datetime.timedelta(seconds=1), nccl_factory=offering())
    assert FakeProcessGroupNCCL.created == []


def test_an_instance_that_cannot_abort_is_reported_as_an_error(caplog):
    with caplog.at_level(logging.ERROR, logger="colossal_rl.comm.process_group"):
        abort_nccl(offering()(dist.HashStore(), 0, 2, RecordedOptions()), "group 'sync'")
    assert "cannot abort the NCCL communicator" in caplog.text and "keep the GPU busy" in caplog.text


# --- item 5: our deadline first, then NCCL's watchdog ---------------------------------------------------------


def test_our_deadline_aborts_before_the_watchdog_counting_both_from_the_enqueue():
    """The watchdog counts from the enqueue and, by torch's default, ends the process: a pipelined broadcast waited
    on long after it was enqueued must still be aborted at ``timeout_s`` after its enqueue, well before the watchdog's
    timeout (what the group set on the options)."""
    timeout_s, clock = 100.0, SteppingClock(step=5.0)

    class OnTheClock(FakeProcessGroupNCCL):
        def __init__(self, store, rank, size, options):
            super().__init__(store, rank, size, options, clock=clock)

    process_group = _make_process_group(
        "nccl", dist.HashStore(), 0, 2, datetime.timedelta(seconds=timeout_s), device="cpu", nccl_factory=OnTheClock,
        clock=clock,
    )  # fmt: skip
    watchdog_s = process_group.options._timeout.total_seconds()
    group = nccl_group(process_group, timeout_s, clock)
    pending = group.broadcast_async(torch.zeros(4), 0)
    enqueued = clock.now
    clock.now += 0.8 * timeout_s  # the sender waited on the buckets before this one
    with pytest.raises(CollectiveTimeoutError):
        pending.wait()
    [(what, aborted)] = process_group.calls
    assert what == "abort"
    assert timeout_s <= aborted - enqueued <= timeout_s + 2 * clock.step  # ours, counted from the enqueue
    assert watchdog_s == timeout_s + WATCHDOG_GRACE_S
    assert watchdog_s - (aborted - enqueued) >= 10.0  # the watchdog leaves the abort time to finish


def test_the_gloo_path_keeps_its_own_timeout():
    """gloo has no watchdog: its process group gets exactly ``timeout`` (and enforces it on every operation)."""
    process_group = _make_process_group("gloo", dist.HashStore(), 0, 1, datetime.timedelta(seconds=7))
    assert isinstance(process_group, dist.ProcessGroupGloo)
    assert process_group.options._timeout == datetime.timedelta(seconds=7)


# --- item 6: the communicator forms under the same deadline --------------------------------------------------


class StalledBootstrap(FakeProcessGroupNCCL):
    """NCCL forms its communicator inside the first collective, blocking: here it never returns (a member that
    never arrives); ``release`` lets the test end the thread."""

    def __init__(self, *args):
        super().__init__(*args)
        self.release = threading.Event()

    def allreduce(self, tensors, options=None):
        self.collectives.append(("allreduce", tensors))
        self.release.wait(timeout=60)
        return CompletedWork()


class WarmUpNeverCompletes(FakeProcessGroupNCCL):
    def allreduce(self, tensors, options=None):
        self.collectives.append(("allreduce", tensors))
        return NeverCompletingWork()


@pytest.mark.parametrize("factory", [StalledBootstrap, WarmUpNeverCompletes])
def test_a_communicator_that_never_forms_fails_group_creation_within_the_deadline(factory):
    FakeProcessGroupNCCL.created.clear()
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"group 'sync': the NCCL communicator did not form within 0.5s"):
        _make_process_group(
            "nccl", dist.HashStore(), 0, 2, datetime.timedelta(seconds=0.5), name="sync", device="cpu",
            nccl_factory=factory,
        )  # fmt: skip
    assert 0.5 <= time.monotonic() - started < 5.0
    [process_group] = FakeProcessGroupNCCL.created
    getattr(process_group, "release", threading.Event()).set()  # ends a stalled warm-up thread
    assert process_group.calls == [("abort", None)]


def test_the_communicator_forms_at_creation_with_one_element_on_the_members_device():
    FakeProcessGroupNCCL.created.clear()
    process_group = _make_process_group(
        "nccl", dist.HashStore(), 1, 2, datetime.timedelta(seconds=5), device="meta", nccl_factory=FakeProcessGroupNCCL
    )
    [(collective, [tensor])] = process_group.collectives
    assert collective == "allreduce" and tensor.numel() == 1 and tensor.device.type == "meta"
    assert process_group.calls == []


# --- the NCCL release check before the communicator forms ----------------------------------------------------


def run_two(first, second, timeout_s: float = 30.0):
    """Run two members as threads; each one's result, or the exception it raised."""

    def outcome(member):
        try:
            return member()
        except Exception as error:  # noqa: BLE001 - the test looks at it
            return error

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(outcome, first), pool.submit(outcome, second)]
        return [future.result(timeout=timeout_s) for future in futures]


def member_checking(port: int, rank: int, release: str | None, stores: list | None = None):
    """A member's check; its store goes into ``stores`` (kept by the test) so rank 0's outlives both threads, as a
    group's store does in a run."""

    def member():
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=10))
        if stores is not None:
            stores.append(store)
        group_store = group_store_for(store, "sync")
        gather_members(group_store, rank=rank, world_size=2, timeout_s=10.0, name="sync")  # as every member does
        _check_nccl_releases(group_store, rank=rank, world_size=2, group="sync", timeout_s=10.0, release=release)
        return "same release"

    return member


def test_members_with_different_nccl_releases_fail_in_one_line_naming_both():
    port = find_free_port()
    outcomes = run_two(member_checking(port, 0, "2.21.5"), member_checking(port, 1, "2.29.7"))
    for error in outcomes:
        assert isinstance(error, NcclVersionMismatchError), error
        message = str(error)
        assert "\n" not in message and "'sync'" in message
        assert "NCCL 2.21.5 on rank 0" in message and "NCCL 2.29.7 on rank 1" in message and " pid " in message


def test_members_with_one_nccl_release_pass_the_check():
    port = find_free_port()
    stores: list = []
    outcomes = run_two(member_checking(port, 0, "2.29.7", stores), member_checking(port, 1, "2.29.7", stores))
    assert outcomes == ["same release"] * 2


def test_creating_an_nccl_group_checks_releases_before_building_the_process_group(monkeypatch):
    """Member 1 (a thread standing for a producer) runs another NCCL release: member 0's ``create_standalone_group``
    must end in the one-line mismatch before it ever constructs a ``ProcessGroupNCCL``."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeProcessGroupNCCL)
    FakeProcessGroupNCCL.created.clear()
    port = find_free_port()

    def trainer():
        return create_standalone_group("nccl", 0, 2, "127.0.0.1", port, timeout_s=10.0, name="sync", device="cpu")

    error, _ = run_two(trainer, member_checking(port, 1, "0.0.1"))
    assert isinstance(error, NcclVersionMismatchError), error
    assert f"NCCL {loaded_nccl_version()} on rank 0" in str(error) and "NCCL 0.0.1 on rank 1" in str(error)
    assert FakeProcessGroupNCCL.created == []


def test_an_nccl_group_is_built_once_every_member_has_reported_its_release(monkeypatch):
    seen_at_construction = []

    class RecordingStore(FakeProcessGroupNCCL):
        def __init__(self, store, rank, size, options):
            super().__init__(store, rank, size, options)
            seen_at_construction.append(store.check(["nccl_release/0", "nccl_release/1"]))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingStore)
    port = find_free_port()

    def member(rank):
        return lambda: create_standalone_group("nccl", rank, 2, "127.0.0.1", port, 10.0, name="sync", device="cpu")

    groups = run_two(member(0), member(1))
    assert all(isinstance(group, StandaloneGroup) for group in groups), groups
    assert seen_at_construction == [True, True]

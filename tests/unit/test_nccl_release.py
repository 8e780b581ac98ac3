"""One NCCL release on both sides of the weight sync (issue 44 item 1): the release every member reports is the one its
process really calls, a mismatch is one line naming both, and the trainers' actors get the preload on GPU machines
only — never the producers' vLLM processes."""

from __future__ import annotations

import datetime
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from colossal_rl import producer_env, trainer_nccl
from colossal_rl.comm.nccl_release import (
    NCCL_RELEASE,
    TRAINER_BASE_NCCL,
    NcclVersionMismatchError,
    check_one_release,
    exchange_releases,
    library_version,
    loaded_nccl_library,
    loaded_nccl_version,
    version_string,
)
from colossal_rl.comm.process_group import find_free_port
from colossal_rl.driver import actor_groups
from colossal_rl.producer_env import ProducerEnvError


def test_version_codes_read_as_releases():
    assert version_string(22907) == "2.29.7"
    assert version_string(2708) == "2.7.8"  # NCCL's code before 2.9: X * 1000 + Y * 100 + Z
    assert version_string((2, 21, 5)) == "2.21.5"
    assert version_string("2.29.7") == "2.29.7"


def test_this_process_reports_the_library_it_loaded_not_a_compiled_in_number():
    library = loaded_nccl_library()
    assert library is not None and library.endswith("libnccl.so.2")
    assert loaded_nccl_version() == library_version(library) == TRAINER_BASE_NCCL  # torch 2.5.1's own wheel, no preload


def test_equal_releases_pass_and_a_mismatch_is_one_line_naming_both():
    check_one_release({0: ("trainer", "2.29.7"), 1: ("vllm worker", "2.29.7")}, group="stage0")
    with pytest.raises(NcclVersionMismatchError) as raised:
        check_one_release({0: ("trainer on a", "2.21.5"), 1: ("vllm worker on b", "2.29.7")}, group="stage0")
    message = str(raised.value)
    assert "\n" not in message
    for part in ("'stage0'", "2.21.5", "rank 0 (trainer on a)", "2.29.7", "rank 1 (vllm worker on b)", NCCL_RELEASE):
        assert part in message
    with pytest.raises(NcclVersionMismatchError, match="rank 1 \\(cpu producer\\) has no NCCL"):
        check_one_release({0: ("trainer", "2.29.7"), 1: ("cpu producer", None)}, group="stage0")


def test_members_exchange_their_releases_through_the_groups_store():
    port, results, stores = find_free_port(), {}, []
    timeout, done = datetime.timedelta(seconds=20), threading.Barrier(2, timeout=30)

    def member(rank: int, release: str) -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
        stores.append(store)  # rank 0 hosts the store: it must outlive the other's reads, as the group's does
        reports = exchange_releases(dist.PrefixStore("g", store), rank=rank, world_size=2, who=f"m{rank}",
                                    release=release, timeout_s=20)  # fmt: skip
        try:
            check_one_release(reports, group="g")
            results[rank] = "ok"
        except NcclVersionMismatchError as error:
            results[rank] = str(error)
        done.wait()

    threads = [threading.Thread(target=member, args=(0, "2.21.5")), threading.Thread(target=member, args=(1, "2.29.7"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert set(results) == {0, 1}
    for rank in (0, 1):  # both members refuse, each naming both sides
        assert "2.21.5 on rank 0 (m0)" in results[rank] and "2.29.7 on rank 1 (m1)" in results[rank]


def test_a_trainer_nccl_of_another_release_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(trainer_nccl.OVERRIDE_VARIABLE, loaded_nccl_library())  # torch's own 2.21.5: the wrong one
    with pytest.raises(ProducerEnvError) as raised:
        trainer_nccl.ensure_trainer_nccl()
    assert f"is NCCL {TRAINER_BASE_NCCL}, but the GPU producers run NCCL {NCCL_RELEASE}" in str(raised.value)
    monkeypatch.setenv(trainer_nccl.OVERRIDE_VARIABLE, "none")
    assert trainer_nccl.ensure_trainer_nccl() is None


def test_an_installed_trainer_nccl_is_found_again_and_a_half_install_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_RL_CACHE", str(tmp_path))
    monkeypatch.delenv(trainer_nccl.OVERRIDE_VARIABLE, raising=False)
    directory = trainer_nccl.install_dir()
    assert directory.parent == tmp_path / "nccl" and NCCL_RELEASE in directory.name
    trainer_nccl.library_path(directory).parent.mkdir(parents=True)
    trainer_nccl.library_path(directory).write_bytes(b"")
    assert not trainer_nccl.is_installed(directory)  # no marker: interrupted
    (directory / trainer_nccl.COMPLETE_MARKER).write_text('{"requirement": "nvidia-nccl-cu12==2.21.5"}')
    assert not trainer_nccl.is_installed(directory)  # another release's install
    (directory / trainer_nccl.COMPLETE_MARKER).write_text(f'{{"requirement": "{trainer_nccl.requirement()}"}}')
    assert trainer_nccl.is_installed(directory)


def test_the_preload_comes_first_and_keeps_what_was_preloaded_before():
    library = Path("/cache/nccl/libnccl.so.2")
    assert trainer_nccl.preload_env_vars(library, "/x/libfoo.so:/cache/nccl/libnccl.so.2") == {
        "LD_PRELOAD": "/cache/nccl/libnccl.so.2:/x/libfoo.so"
    }
    assert trainer_nccl.preload_env_vars(None, "/x/libfoo.so") == {}
    assert trainer_nccl.trainer_runtime_env(on_gpu=False) == {}


@pytest.fixture
def preload_available(monkeypatch, tmp_path):
    library = tmp_path / "libnccl.so.2"
    monkeypatch.setattr(trainer_nccl, "ensure_trainer_nccl", lambda: library)
    monkeypatch.setattr(producer_env, "ensure_producer_env", lambda kind=None: Path("/envs/gpu/bin/python"))
    monkeypatch.setattr(producer_env, "detect_kind", lambda: "gpu")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    return str(library)


def test_on_gpus_trainers_and_transformers_producers_preload_the_same_nccl(preload_available):
    trainers, producers = actor_groups.actor_environments("transformers", on_gpu=True)
    assert trainers["runtime_env"]["env_vars"]["LD_PRELOAD"] == preload_available
    assert producers == trainers  # one environment, one NCCL, one weight-sync group


def test_vllm_producers_run_their_own_nccl_never_the_trainers_preload(preload_available):
    trainers, producers = actor_groups.actor_environments("vllm", on_gpu=True)
    assert trainers["runtime_env"]["env_vars"]["LD_PRELOAD"] == preload_available
    assert producers["runtime_env"]["py_executable"] == "/envs/gpu/bin/python"
    assert "LD_PRELOAD" not in producers["runtime_env"]["env_vars"]


def test_on_cpu_nothing_is_preloaded(preload_available):
    trainers, producers = actor_groups.actor_environments("transformers", on_gpu=False)
    assert trainers == producers == {}


class StoreWhoseHostLeavesAfterTheReads:
    """A dict store for rank ``rank`` whose host answers the reports but is gone by the read barrier's wait — what a
    member sees when rank 0 read everything and went on (a mismatch makes it raise and drop the store)."""

    def __init__(self, reports: dict[str, str]) -> None:
        self.values, self.waits = dict(reports), 0

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def wait(self, keys, timeout) -> None:
        self.waits += 1
        if self.waits == 2:
            raise dist.DistNetworkError("failed to recv, got 0 bytes")
        assert all(key in self.values for key in keys)


def test_a_member_keeps_the_reports_it_read_when_the_host_left_before_the_read_barrier():
    others = {"nccl_release/0": '["host", "2.21.5"]'}
    store = StoreWhoseHostLeavesAfterTheReads(others)
    reports = exchange_releases(store, rank=1, world_size=2, who="m1", release="2.29.7", timeout_s=5)
    assert reports == {0: ("host", "2.21.5"), 1: ("m1", "2.29.7")}
    with pytest.raises(NcclVersionMismatchError, match="2.21.5 on rank 0"):  # the mismatch, not a connection error
        check_one_release(reports, group="g")
    with pytest.raises(dist.DistNetworkError):  # the host itself losing its own store is an error, never hidden
        exchange_releases(StoreWhoseHostLeavesAfterTheReads({"nccl_release/1": '["m1", "2.29.7"]'}), rank=0,
                          world_size=2, who="host", release="2.21.5", timeout_s=5)  # fmt: skip


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_fsdp2_runs_every_actor_in_the_producers_environment_with_its_own_nccl(preload_available, backend):
    """One torch, one NCCL by construction: trainers and producers of either backend share the producers' interpreter,
    and nothing preloads the trainers' NCCL build into it."""
    trainers, producers = actor_groups.actor_environments(backend, on_gpu=True, trainer_backend="fsdp2")
    assert trainers == producers
    assert trainers["runtime_env"]["py_executable"] == "/envs/gpu/bin/python"
    assert "LD_PRELOAD" not in trainers["runtime_env"]["env_vars"]
